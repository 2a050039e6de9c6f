"""How a store of one writer writes rows: blocks wait in RAM until they fill (or an
extend goes past them, or a flush), and a write over rows that a record refers to moves
their block to a free slot (copy-on-write), with the rows of the block it leaves alone.

:class:`SoloWrites` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that writes; see ``docs/design/ring.md``, "Step 1" and "Step 5".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.arrays import PendingWrite
from zarr_rb.core.arrivals import Arrivals
from zarr_rb.core.commits import StoreAPI
from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.solo_slots import SoloSlots
from zarr_rb.core.store_facts import whole_rows
from zarr_rb.core.write_cache import Block
from zarr_rb.core.write_patches import Write
from zarr_rb.format.schema import plain_then_ragged
from zarr_rb.util.keys import Key


@dataclasses.dataclass(eq=False)
class StartedWrite:
    """A write of rows started: what finishing it (or undoing it) needs."""

    pending: PendingWrite | None
    """The arrays' write in flight (``None``: written already)."""
    writes: list[Write]
    touched: np.ndarray
    was_intact: np.ndarray
    keys: set[Key]
    moved: np.ndarray
    """Blocks moved by copy-on-write, and the slots they were in."""
    before: np.ndarray
    lost: np.ndarray
    """Rows that stopped being intact when the write started (rewritten in place)."""

    def has_landed(self) -> bool:
        """Whether finishing it waits for nothing."""
        return self.pending is None or self.pending.has_landed()

    def released(self) -> bool:
        """Whether the memory it wrote from may take other rows (see
        :meth:`PendingWrite.released`)."""
        return self.pending is None or self.pending.released()


