"""Where each block of positions lives on disk: the slot map of the copy-on-write ring.

The data arrays are addressed by *slot* (``block_rows`` consecutive rows on disk), not by
position: position ``p`` of the ring is row ``slot * block_rows + p % block_rows`` of
every data array, where ``slot`` is the map's entry for block ``p // block_rows``. A store
that was never written over has the identity map and arrays of exactly its capacity
(format 2 and older, and every store until its first overwrite).

Rows that a commit declares readable are never written again: an overwrite goes into a
free slot (one that neither the last commit nor the writer's map refers to), together
with the rows of its block that it leaves alone, and the next commit switches the block
to it. A crash before that commit leaves the block in its old slot, whole. See
``docs/design/ring.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zarr_rb.errors import StoreCorruptedError

SPARE_FACTOR = 2
"""Slots per block of a store that was written over: one for the block's committed rows,
one for the rows a writer puts in its place before the next commit."""


def max_slots(blocks: int) -> int:
    """The most slots a record may name for ``blocks`` blocks (a larger one is damaged):
    spare slots for kept saves, and on S3 the slots each writer that took the store over
    reserved past those of the writers before it (which it never writes into)."""
    return 64 * blocks + 2**24


class SlotMap:
    """The slot of each block; ``capacity`` slots fit in the data arrays."""

    __slots__ = ("_identity", "block_rows", "capacity", "slots")

    def __init__(self, slots: np.ndarray, *, block_rows: int, capacity: int) -> None:
        self.slots = np.asarray(slots, dtype=np.int64)
        self.block_rows = block_rows
        self.capacity = capacity
        self._identity = self._check_identity()

    def _check_identity(self) -> bool:
        return self.capacity == self.blocks and bool(
            np.array_equal(self.slots, np.arange(self.blocks))
        )

    @classmethod
    def identity(cls, rows: int, block_rows: int) -> SlotMap:
        """Block ``b`` in slot ``b``: a store as format 2 lays it out."""
        blocks = -(-rows // block_rows)
        return cls(np.arange(blocks), block_rows=block_rows, capacity=blocks)

    @property
    def blocks(self) -> int:
        return int(self.slots.size)

    @property
    def is_identity(self) -> bool:
        """Every block in its own slot, and no spare slot: the layout of format 2."""
        return self._identity

    def assign(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        """Move ``blocks`` to ``slots`` (a writer's map, between two commits)."""
        self.slots[blocks] = slots
        self._identity = self._check_identity()

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """The rows of the data arrays that hold positions ``rows``."""
        if self.is_identity:
            return rows
        block_rows = self.block_rows
        out: np.ndarray = self.slots[rows // block_rows] * block_rows + rows % block_rows
        return out

    def copy(self) -> SlotMap:
        return SlotMap(self.slots.copy(), block_rows=self.block_rows, capacity=self.capacity)

    def with_capacity(self, capacity: int) -> SlotMap:
        return SlotMap(self.slots, block_rows=self.block_rows, capacity=capacity)

    def free_slot(self, *others: SlotMap) -> int | None:
        """The lowest slot that neither this map nor ``others`` refers to."""
        used = np.zeros(self.capacity, dtype=bool)
        used[self.slots] = True
        for other in others:
            used[other.slots[other.slots < self.capacity]] = True
        free = np.flatnonzero(~used)
        return int(free[0]) if free.size else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlotMap):
            return NotImplemented
        return (
            self.block_rows == other.block_rows
            and self.capacity == other.capacity
            and bool(np.array_equal(self.slots, other.slots))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SlotMap(runs={self._runs()}, capacity={self.capacity})"

    def _runs(self) -> list[list[int]]:
        """``[first block, its slot, blocks]`` for each run of blocks in consecutive slots."""
        if not self.blocks:
            return []
        breaks = np.flatnonzero(np.diff(self.slots) != 1) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [self.blocks]))
        return [
            [int(a), int(self.slots[a]), int(b - a)]
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
        ]

    def to_json(self) -> dict[str, Any]:
        return {"block_rows": self.block_rows, "capacity": self.capacity, "runs": self._runs()}


def parse_slot_map(value: object, *, rows: int) -> SlotMap | None:
    """A map from the commit record (untrusted): every block of ``rows`` positions in one
    slot of its own, inside the capacity."""
    if value is None:
        return None

    def bad(what: str) -> StoreCorruptedError:
        return invalid_metadata(what, value)

    if not isinstance(value, Mapping):
        raise bad("'slots' to be an object or null")
    block_rows, capacity, runs = value.get("block_rows"), value.get("capacity"), value.get("runs")
    if not (isinstance(block_rows, int) and isinstance(capacity, int)) or (
        isinstance(block_rows, bool) or isinstance(capacity, bool)
    ):
        raise bad("slots with integer block_rows and capacity")
    if block_rows < 1 or capacity < 0:
        raise bad("slots with block_rows >= 1 and capacity >= 0")
    blocks = -(-rows // block_rows)
    if capacity < blocks or capacity > max_slots(blocks) or not isinstance(runs, list):
        raise bad(f"slots for {blocks} blocks, with a capacity of at least that many")
    slots = np.full(blocks, -1, dtype=np.int64)
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and all(_is_int(n) for n in run)):
            raise bad("slot runs [first block, slot, blocks]")
        first, slot, count = run
        if not (first >= 0 and count >= 1 and first + count <= blocks):
            raise bad(f"slot runs inside the {blocks} blocks")
        if not (slot >= 0 and slot + count <= capacity):
            raise bad(f"slot runs inside the capacity of {capacity} slots")
        if (slots[first : first + count] != -1).any():
            raise bad("each block in one run")
        slots[first : first + count] = np.arange(slot, slot + count)
    if (slots < 0).any():
        raise bad("a slot for every block")
    if np.unique(slots).size != blocks:
        raise bad("each slot holding one block")
    return SlotMap(slots, block_rows=block_rows, capacity=capacity)


def invalid_metadata(what: str, got: object) -> StoreCorruptedError:
    """The error for a map in the commit record that is not ``what`` it must be."""
    return StoreCorruptedError(f"invalid zarr_rb metadata: expected {what}, got {str(got)[:200]!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
