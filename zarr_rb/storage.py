"""Where :class:`~zarr_rb.ZarrStorage` was defined before the package had a ``torchrl``
subpackage: kept so that imports and pickles naming ``zarr_rb.storage.ZarrStorage`` keep
working (``from zarr_rb import ZarrStorage`` is the name to use)."""

from zarr_rb.torchrl.storage import ZarrStorage

__all__ = ["ZarrStorage"]
