"""Many writers on one store: blocks taken in ring order, commits merged by compare-and-swap.

A shared store (``ZarrStorage(..., shared=True)``, or a storage handed to another process)
is written by any number of writers, in any number of processes and machines, each
holding the store through :meth:`~zarr_rb.locations.Location.join_writers` (a lock file
of its own on a local disk, a lease on an object store).

* **Blocks.** Rows are written by whole blocks (the shard height of large leaves and the
  chunk height of small ones, so no object on disk holds rows of two blocks). A writer
  appends into a block it *holds*; when it is full, the writer takes the next one in ring
  order (:class:`~zarr_rb.core.format.Ring`): no two writers ever write one block, and
  the ring evicts the oldest block first, as TorchRL's round-robin writer evicts the
  oldest rows. Taking a block withdraws the rows it held in the same commit, before any
  byte of it is rewritten.
* **Merged commits.** Every change of the commit record is an edit of the record as it
  is now: read it, apply the edit (these rows are readable, this block is held, that one
  released), write it back with a compare-and-swap on the generation read, and on a
  conflict read it again and re-apply. Writers never overwrite each other's rows or
  commits; readers see committed rows only.
* **Visibility.** Each extend publishes its rows before it returns, so ``len(rb)`` and
  ``rb.sample()`` in every other process include them (they re-read the record when
  asked for the length).
* **Dead writers.** A writer that dies loses the rows it had not published; the blocks
  it held are released by the next writer that finds it gone (at once on a local disk,
  where the kernel drops a dead process's locks; once its lease expired on an object
  store). No one else's rows are touched.
* **Reads** are checked like a reader's (a seqlock): after reading rows of other
  writers, the record is read again, and the read retried if any of their blocks was
  taken meanwhile.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from zarr_rb.core.format import (
    ATTRS_KEY,
    Commit,
    Ring,
    Schema,
    StoreMeta,
    commit_from_mask,
    parse_store_meta,
)
from zarr_rb.core.metadata import check_is_store, read_root
from zarr_rb.errors import (
    FencedError,
    LockedError,
    NotSupportedError,
    RowsNotCommittedError,
    SchemaMismatchError,
    ServerBusyError,
    StoreCorruptedError,
)

if TYPE_CHECKING:
    from zarr_rb.core.store import Store

_R = TypeVar("_R")
Edit = Callable[[StoreMeta], StoreMeta | None]
"""A change of the commit record, applied to the record as it is now (``None``: none)."""

BUSY_BLOCK_SECONDS = 60.0
"""How long a write of given rows waits for another writer to release their block."""
BUSY_SERVER_SECONDS = 60.0
"""How long a commit is retried while an object store answers with server errors."""
SWEEP_SECONDS = 2.0
"""How often a writer looks for blocks held by writers that are gone."""
_READ_RETRIES = 50


def new_writer_id() -> str:
    return uuid.uuid4().hex[:16]


class Sharing:
    """The shared-writer side of one open store: its blocks, its merged commits."""

    def __init__(self, store: Store, writer: str) -> None:
        self.store = store
        self.writer = writer
        self.current: int | None = None
        """The block this writer appends into."""
        self.filled = 0
        """Rows of :attr:`current` written."""
        self._finished: list[int] = []
        """Blocks filled since the last publish, released by the next one."""
        self._alive: dict[str, bool] = {writer: True}
        self._swept = time.monotonic()

    @classmethod
    def start(cls, store: Store, writer: str) -> Sharing:
        """Write ``store`` as one of its shared writers, named ``writer`` (its hold is
        taken already); a store of one writer becomes shared."""
        check_shareable(store)
        sharing = store.sharing = cls(store, writer)
        if store._ledger is not None:
            store._ledger.grow(store.rows)  # other writers' blocks lie anywhere in the ring
        block_rows = store.meta.block_rows

        def convert(meta: StoreMeta) -> StoreMeta | None:
            if meta.commit.ring is not None:
                return None
            # The single writer's next block comes first: the ring order goes on from it.
            taken = -(-meta.commit.cursor // block_rows) if block_rows and meta.commit.length else 0
            commit = dataclasses.replace(meta.commit, ring=Ring(taken=taken))
            return dataclasses.replace(meta, commit=commit)

        sharing.update(convert)
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

        def claim(meta: StoreMeta) -> StoreMeta | None:
            if meta.schema is None:
                return dataclasses.replace(meta, schema=schema, block_rows=block_rows)
            if meta.schema != schema:
                raise SchemaMismatchError(
                    f"{where}: another writer created it with keys "
                    f"{[leaf.key for leaf in meta.schema.leaves]} and batch shape "
                    f"{list(meta.schema.batch_shape)}; this one writes keys "
                    f"{[leaf.key for leaf in schema.leaves]} and batch shape "
                    f"{list(schema.batch_shape)}. Every writer of a shared store must write "
                    "the same keys, shapes and dtypes",
                )
            return None

        self.update(claim)

    # --- the record ------------------------------------------------------------------------

    @property
    def ring(self) -> Ring:
        ring = self.store.committed.ring
        assert ring is not None
        return ring

    def update(self, edit: Edit) -> StoreMeta:
        """Apply ``edit`` to the commit record by compare-and-swap, re-reading and
        re-applying it after every conflict; the store then shows the record written."""
        store = self.store
        attempt = 0
        deadline = time.monotonic() + BUSY_SERVER_SECONDS
        while True:
            try:
                meta = self.read_record()
                try:
                    edited = edit(meta)
                except BaseException:
                    self.adopt(meta)  # the record was read: show it (refresh() skips it)
                    raise
                if edited is None:
                    self.adopt(meta)
                    return meta
                commit = dataclasses.replace(edited.commit, generation=meta.commit.generation + 1)
                edited = dataclasses.replace(edited, commit=commit)
                store.check_hold()
                with store.writing("publishing a commit"):
                    if store.engine.try_write_root_attributes({ATTRS_KEY: edited.to_json()}):
                        self.adopt(edited)
                        return edited
            except ServerBusyError:
                # Object stores may answer many conditional writes of one object at once
                # with server errors: the record is read again, the edit applied again.
                if time.monotonic() > deadline:
                    raise
            attempt += 1
            time.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))

    def read_record(self) -> StoreMeta:
        return self._parse(read_root(self.store.engine, adopt=True))

    def _parse(self, document: dict[str, Any] | None) -> StoreMeta:
        where = f"store {self.store.url!r}"
        if document is None:
            raise StoreCorruptedError(f"{where}: its root zarr.json is gone")
        check_is_store(document, where)
        return parse_store_meta(document["attributes"], where=where)

    def refresh(self) -> None:
        """Pick up what other writers committed (one read of the record, no more when it
        did not change)."""
        document = self.store.engine.root_if_changed()
        if document is not None:
            self.adopt(self._parse(document))

    def adopt(self, meta: StoreMeta) -> None:
        """Show the rows of ``meta``'s commit: those of every writer, and this writer's own
        rows of the blocks it holds."""
        store = self.store
        if meta.commit.ring is None:
            raise StoreCorruptedError(
                f"store {store.url!r} is no longer shared: a single writer took it over"
            )
        before = store.committed
        new_schema = store.schema is None and meta.schema is not None
        store.meta = dataclasses.replace(store.meta, **_shared_fields(meta))
        store.committed = meta.commit
        store.cursor = meta.commit.cursor
        if new_schema:
            assert meta.schema is not None
            store.ensure_arrays()
            store._attach_schema(meta.schema, meta.block_rows or 1)
        if store.schema is None:
            return
        store.length = meta.commit.length * store.schema.elements_per_row
        if meta.commit.generation == before.generation:
            return
        store.version += 1
        ledger = store._ledger
        assert ledger is not None
        published = meta.commit.readable_mask(store.rows)
        mine = self._mask_of(self.ring.blocks_of(self.writer))
        changed = (published != ledger.published) | self._retaken(before, meta.commit)
        changed &= ~mine
        ledger.published_as(published)
        ledger.intact = np.where(mine, ledger.intact, published)
        if store.engine.cache is not None:
            # Before the changed rows are read again: objects cached before now may hold
            # what those rows held before other writers rewrote them.
            store.engine.cache.new_epoch()
        if changed.any():
            store.mirror_changed(changed)

    def _retaken(self, before: Commit, after: Commit) -> np.ndarray:
        """Rows of blocks taken (or rewritten) between two records."""
        blocks = self._retaken_blocks(before, after)
        if blocks is None:
            return np.ones(self.store.rows, dtype=bool)
        return self._mask_of(sorted(blocks))

    def _retaken_blocks(self, before: Commit, after: Commit) -> set[int] | None:
        """Blocks taken (or rewritten) between two records (``None``: any of them)."""
        old, new = before.ring, after.ring
        if old is None or new is None or new.rewrites != old.rewrites:
            return None
        if new.taken - old.taken >= self.blocks:
            return None
        return {position % self.blocks for position in range(old.taken, new.taken)}

    # --- blocks ----------------------------------------------------------------------------

    @property
    def block_rows(self) -> int:
        return self.store.meta.block_rows or 1

    @property
    def blocks(self) -> int:
        return -(-self.store.rows // self.block_rows)

    def _rows_of(self, block: int) -> slice:
        start = block * self.block_rows
        return slice(start, min(start + self.block_rows, self.store.rows))

    def _size_of(self, block: int) -> int:
        piece = self._rows_of(block)
        return int(piece.stop - piece.start)

    def _mask_of(self, blocks: list[int]) -> np.ndarray:
        mask = np.zeros(self.store.rows, dtype=bool)
        for block in blocks:
            mask[self._rows_of(block)] = True
        return mask

    def _is_alive(self, writer: str) -> bool:
        alive = self._alive.get(writer)
        if alive is None:
            alive = self.store.engine.location.writer_alive(writer)
            if alive:
                return True  # not cached: it may die by the next question
            self._alive[writer] = False
        return alive

    def place(self, count: int) -> np.ndarray:
        """Rows for ``count`` new rows: the free rows of this writer's block, then of the
        next blocks it takes."""
        pieces = []
        while count > 0:
            if self.current is None or self.filled == self._size_of(self.current):
                if self.current is not None:
                    self._finished.append(self.current)
                self._take_next()
            assert self.current is not None
            start = self._rows_of(self.current).start + self.filled
            taken = min(count, self._size_of(self.current) - self.filled)
            pieces.append(np.arange(start, start + taken))
            self.filled += taken
            count -= taken
        return np.concatenate(pieces)

    def _take_next(self) -> None:
        chosen: list[int] = []

        def take(meta: StoreMeta) -> StoreMeta:
            chosen.clear()
            ring = meta.commit.ring
            assert ring is not None
            held = dict(ring.held)
            self._check_holds(held)
            position = ring.taken
            for _ in range(self.blocks):
                block = position % self.blocks
                position += 1
                holder = held.get(block)
                if holder is None or (holder != self.writer and not self._is_alive(holder)):
                    break
            else:
                raise LockedError(
                    f"store {self.store.url!r}: each of its {self.blocks} blocks of "
                    f"{self.block_rows} rows is held by a live writer; a shared store needs "
                    "more blocks than writers: create it with a larger max_size or smaller "
                    "blocks (Compression(block_rows=...))",
                    holder={"writers": sorted(set(held.values()))},
                )
            chosen.append(block)
            held[block] = self.writer
            readable = meta.commit.readable_mask(self.store.rows)
            readable[self._rows_of(block)] = False
            ring = dataclasses.replace(ring, taken=position, held=_sorted(held))
            return self._with(meta, readable, ring)

        self.update(take)
        self.current, self.filled = chosen[0], 0
        # What the block held belongs to the transitions it evicts: not this writer's to
        # serve, nor to complete rows with.
        ledger = self.store._ledger
        assert ledger is not None
        ledger.intact[self._rows_of(self.current)] = False

    def hold_rows(self, rows: np.ndarray) -> list[int]:
        """Before a write of given rows (``storage[i] = ...``): hold every block they are in
        (waiting for other writers to release theirs), and withdraw those rows that were
        readable. Returns the blocks held for this write alone."""
        blocks = np.unique(rows // self.block_rows).tolist()
        touched = np.zeros(self.store.rows, dtype=bool)
        touched[rows] = True
        extra: list[int] = []
        whole_before: list[np.ndarray] = []
        deadline = time.monotonic() + BUSY_BLOCK_SECONDS

        def hold(meta: StoreMeta) -> StoreMeta | None:
            extra.clear()
            ring = meta.commit.ring
            assert ring is not None
            held = dict(ring.held)
            self._check_holds(held)
            for block in blocks:
                holder = held.get(block)
                if holder == self.writer:
                    continue
                if holder is not None and self._is_alive(holder):
                    raise _BlockBusyError(block)
                held[block] = self.writer
                extra.append(block)
            readable = meta.commit.readable_mask(self.store.rows)
            whole_before[:] = [readable]
            if not extra and not (readable & touched).any():
                return None
            ring = dataclasses.replace(ring, held=_sorted(held), rewrites=ring.rewrites + 1)
            return self._with(meta, readable & ~touched, ring)

        while True:
            try:
                self.update(hold)
                break
            except _BlockBusyError as busy:
                if time.monotonic() > deadline:
                    raise LockedError(
                        f"store {self.store.url!r}: block {busy.block} (rows "
                        f"{self._rows_of(busy.block).start}-"
                        f"{self._rows_of(busy.block).stop - 1}) stayed held by another "
                        f"writer for {BUSY_BLOCK_SECONDS:g} s; rows that other writers "
                        "append to cannot be rewritten meanwhile",
                        holder={},
                    ) from None
                time.sleep(0.01)
        ledger = self.store._ledger
        assert ledger is not None
        # Rows another writer wrote are whole if the record said they were readable.
        theirs = self._mask_of(extra)
        ledger.intact = np.where(theirs, whole_before[0], ledger.intact)
        return extra

    def publish(self, rows: np.ndarray, *, release: Sequence[int] = ()) -> None:
        """Declare readable the rows just written that are whole (all keys), release the
        blocks held for that write alone and the full block appended into."""
        ledger = self.store._ledger
        assert ledger is not None
        written = np.zeros(self.store.rows, dtype=bool)
        written[rows] = True
        whole = written & ledger.intact
        let_go = [*release, *self._finished]
        full = self.current is not None and self.filled == self._size_of(self.current)
        if full:
            assert self.current is not None
            let_go.append(self.current)
        blocks = set(np.unique(rows // self.block_rows).tolist())
        last = int(rows.max()) + 1 if rows.size else 0

        def publish(meta: StoreMeta) -> StoreMeta:
            ring = meta.commit.ring
            assert ring is not None
            held = dict(ring.held)
            lost = sorted(block for block in blocks if held.get(block) != self.writer)
            if lost:
                raise self._fenced(lost)
            for block in let_go:
                held.pop(block, None)
            readable = meta.commit.readable_mask(self.store.rows) | whole
            ring = dataclasses.replace(ring, held=_sorted(held))
            cursor = last % self.store.rows if rows.size else meta.commit.cursor
            return self._with(meta, readable, ring, cursor=cursor)

        self.update(publish)
        self._finished.clear()
        if full:
            self.current, self.filled = None, 0
        self._sweep()

    def withdraw(self, rows: np.ndarray) -> None:
        """Rows (a mask) found damaged: not readable until rewritten."""

        def withdraw(meta: StoreMeta) -> StoreMeta:
            ring = meta.commit.ring
            assert ring is not None
            readable = meta.commit.readable_mask(self.store.rows) & ~rows
            return self._with(meta, readable, dataclasses.replace(ring, rewrites=ring.rewrites + 1))

        self.update(withdraw)

    def _sweep(self) -> None:
        """Release the blocks of writers that are gone (at most every few seconds)."""
        if time.monotonic() - self._swept < SWEEP_SECONDS:
            return
        self._swept = time.monotonic()
        gone = {who for _, who in self.ring.held if who != self.writer and not self._is_alive(who)}
        if gone:
            self._release(lambda who: who in gone)

    def leave(self) -> None:
        """Give the blocks this writer holds back (it closes)."""
        self._release(lambda who: who == self.writer)
        self.current, self.filled = None, 0

    def _release(self, whose: Callable[[str], bool]) -> None:
        """Release every block held by a writer for which ``whose`` is true."""

        def release(meta: StoreMeta) -> StoreMeta | None:
            ring = meta.commit.ring
            assert ring is not None
            kept = tuple((block, who) for block, who in ring.held if not whose(who))
            if kept == ring.held:
                return None
            readable = meta.commit.readable_mask(self.store.rows)
            return self._with(meta, readable, dataclasses.replace(ring, held=kept))

        self.update(release)

    def _check_holds(self, held: dict[int, str]) -> None:
        """This writer's blocks must still be its own (others release them only once they
        took it for gone: it must then write nothing more)."""
        mine = [*self._finished, *([self.current] if self.current is not None else [])]
        lost = [block for block in mine if held.get(block) != self.writer]
        if lost:
            raise self._fenced(lost)

    def _fenced(self, blocks: list[int]) -> FencedError:
        return FencedError(
            f"store {self.store.url!r}: block(s) {blocks} of this writer were released by "
            "another writer, which took this one for gone (its lease expired: the process "
            "stalled for longer than the lease lasts); its rows there were not published. "
            "Reopen the store to write again",
            holder={},
        )

    def _with(
        self, meta: StoreMeta, readable: np.ndarray, ring: Ring, *, cursor: int | None = None
    ) -> StoreMeta:
        commit = commit_from_mask(
            readable,
            generation=meta.commit.generation + 1,
            cursor=meta.commit.cursor if cursor is None else cursor,
            length=meta.commit.length,
        )
        # The slot map stays: shared writers write blocks in place, where it puts them.
        commit = dataclasses.replace(commit, ring=ring, slots=meta.commit.slots)
        return dataclasses.replace(meta, commit=commit)

    # --- reads -----------------------------------------------------------------------------

    def read_checked(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        """``read()`` of ``rows``, retried while other writers took blocks of those rows
        during it (a seqlock on the ring)."""
        for attempt in range(_READ_RETRIES):
            before = self.store.committed
            out = read()
            self.refresh()
            after = self.store.committed
            if after.generation == before.generation:
                return out
            retaken = self._retaken_blocks(before, after)
            if retaken is not None and retaken.isdisjoint((rows // self.block_rows).tolist()):
                return out
            time.sleep(0.0005 * (attempt + 1))
        raise RowsNotCommittedError(
            f"store {self.store.url!r}: rows kept being rewritten by other writers while "
            f"being read ({_READ_RETRIES} attempts)",
        )


class _BlockBusyError(Exception):
    def __init__(self, block: int) -> None:
        self.block = block


def _sorted(held: dict[int, str]) -> tuple[tuple[int, str], ...]:
    return tuple(sorted(held.items()))


def _shared_fields(meta: StoreMeta) -> dict[str, Any]:
    """What a writer takes from the record others write."""
    return {
        "schema": meta.schema,
        "block_rows": meta.block_rows,
        "saved": meta.saved,
        "versions": meta.versions,
        "commit": meta.commit,
        "format": meta.format,
    }


def check_shareable(store: Store) -> None:
    """A store written by one writer can take more only if no object on disk holds rows
    of two blocks (stores of zarr_rb 0.x before shared writers could have such chunks)."""
    if store.schema is None:
        return
    block_rows = store.meta.block_rows or 1
    for leaf in store.schema.leaves:
        if leaf.ragged:
            raise NotSupportedError(
                f"store {store.url!r}: key {leaf.key!r} holds rows of different lengths, "
                "which shared writers cannot write yet (its array grows wider as longer "
                "rows come); keep one writer for it",
            )
        rows = store.array(leaf.key).chunk_rows
        if rows != block_rows:
            raise NotSupportedError(
                f"store {store.url!r}: key {leaf.key!r} is stored in chunks of {rows} rows, "
                f"across blocks of {block_rows} (a store created by an older zarr_rb), so "
                "two writers could write one chunk; copy it into a new store to share it "
                "(zarr_rb.snapshot does not change chunks: write its rows into a new "
                "ZarrStorage)",
            )
