"""Buffers between zarr_rb and TorchRL's own formats: TorchRL's ``rb.dumps`` layout
(:mod:`~zarr_rb.interop.dumps` into a store, :mod:`~zarr_rb.interop.export` out of one)
and buffers on TorchRL's own storages (:mod:`~zarr_rb.interop.buffers`, for
``zarr_rb.save`` and ``zarr_rb.load(..., storage="memory")``).

The public names are imported on first use, as those of :mod:`zarr_rb`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarr_rb.interop.dumps import BLOCK_BYTES, buffer_like_dump, import_torchrl
    from zarr_rb.interop.export import export_torchrl

_HOMES = {
    "BLOCK_BYTES": "zarr_rb.interop.dumps",
    "buffer_like_dump": "zarr_rb.interop.dumps",
    "import_torchrl": "zarr_rb.interop.dumps",
    "export_torchrl": "zarr_rb.interop.export",
}

__all__ = ["BLOCK_BYTES", "buffer_like_dump", "export_torchrl", "import_torchrl"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
