"""A store on disk: its schema, the parts that serve it, and the calls into it.

* **Positions and commits** belong to :attr:`Store.commits`, one object behind one
  interface (:class:`~zarr_rb.core.commits.Commits`): :class:`~zarr_rb.core.solo.SoloCommits`
  for a store of one writer (copy-on-write of blocks, a record replaced whole) and
  :class:`~zarr_rb.core.sharing.Sharing` for a store of several (rows appended into
  slots of each writer's own, placed by compare-and-swap of the record). ``Store`` asks it
  where rows are and has it write and commit; it never branches on which one it is.
* **The commit record** (the root group's attributes) is replaced atomically; the rows it
  declares readable are on disk, whole, and no slot it refers to is ever written again
  (see ``docs/design/ring.md``).
* **Reads** go through the map of the record they started from; a reader re-reads the
  record after each read and retries if the rows it read moved (a seqlock), so a read
  never returns a torn transition.

The other parts each own their state: the data arrays (:attr:`Store.arrays`), the rows
the writer serves from RAM (:attr:`Store.ram`), its saves (:attr:`Store.saves`), its
hold and users (:attr:`Store.lifetime`) and the pieces of its maps (:attr:`Store.pieces`).
Every public call holds the store's lock (:mod:`zarr_rb.core.calls`).

This module works with leaf dictionaries ``{key: tensor[rows, ...]}`` and row
numbers; it knows nothing about TorchRL. Stores are opened by :mod:`zarr_rb.core.open`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from zarr_rb.core.arrays import StoreArrays
from zarr_rb.core.calls import Calls, serialized
from zarr_rb.core.commits import Commits
from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.ledger import Ledger
from zarr_rb.core.lifetime import Lifetime
from zarr_rb.core.pieces import MapPieces
from zarr_rb.core.ram_rows import RamRows
from zarr_rb.core.reader import follows_writer, read_committed
from zarr_rb.core.saves import StoreSaves
from zarr_rb.core.sharing import Sharing, check_shareable, new_writer_id
from zarr_rb.core.solo import SoloCommits
from zarr_rb.core.write_cache import WriteBuffer
from zarr_rb.engine import Engine
from zarr_rb.engine.layout import Compression, choose_block_rows
from zarr_rb.errors import (
    FencedError,
    ReadOnlyError,
    StoreClosedError,
    StoreWriteError,
    ZarrRBError,
)
from zarr_rb.format.commit import Commit
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.ring import SlotMap
from zarr_rb.format.schema import LeafSpec, Schema, leaves_by_key, with_lengths
from zarr_rb.locations import LocalLocation
from zarr_rb.locations.base import WriterHold
from zarr_rb.util.io import errno_of, short_reason
from zarr_rb.util.keys import Key


class Store:
    """One zarr_rb store: open it with :func:`zarr_rb.core.open.open_store`."""

    def __init__(
        self,
        engine: Engine,
        meta: StoreMeta,
        *,
        read_only: bool,
        compression: Compression,
        lock: WriterHold | None = None,
        create: Callable[[], WriterHold] | None = None,
        history: bool = False,
    ) -> None:
        self.engine = engine
        self.history = history
        """Read-only rows of an archive's history (``meta`` made by ``as_history``): they
        stay as opened, and nothing they read is ever written again."""
        self.read_only = read_only
        self.compression = compression
        self.calls = Calls(self.flush, where=f"store {engine.url!r}")
        self.archive = meta.commit.history is not None
        """Whether commits append to the history (an archive, or one starting)."""
        self.epoch_at_open = meta.commit.epoch
        """Rows written over before this epoch were written over by another process."""
        self.leaves: dict[Key, LeafSpec] = {}
        self.write_cache: WriteBuffer | None = None
        self.ledger: Ledger | None = None
        self.version = 0
        """Grows with every change of the rows this store serves (lazy columns' caches)."""
        self.shared: dict[str, object] = {}
        """State that the storages sharing this store share (their mutation revision)."""
        self.pinned: Saved | None = None
        """A reader's save whose rows it reads (a loaded save), until :meth:`refresh`."""
        self.arrays = StoreArrays(self)
        self.ram = RamRows(self, large_row_bytes=compression.large_row_bytes, read_only=read_only)
        self.lifetime = Lifetime(self, lock=lock, create=create)
        self.lifetime.on_close(self.ram.fill.close)
        self.saves = StoreSaves(self)
        self.pieces = MapPieces(
            engine.location, meta, listed=not read_only and create is None
        )  # (a store on disk, opened to write: pieces a crash left are listed)
        self.commits: Commits = SoloCommits(
            self, meta, late_writes=lock is not None and lock.late_writes
        )
        """The owner of the positions and the commits: this store's own, until other
        writers join it (:class:`~zarr_rb.core.sharing.Sharing`)."""
        if meta.schema is not None:
            self.attach_schema(meta.schema, meta.block_rows or 1)

    # --- schema ----------------------------------------------------------------------------

    @property
    def meta(self) -> StoreMeta:
        """The record as this store last read or published it (its commits object's)."""
        return self.commits.meta

    @property
    def committed(self) -> Commit:
        """The commit this store serves (see :attr:`Commits.committed`)."""
        return self.commits.committed

    @property
    def schema(self) -> Schema | None:
        return self.meta.schema

    @staticmethod
    def elements_per_row(schema: Schema | None) -> int:
        return 1 if schema is None else schema.elements_per_row

    @property
    def rows(self) -> int:
        assert self.schema is not None
        return self.schema.rows

    @property
    def length_rows(self) -> int:
        """Rows covered by ``length`` (elements)."""
        return -(-self.length // self.elements_per_row(self.schema))

    def leaf(self, key: Key) -> LeafSpec:
        return self.leaves[key]

    def element_shape(self, leaf: LeafSpec, width: int = 0) -> tuple[int, ...]:
        """Shape of one row of a leaf's array (of a ragged leaf: ``width`` long)."""
        assert self.schema is not None
        if leaf.ragged:
            return (width, *leaf.shape)
        return (*self.schema.batch_shape[1:], *leaf.shape)

    def attach_schema(self, schema: Schema, block_rows: int) -> None:
        self.leaves = leaves_by_key(schema.leaves)
        recorded = Compression.recorded(self.meta.compression, schema)  # (frames decided)
        self.compression = recorded or self.compression.resolved(bool(schema.frames))
        self.commits.use_map(self.committed)
        if self.meta.commit.ring is not None:
            self.arrays.wait_for(schema)  # (a shared store's, made by another writer)
        self.arrays.check_metadata(schema)  # (row masks are sized from the schema)
        self.write_cache = _write_buffer(schema, block_rows, self.element_shape)
        self.ram.choose()
        # Rows known to hold intact data: those of the commit. Rows past it were never
        # written or belong to an interrupted write; they become intact when written.
        self.ledger = Ledger(
            self.committed.readable_mask(self.committed.length), self.leaves, capacity=schema.rows
        )
        if self.commits.shared:
            self.ledger.grow(schema.rows)  # other writers' blocks lie anywhere in the ring

    @serialized
    def initialize(
        self, schema: Schema, *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Create the arrays of ``schema`` (first write of a new store; ``samples``: the rows
        it writes, see :meth:`StoreArrays.create`)."""
        self.check_writable()
        block_rows = choose_block_rows(self.compression, schema.leaves, schema.batch_shape)
        self.lifetime.ensure_on_disk()
        self.commits.initialize(schema, block_rows, samples)

    @serialized
    def add_leaves(
        self, leaves: Sequence[LeafSpec], *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Add columns to an initialised store. Rows already written read as zeros in them,
        as in TorchRL's storages; the new schema is published with the next commit."""
        self.check_writable()
        self.commits.add_leaves(leaves, samples)

    # --- positions -------------------------------------------------------------------------

    @property
    def physical_rows(self) -> int:
        """Rows the data arrays must have: those of every slot of the map."""
        ring = self.committed.ring
        if ring is not None and ring.capacity:
            return max(self.rows, ring.capacity * (self.meta.block_rows or 1))
        slots = self.commits.positions
        if not isinstance(slots, SlotMap) or slots.is_identity:
            return self.rows
        return slots.capacity * slots.block_rows

    def physical(self, positions: np.ndarray) -> np.ndarray:
        """The rows of the data arrays that hold ``positions``, as this store reads them."""
        return self.commits.physical(positions)

    @property
    def length(self) -> int:
        """Elements in the buffer, as TorchRL counts them (see :attr:`Commits.length`)."""
        return self.commits.length

    @property
    def cursor(self) -> int:
        """Where the next extend goes (see :attr:`Commits.cursor`)."""
        return self.commits.cursor

    @property
    def rows_reached(self) -> int:
        """Rows this writer may have written (see :attr:`Commits.rows_reached`)."""
        return self.commits.rows_reached

    @property
    def is_shared(self) -> bool:
        """Whether other writers write this store too."""
        return self.commits.shared

    # --- writing ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.lifetime.closed

    @property
    def fenced(self) -> FencedError | None:
        """Why this writer was fenced (another writer took the store over), if it was."""
        return self.calls.fenced

    def check_writable(self) -> None:
        """Refuse a write the store cannot take (read-only, closed, fenced)."""
        if self.read_only:
            raise ReadOnlyError(
                f"store {self.url!r} was opened read-only; open it with "
                "read_only=False (one writer per store) to write",
            )
        if self.closed:
            raise StoreClosedError(f"store {self.url!r} is closed")
        if self.fenced is not None:
            raise FencedError(str(self.fenced), holder=self.fenced.holder)

    @serialized
    def before_write(self, rows: np.ndarray) -> None:
        """Make ready for a write of ``rows`` (sorted, unique), before the buffer counts
        them: a failure here (a typed error) leaves the store and the buffer as they were."""
        self.check_writable()
        if rows.size:
            self.commits.before_write(rows)

    @serialized
    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None = None
    ) -> None:
        """Write ``values[key][i]`` to row ``rows[i]`` (``rows`` sorted and unique).

        ``values`` holds every leaf (a row write) or some of them (the other leaves of those
        rows keep their values). ``cursor``: the row the next sequential write goes to once
        this one is done (a writer's extend); set before anything is committed, so that
        every commit made during the write records where its rows end.
        """
        self.check_writable()
        if not rows.size:
            return  # (an extend of no rows, which TorchRL's storages take: nothing changes)
        self.commits.write(rows, values, cursor=cursor)

    @serialized
    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        """A shared store's extend: write ``count`` whole rows into this writer's slots,
        then commit them at the cursor; returns the positions they got."""
        self.check_writable()
        return self.commits.append(values, count)

    @contextlib.contextmanager
    def writing(self, what: str, *, kept: bool = True) -> Iterator[None]:
        """Turn a failed write (a full disk, an I/O error) into a :class:`StoreWriteError`.

        ``kept``: the rows of the call that failed wait in RAM for a retry (else the call
        stored nothing of them, and the caller must write them again)."""
        try:
            yield
        except (OSError, ValueError) as err:
            if isinstance(err, ZarrRBError):
                raise
            raise _write_error(self.url, self.committed, what, err, kept=kept) from None

    def write_past(self, slot: int) -> None:
        """Write no slot below ``slot`` (see :meth:`SoloCommits.write_past`): a writer that
        took the store over on a lease, or made it."""
        assert isinstance(self.commits, SoloCommits)
        self.commits.write_past(slot)

    def collect(self) -> int:
        """Delete the objects of slots that nothing refers to (a writer's; see
        :meth:`Commits.collect`). Returns how many slots it emptied (or found empty)."""
        if self.schema is None or self.read_only:
            return 0
        return self.commits.collect()

    @serialized
    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        """Withdraw ``positions``, found damaged in rows ``physical`` of the data arrays
        (where the commit ``seen`` has them), from the readable range until they are
        rewritten. Those that a write moved since stay. Returns how many were withdrawn."""
        self.check_writable()
        assert self.ledger is not None
        self.version += 1
        return self.commits.withdraw(positions, physical, seen)

    @serialized
    def flush(self) -> None:
        """Write every row held in RAM and publish a commit that covers them."""
        if self.read_only or self.closed or self.write_cache is None:
            return
        if self.fenced is not None:
            raise FencedError(str(self.fenced), holder=self.fenced.holder)
        self.commits.flush()

    @serialized
    def discard(self) -> None:
        """Forget rows held in RAM (after ``empty``)."""
        self.version += 1
        self.commits.settle(keep=False)
        if self.write_cache is not None:
            self.write_cache.forget()
        self.ram.clear()

    def start_archive(self) -> None:
        """Keep every row extended from the next commit on (an archive's history); a store
        that keeps one already goes on."""
        self.check_writable()
        self.archive = True
        self.commits.start_history()

    @serialized
    def empty(self) -> None:
        """Drop every row, as TorchRL's ``rb.empty()`` does, and commit: nothing is
        readable, the cursor is back at 0, the epoch moves and the last save is dropped
        (its rows are gone)."""
        self.check_writable()
        self.discard()
        self.commits.set_length(0)
        self.commits.move_cursor(0)
        if not self.lifetime.on_disk:
            return  # nothing was ever written
        self.commits.empty()

    @serialized
    def publish_meta(self) -> None:
        """Publish the store's settings and schema with the current commit."""
        self.commits.publish_meta()

    # --- reading ---------------------------------------------------------------------------

    @serialized
    def read(
        self,
        rows: np.ndarray,
        keys: Iterable[Key],
        *,
        unwritten_as_zeros: bool = False,
        unreadable_as_zeros: bool = False,
        under: Commit | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Read rows (any order, repeats allowed) of some leaves, RAM-held rows included.

        Args:
            unwritten_as_zeros: rows past the length that hold no data for a key read as
                zeros (as the unused capacity of TorchRL's storages), instead of raising.
            unreadable_as_zeros: every row that cannot be read (holes too) reads as zeros;
                for callers that then leave those rows out (samplers' trajectory scans).

        Raises:
            RowsNotCommittedError: a row holds no intact data for a key (a read-only store:
                a row outside the commit; ``under``: that commit's rows, read-only stores,
                and the writer no longer keeps them).
        """
        keys = list(keys)
        if self.read_only:
            committed = read_committed(
                self,
                rows,
                with_lengths(self.leaves, keys),
                unreadable_as_zeros=unreadable_as_zeros,
                under=under,
            )
            return {key: committed[key] for key in keys}
        return self.commits.read(
            lambda: self.ram.read(
                rows,
                keys,
                unwritten_as_zeros=unwritten_as_zeros,
                unreadable_as_zeros=unreadable_as_zeros,
                under=self.commits.held(),  # (a shared writer's sample's: see Commits.hold)
            ),
            rows,
        )

    @serialized
    def unreadable_rows(self) -> np.ndarray:
        """Rows inside the length that cannot be read: withdrawn by a crash, a failed write
        or a repair, and not rewritten since (samplers must not draw them)."""
        if self.schema is None:
            return np.empty(0, dtype=np.int64)
        assert self.ledger is not None
        if not self.read_only:
            return self.ram.unreadable_rows(self.length_rows)
        return self.commits.unreadable(self.length_rows)

    @serialized
    def refresh(self) -> Commit:
        """Re-read the commit record and move to it: its length, cursor and rows (readers,
        and the writers of a shared store); returns it."""
        return self.commits.refresh()

    @serialized
    def hold(self, on: bool = True) -> None:
        """A reader, or a shared writer: hold the last commit, or let go (see Commits.hold)."""
        if follows_writer(self) or self.commits.shared:
            self.commits.hold() if on else self.commits.let_go()

    # --- sharing and lifetime ---------------------------------------------------------------

    @serialized
    def become_shared(self) -> None:
        """Let other processes join this store as writers (it is handed to one): flush,
        trade the single writer's hold for a shared one, start sharing."""
        if self.commits.shared or self.read_only:
            return
        check_shareable(self)
        self.lifetime.ensure_on_disk()
        self.flush()
        writer = new_writer_id()
        self.lifetime.join_writers(writer)
        Sharing.start(self, writer)

    def close(self) -> bool:
        """One user is done with the store (see :meth:`Lifetime.close`)."""
        return self.lifetime.close()

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def path(self) -> Path | str:
        """The directory of a local store, the URL of any other."""
        location = self.engine.location
        return location.root if isinstance(location, LocalLocation) else location.url


def _write_buffer(
    schema: Schema, block_rows: int, element_shape: Callable[[LeafSpec], tuple[int, ...]]
) -> WriteBuffer:
    """The write buffer of a store of ``schema``, in blocks of ``block_rows`` rows."""
    return WriteBuffer(
        element_shapes={leaf.key: element_shape(leaf) for leaf in schema.leaves},
        dtypes={leaf.key: TORCH_DTYPES[leaf.dtype] for leaf in schema.leaves},
        block_rows=block_rows,
        rows=schema.rows,
        ragged=frozenset(leaf.key for leaf in schema.leaves if leaf.ragged),
        frames_on_disk=schema.frame_keys,
    )


def _write_error(
    url: str, committed: Commit, what: str, err: Exception, *, kept: bool
) -> StoreWriteError:
    """The error of a failed write (see :meth:`Store.writing`)."""
    if kept:
        rows = "rows not yet committed are kept in RAM"
        then = "retry with flush() or zarr_rb.save(), or reopen the store"
    else:
        rows = "the rows of this write were not stored"
        then = "write them again"
    return StoreWriteError(
        errno_of(err),
        f"store {url!r}: {what} failed ({short_reason(err)}). The store stays at its last "
        f"commit (generation {committed.generation}, length {committed.length}); {rows}. "
        f"Free space or fix the disk, then {then}",
    )
