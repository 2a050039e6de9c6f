"""The slots of a store that several writers write: the open slot a writer appends into,
slots taken from the free ones (and the arrays' growth) by compare-and-swap of the record,
the slots runs, open slots and kept saves refer to, and the collection of the objects of
slots none refers to.

:class:`SharingSlots` is the part of :class:`~zarr_rb.core.sharing.Sharing` (which derives
from it) that owns this state; see ``docs/design/ring.md``, "Step 2" and "Step 4".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from zarr_rb.core.commits import Commits
from zarr_rb.engine import RowArray
from zarr_rb.errors import FencedError, SlotsExhaustedError
from zarr_rb.format.commit import RECENT_TAKES, Commit, Ring, max_ring_capacity
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.runs import RunMap

COLLECT_BATCH = 256
"""Free slots a collection holds (as open slots of its own) per record it publishes."""
SPARE_SLOTS = 64
"""Slots a shared store's arrays have beyond twice its blocks: open slots of writers, and
slots whose rows are not all overwritten yet (their metadata only: no chunk is made)."""


def initial_capacity(blocks: int) -> int:
    """Slots the arrays of a shared store of ``blocks`` blocks are made with."""
    return 2 * blocks + SPARE_SLOTS


def kept_out(ring: Ring) -> np.ndarray:
    """Boolean mask over the slots of ``ring`` that no writer takes again (a writer that
    lost its hold may still write them: see ``Ring``)."""
    out = np.zeros(ring.capacity, dtype=bool)
    out[: ring.fresh_from] = True
    out[list(ring.retired)] = True
    return out


def runs_of(commit: Commit) -> RunMap:
    """The positions ``commit`` declares readable, as runs of the rows that hold them."""
    positions = np.flatnonzero(commit.readable_mask(commit.length))
    return RunMap.of(positions, commit.physical(positions))


class SharingSlots(Commits):
    """The slots of a shared store (see the module's docstring)."""

    writer: str

    def _init_slots(self, writer: str) -> None:
        self.writer = writer
        self.slot: int | None = None
        """The slot this writer appends into."""
        self.filled = 0
        """Rows of :attr:`slot` written (committed or not)."""
        self._full: list[int] = []
        """Slots filled since the last commit: no longer open once it is published."""
        self._alive: dict[str, bool] = {writer: True}
        self._kept: dict[tuple[int, float, int, int], np.ndarray | None] = {}
        """The slots of each kept save (see :meth:`_slots_kept_by`), by save."""
        self._emptied: tuple[Ring, np.ndarray] | None = None
        """Slots known to hold no object, as of the ring of a record (see :meth:`collect`):
        a slot taken since may hold some again."""

    def update(self, edit: Callable[[StoreMeta], StoreMeta | None]) -> StoreMeta:
        """Change the record by compare-and-swap (see :meth:`Sharing.update`)."""
        raise NotImplementedError

    def read_record(self) -> StoreMeta:
        """The record as it is now (see :meth:`Sharing.read_record`)."""
        raise NotImplementedError

    # --- slots -----------------------------------------------------------------------------

    @property
    def block_rows(self) -> int:
        return self.meta.block_rows or 1

    def _is_alive(self, writer: str) -> bool:
        alive = self._alive.get(writer)
        if alive is None:
            alive = self.store.engine.location.writer_alive(writer)
            if alive:
                return True  # not cached: it may die by the next question
            self._alive[writer] = False
        return alive

    def room(self, count: int) -> np.ndarray:
        """Rows of the data arrays for ``count`` new rows: the rest of this writer's open
        slot, then of the slots it takes. A writer that creates objects once starts every
        write in a slot it has not written yet (see :meth:`Sharing.commit_rows`)."""
        block_rows = self.block_rows
        if self.filled and self.store.lifetime.creates_once:
            assert self.slot is not None
            self._full.append(self.slot)  # its objects are made: it takes no more rows
            self.slot = None
        pieces = []
        while count > 0:
            if self.slot is None or self.filled == block_rows:
                if self.slot is not None:
                    self._full.append(self.slot)
                self._take()
            assert self.slot is not None
            taken = min(count, block_rows - self.filled)
            start = self.slot * block_rows + self.filled
            pieces.append(np.arange(start, start + taken, dtype=np.int64))
            self.filled += taken
            count -= taken
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)

    def _take(self) -> None:
        """Take a free slot (growing the arrays' capacity when none is left)."""
        chosen: list[int] = []

        def take(meta: StoreMeta) -> StoreMeta:
            assert meta.commit.ring is not None
            self._check_open(meta.commit.ring)
            meta, slot = self.with_slot_taken(meta)
            chosen[:] = [slot]
            return meta

        meta = self.update(take)
        assert meta.commit.ring is not None
        self.store.arrays.ensure_capacity(meta.commit.ring.capacity)
        self.open_slot(chosen[0])

    def open_slot(self, slot: int) -> None:
        """Append into ``slot`` from its first row on: a slot just taken, which was free
        (no record refers to it), so that its frames' cells are taken from the first."""
        self.slot, self.filled = slot, 0
        self.store.arrays.frames.take_slots([slot])

    def with_slot_taken(self, meta: StoreMeta) -> tuple[StoreMeta, int]:
        """``meta`` with a free slot opened as this writer's (the arrays' capacity grown
        when none is left; the open slots of writers gone dropped), and that slot."""
        ring = meta.commit.ring
        assert ring is not None
        opened = [(w, s) for w, s in ring.open if w == self.writer or self._is_alive(w)]
        if self.store.lifetime.late_writes:
            # A writer taken for gone may be a stalled one whose writes land later.
            gone = [s for w, s in ring.open if (w, s) not in opened]
            ring = dataclasses.replace(ring, retired=(*ring.retired, *gone))
        used = self._used_slots(meta, opened, ring)
        free = np.flatnonzero(~used)
        capacity = ring.capacity
        if free.size:
            slot = int(free[0])
        else:
            slot, capacity = capacity, max(2 * capacity, capacity + SPARE_SLOTS)
            capacity = min(capacity, max_ring_capacity(self.store.rows))
            if slot >= capacity:
                raise SlotsExhaustedError(
                    f"store {self.store.url!r}: its arrays hold {slot} slots, as many as "
                    "a record may name; nothing was written. Save the buffer into a new "
                    "store (zarr_rb.save(rb, new_path)) and write there",
                )
        opened_too = dataclasses.replace(
            ring, capacity=capacity, open=(*opened, (self.writer, slot))
        )
        ring = _with_taken(opened_too, [slot])
        commit = dataclasses.replace(meta.commit, ring=ring)
        return dataclasses.replace(meta, commit=commit), slot

    def _used_slots(self, meta: StoreMeta, opened: list[tuple[str, int]], ring: Ring) -> np.ndarray:
        """The slots that a run of the record, an open slot or a kept save refers to, and
        those ``ring`` keeps from late writes (retired ones, those below ``fresh_from``)."""
        used = self._referenced_slots(meta, opened, ring)
        used |= kept_out(ring)
        return used

    def _referenced_slots(
        self, meta: StoreMeta, opened: list[tuple[str, int]], ring: Ring
    ) -> np.ndarray:
        """The slots that a run of the record, an archive's history, one of ``opened`` or
        a kept save refers to."""
        runs = meta.commit.runs or RunMap.empty()
        used = runs.used_slots(self.block_rows, ring.capacity)
        if meta.commit.history is not None:  # an archive keeps every row extended
            used |= meta.commit.history.used_slots(self.block_rows, ring.capacity)
        for _, slot in opened:
            used[slot] = True
        kept = {}
        for saved in meta.pinned():
            key = (saved.slot, saved.time, saved.length, ring.capacity)
            kept[key] = self._kept.get(key)
            if kept[key] is None:
                kept[key] = self._slots_kept_by(saved, ring.capacity)
            used |= kept[key]
        self._kept = kept
        return used

    def _slots_kept_by(self, saved: Saved, capacity: int) -> np.ndarray:
        """The slots holding the rows a kept save covered (a save made before the store
        became shared: its rows stay until it is replaced or dropped)."""
        assert self.store.schema is not None
        commit = saved.commit(self.store.schema.elements_per_row)
        return runs_of(commit).used_slots(self.block_rows, capacity)

    # --- collection ------------------------------------------------------------------------

    def collect(self) -> int:
        """Delete the objects of slots nothing refers to, past the first
        ``initial_capacity`` (those writers take first): the disk that kept saves held,
        given back once they are replaced or dropped, and that of retired slots once no
        run refers to them. Returns how many slots it emptied.

        A free slot is held (an open slot of this writer, published by compare-and-swap)
        while its objects are deleted, then given back: no writer takes it meanwhile. A
        slot kept out of reach (retired, below ``fresh_from``) is never taken: its objects
        go without. The first collection of a writer lists the arrays; later ones delete
        the slots that came free since (a slot taken since may hold objects again)."""
        store = self.store
        arrays = store.arrays.block_arrays()
        meta = self.read_record()
        ring = meta.commit.ring
        assert ring is not None
        spare = initial_capacity(-(-store.rows // self.block_rows))
        never_again = kept_out(ring)
        if not arrays or (ring.capacity <= spare and not never_again.any()):
            return 0
        stored = self._maybe_stored(ring, arrays)
        referenced = self._referenced_slots(meta, list(ring.open), ring)
        candidates = stored & ~referenced
        emptied = np.flatnonzero(candidates & never_again)  # never taken again: wherever they are
        if emptied.size:
            store.lifetime.check_hold()
            self._count_taken(emptied.tolist())
            store.arrays.drop_slots(arrays, emptied.tolist())
        candidates[:spare] = False  # free ones that writers take first keep their objects
        free = np.flatnonzero(candidates & ~never_again)
        for start in range(0, free.size, COLLECT_BATCH):
            held = self._hold(free[start : start + COLLECT_BATCH].tolist())
            try:
                store.lifetime.check_hold()
                store.arrays.drop_slots(arrays, held)
            finally:
                # Free again, emptied or not (a slot taken is written whole before use).
                self._give_back(held)
            emptied = np.concatenate([emptied, np.asarray(held, dtype=np.int64)])
        # Known empty from here: the slots just emptied, and those with no object that no
        # writer has open (an open one may be written without being taken again).
        empty = ~stored
        empty[[slot for _, slot in ring.open]] = False
        empty[emptied] = True
        # The slots this collection emptied count as taken since ``ring``: known from the
        # record after them, unless other writers took slots meanwhile (perhaps those).
        after = self.committed.ring
        alone = after is not None and after.takes - ring.takes == emptied.size
        self._emptied = (after if alone and after is not None else ring, empty)
        return int(emptied.size)

    def _maybe_stored(self, ring: Ring, arrays: list[RowArray]) -> np.ndarray:
        """Boolean mask over the slots of ``ring``: those that may hold objects."""
        if self._emptied is not None:
            seen, empty = self._emptied
            taken = ring.taken_since(seen)
            if taken is not None:
                known = np.zeros(ring.capacity, dtype=bool)
                known[: min(empty.size, ring.capacity)] = empty[: ring.capacity]
                known[[slot for slot in taken if slot < ring.capacity]] = False
                return ~known
        stored = np.zeros(ring.capacity, dtype=bool)
        stored_slots = self.store.arrays.stored_slots(arrays)
        listed = [slot for slot in stored_slots if slot < ring.capacity]
        stored[listed] = True
        return stored

    def _hold(self, slots: list[int]) -> list[int]:
        """Open ``slots`` as this writer's (those still free in the record as it is now),
        so that no writer takes them; returns those held."""
        held: list[int] = []

        def hold(meta: StoreMeta) -> StoreMeta | None:
            ring = meta.commit.ring
            assert ring is not None
            self._check_open(ring)
            used = self._used_slots(meta, list(ring.open), ring)
            held[:] = [slot for slot in slots if slot < ring.capacity and not used[slot]]
            if not held:
                return None
            opened = (*ring.open, *((self.writer, slot) for slot in held))
            ring = _with_taken(dataclasses.replace(ring, open=opened), held)
            return dataclasses.replace(meta, commit=dataclasses.replace(meta.commit, ring=ring))

        self.update(hold)
        return held

    def _count_taken(self, slots: list[int]) -> None:
        """Count ``slots`` as taken (their objects are about to be deleted), without opening
        them: slots kept out of reach, which no writer takes again."""

        def count(meta: StoreMeta) -> StoreMeta:
            ring = meta.commit.ring
            assert ring is not None
            ring = _with_taken(ring, slots)
            return dataclasses.replace(meta, commit=dataclasses.replace(meta.commit, ring=ring))

        self.update(count)

    def _give_back(self, slots: list[int]) -> None:
        """Free ``slots``, which :meth:`_hold` opened (empty now)."""
        given = set(slots)

        def give_back(meta: StoreMeta) -> StoreMeta | None:
            ring = meta.commit.ring
            assert ring is not None
            kept = tuple((w, s) for w, s in ring.open if not (w == self.writer and s in given))
            if kept == ring.open:
                return None  # (retired by a writer that took this one for gone)
            ring = dataclasses.replace(ring, open=kept)
            return dataclasses.replace(meta, commit=dataclasses.replace(meta.commit, ring=ring))

        self.update(give_back)

    def _check_open(self, ring: Ring) -> None:
        """This writer's slots must still be its own (others drop them only once they took
        it for gone: it must then write nothing more)."""
        mine = [*self._full, *([self.slot] if self.slot is not None else [])]
        held = set(ring.slots_of(self.writer))
        lost = [slot for slot in mine if slot not in held]
        if lost:
            raise FencedError(
                f"store {self.store.url!r}: slot(s) {lost} of this writer were given back "
                "by another writer, which took this one for gone (its lease expired: the "
                "process stalled for longer than the lease lasts); its rows there were not "
                "committed. Reopen the store to write again",
                holder={},
            )


def _with_taken(ring: Ring, slots: list[int]) -> Ring:
    """``ring`` with ``slots`` counted as taken: a reader that read rows of one of them
    under an older record reads again (:meth:`Ring.taken_since`). A slot is taken when a
    writer opens it to write, and when a collection empties it."""
    recent = (*ring.recent, *slots)[-RECENT_TAKES:]
    return dataclasses.replace(ring, takes=ring.takes + len(slots), recent=recent)
