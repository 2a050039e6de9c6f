"""Which rows of a store of one writer reach the disk now and which wait in RAM, so that
they land in the order they were extended: a commit records a cursor, and the rows
extended past it must still hold what they held before (``docs/design/ring.md``, "Rows
land in the order they were extended").

:class:`SoloStaging` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that decides; :class:`~zarr_rb.core.solo_writes.SoloWrites` writes, and
:class:`~zarr_rb.core.solo_behind.SoloBehind` writes behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from zarr_rb.core.solo_behind import SoloBehind
from zarr_rb.core.write_cache import Block
from zarr_rb.core.write_patches import Write
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.frames import FrameTier

_MAX_STAGED_BLOCKS = 8
STAGED_RAGGED_BYTES = 128 * 2**20
"""A block of rows of different lengths waits in RAM padded to its longest row; rows so
long that their block would take more than this are written at once instead."""


class SoloStaging(SoloBehind):
    """The writes a call makes now, and the rows it leaves in RAM."""

    def _writes_for(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        zeros: list[Write],
        *,
        sequential: bool,
        lent: tuple[FrameTier, np.ndarray] | None = None,
    ) -> tuple[list[Write], list[Block]]:
        """What a write of ``values`` to ``rows`` (after ``zeros``, zeros into cells of keys
        never written) writes now, and the blocks taken out of RAM that it writes; the
        other rows wait in RAM. ``sequential``: an extend. ``lent``: the rows whose frames
        the RAM tier holds as written, which leave them there while they wait."""
        cache = self.store.write_cache
        assert cache is not None
        if values.keys() == self.store.leaves.keys():
            return self._stage_rows(rows, values, sequential=sequential, lent=lent)
        # Some keys: rows waiting in RAM take the new values there; the others are written
        # now (the other keys of a row that is not held are not known here).
        in_ram = cache.patch(rows, values)
        elsewhere = np.flatnonzero(~in_ram)
        writes: list[Write] = zeros
        blocks: list[Block] = []
        if elsewhere.size:
            picked = torch.from_numpy(elsewhere)
            writes.append((rows[elsewhere], {k: v[picked] for k, v in values.items()}))
            if sequential:
                # The rows extended before, waiting in RAM, land with these, not after.
                blocks, older = cache.take([block.index for block in cache])
                writes = [*older, *writes]
        return writes, blocks

    def _stage_rows(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        sequential: bool,
        lent: tuple[FrameTier, np.ndarray] | None = None,
    ) -> tuple[list[Write], list[Block]]:
        """Stage whole rows in RAM by block; returns what must be written now, and the
        blocks taken out of RAM to be written (their memory serves again once they are).

        ``sequential``: the rows are a writer's extend, ending just before :attr:`cursor`.
        Only the block it ends in may then stay in RAM: every other staged block (one it
        went past, partly on disk already after a flush in its middle, or the block an
        earlier extend ended in) is written now, so that the rows a commit publishes
        always run up to the cursor it records, with no row left behind in RAM.
        """
        cache = self.store.write_cache
        assert cache is not None
        if self._too_long_to_stage(values):
            # Written now, after the rows that wait in RAM (older values, and earlier
            # extends' rows: see below). If those fail, these rows wait with them.
            waiting = {int(i) for i in np.unique(rows // cache.block_rows)}
            if sequential or any(block.index in waiting for block in cache):
                older, writes = cache.take([block.index for block in cache])
                try:
                    self._write_now(writes, older)
                except BaseException:
                    self._keep_for_retry([(rows, values)])
                    raise
            return [(rows, values)], []
        before = {block.index for block in cache}
        direct, full = cache.stage(rows, values, lent=lent)
        if sequential and rows.size:
            block_rows = cache.block_rows
            last = (self.cursor - 1) % cache.rows // block_rows
            passed = {block.index for block in cache} - {last}
            if last in before and (passed or (rows // block_rows != last).any()):
                # The block it ends in waited in RAM with rows extended earlier: the extend
                # went around the ring back into the block an earlier one ended in, or a
                # failed extend's rows wait there and in the blocks written now. Its
                # earlier rows come before the rows written now.
                passed.add(last)
            full = sorted(set(full) | passed)
        elif full or len(cache) > _MAX_STAGED_BLOCKS:
            # (Past _MAX_STAGED_BLOCKS partly filled blocks, they are written as they are.)
            # A write to given rows that writes blocks waiting in RAM writes them all: one
            # may hold the newest rows extended (the block the cursor is in), and others
            # earlier rows of extends that failed and wait for a retry. Written alone, the
            # newest would be on disk before those, and the next commit would declare a
            # state the buffer never was in.
            full = [block.index for block in cache]
        blocks, writes = cache.take(full)
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

    def _block_behind(self, writes: Sequence[Write], blocks: Sequence[Block]) -> Block | None:
        """The block an extend's ``writes`` write, if they are one full block staged in RAM
        that may be written while the next rows come (:meth:`_writes_behind_here`): no other
        row is written now, so the commits made meanwhile, which leave it out, still
        declare a prefix of the rows in the order written."""
        if len(writes) == 1 and len(blocks) == 1 and blocks[0].full:
            # (Not while failed writes of some keys wait: they are written first, see
            # _write_now.)
            assert self.store.write_cache is not None
            behind = self._writes_behind_here() and not self.store.write_cache.patches
            return blocks[0] if behind else None
        return None
