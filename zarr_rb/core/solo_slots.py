"""Which slots a store of one writer writes into: the block map and the maps that keep
slots in use (the last commit, kept saves, an archive's history), free slots and the
arrays' growth, the slots a writer on a lease reserves in the record before it writes
there, the blocks whose committed slot commits keep naming (committed rows torn by a failed
write in place), and the collection of the objects no record refers to.

:class:`SoloSlots` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that owns this state; see ``docs/design/ring.md``, "S3 and fencing" and "Step 4".
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np

from zarr_rb.core.commits import Commits
from zarr_rb.errors import SlotsExhaustedError
from zarr_rb.format.commit import Commit, LeaseFloor
from zarr_rb.format.names import FORMAT_VERSION
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.ring import SPARE_FACTOR, SlotMap, max_slots

KEPT_COMMITS = 8
"""Commits whose rows a writer keeps, at most: their slots are not written, nor the rows
they declare readable, until this many newer commits (:attr:`Commit.kept_from`), so that a
reader can finish reading one of them (a sample: ``docs/design/reader-snapshots.md``).
Fewer when the slots they keep besides the last commit's would pass a ring's worth (the
spare slots the arrays have anyway): a write of a whole ring per commit keeps one."""

if TYPE_CHECKING:
    from zarr_rb.core.commits import StoreAPI


class SoloSlots(Commits):
    """The slots of a store of one writer (see the module's docstring)."""

    def _init_slots(self, store: StoreAPI, meta: StoreMeta, *, late_writes: bool) -> None:
        self._avoided_saves: set[int] = set()
        """State groups this writer never saves into: those writers that held the store
        before it may still write late (a lease lost while saving), as the record this one
        took the store over at names them (see :class:`LeaseFloor`)."""
        if late_writes and not store.read_only:
            lease = meta.commit.lease
            avoided = set(lease.avoid) if lease is not None else set()
            if lease is None or lease.held:
                # The writer before may have stalled while saving: into the group it
                # saves into next, which this record tells.
                named = meta.save_slots() | avoided
                avoided.add(next(slot for slot in itertools.count() if slot not in named))
            self._avoided_saves = avoided
        self._known_empty: np.ndarray | None = None
        """Slots that held no object when :meth:`collect` last ran and were not handed
        out since (``None``: not known; the next collection lists the arrays)."""
        self._own_from: int | None = None
        """The first slot this writer reserved for itself, when a writer that held the
        store before it may still write (a lease it lost while it stalled: see
        ``WriterHold.late_writes``): slots below it are that writer's, so this one moves
        the blocks it writes out of them. ``None``: not fixed yet (when this writer first
        writes: the floor of a record whose writer closed cleanly, else its capacity)."""
        self._lease = meta.commit.lease
        """What this writer's commits record of the slots a writer on a lease owns: the
        record's, until this writer holds its own (see :class:`LeaseFloor`)."""
        self._holding = False
        """Whether the record says this writer holds slots from ``_own_from`` on."""
        self._kept = [meta.commit]
        """The commits whose rows this writer keeps (:data:`KEPT_COMMITS` at most), oldest
        first, the last one last: from the one it opened at (it knows no older one's map)."""

    def publish(self, commit: Commit, *, saved: Saved | None = None, rows: bool = True) -> None:
        """Publish ``commit`` (see :meth:`SoloCommits.publish`)."""
        raise NotImplementedError

    def collect(self) -> int:
        self.settle()
        if not isinstance(self.positions, SlotMap) or self.positions.is_identity:
            return 0
        store = self.store
        slots = self.block_map
        spare = SPARE_FACTOR * slots.blocks
        if slots.capacity <= spare:
            return 0  # the arrays never grew past the slots the ring reuses
        eligible = ~self._used_slots()
        # (Slots below this writer's own are never written again: they go too.)
        eligible[self._own_floor() : spare] = False
        known = self._known_empty
        if known is not None:
            size = slots.capacity
            known = np.concatenate([known, np.zeros(max(0, size - known.size), bool)])
            free = np.flatnonzero(eligible & ~known[:size]).tolist()
            if not free:
                return 0
            if len(free) > SPARE_FACTOR * slots.blocks:
                known = None  # many slots not known to be empty: listing them costs less
        self._announce_kept()
        arrays = store.arrays.block_arrays()
        emptied: set[int] = set()
        with store.writing("deleting slots no record refers to"):
            stale = [
                (
                    array,
                    free
                    if known is not None
                    else sorted(array.stored_chunks() & set(np.flatnonzero(eligible).tolist())),
                )
                for array in arrays
            ]
            if any(slot >= self._own_floor() for _, chunks in stale for slot in chunks):
                # A DELETE is a write: one that lands late must not reach a writer that took
                # the store over at a record that leaves it these slots.
                self._first_own_slot()
            for array, chunks in stale:
                array.drop_chunks(chunks)
                emptied.update(chunks)
        self._known_empty = eligible
        return len(emptied)

    @property
    def block_map(self) -> SlotMap:
        """The block map of a store of one writer."""
        assert isinstance(self.positions, SlotMap)
        return self.positions

    def _slots_of(self, commit: Commit) -> SlotMap:
        """The block map of ``commit`` (the identity when it records none)."""
        store = self.store
        assert store.schema is not None
        if commit.slots is not None:
            return commit.slots
        return SlotMap.identity(store.rows, store.meta.block_rows or 1)

    def _committed_slots(self) -> SlotMap:
        return self._slots_of(self.committed)

    def _kept_where_committed(self) -> np.ndarray:
        """Blocks moved since the last commit that hold rows it declares that are not whole
        where the blocks are now, because a write over them in place failed (it waits in
        RAM to be made again): until the write is made, the writer's commits wait (the
        record stays at the last commit), and a record published meanwhile (a withdrawal)
        names the slot the last commit named, where those rows are whole. A crash then
        loses the rows written since, not the rows committed."""
        ledger = self.store.ledger
        cache = self.store.write_cache
        positions = self.positions
        none = np.empty(0, dtype=np.int64)
        if ledger is None or cache is None or not isinstance(positions, SlotMap):
            return none
        torn = ledger.published & ~ledger.intact
        if not torn.any():
            return none
        waiting = self.store.ram.staged_mask(ledger.extent)
        patched = cache.patches.rows()
        waiting[patched[patched < ledger.extent]] = True
        torn &= waiting  # (not rows withdrawn as damaged: those stay withdrawn)
        if not torn.any():
            return none
        blocks = np.unique(np.flatnonzero(torn) // positions.block_rows)
        committed = self._committed_slots().slots
        blocks = blocks[blocks < min(positions.slots.size, committed.size)]
        moved: np.ndarray = blocks[positions.slots[blocks] != committed[blocks]]
        return moved

    def _pinned_slots(self) -> list[SlotMap]:
        """The maps of the saves whose rows the store keeps (their slots are not free)."""
        return [self._slots_of(saved.commit()) for saved in self.meta.pinned()]

    def kept_from(self, commit: Commit) -> int:
        """:attr:`Commit.kept_from` of ``commit``, as this writer publishes it."""
        return self._kept_with(commit)[0].generation

    def _keep(self, commit: Commit) -> None:
        """``commit`` was published: its rows are kept, and the oldest commits' no longer
        once more than :data:`KEPT_COMMITS` are kept (its record said so)."""
        self._kept = self._kept_with(commit)

    def _kept_with(self, commit: Commit) -> list[Commit]:
        """The commits kept once ``commit`` is published (see :data:`KEPT_COMMITS`)."""
        if commit.generation == self._kept[-1].generation:
            return [*self._kept[:-1], commit]  # (the same commit: slots reserved, a lease held)
        if commit.generation < self._kept[-1].generation:
            return [commit]  # (never after a commit of its own; kept_from stays <= generation)
        kept = [*self._kept, commit][-KEPT_COMMITS:]
        if self.store.schema is None:
            return kept
        last = self._slots_of(commit)
        budget = last.blocks
        while len(kept) > 1:
            older = [self._slots_of(c).slots for c in kept[:-1]]
            if _slots_besides(older, last.slots).size <= budget:
                break
            kept = kept[1:]
        return kept

    def _announce_kept(self) -> None:
        """Before this writer's first write: the record says which commits it keeps (the
        writer before it may have kept older ones, whose maps this one does not know)."""
        if self.committed.kept_from != self._kept[0].generation:
            self.publish(self.committed, rows=False)

    def _kept_readable(self, blocks: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which of ``blocks`` (in ``slots`` now) an older kept commit has in the same slot
        with some of ``rows`` readable: a write over those rows moves the block."""
        block_rows = self.block_map.block_rows
        out = np.zeros(blocks.size, dtype=bool)
        for kept in self._kept[:-1]:
            named = self._slots_of(kept).slots
            inside = blocks < named.size
            same = np.zeros(blocks.size, dtype=bool)
            same[inside] = named[blocks[inside]] == slots[inside]
            readable = rows[kept.readable(rows)] // block_rows
            out |= same & np.isin(blocks, readable)
        return out

    def _used_slots(self) -> np.ndarray:
        """Boolean mask over the slots of a store of one writer: those the writer's map,
        the commits it keeps, a kept save or an archive's history refers to."""
        slots = self.block_map
        used = np.zeros(slots.capacity, dtype=bool)
        kept_maps = [self._slots_of(commit) for commit in self._kept[:-1]]
        for kept in (slots, self._committed_slots(), *kept_maps, *self._pinned_slots()):
            used[kept.slots[kept.slots < slots.capacity]] = True
        if self.committed.history is not None:  # an archive's rows are never written over
            used |= self.committed.history.used_slots(slots.block_rows, slots.capacity)
        return used

    @property
    def late_writes_alone(self) -> bool:
        """A single writer whose slots are reserved in the record before it writes."""
        return self.store.lifetime.late_writes

    def write_past(self, slot: int) -> None:
        """Write no slot below ``slot`` (a writer that held the store before may still
        write there: see ``_own_from``); 0: every slot is this writer's."""
        self._own_from = slot
        if slot == 0:
            self._known_empty = np.zeros(0, bool)  # nor left objects in slots it adds

    def _own_floor(self) -> int:
        """The first slot this writer may write into: 0 unless a writer that held the
        store before it may still write (see ``_own_from``)."""
        if not self.late_writes_alone:
            return 0
        if self._own_from is None:
            lease = self.committed.lease
            if lease is not None and not lease.held:
                self._own_from = lease.floor  # its writer closed: nothing of it lands late
            else:
                self._own_from = self._committed_slots().capacity
        return self._own_from

    def _first_own_slot(self) -> int:
        """:meth:`_own_floor`, recorded as held before this writer's first write: a writer
        that takes the store over from this one (were it to stall) starts past them."""
        own = self._own_floor()
        if self.late_writes_alone and not self._holding:
            self._lease = LeaseFloor(floor=own, held=True, avoid=self._avoid())
            self.publish(self.committed, rows=False)
            self._holding = True
        return own

    def _release_slots(self) -> None:
        """After this writer's last write (a clean close): the next writer on the lease
        takes its slots again, from the same floor."""
        if not self._holding:
            return
        self._lease = LeaseFloor(floor=self._own_floor(), held=False, avoid=self._avoid())
        self.publish(self.committed, rows=False)
        self._holding = False

    def _avoid(self) -> tuple[int, ...]:
        return tuple(sorted(self._avoided_saves))

    def _free_slots(self, count: int) -> np.ndarray:
        """``count`` slots of this writer that neither the last commit nor the writer's
        map refers to; the arrays grow (their metadata only) when there are not enough."""
        slots = self.block_map
        own = self._own_floor()
        free = np.flatnonzero(~self._used_slots())
        free = free[free >= own]
        if free.size >= count:
            chosen = free[:count]
            if self._known_empty is not None:  # written from now on
                self._known_empty[chosen[chosen < self._known_empty.size]] = False
            reserved = self._committed_slots()
            if self.late_writes_alone and chosen.size and int(chosen.max()) >= reserved.capacity:
                # Reserved before anything is written there (also when the arrays grew for
                # them before and that reservation failed): a writer that took the store
                # over from this one takes its slots past these (and this one's late
                # writes, were it stalled, land in slots no one else writes).
                reserved = reserved.with_capacity(slots.capacity)
                self.publish(dataclasses.replace(self.committed, slots=reserved), rows=False)
            return chosen
        # Metadata only (chunks are made as they are written): room for a whole ring more,
        # so that kept saves do not make every write grow the arrays.
        # (Past this writer's own first slot at once: it may lie far past the record's.)
        capacity = max(
            SPARE_FACTOR * slots.blocks, slots.capacity + max(count, slots.blocks), own + count
        )
        if capacity > max_slots(slots.blocks):
            capacity = max_slots(slots.blocks)
            if capacity - max(own, slots.capacity) < count:
                raise SlotsExhaustedError(
                    f"store {self.store.url!r}: its arrays hold {slots.capacity} slots of "
                    f"{slots.block_rows} rows, as many as a record may name (each writer that "
                    "took the store over on S3 reserved slots of its own); nothing was written. "
                    "Save the buffer into a new store (zarr_rb.save(rb, new_path)) and write there",
                )
        if self.meta.format < FORMAT_VERSION:
            # Readers that know no slot map refuse the store (FormatVersionError) from
            # before its arrays grow, rather than take them for damaged.
            self.meta = dataclasses.replace(self.meta, format=FORMAT_VERSION)
            self.publish(self.committed, rows=False)
        with self.store.writing("adding slots to the arrays"):
            self.store.arrays.grow_rows(capacity * slots.block_rows)
        self.positions = slots.with_capacity(capacity)
        known = self._known_empty
        if known is not None:  # slots up to the old capacity may hold objects, new ones not
            self._known_empty = np.concatenate(
                [
                    known,
                    np.zeros(slots.capacity - known.size, bool),
                    np.ones(capacity - slots.capacity, bool),
                ]
            )
        return self._free_slots(count)  # reserved there


def _slots_besides(maps: list[np.ndarray], last: np.ndarray) -> np.ndarray:
    """The slots ``maps`` name that ``last`` does not (unique): ``np.setdiff1d`` of them,
    without sorting every block of a large capacity. A block in the same slot in a map and
    in ``last`` (most of them, between commits) needs no search."""
    differ = []
    for slots in maps:
        n = min(slots.size, last.size)
        differ += [slots[:n][slots[:n] != last[:n]], slots[n:]]
    named = np.unique(np.concatenate([np.empty(0, dtype=last.dtype), *differ]))
    out: np.ndarray = named[~np.isin(named, last)]
    return out
