"""Samplers never draw rows that a crash or a repair withdrew.

After a crash in the middle of a rewrite, or ``verify --repair``, some rows inside a
store's length hold no intact data until they are written again (holes). TorchRL's
samplers know nothing of them, so the storage steers each sampler off them:

* ``RandomSampler`` draws through ``ZarrStorage._rand_given_ndim``, which skips them;
* prioritized samplers get a zero priority for them (exactly zero in their trees, so
  they are never drawn), set again whenever new holes appear;
* ``SamplerWithoutReplacement`` has them removed from each new permutation;
* slice samplers see trajectories cut at them: no slice covers a hole, and the holes
  themselves are no trajectory.

Nothing here runs while a store has no holes, beyond one check of the row masks per
sample.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrl.data import find_start_stop_traj

from zarr_rb import _compat

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

_GUARDED = "_zarr_rb_guarded"


def guard_sampler(sampler: Any, storage: ZarrStorage) -> None:
    """Make ``sampler`` skip the unreadable rows of ``storage`` (once per sampler)."""
    if getattr(sampler, _GUARDED, None) is storage:
        return
    setattr(sampler, _GUARDED, storage)
    if _compat.is_sampler(sampler, "PrioritizedSampler"):
        _before_each_sample(sampler, functools.partial(_zero_priorities, sampler, storage))
    if _compat.is_sampler(sampler, "SliceSampler"):
        _compat.wrap_trajectory_boundaries(
            sampler, functools.partial(_boundaries_without_holes, storage=storage)
        )
    elif _compat.is_sampler(sampler, "SamplerWithoutReplacement"):
        _compat.wrap_permutation(
            sampler, functools.partial(_drop_holes_from_permutation, sampler, storage)
        )


def _element_indices(rows: np.ndarray, storage: ZarrStorage) -> torch.Tensor:
    """Flat element indices of whole rows (TorchRL indexes elements of ndim>1 storages)."""
    per_row = _elements_per_row(storage)
    rows_t = torch.from_numpy(rows)
    if per_row == 1:
        return rows_t
    return (rows_t[:, None] * per_row + torch.arange(per_row)).reshape(-1)


def _elements_per_row(storage: ZarrStorage) -> int:
    shape = storage._total_shape
    return 1 if shape is None else math.prod(shape[1:])


def _before_each_sample(sampler: Any, prepare: Any) -> None:
    sample = sampler.sample

    @functools.wraps(sample)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        prepare()
        return sample(*args, **kwargs)

    sampler.sample = guarded


def _zero_priorities(sampler: Any, storage: ZarrStorage) -> None:
    holes = storage._store.unreadable_rows()
    if holes.size:
        _compat.exclude_from_priority_trees(sampler, _element_indices(holes, storage))


def _drop_holes_from_permutation(sampler: Any, storage: ZarrStorage, batch_size: int) -> None:
    holes = storage._store.unreadable_rows()
    if holes.size:
        _compat.drop_from_permutation(sampler, _element_indices(holes, storage), batch_size)


def _boundaries_without_holes(
    boundaries: Any, storage_arg: Any, fallback: bool, *, storage: ZarrStorage
) -> Any:
    """A slice sampler's trajectory boundaries (``boundaries(storage_arg, fallback)``),
    computed with holes read as zeros, then cut at the holes."""
    if not storage._store.unreadable_rows().size:
        return boundaries(storage_arg, fallback)
    with storage.unreadable_read_as_zeros():
        found = boundaries(storage_arg, fallback)
    return _cut_at_holes(found, storage=storage)


def _cut_at_holes(
    boundaries: Any, *, storage: ZarrStorage
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trajectories ``(start, stop, lengths)`` (TorchRL's layout: inclusive ``[N, ndim]``
    coordinates) cut at the storage's holes, the holes themselves left out."""
    start, stop, lengths = boundaries
    holes = storage._store.unreadable_rows()
    if not holes.size:
        return start, stop, lengths
    shape = storage.shape
    assert shape is not None
    full = bool(storage._is_full)
    rows = shape[0]
    end = torch.zeros(tuple(shape), dtype=torch.bool)
    end[tuple(stop.long().cpu().unbind(-1))] = True
    hole_rows = torch.from_numpy(holes)
    before = hole_rows - 1
    before = before % rows if full else before[before >= 0]
    end[hole_rows] = True  # each hole row is a trajectory of its own, dropped below
    end[before] = True  # the trajectory before a hole ends before it
    cut_start, cut_stop, cut_lengths = find_start_stop_traj(
        end=end, at_capacity=full, cursor=_compat.last_cursor_index(storage)
    )
    keep = ~torch.isin(cut_start[:, 0], hole_rows)
    device = start.device
    return cut_start[keep].to(device), cut_stop[keep].to(device), cut_lengths[keep].to(device)