class SoloWrites(SoloSlots):
    """The writes of a store of one writer (see the module's docstring)."""

    def _init_writes(self) -> None:
        self._rewrote_published = False
        """Rows the last commit declared readable were written over (in other slots) since:
        the next commit moves the epoch."""

        def held() -> np.ndarray:
            assert self.store.write_cache is not None
            return self.store.write_cache.held_rows()

        self.arrivals = Arrivals(held)
        """Rows extended and not on disk yet, and rows a failed call lost."""
        self._created_slots: list[int] = []
        """Slots this writer created objects in since its last record (objects created
        once: the next record's ``object_era`` lists them for readers' caches)."""

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
        cache = self.store.write_cache
        hit, _ = cache.staged_rows(rows)
        # Past the committed rows: cells never written, but those held in RAM (in a block,
        # or a failed write of some keys waiting to be written again). (Inside them, a cell
        # that cannot be read was lost to a crash or a failed write: it stays unreadable,
        # not zero.)
        fresh = self.committed.unwritten_at(rows)
        empty = {
            key: ~(self.store.ledger.readable(rows, key) | hit | cache.patches.mask(rows, key))
            & fresh
            for key in missing
        }
        if all(cells.all() for cells in empty.values()):
            return whole_rows(self.store, rows, values), []
        zeros: list[Write] = []
        for key, cells in empty.items():
            if cells.any():
                leaf = self.store.leaf(key)
                shape = (int(cells.sum()), *self.store.element_shape(leaf))
                zeros.append(
                    (rows[cells], {key: torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])})
                )
        return values, zeros

    def _unkept(self, rows: np.ndarray) -> np.ndarray:
        """A call that wrote ``rows`` (unique) failed, perhaps after it put some of their
        values into RAM's copies (the mirror of small leaves, the tier of frames) and into
        the write buffer, perhaps before. RAM's copies of them are read again from the
        write buffer and the store (whatever the call reached there, and older values
        elsewhere); those neither kept in the write buffer nor intact on disk are holes,
        which commits pass over (``SoloCursor._settled``). Returns the rows whose values
        from this call the write buffer does not keep."""
        cache, ledger = self.store.write_cache, self.store.ledger
        if cache is None or ledger is None or not rows.size:
            return rows[:0]
        self.store.ram.forget(rows)
        kept = np.isin(rows, cache.held_rows()) | np.isin(rows, cache.patches.rows())
        return rows[~kept | np.isin(rows, cache.take_restored())]

    def _write_now(
        self,
        writes: list[Write],
        blocks: list[Block],
        *,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Write to disk and wait (after the block write in flight, if any): ``blocks`` are
        the blocks taken out of the write buffer that ``writes`` write. Failed writes of
        some keys that wait in RAM (patches) are written again with them: rows of an extend
        among them come before these. ``meanwhile`` (which must not raise) is called once
        the first write is started, while TensorStore encodes it."""
        if not writes:
            return
        assert self.store.write_cache is not None
        behind = self.store.write_cache.writing
        try:
            self.settle()
        except BaseException:
            # The rows of this call wait too, after the block written behind (which waits
            # in RAM again): it was extended before every one of them.
            assert behind is not None
            (older,) = self.store.write_cache.take([behind.index])[1]
            self._keep_for_retry([older, *writes])
            raise
        # (Their cells are none of these writes': each write drops the cells it rewrites
        # from the patches, see WriteBuffer.supersede.)
        self._write_in_turn([*self.store.write_cache.patches.take(), *writes], meanwhile=meanwhile)
        self.store.write_cache.reuse(blocks)

    def _write_in_turn(
        self, writes: Sequence[Write], *, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Write to disk in order, one call per run of writes of the same keys: a call
        counts its keys as written to every row it writes (a failed one, as torn there).
        What a failed call and those after it hold is kept for the next flush to retry.
        ``meanwhile``: see :meth:`_write_now`."""
        runs: list[list[Write]] = []
        for write in writes:
            if runs and runs[-1][0][1].keys() == write[1].keys():
                runs[-1].append(write)
            else:
                runs.append([write])
        for done, run in enumerate(runs):
            try:
                self._write_to_disk(run, meanwhile=meanwhile)
                meanwhile = None
            except BaseException:
                self._keep_for_retry([write for later in runs[done:] for write in later])
                raise

    def _keep_for_retry(self, writes: Sequence[Write]) -> None:
        """Keep the rows of failed ``writes`` (in the order made), so that the next flush
        writes them again: writes of some keys as patches, and whole rows in blocks in RAM,
        but those before a write of some keys, which are patches too (both are read from
        there). Patches are written before the blocks waiting in RAM (see
        :meth:`_write_now`): rows extended before a patch's, kept in a block, would land
        after it."""
        cache = self.store.write_cache
        assert cache is not None
        self.store.ram.keep_lent_frames()  # (the writes' values are staged again: whole)
        every = self.store.leaves.keys()
        some_keys = [i for i, (_, values) in enumerate(writes) if values.keys() != every]
        last_patch = some_keys[-1] if some_keys else -1
        for i, (rows, values) in enumerate(writes):
            if i <= last_patch:
                cache.patches.keep((rows, values))
            else:
                cache.stage(rows, values, force=True)

    def _write_to_disk(
        self, writes: Sequence[Write], *, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Write rows. A block whose rows hold data (committed, or written since) is
        written by copy-on-write: into a free slot, with the rows of the block this write
        leaves alone; the next commit switches the block to it, and until then the block's
        old slot stays as it was (a crash or a failed write leaves it whole). Rows never
        written go straight into their block's slot. ``meanwhile`` (which must not raise)
        is called once the write is started, before it is waited for."""
        started = self._start_write(writes)
        if meanwhile is not None:
            meanwhile()
        self._finish_write(started)

    def _start_write(self, writes: Sequence[Write], *, behind: bool = False) -> StartedWrite:
        """Start :meth:`_write_to_disk`: everything up to waiting for the arrays' writes
        (objects created once are written whole here). ``behind``: commits made before it
        finishes do not depend on what it writes."""
        assert self.store.ledger is not None
        assert self.positions is not None
        self.store.lifetime.check_hold()
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
        lost = self.store.ledger.start_write(in_place)
        started = StartedWrite(
            None, [*copies, *writes], touched, was_intact, keys, moved, before, lost
        )
        try:
            if self.store.lifetime.creates_once:
                self.store.arrays.write_rows(started.writes, seeds=seeds)
            else:
                started.pending = self.store.arrays.start_rows(started.writes, behind=behind)
        except BaseException:
            self._undo_write(started)
            raise
        return started

    def _finish_write(self, started: StartedWrite, *, what: str = "writing rows") -> None:
        """Wait for a write :meth:`_start_write` started; its rows become intact."""
        assert self.store.ledger is not None
        if started.pending is not None:
            try:
                self.store.arrays.finish(started.pending, what=what)
            except BaseException:
                self._undo_write(started)
                raise
        if self.arrivals.any_unlanded:
            # (Not rows that still wait in RAM: cells of an extend kept after it failed.)
            assert self.store.write_cache is not None
            landed = np.flatnonzero(started.touched)
            landed = landed[~np.isin(landed, self.store.write_cache.held_rows(writing=False))]
            self.arrivals.landed(landed)
        if self.store.lifetime.creates_once:
            written = np.concatenate([np.empty(0, np.int64), *(rows for rows, _ in started.writes)])
            slots = np.unique(self.physical(written) // self.block_map.block_rows)
            self._created_slots.extend(slots.tolist())
        self.store.ledger.finish_write(started.touched, started.was_intact, started.keys)

    def _undo_write(self, started: StartedWrite) -> None:
        """A write failed: its blocks are where they were, and the rows it rewrote in place
        are not whole (their cells of other keys still are)."""
        assert self.store.ledger is not None
        self.block_map.assign(started.moved, started.before)
        self.store.ledger.fail_write(started.lost, started.keys)

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
        self._announce_kept()
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
        # So is one where an older commit this writer keeps has rows the write goes over
        # (emptied or withdrawn since): a reader may still read that commit.
        kept = self._kept_readable(touched_blocks, slots, np.flatnonzero(touched))
        move = pinned | (committed & has_live) | foreign | kept
        # A block whose frames could run out of cells where it is moves, its frames copied
        # by value: it starts afresh in its new slot (docs/design/frames-on-disk.md).
        move |= ~self.store.arrays.frames.room(slots, touched_blocks, writes, block_rows)
        creates_once = self.store.lifetime.creates_once
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
        self.store.arrays.frames.take_slots(fresh.tolist())
        before = block_map.slots[blocks].copy()
        positions = (blocks[:, None] * block_rows + np.arange(block_rows)).ravel()
        positions = positions[positions < ledger.extent]
        copies: list[Write] = []
        # Arrays whose shards are the blocks: the block's objects are copied as stored, and
        # the write goes over them (it rewrites the inner chunks it touches, as in place).
        # When objects are created once, the write starts from those copies instead
        # (``seeds``): the rows kept and the rows written make each object, created whole.
        whole = self.store.arrays.whole_block_keys()
        seeds: list[tuple[int, int]] = []
        if creates_once:
            seeds = list(zip(before.tolist(), fresh.tolist(), strict=True))
        else:
            with self.store.writing("copying blocks to other slots"):
                for key in whole:
                    # (Not a block whose every row the write covers: nothing of it is kept.)
                    kept = ~_written_mask(writes, key, ledger.extent)
                    moved_blocks = zip(
                        blocks.tolist(), before.tolist(), fresh.tolist(), strict=True
                    )
                    for block, source, target in moved_blocks:
                        if kept[block * block_rows : (block + 1) * block_rows].any():
                            self.store.arrays.get(key).copy_chunk(source, target)
        copies.extend(_copies_by_value(self.store, writes, positions, whole))
        block_map.assign(blocks, fresh)
        return blocks, before, copies, in_place, seeds


def _copies_by_value(
    store: StoreAPI, writes: Sequence[Write], positions: np.ndarray, whole: Sequence[Key]
) -> list[Write]:
    """The writes that copy, by value, the rows of moved blocks (``positions``) that
    ``writes`` leave alone, of the leaves not copied as stored (not in ``whole``): of each
    key, the rows holding data of it; the leaves stored as frames a row at a time."""
    ledger = store.ledger
    assert ledger is not None
    copies: list[Write] = []
    others = [key for key in store.leaves if key not in whole]
    stored_as_frames = store.arrays.frames.keys()
    for group in plain_then_ragged(store.leaves, others):
        requests = {}
        for key in group:
            written = [rows for rows, values in writes if key in values]
            keep = ledger.readable(positions, key)
            if written:
                keep &= ~np.isin(positions, np.concatenate(written))
            if keep.any():
                requests[key] = positions[keep]
        framed = {key: rows for key, rows in requests.items() if key in stored_as_frames}
        if framed:
            copies.extend(store.arrays.frames.copies(framed, store.arrays.read(framed)))
            requests = {key: rows for key, rows in requests.items() if key not in framed}
        lengths = {
            key: store.arrays.read({store.leaf(key).lengths_key: rows})[
                store.leaf(key).lengths_key
            ].numpy()
            for key, rows in requests.items()
            if store.leaf(key).ragged
        }
        for key, values in store.arrays.read(requests, lengths).items():
            copies.append((requests[key], {key: values}))
    return copies


def _written_mask(writes: Sequence[Write], key: Key, rows: int) -> np.ndarray:
    """Which of the first ``rows`` rows ``writes`` write a value of ``key`` into."""
    mask = np.zeros(rows, dtype=bool)
    for written, values in writes:
        if key in values:
            mask[written[written < rows]] = True
    return mask
