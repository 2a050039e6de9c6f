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
  one else writes (see :class:`~zarr_rb.format.commit.LeaseFloor`).

One object, :class:`SoloCommits`, owns all of it; its code is in eight modules by concern:
this one (the interface, commits), :mod:`~zarr_rb.core.solo_cursor` (the length and cursor
a commit records), :mod:`~zarr_rb.core.solo_keys` (keys added to a store
that holds rows), :mod:`~zarr_rb.core.solo_saves` (saves and versions),
:mod:`~zarr_rb.core.solo_staging` (which rows are written now, which wait in RAM),
:mod:`~zarr_rb.core.solo_behind` (a block written while the next rows come),
:mod:`~zarr_rb.core.solo_writes` (writes and copy-on-write) and
:mod:`~zarr_rb.core.solo_slots` (free slots, reservations, collection), the classes it
derives from.

See ``docs/design/ring.md``, "Step 1" and "Owners".
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from zarr_rb.core.frame_arrays import with_frames
from zarr_rb.core.history import Extended
from zarr_rb.core.reader import reread_commit
from zarr_rb.core.solo_cursor import SoloCursor, first_unset
from zarr_rb.errors import NotSupportedError, StoreWriteError
from zarr_rb.format.commit import (
    ERA_SLOTS,
    Commit,
    ObjectEra,
    commit_from_mask,
    declared_length,
)
from zarr_rb.format.names import ATTRS_KEY, FRAMES_FORMAT
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.runs import RunMap
from zarr_rb.format.schema import Schema
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.commits import StoreAPI
    from zarr_rb.core.write_cache import WriteBuffer

_R = TypeVar("_R")


