"""Write combining: rows wait in RAM, grouped by block, until a whole block can be
written at once (one shard per large leaf, so no read-modify-write of shards).

Blocks are only staged for sequential writes (the round-robin pattern of
TorchRL's writers); scattered writes go straight to disk, so a random
``storage[idx] = data`` never allocates a block per touched row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from zarr_rb.core.block_memory import BlockMemory
from zarr_rb.core.frame_lending import FrameLending
from zarr_rb.core.mirror import zeros
from zarr_rb.core.write_patches import Patches, Write
from zarr_rb.engine.rows import is_run
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.frames import FrameTier


@dataclasses.dataclass(slots=True)
class Block:
    """Rows ``[index * rows, (index + 1) * rows)`` of every leaf, and which of them are set."""

    index: int
    values: dict[Key, torch.Tensor]
    dirty: np.ndarray
    length: int
    """Rows of this block inside the array (the last block may be shorter)."""
    lent: np.ndarray
    """Rows (held) whose frames the RAM tier holds for this block: its tensors of the tier's
    keys do not hold them until the block is written or the tier lets them go (see
    :meth:`WriteBuffer.lend_frames`)."""
    in_tier: np.ndarray
    """Rows whose frames the tier held as this block does when they were staged, lent
    then: while the tier holds them, it holds their frames (copied here since or not)."""
    frames_touched: bool = False
    """Whether its tensors of the tier's keys hold pages: rows were copied in, or they
    served a block before (unwritten, they are mappings that take no RAM)."""

    @property
    def full(self) -> bool:
        return bool(self.dirty[: self.length].all())

    def put(self, key: Key, offsets: torch.Tensor, values: torch.Tensor, *, ragged: bool) -> None:
        """``values[key][offsets] = values``; ``ragged`` rows padded with zeros to the
        block's width, which grows to the width of ``values``."""
        target = self.values[key]
        if not ragged:
            if is_run(offsets.numpy()):
                first = int(offsets[0])
                target[first : first + offsets.numel()] = values  # a run of rows: one copy
            else:
                target[offsets] = values
            return
        width = values.shape[1]
        if width > target.shape[1]:
            wider = target.new_zeros((target.shape[0], width, *target.shape[2:]))
            wider[:, : target.shape[1]] = target
            self.values[key] = target = wider
        target[offsets, :width] = values
        target[offsets, width:] = 0


