"""Analysis: a store opened read-only as a dataset (:func:`open`), its episodes, dask and
xarray arrays, a PyTorch ``Dataset``, and pictures of its frames and returns."""

from __future__ import annotations

from zarr_rb.analysis.dataset import ReplayDataset, TorchRLBatches
from zarr_rb.analysis.episodes import EpisodeKeys, Episodes
from zarr_rb.analysis.view import Column, View, open

__all__ = ["Column", "EpisodeKeys", "Episodes", "ReplayDataset", "TorchRLBatches", "View", "open"]
