"""Analysis: a store opened read-only as a dataset (:func:`open`), its episodes, dask and
xarray arrays, a PyTorch ``Dataset``, and pictures of its frames and returns.

Names are imported on first use (PEP 562), so that ``zarr-rb info`` and other readers of
metadata import neither torch nor TorchRL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarr_rb.analysis.dataset import ReplayDataset, TorchRLBatches
    from zarr_rb.analysis.episodes import EpisodeKeys, Episodes
    from zarr_rb.analysis.view import Column, View, open

_HOMES = {
    "Column": "zarr_rb.analysis.view",
    "EpisodeKeys": "zarr_rb.analysis.episodes",
    "Episodes": "zarr_rb.analysis.episodes",
    "ReplayDataset": "zarr_rb.analysis.dataset",
    "TorchRLBatches": "zarr_rb.analysis.dataset",
    "View": "zarr_rb.analysis.view",
    "open": "zarr_rb.analysis.view",
}

__all__ = ["Column", "EpisodeKeys", "Episodes", "ReplayDataset", "TorchRLBatches", "View", "open"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