def block_write(block: Block) -> Write:
    """The rows a block holds and their values (all of them when the block is full): views
    of its tensors when it is full. Its tensors of the tier's keys hold no lent row's frames
    (see :meth:`WriteBuffer.write_of`)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}


class WriteBuffer:
    """Blocks of rows written by this process and not yet on disk."""

    def __init__(
        self,
        *,
        element_shapes: Mapping[Key, tuple[int, ...]],
        dtypes: Mapping[Key, torch.dtype],
        block_rows: int,
        rows: int,
        ragged: frozenset[Key] = frozenset(),
        frames_on_disk: frozenset[Key] = frozenset(),
    ) -> None:
        self.block_rows = block_rows
        self._lending = FrameLending(block_rows=block_rows, frames_on_disk=frames_on_disk)
        self.rows = rows
        self._memory = BlockMemory(element_shapes, dtypes, ragged)
        self._blocks: dict[int, Block] = {}
        self._writing: Block | None = None
        """A full block whose write to disk was started and has not finished: its rows are
        read from here (they are not on disk yet), and nothing else writes into it."""
        self._restored: list[np.ndarray] = []
        """Rows whose values a copy interrupted between two keys put back (see
        :meth:`_put_rows`), until :meth:`take_restored`."""
        self.patches = Patches()
        """Writes of rows not held in a block whose write to disk failed (see
        :class:`~zarr_rb.core.write_patches.Patches`)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        """The blocks waiting to be written (not the one being written)."""
        return iter(list(self._blocks.values()))

    @property
    def nbytes(self) -> int:
        """RAM of the blocks held here (waiting and being written) and of the spare one
        kept for the next block."""
        lendable = self._lendable()
        tensors = [
            value
            for block in self.held()
            for key, value in block.values.items()
            if block.frames_touched or key not in lendable
        ]
        return sum(t.untyped_storage().nbytes() for t in tensors) + self._memory.nbytes

    def held(self) -> Iterator[Block]:
        """Every block whose rows are read from here: those waiting and the one being
        written."""
        blocks = list(self._blocks.values())
        if self._writing is not None:
            blocks.append(self._writing)
        return iter(blocks)

    def forget(self) -> None:
        """Forget every row held, blocks and patches (``empty``; no block is being
        written)."""
        assert self._writing is None
        self._blocks.clear()
        self._lending.forget()
        self.patches.clear()

    # --- the block being written -----------------------------------------------------------

    @property
    def writing(self) -> Block | None:
        return self._writing

    def start_writing(self, block: Block) -> None:
        """``block`` (popped) is being written: its rows are read from here until then."""
        assert self._writing is None
        self._writing = block

    def written(self, *, released: bool) -> None:
        """The block being written is on disk. TensorStore wrote it without a copy: its
        memory serves the next block once TensorStore let go of it (``released``), and is
        otherwise left to TensorStore (unmapped once neither holds it)."""
        assert self._writing is not None
        block, self._writing = self._writing, None
        self.landed([block])
        if released:
            self.reuse([block])

    def not_written(self) -> None:
        """The block's write failed: a copy of it waits again, for the next flush (the
        memory written from stays as it is: TensorStore may keep it)."""
        assert self._writing is not None
        block, self._writing = self._writing, None
        self.keep_unkept()  # (its tensors are copied: with every row's frames)
        assert block.index not in self._blocks
        values = {}
        for key, value in block.values.items():
            values[key] = zeros(tuple(value.shape), value.dtype)
            values[key].copy_(value)
        self._blocks[block.index] = dataclasses.replace(block, values=values, frames_touched=True)

    def held_rows(self, *, writing: bool = True) -> np.ndarray:
        """The rows held here (sorted, unique): in a block waiting (and in the one being
        written, with ``writing``), or with cells in a patch."""
        blocks = self.held() if writing else iter(self)
        parts = [self.patches.rows()]
        parts += [block.index * self.block_rows + np.flatnonzero(block.dirty) for block in blocks]
        return np.unique(np.concatenate(parts))

    def pop(self, index: int) -> Block:
        return self._blocks.pop(index)

    def take(self, indices: Iterable[int]) -> tuple[list[Block], list[Write]]:
        """Take blocks out to be written, and their writes: those are made first (a copy
        of the rows of a block partly filled may fail), so that a failure leaves every
        block here."""
        blocks = [self._blocks[index] for index in indices]
        try:
            writes = [self.write_of(block) for block in blocks]
        except BaseException:
            self._lending.landed(blocks)  # (they wait here, lending as before)
            raise
        for block in blocks:
            del self._blocks[block.index]
        return blocks, writes

    def _block_rows_in_array(self, index: int) -> int:
        return min(self.block_rows, self.rows - index * self.block_rows)

    def reuse(self, blocks: list[Block]) -> None:
        """Blocks popped and now written to disk: the next new block takes the memory of
        one (pages the process holds already: filling a new block's 50 MB of Atari rows
        took 2-4 times as long in fresh pages, each faulted in on first write), and the
        next block written its tensors of the tier's keys."""
        self.landed(blocks)
        for block in blocks:
            self._memory.reuse(block, self._lendable())

    def landed(self, blocks: Iterable[Block]) -> None:
        """Blocks taken out to be written are on disk: nothing reads their writes' values."""
        self._lending.landed(blocks)

    def _new_block(self, index: int) -> Block:
        n = self.block_rows
        lendable = self._lendable()
        block = Block(
            index=index,
            values=self._memory.new_values(n, lendable),
            dirty=np.zeros(n, dtype=bool),
            length=self._block_rows_in_array(index),
            lent=np.zeros(n, dtype=bool),
            in_tier=np.zeros(n, dtype=bool),
            frames_touched=not lendable,
        )
        self._blocks[index] = block
        return block

    # --- frames the RAM tier holds ---------------------------------------------------------

    def lend_frames(self, tier: FrameTier | None) -> None:
        """Rows staged whole whose frames ``tier`` holds as staged leave them there
        (:mod:`~zarr_rb.core.frame_lending`). The tier calls :meth:`keep_frames` before it
        lets rows go. Rows lent to the tier lent before are copied here first."""
        lending = self._lending
        if lending.tier is not None:
            for block in lending.lending(self._blocks.values()):
                lending.keep(block, np.flatnonzero(block.lent))
            lending.forget()
            lending.tier.before_release = None
        lending.tier = tier
        if tier is not None:
            tier.before_release = self.keep_frames

    def _lendable(self) -> frozenset[Key]:
        return self._lending.keys

    def lent_rows(self) -> np.ndarray:
        """The rows whose frames the tier holds for a block here, or taken out (sorted)."""
        blocks = self._lending.lending(self._blocks.values())
        parts = [block.index * self.block_rows + np.flatnonzero(block.lent) for block in blocks]
        return np.sort(np.concatenate([np.empty(0, np.int64), *parts]))

    def keep_frames(self, rows: np.ndarray) -> None:
        """Rows (sorted, unique) the tier is about to let go: those whose frames it holds
        for a block here, or taken out, are copied into the block."""
        self._lending.keep_rows(self._lending.lending(self._blocks.values()), rows)

    def keep_unkept(self) -> None:
        """Fill the values of the writes of blocks taken out from the tier (see
        :meth:`~zarr_rb.core.frame_lending.FrameLending.keep_unkept`)."""
        self._lending.keep_unkept()

    def write_of(self, block: Block) -> Write:
        """:func:`block_write`, the frames the block lent copied in first: into the tensors
        of the block written before it (pages held already) when its own hold no row. A
        block written from the tier's frames copies none (:meth:`FrameLending.from_tier
        <zarr_rb.core.frame_lending.FrameLending.from_tier>`)."""
        if self._lending.from_tier(block):
            return block_write(block)
        lent = np.flatnonzero(block.lent)
        if lent.size and not (block.dirty & ~block.lent).any():
            self._memory.spare_frames(block, self._lendable())
        self._lending.keep(block, lent)
        return block_write(block)

    def stage(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        force: bool = False,
        lent: tuple[FrameTier, np.ndarray] | None = None,
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Stage what belongs in RAM (everything, with ``force``).

        ``rows`` is sorted and unique, ``values[key][i]`` belongs to ``rows[i]``. ``lent``:
        a tier and which rows it holds as given here: their frames stay there, if that is
        the tier lent to (:meth:`lend_frames`).

        Returns:
            The ranges of positions (into ``rows``) that were *not* staged and must be
            written directly (whole blocks, and scattered rows of blocks not in RAM), and
            the indices of blocks that became full.
        """
        if not rows.size:
            return [], []
        held = None if lent is None or lent[0] is not self._lending.tier else lent[1]
        block_ids = rows // self.block_rows
        # Boundaries of the runs of equal block ids (rows are sorted).
        starts = np.flatnonzero(np.diff(block_ids, prepend=-1))
        stops = np.append(starts[1:], rows.size)
        direct: list[tuple[int, int]] = []
        full: list[int] = []
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            index = int(block_ids[start])
            offsets = rows[start:stop] - index * self.block_rows
            block = self._blocks.get(index)
            contiguous = offsets[-1] - offsets[0] + 1 == offsets.size
            whole = (
                contiguous and offsets[0] == 0 and offsets.size == self._block_rows_in_array(index)
            )
            if block is None and (whole or not contiguous) and not force:
                # A whole block needs no staging; scattered rows are not worth a block.
                direct.append((start, stop))
                continue
            new = block is None
            if block is None:
                block = self._new_block(index)
            try:
                self._put_rows(
                    block,
                    offsets,
                    {k: t[start:stop] for k, t in values.items()},
                    lent=None if held is None else held[start:stop],
                )
            except BaseException:
                if new:  # (a block that holds no row: not left here)
                    self.reuse([self._blocks.pop(index)])
                raise
            block.dirty[offsets] = True
            if block.full:
                full.append(index)
        return direct, full

    def patch(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> np.ndarray:
        """Write some keys of rows held in RAM there (``rows`` sorted and unique).

        Returns:
            A mask over ``rows``: which were held in RAM and took the new values. No block is
            created: the other keys of a row that is not held would be unknown.
        """
        hit, served = self.staged_rows(rows)
        for block, positions in served:
            picked = torch.from_numpy(positions)
            self._put_rows(
                block,
                rows[positions] - block.index * self.block_rows,
                {key: tensor[picked] for key, tensor in values.items()},
            )
        return hit

    def take_restored(self) -> np.ndarray:
        """The rows whose values a copy interrupted between two keys put back since the
        last call: they hold their values from before the write that failed, not its."""
        restored, self._restored = self._restored, []
        return np.concatenate(restored) if restored else np.empty(0, dtype=np.int64)

    def _put_rows(
        self,
        block: Block,
        offsets: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        lent: np.ndarray | None = None,
    ) -> None:
        """Put ``values`` (of some keys) into rows ``offsets`` of ``block``, whole or not at
        all: interrupted after a key, rows the block held get back the values they held
        (copied first), and the others stop being held here. ``lent``: rows whose frames
        the tier holds as given (with every key of the tier's in ``values``): not copied."""
        lendable = self._lendable()
        frames = lendable & values.keys()
        if frames:
            # Rows lent before whose frames change: the frames they keep are copied first.
            self._lending.keep(block, offsets[block.lent[offsets]])
        if lent is None or frames != lendable:
            lent = np.zeros(offsets.size, dtype=bool)
        parts = {key: (offsets, tensor) for key, tensor in values.items()}
        if lent.any():
            copied = np.flatnonzero(~lent)
            for key in frames:
                parts[key] = (offsets[copied], values[key][torch.from_numpy(copied)])
        held = block.dirty[offsets]
        before = {}
        for key, (at, _) in parts.items():
            again = at[block.dirty[at]]
            if again.size:
                before[key] = (again, block.values[key][torch.from_numpy(again)].clone())
        put: list[Key] = []
        try:
            for key, (at, tensor) in parts.items():
                put.append(key)
                if at.size:
                    block.put(key, torch.from_numpy(at), tensor, ragged=key in self._memory.ragged)
        except BaseException:
            block.dirty[offsets] = False  # (torn until their values are back)
            if held.any():
                for key in put:
                    if key in before:
                        again, old = before[key]
                        block.put(
                            key, torch.from_numpy(again), old, ragged=key in self._memory.ragged
                        )
                block.dirty[offsets[held]] = True
                self._restored.append(block.index * self.block_rows + offsets[held])
            raise
        if frames:
            block.lent[offsets] = lent
            block.in_tier[offsets] = lent
            block.frames_touched |= not lent.all()

    def add_key(
        self,
        key: Key,
        element_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        ragged: bool = False,
    ) -> None:
        """A new leaf: held rows read as zeros in it until written. Each patch takes the
        zeros of its rows (rows kept only there may never have been written to disk), so
        that they land with the patch, in its place in the order."""
        self._memory.add_key(key, element_shape, dtype, ragged=ragged)
        for block in self._blocks.values():
            block.values[key] = torch.zeros((self.block_rows, *element_shape), dtype=dtype)
        self.patches.add_key(key, element_shape, dtype)

    def staged_rows(self, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[Block, np.ndarray]]]:
        """Which of ``rows`` (any order, repeats allowed) are held in RAM.

        Returns:
            A boolean mask over ``rows``, and for each block involved the block with
            the positions (into ``rows``) it serves.
        """
        hit = np.zeros(rows.size, dtype=bool)
        served: list[tuple[Block, np.ndarray]] = []
        if not self._blocks and self._writing is None:
            return hit, served
        block_ids = rows // self.block_rows
        for block in self.held():
            index = block.index
            positions = np.flatnonzero(block_ids == index)
            if not positions.size:
                continue
            offsets = rows[positions] - index * self.block_rows
            positions = positions[block.dirty[offsets]]
            if positions.size:
                hit[positions] = True
                served.append((block, positions))
        return hit, served
