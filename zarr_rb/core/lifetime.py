"""A store's life in this process: made on disk at its first write, held by a writer lock
or lease, used by the storages that opened it, and closed by the last of them (which
flushes it, gives up its hold and deletes what was to go with it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from zarr_rb.core.arrays import StoreArrays
from zarr_rb.core.calls import Calls, serialized
from zarr_rb.engine import Engine
from zarr_rb.errors import StoreWriteError, ZarrRBError
from zarr_rb.format.names import DATA_GROUP
from zarr_rb.locations import Location
from zarr_rb.locations.base import ROOT_METADATA, WriterHold
from zarr_rb.util.io import errno_of, short_reason


class _Leaves(Protocol):
    def leave(self) -> None: ...


class LifetimeOwner(Protocol):
    """What the lifetime uses of its store (:class:`~zarr_rb.core.store.Store`)."""

    calls: Calls

    @property
    def engine(self) -> Engine: ...
    @property
    def arrays(self) -> StoreArrays: ...
    @property
    def read_only(self) -> bool: ...
    @property
    def url(self) -> str: ...
    @property
    def commits(self) -> _Leaves: ...
    def flush(self) -> None: ...
    def write_past(self, slot: int) -> None: ...
    def publish_meta(self) -> None: ...
    def writing(
        self, what: str, *, kept: bool = True
    ) -> contextlib.AbstractContextManager[None]: ...


class Lifetime:
    """The hold on one open store and the storages of this process that use it."""

    def __init__(
        self,
        store: LifetimeOwner,
        *,
        lock: WriterHold | None,
        create: Callable[[], WriterHold] | None,
    ) -> None:
        self.store = store
        self.calls = store.calls
        self._lock = lock
        self._create = create
        """A new store, not yet on disk: makes its place there and takes its writer lock
        (see :meth:`ensure_on_disk`)."""
        self._creates_once: bool | None = None
        """Whether the location refuses to create an object that exists (asked once)."""
        self.users = 1
        """Storages of this process that have this store open (they share one writer)."""
        self.closed = False
        self._remove: list[Location] = []
        self._on_close: list[Callable[[], None]] = []

    # --- the hold --------------------------------------------------------------------------

    @property
    def on_disk(self) -> bool:
        """Whether the store was made on disk (a new one is, at its first write)."""
        return self._create is None

    @serialized
    def ensure_on_disk(self) -> None:
        """Make a new store on disk: its directory, its writer lock, its root record and
        data group. As TorchRL's storages, which make their files at the first write, a
        new store is made when something is first written into it (rows, a save), so
        that a storage built and never written leaves nothing behind, and a storage built
        in a directory deleted before its first write (TorchRL's scripts build theirs in
        a ``TemporaryDirectory`` that they leave at once) still works.

        Raises:
            LockedError: another writer holds the new store's lock.
            StoreExistsError: another writer made a store there since this one was opened.
        """
        create = self._create
        if create is None:
            return
        store = self.store
        try:
            self._lock = create()
        except OSError as err:
            if isinstance(err, ZarrRBError):
                raise
            raise StoreWriteError(
                errno_of(err),
                f"store {store.url!r} could not be made ({short_reason(err)}); nothing was "
                "written. Free space or fix the disk, then write again",
            ) from None
        self._create = None
        store.write_past(0)  # made by this writer: no other ever wrote into it
        try:
            store.publish_meta()
            with store.writing("creating the data group", kept=False):
                store.engine.create_group(DATA_GROUP)
        except BaseException:
            # Nothing was published (the root record is written whole or not at all) or the
            # store exists, empty: either way, a later write starts again from here.
            if store.engine.location.read(ROOT_METADATA) is None:
                self._lock.release()
                self._lock = None
                self._create = create
            raise

    def check_hold(self) -> None:
        """Nothing is written by a writer that lost its hold (a lease taken over).

        Raises:
            FencedError: it did.
        """
        if self._lock is not None:
            self._lock.check()

    @property
    def late_writes(self) -> bool:
        """Whether this writer holds the store by a hold that a stalled holder may outlive
        (a lease): slots another writer may be writing are then never written."""
        return self._lock is not None and self._lock.late_writes

    @property
    def creates_once(self) -> bool:
        """Whether this writer creates each data object once, never writing over one (a
        writer on a lease, on a server that refuses to create an object that exists: see
        ``docs/design/ring.md``, step 5). Its writes then cover every row of each slot they
        go to (:meth:`SoloCommits._copy_on_write` moves every block written into a slot
        that may hold an object; a shared writer writes each write into fresh slots)."""
        if not self.late_writes:
            return False
        if self._creates_once is None:
            self._creates_once = self.store.engine.location.creates_once()
        return self._creates_once

    def join_writers(self, writer: str) -> None:
        """Trade the single writer's hold for a shared one, as writer ``writer``."""
        if self._lock is not None:
            self._lock.release()
        self._lock = self.store.engine.location.join_writers(writer)

    # --- users -----------------------------------------------------------------------------

    @serialized
    def acquire(self) -> None:
        """One more user of this open store (another storage of this process)."""
        self.users += 1

    def remove_when_closed(self, location: Location) -> None:
        """Delete everything at ``location`` (the store, or the temporary directory holding
        it) once the last user has closed the store."""
        self._remove.append(location)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the store is closed (or abandoned)."""
        self._on_close.append(callback)

    @serialized
    def close(self) -> bool:
        """One user is done with the store; the last one flushes it, releases its lock and
        deletes what :meth:`remove_when_closed` named. Returns whether something was
        deleted."""
        if self.closed:
            return False
        store = self.store
        self.users -= 1
        if self.users > 0:
            if not self._gone():
                store.flush()
            return False
        try:
            if not self._gone():
                store.flush()
                store.commits.leave()
        finally:  # the lock or lease is given up even when the store cannot be reached
            self._end()
        removed = False
        for location in self._remove:
            if location is store.engine.location and not self.on_disk:
                continue  # never made by this store: what is there is another writer's
            removed = removed or location.exists()
            location.delete_prefix("")
        return removed

    def drop_user(self) -> None:
        """A user dropped without :meth:`close` (its finalizer). The garbage collector runs
        it at any allocation, perhaps inside a call of this store on this thread, whose
        lock is re-entrant: a flush there would commit that call's write half-done, so the
        rows of a user that is not the last are committed as the call ends; outside any
        call, at once. The last one closes. In a child forked from the process that
        opened the store, a copy of the user is dropped: the store is the parent's, and is
        left to it (see :func:`~zarr_rb.util.fork.refuse_parents_store`)."""
        if self.calls.forked:
            return
        with self.calls.mutex:  # (another thread's call ends first)
            if self.closed:
                return
            if self.users <= 1:
                self.close()
                return
            self.users -= 1
            if self.calls.depth:
                self.calls.flush_on_exit = True
            elif not self._gone():
                self.store.flush()

    @serialized
    def abandon(self) -> None:
        """Drop the store as a process killed at this instant would: the rows in RAM are
        lost, nothing is flushed or committed, the writer's lock is released (as the kernel
        releases a dead process's locks). For crash tests."""
        if self.closed:
            return
        self.users = 0
        self._end()  # a shared writer's blocks are then taken for a dead one's

    def _end(self) -> None:
        self.closed = True
        self.store.arrays.close()
        if self._lock is not None:
            self._lock.release()
        for callback in self._on_close:
            callback()

    def _gone(self) -> bool:
        """Whether there is nothing to flush into: a reader, a fenced writer (the error was
        raised at its write), or a store deleted from under it (by another program)."""
        if self.store.read_only or not self.on_disk or self.calls.fenced is not None:
            return True
        return self.store.engine.location.read(ROOT_METADATA) is None
