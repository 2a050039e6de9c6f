"""Many writers on one store: rows placed at commit time, through row runs (format 3).

A shared store (``ZarrStorage(..., shared=True)``, or a storage handed to another process)
is written by any number of writers, in any number of processes and machines, each
holding the store through :meth:`~zarr_rb.locations.Location.join_writers` (a lock file
of its own on a local disk, a lease on an object store).

* **Slots of its own.** A writer appends rows into a slot (``block_rows`` rows of the data
  arrays) that it took from the free ones by compare-and-swap of the commit record, and
  that no other writer writes (``commit.ring.open``). No row a record refers to is ever
  written again.
* **Positions at commit time.** An extend writes its rows there, then one
  compare-and-swap of the record maps positions ``[cursor, cursor + n)`` to them
  (``commit.runs``, :mod:`zarr_rb.format.runs`), moves the cursor and the length; on a
  conflict the record is read again and the same rows mapped at the new cursor, never
  written again. ``extend`` returns the positions they got: ``len`` counts committed
  rows, exactly, and nothing reserved can be left empty by a dead or slow writer. Writes to
  given positions (``storage[i] = ...``) go the same way: new rows, and the commit maps
  ``i`` to them; of two writers writing one position, the later commit wins.
* **Free slots** are those that no run, no open slot and no kept save refers to; the
  arrays grow (their metadata) when none is left.
* **Dead writers** lose the rows they had not committed. Their open slots are dropped by
  the next writer that finds them gone (at once on a local disk, where the kernel drops a
  dead process's locks; once its lease expired on an object store); their committed rows
  stay.
* **Reads** are checked like a reader's (a seqlock): after reading rows through one
  record, the record is read again, and the read retried only if a slot it read was taken
  since (``commit.ring.recent``).

See ``docs/design/ring.md``, "Step 2".
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from zarr_rb.core import sharing_slots
from zarr_rb.core.frame_arrays import with_frames
from zarr_rb.core.sharing_saves import SharingSaves
from zarr_rb.core.sharing_slots import runs_of
from zarr_rb.core.store_facts import whole_rows
from zarr_rb.engine.layout import Compression
from zarr_rb.errors import (
    LockedError,
    NotSupportedError,
    SchemaMismatchError,
)
from zarr_rb.format.commit import ERA_SLOTS, Commit, ObjectEra, Ring
from zarr_rb.format.index_key import INDEX_KEY, put_positions
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.record import StoreMeta, shared_format
from zarr_rb.format.runs import RunMap
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.commits import StoreAPI

_R = TypeVar("_R")
_SHARED_WRITE_ATTEMPTS = 50
"""Writes of some keys of given rows of a shared store, before giving up on rows that other
writers keep writing."""


def new_writer_id() -> str:
    return uuid.uuid4().hex[:16]


class Sharing(SharingSaves):
    """The positions and commits of a store that other writers write too: this writer's
    open slot, its commits by compare-and-swap (see the module's docstring)."""

    shared = True

    def __init__(self, store: StoreAPI, writer: str) -> None:
        super().__init__(store, store.meta, length=store.length, cursor=store.cursor)
        self.committed = store.committed
        self.writer = writer
        self._init_slots(writer)
        self._state_groups: set[int] = set()
        """The numbers of the state groups this writer saved into (see new_save_slot)."""
        self._mine: np.ndarray | None = None
        """Positions this writer is committing (their mirrors are its own to update)."""
        self._replaced_seen = store.engine.arrays_replaced
        """:attr:`Engine.arrays_replaced` as of this writer's last new era token."""

    @classmethod
    def start(cls, store: StoreAPI, writer: str) -> Sharing:
        """Write ``store`` as one of its shared writers, named ``writer`` (its hold is
        taken already); a store of one writer, or shared under format 2, takes runs."""
        check_shareable(store)
        sharing = cls(store, writer)
        if store.schema is not None:
            sharing.use_map(store.committed)
        store.commits = sharing
        if store.ledger is not None:
            store.ledger.grow(store.rows)  # other writers' rows lie anywhere in the ring
        meta = sharing.update(functools.partial(_to_runs, late_writes=store.lifetime.late_writes))
        if meta.commit.ring is not None and store.schema is not None:
            store.arrays.ensure_capacity(meta.commit.ring.capacity)
        return sharing

    def set_schema(self, schema: Schema, block_rows: int) -> None:
        """The first write of a shared store: the first writer to publish its schema sets
        it (compare-and-swap), every writer then creates the arrays that are missing."""
        where = f"store {self.store.url!r}"
        ragged = [leaf.key for leaf in schema.leaves if leaf.ragged]
        if ragged:
            raise NotSupportedError(
                f"{where}: key {ragged[0]!r} holds rows of different lengths, which shared "
                "writers cannot write yet; keep one writer for it",
            )

        compression = self.store.compression

        def claim(meta: StoreMeta) -> StoreMeta | None:
            if meta.schema is None:
                blocks = -(-schema.rows // block_rows)
                ring = meta.commit.ring or Ring()
                ring = dataclasses.replace(
                    ring, capacity=sharing_slots.initial_capacity(blocks), legacy=False
                )
                commit = dataclasses.replace(meta.commit, ring=ring, runs=RunMap.empty())
                return dataclasses.replace(
                    meta,
                    schema=schema,
                    block_rows=block_rows,
                    commit=commit,
                    format=shared_format(schema),
                    compression=compression.resolved(bool(schema.frames)).to_json(),
                )
            # (Which leaves are stored as frames, the first writer decided from its rows.)
            if dataclasses.replace(meta.schema, frames=()) != dataclasses.replace(
                schema, frames=()
            ):
                raise SchemaMismatchError(
                    f"{where}: another writer created it with keys "
                    f"{[leaf.key for leaf in meta.schema.leaves]} and batch shape "
                    f"{list(meta.schema.batch_shape)}; this one writes keys "
                    f"{[leaf.key for leaf in schema.leaves]} and batch shape "
                    f"{list(schema.batch_shape)}. Every writer of a shared store must write "
                    "the same keys, shapes and dtypes",
                )
            recorded = Compression.recorded(meta.compression, meta.schema)
            frames = bool(meta.schema.frames if recorded is None else recorded.frames)
            if compression.frames is not None and compression.frames != frames:
                raise SchemaMismatchError(
                    f"{where}: another writer's first write settled frames={frames}; this one "
                    f"was opened with compression=Compression(frames={compression.frames}). "
                    "Open it with frames=None (the default), which takes what the store holds",
                )
            return None

        self.update(claim)

    # --- the interface ---------------------------------------------------------------------

    def initialize(
        self, schema: Schema, block_rows: int, samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        self.set_schema(with_frames(self.store.arrays.store, schema, samples), block_rows)

    def add_leaves(
        self, leaves: Sequence[LeafSpec], samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        raise NotSupportedError(
            f"store {self.store.url!r} is shared by several writers, whose schema is fixed by "
            f"the first write; cannot add keys {[leaf.key for leaf in leaves]}: write "
            "every key from the first extend on",
        )

    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None
    ) -> None:
        """Writes to given positions (``rows``, sorted and unique): new rows in this
        writer's slots, which the commit maps those positions to; keys left out keep their
        values (read first). The length stays, as in TorchRL's storages."""
        store = self.store
        store.version += 1
        if cursor is not None:
            self.cursor = cursor
        missing = [key for key in store.leaves if key not in values]
        given = values
        for _ in range(_SHARED_WRITE_ATTEMPTS):
            over = None
            if missing and rows.size:
                values = {**given, **store.read(rows, missing, unwritten_as_zeros=True)}
                over = store.committed.physical(rows)  # where what was read lies
            physical = self.room(rows.size)
            store.arrays.write_rows([(physical, values)], physical=True)
            try:
                self.commit_rows(physical, rows, over=over)
            except RowsMovedError:
                continue  # another writer wrote some of those rows since: read them again
            store.ram.update(rows, values)
            return
        raise LockedError(
            f"store {store.url!r}: rows {preview_rows(rows)} kept being written by other "
            f"writers while this one wrote some of their keys ({_SHARED_WRITE_ATTEMPTS} "
            "attempts); write whole rows, or write them again",
            holder={},
        )

    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        store = self.store
        store.version += 1
        physical = self.room(count)
        values = whole_rows(store, physical, values)
        store.arrays.write_rows([(physical, values)], physical=True)
        positions = self.commit_rows(physical)
        if INDEX_KEY in values:  # marks stand for the positions the commit just gave
            index = values[INDEX_KEY].clone()
            put_positions(index.numpy(), positions)
            values = {**values, INDEX_KEY: index}
        rows = store.rows
        if count > rows:  # a ring's worth at most: the last rows
            values = {key: value[count - rows :] for key, value in values.items()}
            store.ram.update(positions[count - rows :], values)
        else:
            store.ram.update(positions, values)
        return positions

    def flush(self) -> None:
        self.refresh()  # nothing waits in RAM: every write was published

    def settle(self, *, keep: bool = True) -> None:
        pass  # each write is waited for, and published, as it is made

    def set_length(self, length: int) -> None:
        pass  # the record's: rows are counted as commits place them, never set

    def empty(self) -> None:
        """Empty the buffer for every writer, as emptying one process's handle of TorchRL's
        shared-memory storage does: no position holds a row, the next rows go to 0, and the
        last save goes (its rows are gone); tagged versions and an archive's history stay."""

        def empty(meta: StoreMeta) -> StoreMeta:
            runs = RunMap.empty()
            commit = dataclasses.replace(
                meta.commit,
                length=0,
                cursor=0,
                runs=runs,
                holes=runs.holes(0),
                epoch=meta.commit.epoch + 1,
            )
            return dataclasses.replace(meta, commit=commit, saved=None)

        self.update(empty)

    def publish_meta(self) -> None:
        raise NotSupportedError(
            f"store {self.store.url!r} is shared by several writers: its settings are "
            "fixed; open it with one writer to change them",
        )

    def read(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        return self.read_checked(read, rows)

    @property
    def rows_reached(self) -> int:
        return self.store.rows  # other writers fill the whole ring

    def commit_rows(
        self,
        physical: np.ndarray,
        positions: np.ndarray | None = None,
        *,
        over: np.ndarray | None = None,
    ) -> np.ndarray:
        """Map rows just written (``physical``) to positions and publish them: the next
        ``physical.size`` positions from the cursor (an extend: the length grows), or
        ``positions`` (sorted, unique: writes to given rows). Returns the positions they
        got.

        Raises:
            RowsMovedError: ``over`` (the rows ``positions`` were in when the write read
                them) is not where they are any longer: another writer wrote them since.
        """
        rows = self.store.rows
        placed: list[np.ndarray] = []
        once = self.store.lifetime.creates_once
        # Slots this write leaves: those it filled, and (objects created once) its last.
        full = [*self._full, *([self.slot] if once and self.slot is not None else [])]
        created = tuple(dict.fromkeys((physical // self.block_rows).tolist())) if once else ()
        replaced = self.store.engine.arrays_replaced
        next_slot: list[int] = []

        def publish(meta: StoreMeta) -> StoreMeta:
            commit = meta.commit
            ring = commit.ring
            assert ring is not None
            self._check_open(ring)
            runs = commit.runs or RunMap.empty()
            count = int(physical.size)
            if positions is None:
                where = (commit.cursor + np.arange(count, dtype=np.int64)) % max(rows, 1)
                cursor = (commit.cursor + count) % max(rows, 1)
                length = min(rows, commit.length + count)
                last = slice(max(0, count - rows), count)  # a ring's worth at most
                kept, rows_kept = where[last], physical[last]
                order = np.argsort(kept, kind="stable")
                kept, rows_kept = kept[order], rows_kept[order]
            else:
                if over is not None and not np.array_equal(runs.physical(positions), over):
                    raise RowsMovedError
                where, kept, rows_kept = positions, positions, physical
                cursor, length = commit.cursor, commit.length
            placed[:] = [where]
            self._mine = kept
            runs = runs.assign(kept, rows_kept)
            opened = tuple((w, s) for w, s in ring.open if not (w == self.writer and s in full))
            history = commit.history
            if history is not None and positions is None:
                history = history.appended(physical)  # every row the extend wrote, in order
            commit = dataclasses.replace(
                commit,
                length=length,
                cursor=cursor,
                runs=runs,
                holes=runs.holes(length),
                ring=dataclasses.replace(ring, open=opened),
                history=history,
            )
            if not once:
                return dataclasses.replace(meta, commit=commit)
            # The slot the next write goes to, taken now (no compare-and-swap of its own),
            # and the slots this one created objects in, for readers' caches.
            era = _era_with(commit.object_era, created, anew=replaced != self._replaced_seen)
            commit = dataclasses.replace(commit, object_era=era)
            meta, slot = self.with_slot_taken(dataclasses.replace(meta, commit=commit))
            next_slot[:] = [slot]
            return meta

        try:
            meta = self.update(publish)
        finally:
            self._mine = None
        del self._full[: len(self._full) if once else len(full)]
        if next_slot:
            assert meta.commit.ring is not None
            self.store.arrays.ensure_capacity(meta.commit.ring.capacity)
            self.open_slot(next_slot[0])
            self._replaced_seen = replaced
        return placed[0]

    def start_history(self) -> None:
        """Keep every row extended from now on (an archive), unless the store does."""

        def start(meta: StoreMeta) -> StoreMeta | None:
            if meta.commit.history is not None:
                return None
            commit = dataclasses.replace(meta.commit, history=RunMap.empty())
            return dataclasses.replace(meta, commit=commit)

        self.update(start)

    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        """``positions`` found damaged in rows ``physical`` of the data arrays, as the
        record ``seen`` mapped them: those still there, in slots no writer
        took since, hold no row until written again (others were written since, by any
        writer, perhaps into the same rows of a slot that came free and was taken again).
        Returns how many were withdrawn."""
        withdrawn = [0]
        assert seen.ring is not None
        seen_ring = seen.ring

        def withdraw(meta: StoreMeta) -> StoreMeta | None:
            commit = meta.commit
            assert commit.ring is not None
            taken = commit.ring.taken_since(seen_ring)
            runs = commit.runs or RunMap.empty()
            inside = positions < commit.length
            still = runs.physical(positions[inside]) == physical[inside]
            if taken is None:
                still[:] = False  # too many slots taken since to tell: leave every one
            elif taken:
                still &= ~np.isin(physical[inside] // self.block_rows, list(taken))
            there = positions[inside][still]
            withdrawn[0] = int(there.size)
            if not there.size:
                return None
            runs = runs.assign(there, np.full(there.size, -1, dtype=np.int64))
            commit = dataclasses.replace(
                commit, runs=runs, holes=runs.holes(commit.length), unwritten=()
            )
            return dataclasses.replace(meta, commit=commit)

        self.update(withdraw)
        return withdrawn[0]

    def leave(self) -> None:
        """Give back this writer's open slot (it closes): its committed rows stay."""

        def release(meta: StoreMeta) -> StoreMeta | None:
            ring = meta.commit.ring
            assert ring is not None
            kept = tuple((w, s) for w, s in ring.open if w != self.writer)
            if kept == ring.open:
                return None
            commit = dataclasses.replace(meta.commit, ring=dataclasses.replace(ring, open=kept))
            return dataclasses.replace(meta, commit=commit)

        self.update(release)
        self.slot, self.filled = None, 0
        self._full.clear()

    # --- reads -----------------------------------------------------------------------------


def _era_with(era: ObjectEra | None, created: tuple[int, ...], *, anew: bool) -> ObjectEra:
    """``era`` (a record's) with the slots a writer just created objects in; a new token
    (no slot listed: readers revalidate their caches once) where the record has none (its
    writers wrote objects over, or none created any yet), where ``anew`` (an array was
    created again at a path), and where the list would grow too long."""
    if era is None or anew or len(era.slots) + len(created) > ERA_SLOTS:
        return ObjectEra(token=secrets.token_hex(8))
    return ObjectEra(token=era.token, slots=era.slots + created)


class RowsMovedError(Exception):
    """Rows a write to given positions read were written by another writer meanwhile."""


def _to_runs(meta: StoreMeta, *, late_writes: bool) -> StoreMeta | None:
    """A store of one writer, or shared under format 2, as a shared store of format 3: its
    readable positions mapped to the rows that hold them, the arrays' slots as capacity
    (``late_writes``: none of them taken again, see :class:`Ring`)."""
    commit = meta.commit
    if commit.ring is not None and not commit.ring.legacy and commit.runs is not None:
        return None
    if meta.schema is None:
        if commit.ring is not None and not commit.ring.legacy:
            return None
        return dataclasses.replace(meta, commit=dataclasses.replace(commit, ring=Ring()))
    block_rows = meta.block_rows or 1
    blocks = -(-meta.schema.rows // block_rows)
    runs = runs_of(commit)
    capacity = blocks if commit.slots is None else commit.slots.capacity
    fresh_from = 0
    if late_writes:
        # Past the slots of its writer; those of one that closed cleanly are free again.
        lease = commit.lease
        fresh_from = min(lease.floor, capacity) if lease and not lease.held else capacity
    ring = Ring(capacity=capacity, fresh_from=fresh_from)
    commit = dataclasses.replace(
        commit, ring=ring, runs=runs, slots=None, holes=runs.holes(commit.length), lease=None
    )
    return dataclasses.replace(meta, commit=commit, format=shared_format(meta.schema))


def check_shareable(store: StoreAPI) -> None:
    """A store written by one writer can take more only if no object on disk holds rows
    of two blocks (stores of zarr_rb 0.x before shared writers could have such chunks).
    (The frames leaves' objects each hold one block: see ``docs/design/frames-on-disk.md``.)"""
    if store.schema is None:
        return
    block_rows = store.meta.block_rows or 1
    framed = store.schema.frame_keys
    for leaf in store.schema.leaves:
        if leaf.key in framed:
            continue
        if leaf.ragged:
            raise NotSupportedError(
                f"store {store.url!r}: key {leaf.key!r} holds rows of different lengths, "
                "which shared writers cannot write yet (its array grows wider as longer "
                "rows come); keep one writer for it",
            )
        rows = store.arrays.get(leaf.key).chunk_rows
        if rows != block_rows:
            raise NotSupportedError(
                f"store {store.url!r}: key {leaf.key!r} is stored in chunks of {rows} rows, "
                f"across blocks of {block_rows} (a store created by an older zarr_rb), so "
                "two writers could write one chunk; copy it into a new store to share it "
                "(zarr_rb.snapshot does not change chunks: write its rows into a new "
                "ZarrStorage)",
            )
