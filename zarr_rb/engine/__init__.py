"""Array I/O through TensorStore on a location (see :mod:`zarr_rb.engine.tensorstore`).

``Engine`` and ``RowArray`` are imported on first use (PEP 562): importing TensorStore
takes about a second, and :mod:`zarr_rb.engine.forked` (zarr-python) needs none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarr_rb.engine.rows import RowArray
    from zarr_rb.engine.tensorstore import Engine

__all__ = ["Engine", "RowArray"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = "zarr_rb.engine.rows" if name == "RowArray" else "zarr_rb.engine.tensorstore"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
