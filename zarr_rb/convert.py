"""Where the conversions from and to TorchRL's own dumps were defined before the package
had an ``interop`` subpackage: kept so that imports naming ``zarr_rb.convert`` keep working
(the names are in :mod:`zarr_rb.interop`, and ``zarr_rb.import_torchrl`` and
``zarr_rb.export_torchrl`` at the top of the package)."""

from zarr_rb.interop.dumps import BLOCK_BYTES, buffer_like_dump, import_torchrl
from zarr_rb.interop.export import export_torchrl

__all__ = ["BLOCK_BYTES", "buffer_like_dump", "export_torchrl", "import_torchrl"]
