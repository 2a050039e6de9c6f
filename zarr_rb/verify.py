"""Scan a store for damaged chunks, and optionally withdraw the rows they hold.

Every stored chunk carries a CRC32C checksum (and sharded arrays checksum their
shard index), so a flipped bit, a truncated or empty file and a missing chunk
are all found by reading the chunk back. :func:`verify` reads every chunk of the
committed rows and of the saved buffer state, one shard at a time.

Examples:
    >>> import torch, zarr_rb
    >>> from tensordict import TensorDict
    >>> with zarr_rb.ZarrStorage(100, "runs/pong.zarr") as storage:
    ...     storage.set(torch.arange(10), TensorDict({"obs": torch.ones(10, 3)}, [10]))
    >>> report = zarr_rb.verify("runs/pong.zarr")
    >>> report.ok
    True

From a shell: ``python -m zarr_rb verify runs/pong.zarr [--repair]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from zarr_rb.core.frame_cells import FrameCells
from zarr_rb.core.open import open_store
from zarr_rb.core.store import Store
from zarr_rb.engine import RowArray
from zarr_rb.engine.damage import damaged_runs
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.messages import describe_runs
from zarr_rb.format.names import STATE_GROUP, frame_ids_path
from zarr_rb.format.schema import LeafSpec

__all__ = ["DamagedChunk", "VerifyReport", "verify"]


@dataclasses.dataclass(frozen=True, slots=True)
class DamagedChunk:
    """A stored chunk that cannot be read back intact."""

    array: str
    """Path of the array inside the store (``"data/obs"``, ``"state/0/sampler/sum_tree"``)."""
    rows: tuple[int, int]
    """Rows ``[start, stop)`` of the array held by the chunk (within the range checked)."""
    reason: str

    def __str__(self) -> str:
        return f"{self.array} {describe_runs([self.rows])}: {self.reason}"


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` found."""

    path: Path | str
    damaged: tuple[DamagedChunk, ...]
    arrays_checked: int
    rows_checked: int
    """Committed rows of the data arrays that were read back."""
    withdrawn_rows: int = 0
    """Rows withdrawn from the readable range by ``repair=True``."""

    @property
    def ok(self) -> bool:
        return not self.damaged

    @property
    def damaged_state(self) -> tuple[DamagedChunk, ...]:
        return tuple(d for d in self.damaged if d.array.startswith(f"{STATE_GROUP}/"))

    def __str__(self) -> str:
        head = (
            f"{self.path}: {self.arrays_checked} arrays, {self.rows_checked} committed rows "
            f"checked; {len(self.damaged)} damaged chunks"
        )
        lines = [head, *(f"  {d}" for d in self.damaged)]
        if self.withdrawn_rows:
            lines.append(f"  repaired: {self.withdrawn_rows} rows withdrawn from the buffer")
        if self.damaged_state:
            lines.append(
                "  the saved buffer state is damaged: zarr_rb.load fails; open the data with "
                "ZarrStorage(path=...) and zarr_rb.save a buffer again",
            )
        return "\n".join(lines)


