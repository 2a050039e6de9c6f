"""The frames a write buffer's rows leave to the RAM tier (``docs/design/ram-tier.md``, "The
write buffer's frames"): rows staged whole whose frames the tier holds as staged keep them
there, and a block holds their stacks only from when it is written, or when the tier lets
them go first. A block the tier holds whole, whose leaves are stored as frames on disk, is
written from the tier's frames and never holds them (``docs/design/frames-on-disk.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.frames import FrameTier


class Block(Protocol):
    """What lending uses of a write buffer's block
    (:class:`~zarr_rb.core.write_cache.Block`)."""

    index: int
    values: dict[Key, torch.Tensor]
    length: int
    lent: np.ndarray
    frames_touched: bool

    @property
    def full(self) -> bool: ...


class FrameLending:
    """The tier a write buffer's blocks lend their frames to, and the blocks taken out to
    be written whose writes' values hold none of their lent rows' frames."""

    def __init__(self, *, block_rows: int, frames_on_disk: frozenset[Key]) -> None:
        self.block_rows = block_rows
        self.tier: FrameTier | None = None
        self._frames_on_disk = frames_on_disk
        """Keys the store keeps as frames on disk (see :meth:`from_tier`)."""
        self._unkept: dict[int, Block] = {}
        """Blocks taken out to be written from the tier: their writes' values (views of
        their tensors) hold no frame of their lent rows until :meth:`keep_unkept` fills
        them, before anything reads them; until the write is on disk (:meth:`landed`)."""

    @property
    def keys(self) -> frozenset[Key]:
        """The keys whose frames rows lend: the tier's."""
        return frozenset() if self.tier is None else self.tier.keys

    def lending(self, waiting: Iterable[Block]) -> list[Block]:
        """The blocks whose lent rows' frames the tier holds: those ``waiting`` in the write
        buffer, and those taken out from the tier."""
        blocks = {id(block): block for block in waiting}
        blocks.update((id(block), block) for block in self._unkept.values())
        return list(blocks.values())

    def keep_rows(self, blocks: Iterable[Block], rows: np.ndarray) -> None:
        """Rows (sorted, unique) the tier is about to let go: those whose frames it holds
        for one of ``blocks`` are copied into the block."""
        for block in blocks:
            start = block.index * self.block_rows
            lo, hi = np.searchsorted(rows, [start, start + self.block_rows])
            offsets = rows[lo:hi] - start
            self.keep(block, offsets[block.lent[offsets]])

    def from_tier(self, block: Block) -> bool:
        """Whether a write of ``block`` takes its frames from the tier, not from its
        tensors: the block is full (its write's values are views of its tensors), every
        row lent, and every key the tier keeps stored as frames on disk, whose cells are
        made from the frames the tier holds for rows it knows
        (:meth:`~zarr_rb.core.frame_cells.FrameCells.row_writes`). Such a block is
        remembered until it lands."""
        tier = self.tier
        if tier is None or not tier.keys <= self._frames_on_disk or not block.full:
            return False
        if not block.lent[: block.length].all():
            return False
        rows = block.index * self.block_rows + np.arange(block.length)
        if not all(tier.known(key, rows).known.all() for key in tier.keys):
            return False
        self._unkept[block.index] = block
        return True

    def keep_unkept(self) -> None:
        """Fill the values of the writes of blocks taken out from the tier, before they are
        read by value (a write that fails and waits for a retry, frames compared rather
        than taken from the tier)."""
        for index, block in list(self._unkept.items()):
            self.keep(block, np.flatnonzero(block.lent))
            del self._unkept[index]

    def landed(self, blocks: Iterable[Block]) -> None:
        """Blocks taken out to be written are on disk: nothing reads their writes' values."""
        for block in blocks:
            self._unkept.pop(block.index, None)

    def forget(self) -> None:
        """No block taken out waits for its write (the rows are dropped, or were kept)."""
        self._unkept.clear()

    def keep(self, block: Block, offsets: np.ndarray) -> None:
        """Copy the frames of rows ``offsets`` (sorted, lent) of ``block`` from the tier."""
        if not offsets.size:
            return
        assert self.tier is not None
        rows = block.index * self.block_rows + offsets
        runs = np.split(np.arange(offsets.size), np.flatnonzero(np.diff(offsets) != 1) + 1)
        for key in self.tier.keys:
            target = block.values[key]
            for run in runs:
                first = int(offsets[run[0]])
                self.tier.gather_into(key, rows[run], target[first : first + run.size])
        block.frames_touched = True
        block.lent[offsets] = False
