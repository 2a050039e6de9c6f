"""Guards around TorchRL's samplers and writers on a ZarrStorage.

**Samplers never draw rows that a crash or a repair withdrew.**

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

**A write the storage refuses leaves TorchRL's writer as it was.**

TorchRL's writers move before they write: ``RoundRobinWriter`` advances its cursor and
write count, ``TensorDictMaxValueWriter`` pushes the new rows into its heap, and only then
call ``storage.set``. When a ZarrStorage refuses the rows (a string UTF-8 cannot encode, a
value of another type...), the writer would point past rows that were never written, and
the next write would leave them empty. The writers of buffers on a ZarrStorage get their
``add`` and ``extend`` routed through :func:`_undone_on_refusal`.

**A reader's sample reads one commit.** A sampler reads a reader's length, cursor and
columns (a slice sampler scans a trajectory key), then the buffer gathers the rows it drew:
every sampler's ``sample`` is routed through :func:`_sample_of_one_commit`, which holds the
writer's last commit from the draw to the gather (``OneCommitSamples.begin_sample``).

**A forked child never moves the parent's writer.** ``RoundRobinWriter`` keeps its cursor
and write count in shared memory, which a child forked from the process that opened the
store shares with it. The store refuses such a child's calls, so its ``add``, ``extend``
and ``_empty`` are refused before the writer moves (putting the writer back afterwards would
rewind the parent's writes made meanwhile).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torchrl.data import find_start_stop_traj

from zarr_rb.format.messages import preview_rows
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.samples import OneCommitSamples
from zarr_rb.torchrl.store_backed import StoreBacked


def guard_sampler(sampler: Any, storage: Any) -> None:
    """Make ``sampler`` skip the unreadable rows of ``storage`` (once per sampler; a
    storage other than a ZarrStorage has none)."""
    if not isinstance(storage, OneCommitSamples):
        return
    inner = None
    if compat.is_sampler(sampler, "PrioritizedSampler"):
        inner = functools.partial(_sample_with_zero_priorities, zarr=storage)
    compat.route_method(
        sampler, "sample", functools.partial(_sample_of_one_commit, zarr=storage, inner=inner)
    )
    if compat.is_sampler(sampler, "SliceSampler"):
        # A prioritized slice sampler needs trajectories that cover every row: there each
        # hole stays a trajectory of its own, which its zero priority keeps from being drawn.
        keep = compat.is_sampler(sampler, "PrioritizedSampler")
        compat.route_method(
            sampler,
            "_get_stop_and_length",
            functools.partial(_boundaries_without_holes, zarr=storage, keep_holes=keep),
        )
    elif compat.is_sampler(sampler, "SamplerWithoutReplacement"):
        compat.route_method(
            sampler,
            "_get_sample_list",
            functools.partial(_permutation_without_holes, zarr=storage),
        )


def random_readable_indices(storage: StoreBacked, batch_size: int) -> Any:
    """``batch_size`` random element indices of the storage (as TorchRL's
    ``_rand_given_ndim``), drawn uniformly among the rows that can be read."""
    unreadable = storage.unreadable_rows()
    rows = _draw_readable(storage.rows_held, unreadable, batch_size, storage)
    if storage.ndim == 1:
        return rows
    generator = compat.storage_generator(storage)
    trailing = storage.shape[1:]
    return (rows, *(torch.randint(n, (batch_size,), generator=generator) for n in trailing))


_REDRAWS = 32
"""Rounds of drawing again the picks that fell on holes, before listing the readable rows
(each round keeps every pick with a chance of at least a half)."""


def _draw_readable(
    rows_held: int, unreadable: np.ndarray, batch_size: int, storage: StoreBacked
) -> torch.Tensor:
    """``batch_size`` rows drawn uniformly among ``[0, rows_held)`` less the sorted
    ``unreadable`` ones, in time that does not grow with ``rows_held`` while holes are
    at most half of the rows: picks that fall on a hole are drawn again."""
    if unreadable.size >= rows_held:
        raise RuntimeError(
            f"store {str(storage.path)!r}: no row can be sampled: every row is withdrawn "
            f"({preview_rows(unreadable)})",
        )
    generator = compat.storage_generator(storage)
    if 2 * unreadable.size <= rows_held:
        picks = torch.randint(rows_held, (batch_size,), generator=generator)
        for _ in range(_REDRAWS):
            on_holes = np.flatnonzero(_members(picks.numpy(), unreadable))
            if not on_holes.size:
                return picks
            picks[on_holes] = torch.randint(rows_held, (on_holes.size,), generator=generator)
    readable = np.ones(rows_held, dtype=bool)
    readable[unreadable] = False
    listed = torch.from_numpy(np.flatnonzero(readable))
    return listed[torch.randint(listed.numel(), (batch_size,), generator=generator)]


def _members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is in ``sorted_set`` (sorted, no repeats)."""
    where = np.searchsorted(sorted_set, values).clip(max=sorted_set.size - 1)
    found: np.ndarray = sorted_set[where] == values
    return found


def _element_indices(rows: np.ndarray, storage: StoreBacked) -> torch.Tensor:
    """Flat element indices of whole rows (TorchRL indexes elements of ndim>1 storages)."""
    per_row = _elements_per_row(storage)
    rows_t = torch.from_numpy(rows)
    if per_row == 1:
        return rows_t
    return (rows_t[:, None] * per_row + torch.arange(per_row)).reshape(-1)


