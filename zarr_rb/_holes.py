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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrl.data import find_start_stop_traj

from zarr_rb import _compat
from zarr_rb.core.format import preview_rows

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage


def guard_sampler(sampler: Any, storage: ZarrStorage) -> None:
    """Make ``sampler`` skip the unreadable rows of ``storage`` (once per sampler; a
    storage other than a ZarrStorage has none)."""
    from zarr_rb.storage import ZarrStorage

    if not isinstance(storage, ZarrStorage):
        return
    if _compat.is_sampler(sampler, "PrioritizedSampler"):
        _compat.route_method(
            sampler, "sample", functools.partial(_sample_with_zero_priorities, zarr=storage)
        )
    if _compat.is_sampler(sampler, "SliceSampler"):
        # A prioritized slice sampler needs trajectories that cover every row: there each
        # hole stays a trajectory of its own, which its zero priority keeps from being drawn.
        keep = _compat.is_sampler(sampler, "PrioritizedSampler")
        _compat.route_method(
            sampler,
            "_get_stop_and_length",
            functools.partial(_boundaries_without_holes, zarr=storage, keep_holes=keep),
        )
    elif _compat.is_sampler(sampler, "SamplerWithoutReplacement"):
        _compat.route_method(
            sampler,
            "_get_sample_list",
            functools.partial(_permutation_without_holes, zarr=storage),
        )


def random_readable_indices(storage: ZarrStorage, batch_size: int) -> Any:
    """``batch_size`` random element indices of the storage (as TorchRL's
    ``_rand_given_ndim``), drawn among the rows that can be read."""
    unreadable = storage._store.unreadable_rows()
    readable = np.setdiff1d(np.arange(storage._store.length_rows), unreadable)
    if not readable.size:
        raise RuntimeError(
            f"store {str(storage.path)!r}: no row can be sampled: every row is withdrawn "
            f"({preview_rows(unreadable)})",
        )
    generator = _compat.storage_generator(storage)
    pick = torch.randint(readable.size, (batch_size,), generator=generator)
    rows = torch.from_numpy(readable)[pick]
    if storage.ndim == 1:
        return rows
    trailing = storage.shape[1:]
    return (rows, *(torch.randint(n, (batch_size,), generator=generator) for n in trailing))


def _element_indices(rows: np.ndarray, storage: ZarrStorage) -> torch.Tensor:
    """Flat element indices of whole rows (TorchRL indexes elements of ndim>1 storages)."""
    per_row = _elements_per_row(storage)
    rows_t = torch.from_numpy(rows)
    if per_row == 1:
        return rows_t
    return (rows_t[:, None] * per_row + torch.arange(per_row)).reshape(-1)


def _elements_per_row(storage: ZarrStorage) -> int:
    schema = storage.schema
    return 1 if schema is None else schema.elements_per_row


def _sample_with_zero_priorities(sample: Any, *args: Any, zarr: ZarrStorage, **kwargs: Any) -> Any:
    holes = zarr._store.unreadable_rows()
    if holes.size:
        _compat.exclude_from_priority_trees(sample.__self__, _element_indices(holes, zarr))
    return sample(*args, **kwargs)


def _permutation_without_holes(
    draw: Any, storage: Any, len_storage: int, batch_size: int, *, zarr: ZarrStorage
) -> None:
    draw(storage, len_storage, batch_size)
    holes = zarr._store.unreadable_rows()
    if holes.size:
        _compat.drop_from_permutation(draw.__self__, _element_indices(holes, zarr), batch_size)


def _boundaries_without_holes(
    boundaries: Any, storage: Any, fallback: bool = True, *, zarr: ZarrStorage, keep_holes: bool
) -> Any:
    """A slice sampler's trajectory boundaries (``boundaries(storage, fallback)``), computed
    with holes read as zeros, then cut at the holes."""
    if not zarr._store.unreadable_rows().size:
        return boundaries(storage, fallback)
    with zarr._reading_holes_as_zeros():
        found = boundaries(storage, fallback)
    return _cut_at_holes(found, storage=zarr, keep_holes=keep_holes)


def _cut_at_holes(
    boundaries: Any, *, storage: ZarrStorage, keep_holes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trajectories ``(start, stop, lengths)`` (TorchRL's layout: inclusive ``[N, ndim]``
    coordinates) cut at the storage's holes; each hole row is left out, or kept as a
    trajectory of one row (``keep_holes``)."""
    start, stop, lengths = boundaries
    holes = storage._store.unreadable_rows()
    if not holes.size:
        return start, stop, lengths
    shape = storage.shape
    assert shape is not None
    full = _compat.is_full(storage)
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
    keep = torch.ones(cut_start.shape[0], dtype=torch.bool)
    if not keep_holes:
        keep = ~torch.isin(cut_start[:, 0], hole_rows)
    device = start.device
    return cut_start[keep].to(device), cut_stop[keep].to(device), cut_lengths[keep].to(device)
