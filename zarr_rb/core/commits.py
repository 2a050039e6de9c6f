"""The owner of a store's positions and commits: where rows go, and what a commit publishes.

A :class:`~zarr_rb.core.store.Store` holds the schema, the arrays, the rows in RAM and the
reads; every change of which rows the positions ``[0, len)`` are, and every record it
publishes, goes through one object of this interface, :attr:`Store.commits`:

* :class:`~zarr_rb.core.solo.SoloCommits`: a store of one writer (and every reader). Rows
  wait in RAM by block; a write over rows that a record refers to moves their block to a
  free slot (copy-on-write, ``commit.slots``); a commit replaces the record whole.
* :class:`~zarr_rb.core.sharing.Sharing`: a store of several writers. Each appends into
  slots of its own; a commit maps positions to them by compare-and-swap of the record
  (``commit.runs``).

A store starts with the first and trades it for the second when it is handed to another
process (:meth:`Store.become_shared`). See ``docs/design/ring.md``, "Owners".
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch

from zarr_rb.core.ram_fill import FillStore
from zarr_rb.core.store_facts import StoreFacts
from zarr_rb.format.commit import Commit
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.ring import SlotMap
from zarr_rb.format.runs import RunMap
from zarr_rb.format.schema import LeafSpec, Schema

if TYPE_CHECKING:
    from zarr_rb.core.arrays import StoreArrays
    from zarr_rb.core.lifetime import Lifetime
    from zarr_rb.core.pieces import MapPieces
    from zarr_rb.core.ram_rows import RamRows
    from zarr_rb.engine import Engine
    from zarr_rb.engine.layout import Compression
    from zarr_rb.util.keys import Key

_R = TypeVar("_R")


class StoreAPI(StoreFacts, FillStore, Protocol):
    """A store as its owner of positions and commits, and the reader, use it:
    :class:`~zarr_rb.core.store.Store` is the one implementation. They name this interface,
    not the class, since ``core/store.py`` imports them."""

    @property
    def archive(self) -> bool: ...
    @property
    def arrays(self) -> StoreArrays: ...
    @property
    def compression(self) -> Compression: ...
    def attach_schema(self, schema: Schema, block_rows: int) -> None: ...
    def check_writable(self) -> None: ...
    def collect(self) -> int: ...

    commits: Commits

    def discard(self) -> None: ...
    @staticmethod
    def elements_per_row(schema: Schema | None) -> int: ...
    @property
    def engine(self) -> Engine: ...
    def flush(self) -> None: ...
    @property
    def history(self) -> bool: ...
    @property
    def length(self) -> int: ...
    @property
    def length_rows(self) -> int: ...
    @property
    def lifetime(self) -> Lifetime: ...
    @property
    def physical_rows(self) -> int: ...
    @property
    def pieces(self) -> MapPieces: ...

    pinned: Saved | None

    @property
    def ram(self) -> RamRows: ...

    version: int

    def writing(
        self, what: str, *, kept: bool = True
    ) -> contextlib.AbstractContextManager[None]: ...


class Commits(abc.ABC):
    """Positions and commits of one open store (see the module's docstring)."""

    shared: bool = False
    """Whether other writers write the store too."""

    def __init__(self, store: StoreAPI, meta: StoreMeta, *, length: int, cursor: int) -> None:
        self.store = store
        self.meta = meta
        """The record as this store last read or published it."""
        self.committed = meta.commit
        """The commit this store serves: the last one it published or picked up (the
        record's own may be older in a shared writer, which keeps the fields it uses)."""
        self.positions: SlotMap | RunMap | None = None
        """Where each position is in the data arrays, as this store reads it now (set with
        the schema)."""
        self._length = length
        self._next_write = cursor
        self._holds: dict[int, Commit] = {}
        """The commit each thread holds (:meth:`hold`)."""

    @property
    def length(self) -> int:
        """Elements in the buffer (its rows times the elements of a row), as TorchRL
        counts them: those of the last commit, and of the rows written since (a reader's
        thread that holds a commit: that commit's)."""
        held = self.held()
        if held is None:
            return self._length
        return held.length * self.store.elements_per_row(self.store.schema)

    @length.setter
    def length(self, value: int) -> None:
        self._length = value

    @property
    def cursor(self) -> int:
        """The position the next sequential write (an extend) goes to (a reader's thread
        that holds a commit: that commit's)."""
        held = self.held()
        return self._next_write if held is None else held.cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        self._next_write = value

    def hold(self) -> None:
        """A reader's thread moves to the last commit and reads it, and only it, until it
        lets go (:meth:`let_go`, or its refresh): its reads, and the length and cursor it
        sees, are that commit's, while other threads move on. The reads of one sample (a
        sampler's scan, then the gather) see one commit. A read that finds the writer no
        longer keeps its rows raises (``Commit.kept_from``), and so do the thread's reads
        after it, until it lets go. See ``docs/design/reader-snapshots.md``."""
        self.refresh()
        alive = {thread.ident for thread in threading.enumerate()}
        for ident in [ident for ident in self._holds if ident not in alive]:
            self._holds.pop(ident, None)  # (in place: a thread's set_aside puts its own back)
        self._holds[threading.get_ident()] = self.committed

    def held(self) -> Commit | None:
        """The commit this thread holds, if it holds one (see :meth:`hold`)."""
        return self._holds.get(threading.get_ident()) if self._holds else None

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A write by this thread reads and writes the store as it is now: a commit the
        thread holds (a sample drawn, not gathered yet) is put aside meanwhile, and held
        again after (the sample's gather reads it)."""
        ident = threading.get_ident()
        held = self._holds.pop(ident, None)
        try:
            yield
        finally:
            if held is not None:
                self._holds[ident] = held

    def let_go(self) -> None:
        """This thread's hold ends: its next read moves to the last commit again."""
        self._holds.pop(threading.get_ident(), None)

    def unreadable(self, rows: int) -> np.ndarray:
        """Positions of ``[0, rows)`` a reader cannot read: of the commit this thread holds,
        or of the last commit it read."""
        held = self.held()
        if held is None:
            assert self.store.ledger is not None
            return self.store.ledger.unpublished(rows)
        positions = np.arange(min(rows, held.length))
        unreadable: np.ndarray = positions[~held.readable(positions)]
        return unreadable

    def use_map(self, commit: Commit) -> None:
        """Read (and write) through the map of ``commit``: the one the store opened at, or
        a newer one a reader or a shared writer picked up."""
        store = self.store
        assert store.schema is not None
        if commit.runs is not None:
            self.positions = commit.runs
        elif commit.ring is not None and not commit.ring.legacy:
            self.positions = RunMap.empty()
        elif commit.slots is not None:
            self.positions = commit.slots.copy()
        else:
            self.positions = SlotMap.identity(store.rows, self.meta.block_rows or 1)

    def picked_up(self, meta: StoreMeta) -> None:
        """A reader read the record ``meta`` again: it serves its commit, schema, saves
        and versions from now on (see :func:`~zarr_rb.core.reader.reread_commit`)."""
        if self.meta.schema is None and meta.schema is not None:
            self.meta = meta  # the writer's first rows: their schema and blocks
        else:
            self.meta = dataclasses.replace(
                self.meta,
                schema=meta.schema,
                commit=meta.commit,
                saved=meta.saved,
                versions=meta.versions,
            )
        self.committed = meta.commit

    def show(self, commit: Commit) -> None:
        """A reader reads the rows of ``commit``: it shows its length and cursor too."""
        store = self.store
        self.length = commit.length * store.elements_per_row(store.schema)
        self.cursor = commit.cursor

    def move_cursor(self, cursor: int) -> None:
        """The next sequential write goes to ``cursor`` (a buffer emptied or loaded)."""
        self.cursor = cursor

    def set_length(self, length: int) -> None:
        """The length TorchRL's storage gives the buffer as it writes (its ``_len``)."""
        self.length = length

    def physical(self, positions: np.ndarray) -> np.ndarray:
        """The rows of the data arrays that hold ``positions``."""
        assert self.positions is not None
        return self.positions.physical(positions)

    # --- what differs between one writer and many -----------------------------------------

    @abc.abstractmethod
    def initialize(
        self, schema: Schema, block_rows: int, samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        """Give a new store its schema and arrays (its first write)."""

    @abc.abstractmethod
    def add_leaves(
        self, leaves: Sequence[LeafSpec], samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        """Add columns; rows written before read as zeros in them."""

    def before_write(self, rows: np.ndarray) -> None:  # noqa: B027 (most need nothing)
        """What a write of ``rows`` needs done first, before the buffer counts them (a
        failure here leaves the buffer as it was)."""

    @abc.abstractmethod
    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None
    ) -> None:
        """Write ``values`` to the positions ``rows`` (sorted, unique); ``cursor``: an
        extend's, where the next one goes (the store set it already)."""

    @abc.abstractmethod
    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        """Write ``count`` whole rows at the positions a commit gives them; returns those."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Publish a commit covering every row written (those waiting in RAM first)."""

    @abc.abstractmethod
    def settle(self, *, keep: bool = True) -> None:
        """Finish the writes of rows started and not finished (a writer's block written
        while its next rows come); ``keep=False``: their rows are being dropped, so a
        failure is not raised."""

    @abc.abstractmethod
    def empty(self) -> None:
        """Publish a commit of no rows (the store reset its length and cursor)."""

    @abc.abstractmethod
    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        """Withdraw damaged positions (see :meth:`Store.withdraw`); returns how many."""

    @abc.abstractmethod
    def collect(self) -> int:
        """Delete the objects of slots that nothing refers to, past the first
        ``SPARE_FACTOR`` rings' worth (those the ring takes first when it moves blocks),
        so that the disk kept saves held is given back once they are replaced or dropped.
        Returns how many slots it emptied (or found empty).

        Only after a commit that refers to none of them: a reader of an earlier record
        that meets a deleted object reads again through the last record (the seqlock).
        Arrays whose shards hold more than one block keep them (their rows are written
        over when their slots are reused).

        Its cost follows the slots freed since it last ran, not the store's size: the
        first collection of a writer lists the arrays' objects, later ones delete the
        slots that became free since (a save replaced, a version dropped)."""

    @abc.abstractmethod
    def start_history(self) -> None:
        """Keep every row extended from the next commit on (an archive)."""

    @abc.abstractmethod
    def use_save(self, saved: Saved, commit: Commit) -> None:
        """A writer's positions go back to the rows of a kept save (``commit``: its rows)."""

    @abc.abstractmethod
    def overwrote_since(self, epoch: int) -> bool:
        """Whether rows were written over in this process since ``epoch`` in a way a save
        made then cannot see (a single writer's epochs; a shared writer's saves keep
        their rows through the runs)."""

    @abc.abstractmethod
    def next_save_slot(self, named: set[int]) -> int:
        """The state group the next save writes into (``named``: the record's)."""

    @abc.abstractmethod
    def hold_for_save(self) -> None:
        """Before a save writes its state: record that this writer holds the store."""

    @abc.abstractmethod
    def publish_saved(self, saved: Saved, *, tag: str | None, last: bool = True) -> None:
        """Publish ``saved`` as the last save (and as version ``tag``), after a flush;
        ``last=False``: as version ``tag`` only, the last save staying as it is."""

    @abc.abstractmethod
    def drop_version(self, tag: str) -> None:
        """Stop keeping version ``tag``."""

    @abc.abstractmethod
    def publish_meta(self) -> None:
        """Publish the store's settings and schema with the current commit."""

    @abc.abstractmethod
    def read(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        """Run a writer's ``read`` of ``rows``, retried if other writers moved them."""

    @abc.abstractmethod
    def refresh(self) -> Commit:
        """Move to the last commit of the record; returns it."""

    @abc.abstractmethod
    def leave(self) -> None:
        """The writer's last act on a clean close (after its last flush)."""

    @property
    @abc.abstractmethod
    def rows_reached(self) -> int:
        """Positions that may hold data (for the mirrors of small leaves)."""
