"""A stacked leaf and its ``("next", ...)`` twin on disk as frames, each stored once per
block: the cells and frame ids of ``docs/design/frames-on-disk.md``.

For a :class:`~zarr_rb.core.frame_plans.FrameKeys` with ``K`` keys, ``L`` lanes and stacks of
``S`` frames, the *cells* array holds ``C = K * L * S`` frames per row, and each block of
``block_rows`` rows owns the cells of its rows (its *region*). A block's new frames fill
its region in order; each key's *ids* array holds, per row, lane and frame of the stack, the
cell of the row's own block that holds the frame. A block is self-contained: its objects
copied as stored into another slot read the same.

Cells are taken from a slot's *mark* up and never written again in place (the mark goes
back to 0 only when the ring takes a free slot for a block, :meth:`FrameCells.take_slots`).
Which frames are new is what the RAM tier found when the rows were written, for a block
whose rows it holds (their ids name each of its frames once, :func:`~zarr_rb.core.
frame_plans.cells_from_ids`); for any other block, it is found by exact comparison of bytes,
as the tier does (:func:`~zarr_rb.core.frame_plans.plan_frames`): a row that fits no
pattern gets new frames, never a wrong one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zarr_rb.core.dtypes import from_numpy
from zarr_rb.core.frame_plans import (
    FrameKeys,
    KnownFrames,
    cells_from_ids,
    copy_frames,
    frame_bytes,
    plan_frames,
)
from zarr_rb.engine.damage import damage_error
from zarr_rb.engine.layout import LeafLayout, fitted
from zarr_rb.engine.rows import RowArray, reaches
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.util.keys import Key

READ_PART_ROWS = 256
"""Rows a read of frames gathers at a time (a sample's batch in one)."""
ID_DTYPE = np.dtype(np.int32)
"""The dtype of the frame ids (a region holds at most ``block_rows * C`` cells)."""


def cells_per_row(spec: FrameKeys) -> int:
    """Frame cells a row owns in its block's region: one per frame of its stacks."""
    return spec.slots_per_row


def ids_tail(spec: FrameKeys) -> tuple[int, ...]:
    """The shape of a row of an ids array: a cell per frame of the stack, per lane when a
    row has several (``[time, n_envs]`` storages)."""
    return (spec.stack,) if spec.lanes == 1 else (spec.lanes, spec.stack)


def cell_layouts(spec: FrameKeys, rows: int, block_rows: int) -> tuple[LeafLayout, LeafLayout]:
    """The layouts of the cells array (``[rows, C, *frame]``, one shard per block, one row of
    cells per inner chunk; a block or a row of cells past a chunk's bound is cut along the
    cells, as a leaf's rows are, :func:`~zarr_rb.engine.layout.fitted`) and of an ids array
    (``[rows, S]``, or ``[rows, L, S]``: one chunk per block, so that a block's objects move
    together)."""
    cells = cells_per_row(spec)
    frame = tuple(spec.frame_shape)
    return (
        fitted(
            LeafLayout(
                shape=(rows, cells, *frame),
                chunks=(1, cells, *frame),
                shards=(block_rows, cells, *frame),
            ),
            block_rows,
            name=".".join(spec.key),
        ),
        LeafLayout(
            shape=(rows, *ids_tail(spec)),
            chunks=(block_rows, *ids_tail(spec)),
            shards=None,
        ),
    )


class RegionFullError(Exception):
    """A write would need more cells than its block's region has past the slot's mark: the
    block must move to a free slot (:meth:`FrameCells.room`)."""


@dataclasses.dataclass(eq=False)
class FrameCells:
    """The frames of ``spec``'s keys in the arrays ``cells`` and ``ids`` (one per key)."""

    spec: FrameKeys
    cells: RowArray
    ids: Mapping[Key, RowArray]
    block_rows: int
    _marks: dict[int, int] = dataclasses.field(default_factory=dict)
    """Slots whose mark this writer knows: the cells ``[0, mark)`` of the slot's region may
    be named by a row; new cells are taken from the mark up."""

    @property
    def cells_per_row(self) -> int:
        return cells_per_row(self.spec)

    @property
    def region_cells(self) -> int:
        return self.block_rows * self.cells_per_row

    # --- marks -----------------------------------------------------------------------------

    def take_slots(self, slots: Iterable[int]) -> None:
        """Slots the ring took for blocks, which no record refers to: their regions are free."""
        for slot in slots:
            self._marks[int(slot)] = 0

    def mark(self, slot: int) -> int:
        """The first cell of ``slot``'s region that no row may name (found from the ids on
        disk the first time: the highest named, plus one, rounded up to a row of cells)."""
        known = self._marks.get(slot)
        if known is None:
            known = self._marks[slot] = self._mark_on_disk(slot)
        return known

    def _mark_on_disk(self, slot: int) -> int:
        first = slot * self.block_rows
        rows = np.arange(first, min(first + self.block_rows, self.cells.shape[0]))
        highest = -1
        for array in self.ids.values():
            if not array.has_chunk(slot):
                continue  # never written: no row of the slot names a cell through it
            try:
                named = array.read_rows(rows).result()
            except ValueError as err:
                raise damage_error(array, rows, err) from None
            highest = max(highest, int(named.max()))
        return _whole_rows_of_cells(highest + 1, self.cells_per_row)

    def room(self, slot: int, rows: int) -> bool:
        """Whether ``rows`` rows written into ``slot`` surely find their cells past its mark
        (each row takes at most ``C`` new cells)."""
        return self.mark(slot) + rows * self.cells_per_row <= self.region_cells

    def copy_chunk(self, source: int, target: int) -> None:
        """Copy the objects of slot ``source`` onto slot ``target``, as stored (the ids name
        cells of their own block, so they read the same there); ``target``'s mark is
        ``source``'s."""
        mark = self.mark(source)
        self.cells.copy_chunk(source, target)
        for array in self.ids.values():
            array.copy_chunk(source, target)
        self._marks[target] = mark

    # --- writes ----------------------------------------------------------------------------

    def start_write(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        behind: bool = False,
        known: KnownFrames | None = None,
    ) -> list[tuple[RowArray, Any, list[str]]]:
        """Start writing the rows ``rows`` of the arrays (sorted, unique) with the ``values``
        of one or both keys: each block's new frames into cells past its slot's mark, and
        the rows' ids. Returns the writes started: each array, its write and the objects it
        writes.

        ``known``: the frames of the rows as the RAM tier holds them (the values given,
        each frame once): a block whose rows are all known there takes its cells from
        them, without comparing its frames again.

        Raises:
            RegionFullError: a block's region has too few cells left past its mark (nothing
                is written then).
        """
        return [
            (array, *array.start_write_rows(at, value, behind=behind))
            for array, at, value in self.row_writes(rows, values, known=known)
        ]

    def row_writes(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        known: KnownFrames | None = None,
    ) -> list[tuple[RowArray, np.ndarray, np.ndarray]]:
        """The writes of rows ``rows`` of the arrays (as :meth:`start_write`), not started:
        each array, its rows and their values. The slots' marks move past the cells taken.

        Raises:
            RegionFullError: as :meth:`start_write` (the marks are left as they were).
        """
        spec = self._spec_for(values.keys())
        blocks = rows // self.block_rows
        bounds = np.flatnonzero(np.diff(blocks)) + 1
        parts = np.split(np.arange(rows.size), bounds)
        for part in parts:
            if not self.room(int(blocks[part[0]]), part.size):
                raise RegionFullError(f"block {int(blocks[part[0]])} of {self.cells.path!r}")
        writes: list[tuple[RowArray, np.ndarray, np.ndarray]] = []
        for part in parts:
            # (A block's rows of the write are a run of them: views, not copies.)
            first, stop = int(part[0]), int(part[-1]) + 1
            block_values = {key: values[key][first:stop] for key in spec.keys}
            block_known = None if known is None else known.part(first, stop)
            writes.extend(
                self._block_writes(
                    int(blocks[part[0]]), rows[part], block_values, spec, block_known
                )
            )
        return writes

    def _spec_for(self, keys: Iterable[Key]) -> FrameKeys:
        given = [key for key in self.spec.keys if key in keys]
        if len(given) == len(self.spec.keys):
            return self.spec
        # One key alone: its stacks compared with each other only.
        return dataclasses.replace(self.spec, key=given[0], next_key=None)

    def _block_writes(
        self,
        slot: int,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        spec: FrameKeys,
        known: KnownFrames | None,
    ) -> list[tuple[RowArray, np.ndarray, np.ndarray]]:
        per_row = self.cells_per_row
        mark = self.mark(slot)
        if known is not None and spec.keys == self.spec.keys and known.known.all():
            cells, slot_ids = self._cells_known(known, spec)
        else:
            cells, slot_ids = self._cells_compared(values, spec)
        taken = cells.shape[0]
        per_key = rows.size * spec.lanes * spec.stack
        ids: dict[Key, np.ndarray] = {}
        for i, key in enumerate(spec.keys):
            key_ids = mark + slot_ids[i * per_key : (i + 1) * per_key]
            ids[key] = key_ids.astype(ID_DTYPE).reshape(rows.size, *ids_tail(spec))
        dtype = np.dtype(self.cells.dtype)
        frames = cells.view(dtype).reshape(taken // per_row, per_row, *spec.frame_shape)
        first_row = slot * self.block_rows + mark // per_row
        cell_rows = np.arange(first_row, first_row + frames.shape[0])
        writes: list[tuple[RowArray, np.ndarray, np.ndarray]] = []
        if frames.shape[0]:
            writes.append((self.cells, cell_rows, frames))
        writes.extend((self.ids[key], rows, key_ids) for key, key_ids in ids.items())
        self._marks[slot] = mark + taken
        return writes

    def _cells_known(self, known: KnownFrames, spec: FrameKeys) -> tuple[np.ndarray, np.ndarray]:
        """A block's cells (bytes, whole rows of cells) and the cell of each slot, from the
        frames the RAM tier holds for its rows."""
        picked, slot_ids = cells_from_ids(known, spec.keys)
        taken = _whole_rows_of_cells(picked.size, self.cells_per_row)
        cells = np.zeros((taken, spec.frame_nbytes), dtype=np.uint8)
        copy_frames(cells, np.arange(picked.size), known.frames, picked)
        return cells, slot_ids

    def _cells_compared(
        self, values: Mapping[Key, torch.Tensor], spec: FrameKeys
    ) -> tuple[np.ndarray, np.ndarray]:
        """A block's cells (bytes, whole rows of cells) and the cell of each slot, finding
        its new frames by comparison (:func:`plan_frames`)."""
        plan = plan_frames(spec, values, None)
        fresh = plan.fresh_count
        cells = np.zeros(
            (_whole_rows_of_cells(fresh, self.cells_per_row), spec.frame_nbytes), dtype=np.uint8
        )
        slot_ids = np.empty(plan.links.size, dtype=np.int64)
        slot_ids[plan.fresh_slots] = np.arange(fresh)
        slot_ids = slot_ids[plan.links]  # every slot takes the cell of the slot it links to
        per_key = plan.slots_per_key
        for i, key in enumerate(spec.keys):
            chosen = plan.fresh_slots[
                (plan.fresh_slots >= i * per_key) & (plan.fresh_slots < (i + 1) * per_key)
            ]
            source = values[key].to(spec.dtype).reshape(-1, *spec.frame_shape)
            copy_frames(cells, slot_ids[chosen], frame_bytes(source), chosen - i * per_key)
        return cells, slot_ids

    # --- reads -----------------------------------------------------------------------------

    def read(self, rows: np.ndarray, keys: Sequence[Key]) -> dict[Key, torch.Tensor]:
        """The rows ``rows`` of the arrays (any order, repeats allowed) of ``keys``, rebuilt
        from their cells.

        Raises:
            ChunkCorruptedError: an object the rows need cannot be read back intact, or is
                missing.
            StoreCorruptedError: an id names a cell outside its block's region.
        """
        spec = self.spec
        per_row = self.cells_per_row
        if not rows.size:
            return {key: torch.empty((0, *spec.element_shape), dtype=spec.dtype) for key in keys}
        self._reach(int(rows.max()))
        pending = {key: self.ids[key].read_rows(rows) for key in keys}
        named: dict[Key, np.ndarray] = {}
        for key, future in pending.items():
            try:
                named[key] = future.result().astype(np.int64)
            except ValueError as err:
                raise damage_error(self.ids[key], rows, err) from None
        if not rows.size:
            return {key: torch.empty((0, *spec.element_shape), dtype=spec.dtype) for key in keys}
        everything = np.concatenate([named[key].reshape(rows.size, -1) for key in keys], axis=1)
        if everything.min() < 0 or everything.max() >= self.region_cells:
            raise StoreCorruptedError(
                f"array {self.ids[keys[0]].path!r}: a frame id outside its block's "
                f"{self.region_cells} cells (rows {rows[:8].tolist()}...): the store is "
                "damaged. Restore it from a copy, or run zarr_rb.verify(path)"
            )
        cells = (rows - rows % self.block_rows)[:, None] * per_row + everything
        out = {key: torch.empty((rows.size, *spec.element_shape), dtype=spec.dtype) for key in keys}
        # A part at a time: a long read holds the cells of one part besides what it returns.
        for first in range(0, rows.size, READ_PART_ROWS):
            part = slice(first, first + READ_PART_ROWS)
            self._gather(cells[part], [tensor[part] for tensor in out.values()])
        return out

    def _gather(self, cells: np.ndarray, out: Sequence[torch.Tensor]) -> None:
        """Read the cells ``cells`` names (per row, every key's frames in turn) and gather
        the frames of the ``i``-th key into ``out[i]``."""
        spec, per_row = self.spec, self.cells_per_row
        wanted, where = np.unique(cells // per_row, return_inverse=True)
        try:
            stored = self.cells.read_rows(wanted).result()
        except ValueError as err:
            raise damage_error(self.cells, wanted, err) from None
        flat = from_numpy(stored, spec.dtype).view(wanted.size * per_row, *spec.frame_shape)
        at = where.reshape(cells.shape) * per_row + cells % per_row
        per_key = math.prod(spec.element_shape) // math.prod(spec.frame_shape)
        for i, target in enumerate(out):
            index = np.ascontiguousarray(at[:, i * per_key : (i + 1) * per_key]).reshape(-1)
            frames = target.view(index.size, *spec.frame_shape)  # (each key its own tensor)
            torch.index_select(flat, 0, torch.from_numpy(index), out=frames)

    def _reach(self, row: int) -> None:
        """Open again the arrays that end before ``row`` (a writer added slots since they
        were opened, in another process or another store of this one).

        Raises:
            StoreCorruptedError: an array still ends before it.
        """
        for array in (self.cells, *self.ids.values()):
            if not reaches(array, row):
                raise StoreCorruptedError(
                    f"array {array.path!r}: the commit record maps rows to row {row}, and "
                    f"it has {array.shape[0]}: the record or the array's metadata is "
                    "damaged. Restore the store from a copy, or run zarr_rb.verify(path)"
                )


def _whole_rows_of_cells(cells: int, per_row: int) -> int:
    """``cells`` rounded up to whole rows of cells (a write never shares an inner chunk with
    an earlier one)."""
    return -(-cells // per_row) * per_row