def verify(
    path: str | os.PathLike[str],
    *,
    repair: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Read back every chunk of a store's committed rows and saved state.

    Args:
        path: the store (a path, or a URL such as ``s3://bucket/runs/pong.zarr``).
        repair: withdraw the rows of damaged data chunks from the readable range (they
            become holes, rewritten by later writes), so that readers and samplers stop
            meeting them. Takes the writer lock; the rows' content is lost either way.
        storage_options: for object stores, as :class:`~zarr_rb.ZarrStorage` takes them.

    Returns:
        The damaged chunks, each with its array, rows and reason.

    Raises:
        StoreCorruptedError: the root metadata itself cannot be read.
        LockedError: ``repair=True`` while another writer holds the store.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> with zarr_rb.ZarrStorage(100, "runs/checked.zarr") as storage:
        ...     storage.set(torch.arange(10), TensorDict({"obs": torch.ones(10, 3)}, [10]))
        >>> report = zarr_rb.verify("runs/checked.zarr")
        >>> report.ok, report.damaged
        (True, ())
    """
    store = open_store(
        path,
        mode="r+" if repair else "r",
        max_size=None,
        ndim=None,
        compression=None,
        storage_options=storage_options,
    )
    try:
        damaged: list[DamagedChunk] = []
        arrays = 0
        seen = store.committed  # the record the rows are checked at
        readable = (  # over the committed rows only: a store's capacity costs nothing here
            seen.readable_mask(seen.length) if store.schema is not None else np.zeros(0, bool)
        )
        positions = np.flatnonzero(readable)
        # The rows of the arrays that hold them (blocks the writer moved to other slots).
        physical = seen.physical(positions)
        # An archive's rows too, those the ring no longer holds (reported, not withdrawn).
        history = seen.history
        archived = (
            np.setdiff1d(history.physical(np.arange(history.end)), physical)
            if history is not None
            else np.empty(0, np.int64)
        )
        stored_as_frames = store.schema.frame_keys if store.schema is not None else frozenset()
        # The cells each key stored as frames names, per cells array: the keys share one,
        # read (and its damage reported) once.
        named_cells: dict[str, tuple[FrameCells, list[_Naming]]] = {}
        for leaf in store.schema.leaves if store.schema is not None else ():
            arrays += 1
            if leaf.key in stored_as_frames:
                held = np.union1d(physical, archived)
                ids_damage, cells, naming = _check_frame_ids(store, leaf.key, held)
                damaged.extend(ids_damage)
                if cells is not None:
                    named_cells.setdefault(cells.cells.path, (cells, []))[1].append(naming)
            elif leaf.ragged:
                damaged.extend(_check_ragged(store, leaf, positions, physical))
            else:
                rows = _ranges(np.union1d(physical, archived))
                damaged.extend(_check_array(store, leaf.path, rows, leaf.key))
        for cells, namings in named_cells.values():
            damaged.extend(_check_cells(cells, namings))
        state_arrays, unreadable = _state_arrays(store)
        damaged.extend(unreadable)
        for array_path, size in state_arrays:
            arrays += 1
            damaged.extend(_check_array(store, array_path, None, None, size=size))
        withdrawn = 0
        if repair:
            # The positions whose rows lie in damaged chunks, as the record read above maps
            # them: the store withdraws those that no writer moved to other rows since.
            lost = np.zeros(positions.size, dtype=bool)
            for chunk in damaged:
                if not chunk.array.startswith(f"{STATE_GROUP}/"):
                    start, stop = chunk.rows
                    lost |= (physical >= start) & (physical < stop)
            withdrawn = store.withdraw(positions[lost], physical[lost], seen)
        return VerifyReport(
            path=store.path,
            damaged=tuple(damaged),
            arrays_checked=arrays,
            rows_checked=int(readable.sum()) + int(archived.size),
            withdrawn_rows=withdrawn,
        )
    finally:
        store.close()


_Naming = tuple[np.ndarray, np.ndarray]
"""Rows of a key stored as frames, and the rows of the cells array each names (a row of
them per row)."""


def _check_frame_ids(
    store: Store, key: tuple[str, ...], rows: np.ndarray
) -> tuple[list[DamagedChunk], FrameCells | None, _Naming]:
    """The damage of the frame ids of a leaf stored as frames, at rows ``rows`` of the
    arrays; the cells they name (``None`` when they cannot be opened) and which rows of
    them the rows whose ids are whole name (checked by :func:`_check_cells`)."""
    nothing: _Naming = (np.empty(0, np.int64), np.empty((0, 0), np.int64))
    try:
        cells = store.arrays.frames.cells(key)
    except (StoreCorruptedError, ValueError) as err:
        unopened = DamagedChunk(frame_ids_path(key), (0, 0), f"cannot open the array: {err}")
        return [unopened], None, nothing
    ids = cells.ids[key]
    damaged = _damaged_in(ids, frame_ids_path(key), _ranges(rows))
    for chunk in damaged:  # (reported with their ids; the frames of the others are checked)
        rows = rows[(rows < chunk.rows[0]) | (rows >= chunk.rows[1])]
    if not rows.size:
        return damaged, cells, nothing
    named = ids.read_rows(rows).result().astype(np.int64).reshape(rows.size, -1)
    per_row = cells.cells_per_row
    outside = ((named < 0) | (named >= cells.region_cells)).any(axis=1)
    damaged.extend(
        DamagedChunk(ids.path, (lo, hi), "a frame id outside its block's region")
        for lo, hi in _ranges(rows[outside])
    )
    inside = ~outside
    cell_rows = (rows[inside] - rows[inside] % cells.block_rows)[:, None] + named[inside] // per_row
    return damaged, cells, (rows[inside], cell_rows)


def _check_cells(cells: FrameCells, namings: list[_Naming]) -> list[DamagedChunk]:
    """The rows naming a frame of ``cells`` that cannot be read back, over every key that
    names them (``namings``): each row of cells named is read once, and the damage is
    reported at the rows naming it, which a repair withdraws."""
    named = np.unique(np.concatenate([cell_rows.reshape(-1) for _, cell_rows in namings]))
    bad = np.fromiter(
        {
            row
            for start, stop in _ranges(named)
            for lo, hi, _ in damaged_runs(cells.cells, start, stop)
            for row in range(lo, hi)
        },
        np.int64,
    )
    if not bad.size:
        return []
    hit = np.concatenate([rows[np.isin(cell_rows, bad).any(axis=1)] for rows, cell_rows in namings])
    return [
        DamagedChunk(cells.cells.path, (lo, hi), "a frame of these rows cannot be read back")
        for lo, hi in _ranges(np.unique(hit))
    ]


def _damaged_in(
    array: RowArray, array_path: str, ranges: tuple[tuple[int, int], ...]
) -> list[DamagedChunk]:
    """The damaged chunks of ``array`` among ``ranges`` of its rows."""
    step = array.chunk_rows
    damaged: list[DamagedChunk] = []
    for start, stop in ranges:
        # One shard (or chunk) at a time: bounded memory, and a damaged chunk is narrowed
        # down to its inner chunk.
        for first in range(start - start % step, stop, step):
            a, b = max(first, start), min(first + step, stop)
            damaged.extend(
                DamagedChunk(array_path, (lo, hi), reason)
                for lo, hi, reason in damaged_runs(array, a, b)
            )
    return damaged


def _check_array(
    store: Store,
    array_path: str,
    ranges: tuple[tuple[int, int], ...] | None,
    key: tuple[str, ...] | None,
    *,
    size: int = 0,
) -> list[DamagedChunk]:
    try:
        if key is not None:
            array = store.arrays.get(key)
        else:
            store.engine.check_array_metadata(array_path, (size,))
            array = store.engine.open_array(array_path, read_only=True)
    except (StoreCorruptedError, ValueError) as err:
        return [DamagedChunk(array_path, (0, 0), f"cannot open the array: {err}")]
    if ranges is None:
        ranges = ((0, array.shape[0]),)
    return _damaged_in(array, array_path, ranges)


def _ranges(rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Rows of an array (unique) as half-open ranges."""
    if not rows.size:
        return ()
    rows = np.sort(rows)  # runs found between sorted rows: no mask over the array's rows
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate(([0], breaks))]
    stops = rows[np.concatenate((breaks - 1, [rows.size - 1]))] + 1
    return tuple((int(a), int(b)) for a, b in zip(starts, stops, strict=True))


def _check_ragged(
    store: Store, leaf: LeafSpec, positions: np.ndarray, physical: np.ndarray
) -> list[DamagedChunk]:
    """The damaged chunks of a ragged leaf: each inner chunk of rows is read up to the
    longest of its rows (chunks past that were never needed, and may not exist).
    ``positions`` are read; ``physical``, the rows of the arrays that hold them."""
    try:
        array = store.arrays.get(leaf.key)
    except (StoreCorruptedError, ValueError) as err:
        return [DamagedChunk(leaf.path, (0, 0), f"cannot open the array: {err}")]
    try:
        sizes = store.arrays.read({leaf.lengths_key: positions})[leaf.lengths_key].numpy()
    except (StoreCorruptedError, ValueError):
        return []  # the lengths leaf is damaged: reported with it
    rows = physical
    ranges = _ranges(physical)
    impossible = (sizes < 0) | (sizes > array.width)
    if impossible.any():  # intact chunks, values no row can have
        return [
            DamagedChunk(
                leaf.lengths_leaf().path,
                (a, b),
                f"rows claim lengths outside 0..{array.width}, the width of {leaf.path}",
            )
            for a, b in _ranges(rows[impossible])
        ]
    order = np.argsort(rows)
    rows, sizes = rows[order], sizes[order]
    step = array.read_chunk_rows
    damaged: list[DamagedChunk] = []
    for start, stop in ranges:
        for first in range(start - start % step, stop, step):
            a, b = max(first, start), min(first + step, stop)
            inside = sizes[np.searchsorted(rows, a) : np.searchsorted(rows, b)]
            span = -(-int(inside.max()) // array.chunk_length)
            if span:
                damaged.extend(
                    DamagedChunk(leaf.path, (lo, hi), reason)
                    for lo, hi, reason in damaged_runs(array, a, b, span * array.chunk_length)
                )
    return damaged


def _state_arrays(store: Store) -> tuple[list[tuple[str, int]], list[DamagedChunk]]:
    """The arrays of the saved buffer state with their sizes, as the save recorded them
    (what ``zarr_rb.load`` reads), and the problems found in that record."""
    saved = store.meta.saved
    if saved is None:
        return [], []
    try:
        attrs = store.engine.read_group_attributes(saved.group).get("zarr_rb_state")
    except (StoreCorruptedError, FileNotFoundError) as err:
        return [], [DamagedChunk(saved.group, (0, 0), str(err))]
    found: list[tuple[str, int]] = []
    damaged: list[DamagedChunk] = []

    def walk(node: object, path: str, depth: int) -> None:
        if not isinstance(node, dict) or depth > 16:
            damaged.append(DamagedChunk(path, (0, 0), "invalid buffer state record"))
            return
        tensors = node.get("tensors", {})
        children = node.get("children", {})
        if not isinstance(tensors, dict) or not isinstance(children, dict):
            damaged.append(DamagedChunk(path, (0, 0), "invalid buffer state record"))
            return
        for name, spec in tensors.items():
            shape = spec.get("shape") if isinstance(spec, dict) else None
            valid = isinstance(shape, list) and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
            )
            if not valid or not _is_name(name):
                damaged.append(DamagedChunk(f"{path}/{name}", (0, 0), "invalid tensor record"))
            elif math.prod(shape or ()):
                found.append((f"{path}/{name}", math.prod(shape or ())))
        for name, child in children.items():
            if _is_name(name):
                walk(child, f"{path}/{name}", depth + 1)
            else:
                damaged.append(DamagedChunk(path, (0, 0), f"invalid child name {name!r}"))

    walk(attrs, saved.group, 0)
    return found, damaged


def _is_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\x00" not in name
