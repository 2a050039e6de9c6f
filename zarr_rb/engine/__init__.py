"""Array I/O through TensorStore on a location (see :mod:`zarr_rb.engine.tensorstore`)."""

from zarr_rb.engine.tensorstore import Engine, RowArray

__all__ = ["Engine", "RowArray"]
