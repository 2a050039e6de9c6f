"""How a store of one writer writes a block filled in RAM while the next rows come
(``docs/design/block-writes.md``): the extend that fills it starts its write and returns,
and the next call that needs it finishes it; until then the block is read from the write
buffer, and no commit declares its rows.

:class:`SoloBehind` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that does this, on the writes of :class:`~zarr_rb.core.solo_writes.SoloWrites`.
"""

from __future__ import annotations

from zarr_rb.core.solo_writes import SoloWrites, StartedWrite
from zarr_rb.core.write_cache import Block, block_write
from zarr_rb.format.ring import SlotMap


class SoloBehind(SoloWrites):
    """The write in flight of a store of one writer (see the module's docstring)."""

    def _init_writes(self) -> None:
        super()._init_writes()
        self._in_flight: StartedWrite | None = None
        """The write of a full block started by an extend and not finished: the next call
        that writes, flushes or moves rows finishes it."""

    def _writes_behind_here(self) -> bool:
        """Whether this store writes blocks while the next rows come: a local store of one
        writer (objects written over in place, no lease), outside an archive (whose history
        takes rows as they reach the disk), with every leaf stored in objects of one
        block."""
        return (
            not self.store.lifetime.creates_once
            and not self.late_writes_alone
            and not self.store.archive
            # Objects of the block's rows alone: a commit made while they are written
            # declares no row they hold (a shard of several blocks would hold some).
            and self.store.arrays.objects_by_block()
        )

    def _write_behind(self, block: Block) -> None:
        """Start writing a full block (taken out of the write buffer) and return: the block
        is read from the write buffer until the write finishes (:meth:`settle`). The write
        before it finishes first: one write is in flight at most."""
        cache = self.store.write_cache
        assert cache is not None
        write = block_write(block)
        try:
            self.settle()
            started = self._start_write([write], behind=True)
            assert self.store.ledger is not None
            if (started.lost & self.store.ledger.published).any():
                # Published rows rewritten in place (their block moved since the last
                # commit, which still names the old slot): a commit made meanwhile would
                # withdraw them. Written now instead.
                self._finish_write(started)
                cache.landed([block])
                if started.released():
                    cache.reuse([block])  # (see WriteBuffer.written)
                return
        except BaseException:
            self._keep_for_retry([write])
            raise
        self._in_flight = started
        cache.start_writing(block)

    def _in_flight_landed(self) -> bool:
        """Whether a block write is in flight, has finished, and TensorStore let go of its
        memory: settling it now waits for nothing, and gives that memory to the next block
        (:meth:`WriteBuffer.written`)."""
        started = self._in_flight
        return started is not None and started.has_landed() and started.released()

    def settle(self, *, keep: bool = True) -> None:
        """Finish the block write in flight, if any: its rows become intact (the next commit
        declares them). If it failed, the block waits in the write buffer for the next
        flush and the error is raised; ``keep=False``: its rows are being dropped (an
        empty, a save loaded), and the outcome does not matter."""
        started, self._in_flight = self._in_flight, None
        if started is None:
            return
        cache = self.store.write_cache
        assert cache is not None
        try:
            self._finish_write(started, what="writing a block of rows (an earlier extend's)")
        except BaseException:
            cache.not_written()
            if keep:
                raise
            return
        cache.written(released=started.released())

    def _slots_record(self) -> SlotMap | None:
        """The writer's map as a commit records it (``None``: the identity). A block whose
        write is in flight is recorded in the slot it was in: its new one does not hold it
        yet. So is a block :meth:`_kept_where_committed` names, in its committed slot."""
        positions = self.positions
        if not isinstance(positions, SlotMap):
            return None
        started = self._in_flight
        kept = self._kept_where_committed()
        if (started is not None and started.moved.size) or kept.size:
            positions = positions.copy()
            if started is not None and started.moved.size:
                positions.assign(started.moved, started.before)
            positions.assign(kept, self._committed_slots().slots[kept])
        if positions.is_identity:
            return None
        return positions.copy()