def _elements_per_row(storage: StoreBacked) -> int:
    schema = storage.schema
    return 1 if schema is None else schema.elements_per_row


def _sample_of_one_commit(
    sample: Any, *args: Any, zarr: OneCommitSamples, inner: Any = None, **kwargs: Any
) -> Any:
    """A sampler's draw from a reader reads one commit of the store, and so does the gather
    of the rows it drew, which the buffer makes next (see ``OneCommitSamples.begin_sample``)."""
    zarr.begin_sample()
    try:
        with zarr.drawing():  # (SliceSampler reads rows itself while it draws)
            return sample(*args, **kwargs) if inner is None else inner(sample, *args, **kwargs)
    except BaseException:
        zarr.end_sample()
        raise


def _sample_with_zero_priorities(sample: Any, *args: Any, zarr: StoreBacked, **kwargs: Any) -> Any:
    holes = zarr.unreadable_rows()
    if holes.size:
        compat.exclude_from_priority_trees(sample.__self__, _element_indices(holes, zarr))
    return sample(*args, **kwargs)


def _permutation_without_holes(
    draw: Any, storage: Any, len_storage: int, batch_size: int, *, zarr: StoreBacked
) -> None:
    draw(storage, len_storage, batch_size)
    holes = zarr.unreadable_rows()
    if holes.size:
        compat.drop_from_permutation(draw.__self__, _element_indices(holes, zarr), batch_size)


def _boundaries_without_holes(
    boundaries: Any, storage: Any, fallback: bool = True, *, zarr: StoreBacked, keep_holes: bool
) -> Any:
    """A slice sampler's trajectory boundaries (``boundaries(storage, fallback)``), computed
    with holes read as zeros, then cut at the holes."""
    if not zarr.unreadable_rows().size:
        return boundaries(storage, fallback)
    with zarr.holes_as_zeros():
        found = boundaries(storage, fallback)
    return _cut_at_holes(found, storage=zarr, keep_holes=keep_holes)


def _cut_at_holes(
    boundaries: Any, *, storage: StoreBacked, keep_holes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trajectories ``(start, stop, lengths)`` (TorchRL's layout: inclusive ``[N, ndim]``
    coordinates) cut at the storage's holes; each hole row is left out, or kept as a
    trajectory of one row (``keep_holes``)."""
    start, stop, lengths = boundaries
    holes = storage.unreadable_rows()
    if not holes.size:
        return start, stop, lengths
    shape = storage.shape
    assert shape is not None
    full = compat.is_full(storage)
    rows = shape[0]
    end = torch.zeros(tuple(shape), dtype=torch.bool)
    end[tuple(stop.long().cpu().unbind(-1))] = True
    hole_rows = torch.from_numpy(holes)
    before = hole_rows - 1
    before = before % rows if full else before[before >= 0]
    end[hole_rows] = True  # each hole row is a trajectory of its own, dropped below
    end[before] = True  # the trajectory before a hole ends before it
    cut_start, cut_stop, cut_lengths = find_start_stop_traj(
        end=end, at_capacity=full, cursor=compat.last_cursor_index(storage)
    )
    keep = torch.ones(cut_start.shape[0], dtype=torch.bool)
    if not keep_holes:
        keep = ~torch.isin(cut_start[:, 0], hole_rows)
    device = start.device
    return cut_start[keep].to(device), cut_stop[keep].to(device), cut_lengths[keep].to(device)


def guard_writer(writer: Any, storage: StoreBacked) -> None:
    """Route ``writer``'s writes so that a write ``storage`` refuses puts it back (once per
    writer; writers zarr_rb does not know keep their own ways, and so do the writers of a
    ``compilable=True`` storage, whose writes ``torch.compile`` traces)."""
    if compat.writer_state(writer) is None or compat.is_compilable(storage):
        return
    for name in ("add", "extend"):
        compat.route_method(writer, name, functools.partial(_undone_on_refusal, storage=storage))
    compat.route_method(writer, "_empty", functools.partial(_in_this_process, storage=storage))


def _in_this_process(method: Any, *args: Any, storage: StoreBacked, **kwargs: Any) -> Any:
    """``method``, refused in a child forked from the process that opened the store."""
    storage.store.calls.check_process()
    return method(*args, **kwargs)


def _undone_on_refusal(method: Any, *args: Any, storage: StoreBacked, **kwargs: Any) -> Any:
    storage.store.calls.check_process()  # (before the writer moves: see the module's doc)
    writer = method.__self__
    before = compat.writer_state(writer)
    begun = storage.writes_begun
    try:
        with storage.writes_by(index_is_position=compat.writes_positions_into_index(writer)):
            index = method(*args, **kwargs)
    except BaseException:
        # Put the writer back only if the storage refused the rows before touching anything
        # (a write that failed on disk keeps its rows for a retry, where the writer put
        # them, and the length that counts them).
        if before is not None and storage.writes_begun == begun:
            compat.restore_writer_state(writer, before)
        raise
    # On a store of several writers, an add returns the position its row got: the writer's
    # cursor, which it returns, is its own, and other writers moved past it (the sampler,
    # setting priorities, and the caller get that position, as extend's index rewritten in
    # place).
    placed = storage.placed_last()  # (set by the writes of a shared store only)
    wrote = storage.writes_begun != begun  # (a max-value writer may write nothing)
    if method.__name__ != "add" or not wrote or placed is None or placed.size != 1:
        return index
    if isinstance(index, torch.Tensor):
        return torch.full_like(index, int(placed[0]))
    return int(placed[0])
