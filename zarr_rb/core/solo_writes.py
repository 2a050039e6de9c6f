"""How a store of one writer writes rows: blocks wait in RAM until they fill (or an
extend goes past them, or a flush), and a write over rows that a record refers to moves
their block to a free slot (copy-on-write), with the rows of the block it leaves alone.

:class:`SoloWrites` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that writes; see ``docs/design/ring.md``, "Step 1" and "Step 5".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.solo_slots import SoloSlots
from zarr_rb.core.write_cache import Block, Write
from zarr_rb.format.schema import plain_then_ragged
from zarr_rb.util.keys import Key

_MAX_STAGED_BLOCKS = 8
STAGED_RAGGED_BYTES = 128 * 2**20
"""A block of rows of different lengths waits in RAM padded to its longest row; rows so
long that their block would take more than this are written at once instead."""


class SoloWrites(SoloSlots):
    """The writes of a store of one writer (see the module's docstring)."""

    def _init_writes(self) -> None:
        self._rewrote_published = False
        """Rows the last commit declared readable were written over (in other slots) since:
        the next commit moves the epoch."""
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
    ) -> tuple[list[Write], list[Block]]:
        """Stage whole rows in RAM by block; returns what must be written now, and the
        blocks taken out of RAM to be written (their memory serves again once they are).

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
                    [block_write(self.store.write_cache.pop(b.index)) for b in older]
                )
            return [(rows, values)], []
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
        writes: list[Write] = [block_write(block) for block in blocks]
        # Slices of the caller's tensors: views, not copies.
        writes.extend(
            (rows[start:stop], {key: value[start:stop] for key, value in values.items()})
            for start, stop in direct
        )
        return writes, blocks

    def _too_long_to_stage(self, values: Mapping[Key, torch.Tensor]) -> bool:
        assert self.store.write_cache is not None
        block_rows = self.store.write_cache.block_rows
        return any(
            self.store.leaf(key).ragged and block_rows * value[:1].nbytes > STAGED_RAGGED_BYTES
            for key, value in values.items()
        )

    def _keep_for_retry(self, writes: Sequence[Write]) -> None:
        """Keep the rows of failed writes, so that the next flush writes them again: whole
        rows wait in RAM in blocks, writes of some keys as patches (both are read from
        there)."""
        assert self.store.write_cache is not None
        for rows, values in writes:
            if values.keys() == self.store.leaves.keys():
                self.store.write_cache.stage(rows, values, force=True)
            else:
                self.store.write_cache.keep_patch((rows, values))

    def _write_to_disk(self, writes: Sequence[Write]) -> None:
        """Write rows. A block whose rows hold data (committed, or written since) is
        written by copy-on-write: into a free slot, with the rows of the block this write
        leaves alone; the next commit switches the block to it, and until then the block's
        old slot stays as it was (a crash or a failed write leaves it whole). Rows never
        written go straight into their block's slot."""
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
        try:
            self.store.arrays.write_rows([*copies, *writes], seeds=seeds)
        except BaseException:
            self.block_map.assign(moved, before)  # the blocks' rows are where they were
            self.store.ledger.fail_write(lost, keys)
            raise
        if self.store.lifetime.creates_once:
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
                    for source, target in zip(before.tolist(), fresh.tolist(), strict=True):
                        self.store.arrays.get(key).copy_chunk(source, target)
        others = [key for key in self.store.leaves if key not in whole]
        for group in plain_then_ragged(self.store.leaves, others):
            requests = {}
            for key in group:
                written = [rows for rows, values in writes if key in values]
                keep = ledger.readable(positions, key)
                if written:
                    keep &= ~np.isin(positions, np.concatenate(written))
                if keep.any():
                    requests[key] = positions[keep]
            lengths = {
                key: self.store.arrays.read({self.store.leaf(key).lengths_key: rows})[
                    self.store.leaf(key).lengths_key
                ].numpy()
                for key, rows in requests.items()
                if self.store.leaf(key).ragged
            }
            for key, values in self.store.arrays.read(requests, lengths).items():
                copies.append((requests[key], {key: values}))
        block_map.assign(blocks, fresh)
        return blocks, before, copies, in_place, seeds


def block_write(block: Block) -> Write:
    """The rows a block holds and their values (all of them when the block is full)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}
