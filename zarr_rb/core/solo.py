"""The positions and commits of a store of one writer (and of every reader).

* **Rows wait in RAM by block** (:class:`~zarr_rb.core.write_cache.WriteBuffer`) and reach
  the disk when their block fills, when an extend goes past it, or at a flush.
* **Copy-on-write.** A write over rows that a record refers to (the last commit, a kept
  save, an archive's history) moves their block to a free slot, with the rows of the block
  it leaves alone; the next commit switches the block's position to it (``commit.slots``).
  A crash or a failed write leaves the old slot whole.
* **A commit** replaces the record whole, declaring the rows on disk within the length,
  as a prefix from the last commit on (rows after one that is not on disk wait).
* **On a lease** (an object store), a writer reserves its slots in the record before it
  writes there, so that the late writes of a stalled writer before it land in slots no
  one else writes (see :class:`~zarr_rb.core.format.LeaseFloor`).

See ``docs/design/ring.md``, "Step 1" and "Owners".
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from zarr_rb.core.commits import Commits
from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.format import (
    ATTRS_KEY,
    ERA_SLOTS,
    FORMAT_NON_TENSOR,
    FORMAT_VERSION,
    STATE_GROUP,
    Commit,
    LeafSpec,
    LeaseFloor,
    ObjectEra,
    Saved,
    Schema,
    StoreMeta,
    commit_from_mask,
    leaves_by_key,
)
from zarr_rb.core.history import Extended
from zarr_rb.core.reader import reread_commit
from zarr_rb.core.ring import SPARE_FACTOR, SlotMap, max_slots
from zarr_rb.core.runs import RunMap
from zarr_rb.core.write_cache import Block, Key
from zarr_rb.errors import NotSupportedError, SlotsExhaustedError

if TYPE_CHECKING:
    from zarr_rb.core.store import Store

_R = TypeVar("_R")

_MAX_STAGED_BLOCKS = 8
STAGED_RAGGED_BYTES = 128 * 2**20
"""A block of rows of different lengths waits in RAM padded to its longest row; rows so
long that their block would take more than this are written at once instead."""

Write = tuple[np.ndarray, Mapping[Key, torch.Tensor]]
"""Rows (sorted, unique) and the values of some or all leaves for them."""


class SoloCommits(Commits):
    """The positions and commits of a store of one writer (see the module's docstring)."""

    def __init__(self, store: Store, meta: StoreMeta, *, late_writes: bool) -> None:
        per_row = store.elements_per_row(meta.schema)
        super().__init__(
            store, meta, length=meta.commit.length * per_row, cursor=meta.commit.cursor
        )
        self._written_from = meta.commit.cursor
        """Where the rows written since the last commit (or since the cursor was moved)
        start: the commit records how far from there they are committed."""
        self._extended = Extended()
        """An archive's positions extended since the last commit (its history grows by
        those a commit publishes)."""
        self._retries: list[Write] = []
        """Writes of some keys that failed: written again by the next flush."""
        self._schema_on_disk = meta.schema
        """The schema of the last published record (keys added since are published next)."""
        self._rewrote_published = False
        """Rows the last commit declared readable were written over (in other slots) since:
        the next commit moves the epoch."""
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
        self._replaced_published: int | None = None
        """``Engine.arrays_replaced`` when this writer last published a record (``None``:
        it published none yet)."""
        self._created_slots: list[int] = []
        """Slots this writer created objects in since its last record (objects created
        once: the next record's ``object_era`` lists them for readers' caches)."""

    # --- the interface ---------------------------------------------------------------------

    def initialize(
        self, schema: Schema, block_rows: int, samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        store = self.store
        with store.writing("creating the arrays"):
            store.create_arrays(schema.leaves, schema.batch_shape, block_rows, samples=samples)
        self.meta = dataclasses.replace(self.meta, schema=schema, block_rows=block_rows)
        store.attach_schema(schema, block_rows)
        self.publish_meta()

    def add_leaves(
        self, leaves: Sequence[LeafSpec], samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        store = self.store
        schema = store.schema
        assert schema is not None
        assert store.write_cache is not None
        assert store.ledger is not None
        block_rows = store.meta.block_rows or 1
        physical_shape = (store.physical_rows, *schema.batch_shape[1:])
        on_disk = store.ledger.intact | store.ledger.published
        if on_disk.any():
            # The record says this writer holds its slots before it writes zeros there, and
            # names the keys only after (a reader of it would meet cells holding nothing).
            self._first_own_slot()
        with store.writing("creating the arrays of new keys"):
            store.create_arrays(leaves, physical_shape, block_rows, samples=samples)
        grown = schema.with_leaves(leaves)
        # A store of format 1 that takes leaves format 1 cannot read becomes format 2, so
        # that an older zarr_rb refuses it (FormatVersionError) instead of misreading it.
        fmt = store.meta.format
        if any(leaf.value != "tensor" for leaf in leaves):
            fmt = max(fmt, FORMAT_NON_TENSOR)
        self.meta = dataclasses.replace(self.meta, schema=grown, format=fmt)
        store.leaves = leaves_by_key(grown.leaves)
        for leaf in leaves:
            store.write_cache.add_key(
                leaf.key, store.element_shape(leaf), TORCH_DTYPES[leaf.dtype], ragged=leaf.ragged
            )
        store.update_mirrorable()
        # Zeros on disk for every row that holds data there (intact here, or published to
        # readers), so that those rows stay whole with the new keys; rows waiting in RAM get
        # zeros there too (add_key).
        committed = self._committed_slots()
        with store.writing("writing zeros into new keys"):
            futures = []
            row_sets = []
            for start, stop in _runs(on_disk, block_rows):
                # In the block's slot, and in its committed one (when the writer moved it
                # since): readers of the last commit read it there.
                positions = np.arange(start, stop)
                rows = np.union1d(self.physical(positions), committed.physical(positions))
                row_sets.append(rows)
            history = store.committed.history
            if history is not None:  # an archive's rows read as zeros in the new keys too
                row_sets.append(np.unique(history.physical(np.arange(history.end))))
            for rows in row_sets:
                for leaf in leaves:
                    if leaf.ragged:
                        continue  # its rows are empty (their lengths are zeros): nothing to read
                    zeros = np.zeros((rows.size, *store.element_shape(leaf)), leaf.stored_dtype)
                    futures.append(store.array(leaf.key).write_rows(rows, zeros))
            for future in futures:
                future.result()
        store.ledger.add_keys(leaf.key for leaf in leaves)

    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None
    ) -> None:
        store = self.store
        assert store.write_cache is not None
        if store.archive and self._extended.overlaps(rows):
            # Rows extended since the last commit, written over: into the history first, as
            # they were extended.
            store.flush()
        store.version += 1
        if cursor is not None:
            self.cursor = cursor
            if store.archive:
                self._extended.add(rows, cursor, store.rows)
        if self._retries:
            # Failed writes waiting to be written again must not land over these newer rows.
            self._retries = _without_cells(self._retries, rows, values.keys())
        values, zeros = self._zeros_where_unwritten(rows, values)
        store.update_mirror(rows, values)
        if values.keys() == store.leaves.keys():
            writes = self._stage_rows(rows, values, sequential=cursor is not None)
        else:
            # Rows waiting in RAM take the new values there; the others are written now.
            in_ram = store.write_cache.patch(rows, values)
            elsewhere = np.flatnonzero(~in_ram)
            writes = zeros
            if elsewhere.size:
                picked = torch.from_numpy(elsewhere)
                writes.append((rows[elsewhere], {k: v[picked] for k, v in values.items()}))
        if writes:
            self._write_or_keep(writes)
            if values.keys() == store.leaves.keys():
                # (Writes of some keys wait for the next commit: a writer that writes a
                # buffer column by column, as TorchRL's checkpointers do, moves each block
                # once, not once per key.)
                self._commit()

    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        raise NotSupportedError(
            f"store {self.store.url!r} has one writer: an extend goes to the cursor "
            "(write), rows are placed at commit time only on a shared store"
        )

    def flush(self) -> None:
        store = self.store
        assert store.write_cache is not None
        writes = [_block_rows(block) for block in store.write_cache]
        store.write_cache.clear()
        if writes:
            self._write_or_keep(writes)
        while self._retries:
            retry = self._retries[0]
            self._write_to_disk([retry])
            self._retries.pop(0)
        self._commit()

    def discard(self) -> None:
        self._retries.clear()

    def move_cursor(self, cursor: int) -> None:
        super().move_cursor(cursor)
        self._written_from = cursor
        self._extended.restart()

    def empty(self) -> None:
        store = self.store
        if self.meta.saved is not None:
            # The rows of the last save are gone: so is the save.
            self.meta = dataclasses.replace(self.meta, saved=None)
        if store.ledger is None:
            commit = dataclasses.replace(
                store.committed,
                generation=store.committed.generation + 1,
                length=0,
                cursor=0,
                holes=(),
                epoch=store.committed.epoch + 1,
            )
            self.publish(commit)
            return
        self._publish_mask(store.ledger.mask(), rewrite=True)

    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        store = self.store
        ledger = store.ledger
        assert ledger is not None
        inside = positions < store.committed.length
        positions, physical = positions[inside], physical[inside]
        still = positions[store.committed.physical(positions) == physical]
        rows = np.zeros(max(ledger.extent, int(still.max(initial=-1)) + 1), dtype=bool)
        rows[still] = True
        rows = ledger.fit(rows)
        withdrawn = int((ledger.published & rows).sum())
        ledger.withdraw(rows)
        if withdrawn:
            self._publish_mask(
                ledger.published & ~rows, length=store.committed.length, rewrite=True
            )
        return withdrawn

    def collect(self) -> int:
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
        whole = store.whole_block_arrays()
        emptied: set[int] = set()
        with store.writing("deleting slots no record refers to"):
            stale = {
                key: free
                if known is not None
                else sorted(
                    store.array(key).stored_chunks() & set(np.flatnonzero(eligible).tolist())
                )
                for key in whole
            }
            if any(slot >= self._own_floor() for chunks in stale.values() for slot in chunks):
                # A DELETE is a write: one that lands late must not reach a writer that took
                # the store over at a record that leaves it these slots.
                self._first_own_slot()
            for key, chunks in stale.items():
                store.array(key).drop_chunks(chunks)
                emptied.update(chunks)
        self._known_empty = eligible
        return len(emptied)

    def start_history(self) -> None:
        pass  # the next commit starts the history (see publish)

    def use_save(self, saved: Saved, commit: Commit) -> None:
        store = self.store
        ledger = store.ledger
        assert ledger is not None
        readable = commit.readable_mask(commit.length)
        # Rows withdrawn since the save (a repair found them damaged) in blocks still in the
        # slots the save has: the damage is the save's too.
        kept, head = self._slots_of(commit), self._committed_slots()
        for start, stop in store.committed.holes:
            lost = np.arange(start, min(stop, commit.length))
            blocks = lost // kept.block_rows
            shared = kept.slots[blocks] == head.slots[blocks]
            readable[lost[shared]] = False
        if store.read_only:
            store.pinned = saved
            self.use_map(commit)
            ledger.published_as(readable)
            store.version += 1
            return
        store.check_writable()
        store.discard()
        self.positions = SlotMap(
            kept.slots.copy(),
            block_rows=kept.block_rows,
            capacity=max(kept.capacity, self.block_map.capacity),
        )
        ledger.rebase(readable)
        # The rows committed since the save are dropped: the epoch moves (unless they are
        # the save's rows, as when a save is loaded right after it was made).
        self._rewrote_published = (commit.length, commit.holes, commit.slots) != (
            store.committed.length,
            store.committed.holes,
            store.committed.slots,
        )

    def overwrote_since(self, epoch: int) -> bool:
        return epoch < self.committed.epoch

    def next_save_slot(self, named: set[int]) -> int:
        taken = named | self._avoided_saves
        return next(slot for slot in itertools.count() if slot not in taken)

    def hold_for_save(self) -> None:
        self._first_own_slot()

    def publish_saved(self, saved: Saved, *, tag: str | None) -> None:
        store = self.store
        commit = store.committed
        saved = dataclasses.replace(saved, pinned=True, slots=commit.slots, holes=commit.holes)
        if tag is not None:
            versions = {**store.meta.versions, tag: saved}
            self.meta = dataclasses.replace(self.meta, versions=versions)
        self.publish(commit, saved=saved)
        self._drop_unnamed_states()

    def drop_version(self, tag: str) -> None:
        store = self.store
        versions = dict(store.meta.versions)
        del versions[tag]
        self.meta = dataclasses.replace(self.meta, versions=versions)
        self.publish(store.committed)
        self._drop_unnamed_states()

    def publish_meta(self) -> None:
        self.publish(self.committed)

    def read(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        return read()

    def refresh(self) -> Commit:
        store = self.store
        store.pinned = None  # to the last commit, from a save it was reading
        commit = reread_commit(store)
        self.length = commit.length * store.elements_per_row(store.schema)
        self.cursor = commit.cursor
        return commit

    def leave(self) -> None:
        if self.late_writes_alone:
            self.store.collect()  # the slots of the writers before, which it moved out of
            self._release_slots()

    @property
    def rows_reached(self) -> int:
        return max(self.store.rows_written, self.committed.length)

    # --- copy-on-write, slots, commits ----------------------------------------------------

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

    def _pinned_slots(self) -> list[SlotMap]:
        """The maps of the saves whose rows the store keeps (their slots are not free)."""
        return [self._slots_of(saved.commit()) for saved in self.meta.pinned()]

    def _zeros_where_unwritten(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]
    ) -> tuple[Mapping[Key, torch.Tensor], list[Write]]:
        """A write that leaves keys out: cells of those keys that were never written (rows
        past the committed ones) get zeros, as in TorchRL's storages, whose unwritten cells
        read as zeros; cells that hold data keep it.

        Returns the values to write (whole rows when every left-out cell was empty) and,
        otherwise, writes of zeros into the empty cells alone.
        """
        missing = [key for key in self.store.leaves if key not in values]
        if not missing or not rows.size:
            return values, []
        assert self.store.write_cache is not None
        assert self.store.ledger is not None
        hit, _ = self.store.write_cache.staged_rows(rows)
        # Past the committed rows: cells never written. (Inside them, a cell that cannot be
        # read was lost to a crash or a failed write: it stays unreadable, not zero.)
        fresh = rows >= self.committed.length
        empty = {key: ~(self.store.ledger.readable(rows, key) | hit) & fresh for key in missing}
        if all(cells.all() for cells in empty.values()):
            return self.store.whole_rows(rows, values), []
        zeros: list[Write] = []
        for key, cells in empty.items():
            if cells.any():
                leaf = self.store.leaf(key)
                shape = (int(cells.sum()), *self.store.element_shape(leaf))
                zeros.append(
                    (rows[cells], {key: torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])})
                )
        return values, zeros

    def _write_or_keep(self, writes: Sequence[Write]) -> None:
        """Write to disk; what a failed write held is kept for the next flush to retry."""
        try:
            self._write_to_disk(writes)
        except BaseException:
            self._keep_for_retry(writes)
            raise

    def _stage_rows(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, sequential: bool
    ) -> list[Write]:
        """Stage whole rows in RAM by block; returns what must be written now.

        ``sequential``: the rows are a writer's extend, ending just before :attr:`cursor`.
        Only the block it ends in may then stay in RAM: every other staged block (one it
        went past, partly on disk already after a flush in its middle, or the block an
        earlier extend ended in) is written now, so that the rows a commit publishes
        always run up to the cursor it records, with no row left behind in RAM.
        """
        assert self.store.write_cache is not None
        if self._too_long_to_stage(values):
            # Written now, after the rows of their blocks that wait in RAM (older values).
            waiting = {int(i) for i in np.unique(rows // self.store.write_cache.block_rows)}
            older = [block for block in self.store.write_cache if block.index in waiting]
            if older:
                self._write_or_keep(
                    [_block_rows(self.store.write_cache.pop(b.index)) for b in older]
                )
            return [(rows, values)]
        direct, full = self.store.write_cache.stage(rows, values)
        if sequential and rows.size:
            block_rows = self.store.write_cache.block_rows
            last = (self.cursor - 1) % self.store.write_cache.rows // block_rows
            passed = {block.index for block in self.store.write_cache} - {last}
            full = sorted(set(full) | passed)
        blocks = [self.store.write_cache.pop(index) for index in full]
        if len(self.store.write_cache) > _MAX_STAGED_BLOCKS:
            # Too many partially filled blocks: write the oldest ones as they are.
            oldest = [block.index for block in self.store.write_cache][
                : len(self.store.write_cache) - _MAX_STAGED_BLOCKS
            ]
            blocks.extend(self.store.write_cache.pop(index) for index in oldest)
        writes: list[Write] = [_block_rows(block) for block in blocks]
        # Slices of the caller's tensors: views, not copies.
        writes.extend(
            (rows[start:stop], {key: value[start:stop] for key, value in values.items()})
            for start, stop in direct
        )
        return writes

    def _too_long_to_stage(self, values: Mapping[Key, torch.Tensor]) -> bool:
        assert self.store.write_cache is not None
        block_rows = self.store.write_cache.block_rows
        return any(
            self.store.leaf(key).ragged and block_rows * value[:1].nbytes > STAGED_RAGGED_BYTES
            for key, value in values.items()
        )

    def _keep_for_retry(self, writes: Sequence[Write]) -> None:
        """Keep the rows of failed writes, so that the next flush writes them again: whole
        rows wait in RAM (and are served from there), writes of some keys are queued."""
        assert self.store.write_cache is not None
        for rows, values in writes:
            if values.keys() == self.store.leaves.keys():
                self.store.write_cache.stage(rows, values, force=True)
            else:
                self._retries.append((rows, values))

    def _write_to_disk(self, writes: Sequence[Write]) -> None:
        """Write rows. A block whose rows hold data (committed, or written since) is
        written by copy-on-write: into a free slot, with the rows of the block this write
        leaves alone; the next commit switches the block to it, and until then the block's
        old slot stays as it was (a crash or a failed write leaves it whole). Rows never
        written go straight into their block's slot."""
        assert self.store.ledger is not None
        assert self.positions is not None
        self.store.check_hold()
        self.store.ledger.grow(
            max((int(rows.max()) + 1 for rows, _ in writes if rows.size), default=0)
        )
        touched = self.store.ledger.mask()
        for rows, _ in writes:
            touched[rows] = True
        keys = {key for _, values in writes for key in values}
        was_intact = self.store.ledger.intact & touched
        moved, before, copies, in_place, seeds = self._copy_on_write(writes, touched)
        # Rows rewritten in slots no record refers to (moved since the last commit): not
        # whole while the write runs (a failed write leaves them to be written again).
        self.store.ledger.start_write(in_place)
        try:
            self.store.write_rows([*copies, *writes], seeds=seeds)
        except BaseException:
            self.block_map.assign(moved, before)  # the blocks' rows are where they were
            raise
        if self.store.creates_once:
            written = np.concatenate([np.empty(0, np.int64), *(r for r, _ in [*copies, *writes])])
            slots = np.unique(self.physical(written) // self.block_map.block_rows)
            self._created_slots.extend(slots.tolist())
        self.store.ledger.finish_write(touched, was_intact, keys)

    def _copy_on_write(
        self, writes: Sequence[Write], touched: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[Write], np.ndarray, list[tuple[int, int]]]:
        """Move the blocks whose rows ``writes`` writes over to free slots, but those that
        are in a slot no record refers to already (moved since the last commit).

        Returns the blocks moved, the slots they were in, the writes that copy the rows of
        those blocks that ``writes`` leaves alone (of each key: the rows holding data of
        it) into their new slots, the rows (a mask) written over where they are, and the
        ``(slot, new slot)`` whose objects of the arrays sharded by block the write starts
        from, copied as stored, when objects are created once (else they are copied now).
        """
        ledger = self.store.ledger
        assert ledger is not None
        block_map = self.block_map
        none = np.empty(0, dtype=np.int64)
        if (ledger.published & touched).any():
            self._rewrote_published = True
        block_rows = block_map.block_rows
        live = (ledger.intact | ledger.published) & touched
        touched_blocks = np.unique(np.flatnonzero(touched) // block_rows)
        slots = block_map.slots[touched_blocks]
        # A slot a kept save refers to is never written (its rows past this writer's length
        # are that save's); one the last commit refers to, where the write goes over rows
        # that hold data. A slot no record refers to is written in place.
        pinned = np.isin(slots, np.concatenate([none, *(m.slots for m in self._pinned_slots())]))
        history = self.committed.history
        if history is not None:  # nor one holding an archive's rows (after an empty, a load)
            pinned |= history.used_slots(block_rows, block_map.capacity)[slots]
        committed = np.isin(slots, self._committed_slots().slots)
        has_live = np.isin(touched_blocks, np.flatnonzero(live) // block_rows)
        # A slot another writer may still write (one that held the store before): moved.
        foreign = slots < self._first_own_slot()
        move = pinned | (committed & has_live) | foreign
        creates_once = self.store.creates_once
        if creates_once:
            # No object is written over: a block whose slot holds rows to keep (any of
            # them, written or not now) moves as well, the rows it keeps copied along.
            move |= np.isin(touched_blocks, np.flatnonzero(ledger.held()) // block_rows)
        in_place = ledger.mask()
        for block in touched_blocks[has_live & ~move].tolist():
            in_place[block * block_rows : (block + 1) * block_rows] = True
        in_place &= live
        blocks = touched_blocks[move]
        if not blocks.size:
            return none, none, [], in_place, []
        fresh = self._free_slots(blocks.size)
        before = block_map.slots[blocks].copy()
        positions = (blocks[:, None] * block_rows + np.arange(block_rows)).ravel()
        positions = positions[positions < ledger.extent]
        copies: list[Write] = []
        # Arrays whose shards are the blocks: the block's objects are copied as stored, and
        # the write goes over them (it rewrites the inner chunks it touches, as in place).
        # When objects are created once, the write starts from those copies instead
        # (``seeds``): the rows kept and the rows written make each object, created whole.
        whole = [key for key in self.store.leaves if self.store.array(key).chunk_rows == block_rows]
        seeds: list[tuple[int, int]] = []
        if creates_once:
            seeds = list(zip(before.tolist(), fresh.tolist(), strict=True))
        else:
            with self.store.writing("copying blocks to other slots"):
                for key in whole:
                    for source, target in zip(before.tolist(), fresh.tolist(), strict=True):
                        self.store.array(key).copy_chunk(source, target)
        others = [key for key in self.store.leaves if key not in whole]
        for group in self.store.plain_then_ragged(others):
            requests = {}
            for key in group:
                written = [rows for rows, values in writes if key in values]
                keep = ledger.readable(positions, key)
                if written:
                    keep &= ~np.isin(positions, np.concatenate(written))
                if keep.any():
                    requests[key] = positions[keep]
            lengths = {
                key: self.store.read_disk({self.store.leaf(key).lengths_key: rows})[
                    self.store.leaf(key).lengths_key
                ].numpy()
                for key, rows in requests.items()
                if self.store.leaf(key).ragged
            }
            for key, values in self.store.read_disk(requests, lengths).items():
                copies.append((requests[key], {key: values}))
        block_map.assign(blocks, fresh)
        return blocks, before, copies, in_place, seeds

    def _used_slots(self) -> np.ndarray:
        """Boolean mask over the slots of a store of one writer: those the writer's map,
        the last commit, a kept save or an archive's history refers to."""
        slots = self.block_map
        used = np.zeros(slots.capacity, dtype=bool)
        for kept in (slots, self._committed_slots(), *self._pinned_slots()):
            used[kept.slots[kept.slots < slots.capacity]] = True
        if self.committed.history is not None:  # an archive's rows are never written over
            used |= self.committed.history.used_slots(slots.block_rows, slots.capacity)
        return used

    @property
    def late_writes_alone(self) -> bool:
        """A single writer whose slots are reserved in the record before it writes."""
        return self.store.late_writes

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
            for key in self.store.leaves:
                self.store.array(key).grow_rows(capacity * slots.block_rows)
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

    def _commit(self) -> None:
        """Publish every row that is on disk and within the storage's length."""
        if self.store.schema is None:
            self.publish(dataclasses.replace(self.committed, length=0, holes=()))
            return
        assert self.store.ledger is not None
        # Rows waiting in RAM keep their previous, still intact, committed content.
        ledger = self.store.ledger
        readable = ledger.intact & ~(self.store.staged_mask(ledger.extent) & ~ledger.published)
        readable[self.store.length_rows :] = False
        # Rows past the committed ones are published as a prefix: rows after one that is
        # not on disk (a failed write kept in RAM) wait for it, rather than leave a hole.
        first_missing = _first_unset(readable, self.committed.length, self.store.length_rows)
        if first_missing is not None:
            readable[first_missing:] = False
        self._publish_mask(readable, rewrite=self._rewrote_published)

    def _committable_cursor(self, readable: np.ndarray) -> int:
        """The cursor a commit that declares the ``readable`` rows records: this writer's,
        unless rows it wrote since the last commit still wait in RAM or are not readable in
        it (withdrawn while they are rewritten); then the first of them in ring order, so
        that a writer reopened after a crash appends right after the rows the commit
        publishes (or, in a full ring, rewrites the oldest or withdrawn ones first), never
        over rows it published."""
        assert self.store.write_cache is not None
        start, rows = self._written_from, self.store.write_cache.rows
        span = (self.cursor - start) % rows
        first = span
        # The span in ring order: one or two runs of rows (never a mask over all of them).
        runs = [(start, min(start + span, rows))]
        if start + span > rows:
            runs.append((0, start + span - rows))
        offset = 0
        for lo, hi in runs:
            found = _first_unset(readable, lo, hi)
            if found is not None:
                first = offset + found - lo
                break
            offset += hi - lo
        for block in self.store.write_cache:
            offsets = np.flatnonzero(block.dirty[: block.length])
            distance = (block.index * self.store.write_cache.block_rows + offsets - start) % rows
            waiting = distance[distance < first]
            if waiting.size:
                first = int(waiting.min())
        return (start + first) % rows

    def _publish_mask(
        self, readable: np.ndarray, *, length: int | None = None, rewrite: bool = False
    ) -> None:
        """Publish a commit declaring the ``readable`` rows; ``rewrite``: rows the last
        commit declared readable are about to be written over (the epoch moves)."""
        assert self.store.ledger is not None
        commit = commit_from_mask(
            readable,
            generation=self.committed.generation + 1,
            cursor=self._committable_cursor(readable),
            length=length,
        )
        commit = dataclasses.replace(
            commit, epoch=self.committed.epoch + rewrite, slots=self._slots_record()
        )
        waiting = None
        if self.store.archive:
            # The rows extended since that this commit publishes: those on disk (the others
            # wait in RAM, for a later commit), in the order written.
            assert self.positions is not None
            assert self.store.write_cache is not None
            pending = self._extended.pending()
            in_ram, _ = self.store.write_cache.staged_rows(pending)
            done = ~in_ram & commit.readable(pending)
            waiting = pending[~done]
            history = self.committed.history or RunMap.empty()
            commit = dataclasses.replace(
                commit, history=history.appended(self.positions.physical(pending[done]))
            )
        if (
            commit.length == self.committed.length
            and commit.holes == self.committed.holes
            and commit.cursor == self.committed.cursor
            and commit.epoch == self.committed.epoch
            and commit.slots == self.committed.slots
            and commit.history == self.committed.history
            and self.store.schema == self._schema_on_disk
        ):
            return
        self.publish(commit)
        self.store.ledger.published_as(readable)
        self._rewrote_published = False
        if waiting is not None:
            self._extended.keep(waiting)

    def _drop_unnamed_states(self) -> None:
        """Delete the state groups of saves that no record names (dropped versions, a save
        a crash interrupted before it was published), but the one the next save writes."""
        saves = (self.meta.saved, *self.meta.versions.values())
        named = {saved.group for saved in saves if saved is not None}
        named.add(f"{STATE_GROUP}/{self.store.next_save_slot()}")
        groups = {
            "/".join(key.split("/")[:2]) for key in self.store.engine.location.list(STATE_GROUP)
        }
        for group in sorted(groups - named):
            if group.count("/") == 1 and group.split("/")[1].isdigit():
                self.store.engine.location.delete_prefix(group)

    def _slots_record(self) -> SlotMap | None:
        """The writer's map as a commit records it (``None``: the identity)."""
        if not isinstance(self.positions, SlotMap) or self.positions.is_identity:
            return None
        return self.positions.copy()

    def publish(self, commit: Commit, *, saved: Saved | None = None, rows: bool = True) -> None:
        """Publish ``commit`` (with ``saved``, the new last save). ``rows=False``: a record
        published in the middle of a write (slots reserved or held) that commits no row of
        it: the rows written since the last commit still start where they did. (Such a
        record keeps the commit's generation: readers, which compare generations, see no
        change, and there is none for them.)"""
        self.store.ensure_on_disk()
        if self.store.archive and commit.history is None:
            commit = dataclasses.replace(commit, history=RunMap.empty())
        if self.late_writes_alone:
            commit = dataclasses.replace(commit, lease=self._lease)
        replaced = self.store.engine.arrays_replaced
        commit = dataclasses.replace(commit, object_era=self._object_era(replaced))
        meta = dataclasses.replace(self.meta, commit=commit)
        if saved is not None:
            meta = dataclasses.replace(meta, saved=saved)
        self.store.check_hold()
        with self.store.writing("publishing a commit"):
            self.store.store_pieces(meta)  # (a failed publish leaves them: garbage, see collect)
            self.store.engine.write_root_attributes({ATTRS_KEY: meta.to_json()})
            self.store.drop_pieces(self.meta, meta)
        self.meta = meta
        self.committed = commit
        if rows:
            self._written_from = commit.cursor
        self._schema_on_disk = meta.schema
        self._replaced_published = replaced
        self._created_slots.clear()

    def _object_era(self, replaced: int) -> ObjectEra | None:
        """:attr:`Commit.object_era` of the next record: the last commit's, with the slots
        this writer created objects in since; a new token (and no slot) at this writer's
        first record (the writer before may have created objects after its last one), after
        an array was created again, and when the slots would be too many; ``None`` when
        objects may be written over."""
        if not self.store.creates_once:
            return None
        era = self.committed.object_era
        created = tuple(self._created_slots)
        if (
            era is None
            or replaced != self._replaced_published
            or len(era.slots) + len(created) > ERA_SLOTS
        ):
            return ObjectEra(token=secrets.token_hex(8))
        return ObjectEra(token=era.token, slots=era.slots + created)


def _first_unset(mask: np.ndarray, start: int, stop: int) -> int | None:
    """The first row of ``[start, stop)`` that ``mask`` leaves unset (rows past the mask are
    unset), or ``None``."""
    end = min(stop, mask.size)
    if start < end:
        unset = np.flatnonzero(~mask[start:end])
        if unset.size:
            return start + int(unset[0])
    past = max(start, mask.size)
    return past if past < stop else None


def _runs(mask: np.ndarray, step: int) -> Iterator[tuple[int, int]]:
    """The ``True`` runs of ``mask`` as ``(start, stop)``, cut at multiples of ``step``."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        for first in range(start, stop, step):
            yield first, min(stop, (first // step + 1) * step)


def _without_cells(writes: Sequence[Write], rows: np.ndarray, keys: Iterable[Key]) -> list[Write]:
    """``writes`` without the cells of ``keys`` in ``rows`` (a newer write holds them)."""
    keys = set(keys)
    out: list[Write] = []
    for written, values in writes:
        kept = ~np.isin(written, rows)
        index = torch.from_numpy(np.flatnonzero(kept))
        covered = {key: value[index] for key, value in values.items() if key in keys}
        others = {key: value for key, value in values.items() if key not in keys}
        if covered and kept.any():
            out.append((written[kept], covered))
        if others:
            out.append((written, others))
    return out


def _block_rows(block: Block) -> Write:
    """The rows a block holds and their values (all of them when the block is full)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}