class SoloCommits(SoloCursor):
    """The positions and commits of a store of one writer (see the module's docstring)."""

    def __init__(self, store: StoreAPI, meta: StoreMeta, *, late_writes: bool) -> None:
        per_row = store.elements_per_row(meta.schema)
        super().__init__(
            store, meta, length=meta.commit.length * per_row, cursor=meta.commit.cursor
        )
        self._init_cursor(meta.commit.cursor)
        self._extended = Extended()
        """An archive's positions extended since the last commit (its history grows by
        those a commit publishes)."""
        self._schema_on_disk = meta.schema
        """The schema of the last published record (keys added since are published next)."""
        self._init_slots(store, meta, late_writes=late_writes)
        self._init_writes()
        self._replaced_published: int | None = None
        """``Engine.arrays_replaced`` when this writer last published a record (``None``:
        it published none yet)."""

    # --- the interface ---------------------------------------------------------------------

    def initialize(
        self, schema: Schema, block_rows: int, samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        store = self.store
        schema = with_frames(store.arrays.store, schema, samples)
        fmt = FRAMES_FORMAT if schema.frames else self.meta.format
        with store.writing("creating the arrays", kept=False):
            store.arrays.create(
                schema.leaves, schema.batch_shape, block_rows, samples=samples, schema=schema
            )
        self.meta = dataclasses.replace(
            self.meta,
            schema=schema,
            block_rows=block_rows,
            format=fmt,
            compression=store.compression.resolved(bool(schema.frames)).to_json(),
        )
        store.attach_schema(schema, block_rows)
        self.publish_meta()

    def before_write(self, rows: np.ndarray) -> None:
        """In an archive, rows extended since the last commit that ``rows`` goes over are
        committed first, into the history as they were extended.

        Raises:
            StoreWriteError: that commit failed; the write stored nothing.
        """
        if not (self.store.archive and self._extended.overlaps(rows)):
            return
        try:
            self.store.flush()
        except StoreWriteError as error:
            raise StoreWriteError(
                error.errno,
                f"{error.strerror} The rows of this write were not stored (it goes over rows "
                "extended since the last commit, which must reach the archive's history "
                "first): write them again once a flush succeeds.",
            ) from error

    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None
    ) -> None:
        store = self.store
        assert store.write_cache is not None
        # The frames go into the RAM tier while TensorStore encodes the rows for the disk,
        # on the core it leaves (nothing here reads the tier before this call returns).
        frames = _Deferred(lambda: store.ram.update_frames(rows, values))
        store.write_cache.take_restored()  # (rows an earlier call put back: not this call's)
        failed: StoreWriteError | None = None
        extended = False
        try:
            self.before_write(rows)  # (done already for a write through the storage's set)
            writing = store.write_cache.writing
            if writing is not None and (
                cursor is None
                or np.any(rows // store.write_cache.block_rows == writing.index)
                or self._in_flight_landed()
                or (store.ram.frames is not None and _ends_a_block(rows, store.write_cache))
            ):
                # Only an extend past the block in flight goes on beside it, until that block
                # has landed (then its memory serves the next block: the next block written,
                # whose frames the RAM tier held, takes them there). If that block's write
                # failed, it waits in RAM again, this call's rows are written (or kept) as
                # usual, and the failure is raised at the end.
                try:
                    self.settle()
                except StoreWriteError as error:
                    failed = error
            store.version += 1
            self.arrivals.written(rows, extended=cursor is not None)
            if cursor is not None:
                if not _run_on(rows, self.cursor, cursor, store.write_cache.rows):
                    self._out_of_order = True
                self.cursor = cursor
                self._advanced += int(rows.size)
                if store.archive:
                    self._extended.add(rows, cursor, store.rows)
                    extended = True
            # Failed writes waiting to be written again must not land over these newer rows.
            store.write_cache.patches.supersede(rows, values.keys())
            values, zeros = self._zeros_where_unwritten(rows, values)
            store.ram.update(rows, values, frames=False)
            tier = store.ram.frames
            if tier is not None or store.arrays.frames.keys():
                # The tier first: the rows it holds leave it their frames while they wait in
                # the write buffer, and frames on disk take their cells from the plan it
                # makes of them (FrameCells.start_write).
                frames.run()
            lent = None
            if tier is not None and frames.error is not None:
                # (A put that failed takes the rows out of the tier; if that was interrupted
                # too, it may hold older frames of them: none are lent, and they go again.)
                tier.release(rows)
            elif tier is not None:
                lent = (tier, tier.resident_rows(rows))
            writes, blocks = self._writes_for(
                rows, values, zeros, sequential=cursor is not None, lent=lent
            )
            if writes:
                behind = self._block_behind(writes, blocks) if cursor is not None else None
                if behind is not None:
                    self._write_behind(behind)
                else:
                    self._write_now(writes, blocks, meanwhile=frames.run)
                if values.keys() == store.leaves.keys():
                    # (Writes of some keys wait for the next commit: a writer that writes a
                    # buffer column by column, as TorchRL's checkpointers do, moves each
                    # block once, not once per key.)
                    self._commit()
        except BaseException as error:
            frames.run()
            frames.note_on(error)
            unkept = self._unkept(rows)
            if extended:
                self._extended.drop(unkept)  # (not extended after all: not in the history)
            raise
        frames.run()
        if failed is not None:
            frames.note_on(failed)
            raise failed
        frames.raise_error()

    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        raise NotSupportedError(
            f"store {self.store.url!r} has one writer: an extend goes to the cursor "
            "(write), rows are placed at commit time only on a shared store"
        )

    def flush(self) -> None:
        store = self.store
        assert store.write_cache is not None
        with contextlib.suppress(StoreWriteError):
            # A block write in flight that failed waits again with the others: this flush
            # writes it (and raises if it fails again).
            self.settle()
        blocks, writes = store.write_cache.take([block.index for block in store.write_cache])
        self._write_in_turn([*store.write_cache.patches.take(), *writes])
        store.write_cache.reuse(blocks)
        self._commit()

    def move_cursor(self, cursor: int) -> None:
        self.settle()
        super().move_cursor(cursor)
        self._written_from = cursor
        self._advanced = 0
        self._out_of_order = False
        self._extended.restart()

    def empty(self) -> None:
        self.settle(keep=False)  # (the store discarded its rows first: nothing is in flight)
        store = self.store
        if store.ledger is not None:
            # No row holds data for the buffer any more, as for a writer reopened after the
            # empty: rows counted again before they are written are holes, not old rows.
            store.ledger.rebase(store.ledger.mask())
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
                unwritten=(),
                epoch=store.committed.epoch + 1,
            )
            self.publish(commit)
            return
        self._publish_mask(store.ledger.mask(), rewrite=True)

    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        self.settle()
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

    def start_history(self) -> None:
        pass  # the next commit starts the history (see publish)

    def publish_meta(self) -> None:
        self.publish(self.committed)

    def read(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        return read()

    def refresh(self) -> Commit:
        store = self.store
        self.let_go()
        store.pinned = None  # to the last commit, from a save it was reading
        commit = reread_commit(store)
        self.show(commit)
        return commit

    def leave(self) -> None:
        self.settle(keep=False)  # (a close flushed first: nothing is in flight)
        if self.late_writes_alone:
            self.store.collect()  # the slots of the writers before, which it moved out of
            self._release_slots()

    @property
    def rows_reached(self) -> int:
        return max(self.store.ram.rows_written, self.committed.length)

    # --- copy-on-write, slots, commits ----------------------------------------------------

    def _commit(self) -> None:
        """Publish every row that is on disk and within the storage's length."""
        if self.store.schema is None:
            self.publish(dataclasses.replace(self.committed, length=0, holes=(), unwritten=()))
            return
        assert self.store.ledger is not None
        if self._kept_where_committed().size:
            # A write over committed rows in place failed and waits in RAM: the record
            # stays at the last commit (where those rows are whole) until a flush makes
            # the write (docs/design/ring.md, "A write over rows in place that fails").
            return
        if self.arrivals.skipped_waiting():
            # A row written again before its extended value landed, and not on disk yet:
            # every state from that value on needs one or the other (docs/design/ring.md,
            # "Rows land in the order they were extended").
            return
        # Rows waiting in RAM keep their previous, still intact, committed content.
        ledger = self.store.ledger
        readable = ledger.intact & ~(self.store.ram.staged_mask(ledger.extent) & ~ledger.published)
        readable[self.store.length_rows :] = False
        # Rows past the committed ones are published as a prefix: rows after one that is
        # not on disk (a failed write kept in RAM) wait for it, rather than leave a hole.
        # Rows nothing holds are holes already: nothing waits for them.
        unheld = self._unheld()  # (once: nothing moves until the commit is published)
        settled = self._settled(readable, unheld)
        settled[self.store.length_rows :] = False
        first_missing = first_unset(settled, self.committed.length, self.store.length_rows)
        if first_missing is not None:
            readable[first_missing:] = False
            settled[first_missing:] = False
        # Lost rows last are holes inside the length, as are those of the last commit.
        length = max(declared_length(settled), min(self.committed.length, self.store.length_rows))
        cursor, after = self._committable_cursor(readable, unheld)
        if self._declares_no_state(length, first_missing, cursor, after):
            # The rows cut there were extended before the cursor: the extends since the
            # last commit went around the ring past it (the first lap, committed short of
            # the rows waiting), so no state they went through holds just these rows (they
            # hold the new lap's values). Commits wait until those rows land.
            return
        self._publish_mask(
            readable,
            length=length,
            rewrite=self._rewrote_published,
            committable=(cursor, after),
            unheld=unheld,
        )

    def _publish_mask(
        self,
        readable: np.ndarray,
        *,
        length: int | None = None,
        rewrite: bool = False,
        committable: tuple[int, int] | None = None,
        unheld: np.ndarray | None = None,
    ) -> None:
        """Publish a commit declaring the ``readable`` rows; ``rewrite``: rows the last
        commit declared readable are about to be written over (the epoch moves).
        ``committable``: :meth:`_committable_cursor` of ``readable``, and ``unheld``:
        :meth:`_unheld`, if known."""
        assert self.store.ledger is not None
        if unheld is None:
            unheld = self._unheld()
        if committable is None:
            committable = self._committable_cursor(readable, unheld)
        cursor, after = committable
        commit = commit_from_mask(
            readable, generation=self.committed.generation + 1, cursor=cursor, length=length
        )
        commit = dataclasses.replace(
            commit,
            unwritten=self._unwritten(readable, commit.length, unheld),
            epoch=self.committed.epoch + rewrite,
            slots=self._slots_record(),
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
        out_of_order = self._out_of_order
        self.publish(commit)
        self._advanced = after  # (the rows extended since its cursor)
        self._out_of_order = out_of_order and after > 0
        self.store.ledger.published_as(readable)
        self._rewrote_published = False
        if waiting is not None:
            self._extended.keep(waiting)

    def publish(self, commit: Commit, *, saved: Saved | None = None, rows: bool = True) -> None:
        """Publish ``commit`` (with ``saved``, the new last save). ``rows=False``: a record
        published in the middle of a write (slots reserved or held) that commits no row of
        it: the rows written since the last commit still start where they did. (Such a
        record keeps the commit's generation: readers, which compare generations, see no
        change, and there is none for them.)"""
        self.store.lifetime.ensure_on_disk()
        if self.store.archive and commit.history is None:
            commit = dataclasses.replace(commit, history=RunMap.empty())
        if self.late_writes_alone:
            commit = dataclasses.replace(commit, lease=self._lease)
        commit = dataclasses.replace(commit, kept_from=self.kept_from(commit))
        replaced = self.store.engine.arrays_replaced
        commit = dataclasses.replace(commit, object_era=self._object_era(replaced))
        meta = dataclasses.replace(self.meta, commit=commit)
        if saved is not None:
            meta = dataclasses.replace(meta, saved=saved)
        self.store.lifetime.check_hold()
        with self.store.writing("publishing a commit"):
            self.store.pieces.store(meta)  # (a failed publish leaves them: garbage, see collect)
            self.store.engine.write_root_attributes({ATTRS_KEY: meta.to_json()})
            self.store.pieces.drop(self.meta, meta)
        self.meta = meta
        self.committed = commit
        self._keep(commit)
        if rows:
            self._written_from = commit.cursor
            self._advanced = 0
            self._out_of_order = False
        self._schema_on_disk = meta.schema
        self._replaced_published = replaced
        self._created_slots.clear()

    def _object_era(self, replaced: int) -> ObjectEra | None:
        """:attr:`Commit.object_era` of the next record: the last commit's, with the slots
        this writer created objects in since; a new token (and no slot) at this writer's
        first record (the writer before may have created objects after its last one), after
        an array was created again, and when the slots would be too many; ``None`` when
        objects may be written over."""
        if not self.store.lifetime.creates_once:
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


def _run_on(rows: np.ndarray, start: int, cursor: int, ring: int) -> bool:
    """Whether ``rows`` (sorted, unique) run on from ``start`` around a ring of ``ring``
    rows, ending just before ``cursor`` (an extend's rows; every row, for a ring or more)."""
    n = rows.size
    if n >= ring:
        return True
    if (cursor - start) % ring != n:
        return False
    end = start + n
    if end <= ring:
        return bool(rows[0] == start and rows[-1] == end - 1)
    wrapped = end - ring  # rows [0, wrapped) and [start, ring)
    return bool(
        rows[wrapped - 1] == wrapped - 1 and rows[wrapped] == start and rows[-1] == ring - 1
    )


def _ends_a_block(rows: np.ndarray, cache: WriteBuffer) -> bool:
    """Whether ``rows`` take the last row of a block (an extend that may fill one)."""
    if not rows.size:
        return False
    return bool(np.any((rows + 1) % cache.block_rows == 0)) or int(rows.max()) + 1 >= cache.rows


@dataclasses.dataclass
class _Deferred:
    """A call made once, when :meth:`run` is first called; its error, if any, is kept for
    :meth:`raise_error` (a write that started beside it still finishes first), or noted on
    the write's own error."""

    call: Callable[[], None]
    done: bool = False
    error: BaseException | None = None

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.call()
        except BaseException as error:  # (raised by raise_error)
            self.error = error

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def note_on(self, error: BaseException) -> None:
        """Note this call's error, if any, on ``error`` (raised instead)."""
        if self.error is not None:
            error.add_note(f"putting the rows' frames into RAM failed too: {self.error!r}")
