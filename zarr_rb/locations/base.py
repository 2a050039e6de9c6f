"""Where a store lives: the small interface every layer above the engine talks to.

A location holds the objects of one store under one root (a directory, or a prefix of
an object-store bucket), addressed by keys relative to it (``"zarr.json"``,
``"data/obs/c.0.0.0.0"``). It offers a handful of primitives, each with the atomicity
the commit protocol relies on:

- :meth:`Location.read` / :meth:`Location.read_versioned`: one whole object, and its
  *generation* (an opaque token that changes with every write of the object).
- :meth:`Location.write`: replace one object; a reader sees the old or the new bytes,
  never a mix (local: temporary file + rename; S3: one PUT).
- :meth:`Location.write_if`: compare-and-swap of one object on its generation (local: the
  compare and the rename inside a short ``flock`` critical section, atomic among all
  processes of the machine, and of NFS clients where ``flock`` maps to NFS locks; S3: a
  conditional PUT with ``If-Match`` / ``If-None-Match``). Only the commit record and the
  writer lease rely on it.
- :meth:`Location.delete`, :meth:`Location.delete_prefix`, :meth:`Location.list`:
  not atomic as a group (a crash may leave some of the objects).
- :meth:`Location.copy_to`: copy objects into another location, on the server where the
  store can (S3 to S3 on one endpoint), by hard links on one filesystem, streamed otherwise.
- :meth:`Location.written` / :meth:`Location.sync`: the durability barrier before a
  commit is published (local: fsync; S3: a PUT is durable once acknowledged).

Array chunks are read and written by TensorStore, through :meth:`Location.kvstore`
(the TensorStore kvstore spec of a key prefix) and :attr:`Location.context`.
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
from collections.abc import Callable, Iterable
from pathlib import PurePath, PurePosixPath
from typing import Any, Protocol, TypeVar

import tensorstore as ts

_T = TypeVar("_T")

Generation = bytes
"""An object's version as its location reports it: compare for equality only."""

ROOT_METADATA = "zarr.json"
LOCK_FILE = ".zarr_rb.lock"
"""The writer lock of a local store; not part of the store's data, never copied."""
CAS_LOCK_FILE = ".zarr_rb.cas.lock"
"""Held (``flock``) for the moment of a compare-and-swap in a local store."""
LEASE_KEY = ".zarr_rb.lease"
"""The writer lease of a store on an object store; not part of its data, never copied."""
TEMPORARY_SUFFIXES = (".tmp", ".__lock", ".partial")
"""Files of interrupted writes: ours (``.tmp``), TensorStore's (``.__lock``) and
zarr-python's (``.partial``). They are never part of a commit."""
WRITERS_DIR = ".zarr_rb.writers"
"""One object per writer of a shared store, ``<dir>/<writer id>``: its lock file (local)
or its lease (object store), which tells the others whether it is alive."""
NO_VALUE = b"\x02"
"""TensorStore's storage generation of an object that does not exist: a write
conditional on it creates the object only if there is none."""
PROBE_DIR = ".zarr_rb.probe"
"""Objects a writer creates and deletes at once, to learn whether the store refuses to
create an object that exists (``Location.creates_once``)."""
NOT_DATA = (LOCK_FILE, CAS_LOCK_FILE, LEASE_KEY, WRITERS_DIR, PROBE_DIR)


def is_temporary(name: str) -> bool:
    return name.endswith(TEMPORARY_SUFFIXES)


def is_store_object(key: str) -> bool:
    """Whether ``key`` belongs to the store's content (what a copy takes along)."""
    name = key.rpartition("/")[2]
    return not is_temporary(name) and key.partition("/")[0] not in NOT_DATA


def writer_key(writer: str) -> str:
    """The object of a shared store's writer ``writer`` (see :data:`WRITERS_DIR`)."""
    return f"{WRITERS_DIR}/{writer}"


class WriterHold(Protocol):
    """The right to write a store: a lock (local) or a lease (object store)."""

    holder: dict[str, Any]
    needs_claim: bool
    """Whether the new holder must also claim the commit record (a lease, which another
    writer may have held until a moment ago and still believe it holds); a kernel lock
    keeps every other writer out by itself."""
    late_writes: bool
    """Whether a holder that lost its hold may still change objects: a lease (a process
    that stalled past it goes on, and requests it sent land late); a kernel lock is held
    until its process is gone. Slots such a holder could be writing are never given to
    another writer (see ``docs/design/ring.md``, "S3 and fencing")."""

    @property
    def held(self) -> bool: ...

    def check(self) -> None:
        """Raise :class:`~zarr_rb.errors.FencedError` if the hold was lost (a lease that
        expired or was taken over): nothing may be written then."""

    def release(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Versioned:
    """An object's bytes (``None``: absent) and its generation."""

    value: bytes | None
    generation: Generation


ProgressCallback = Callable[[int], None]


class Location(abc.ABC):
    """The objects of one store (see the module's docstring for what is atomic)."""

    cache_bytes: int = 0
    """How many bytes of encoded objects a process keeps in RAM to read arrays from (0: it
    reads the location directly, as a local filesystem, whose page cache does that)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the store is, for messages and records (never holds a secret)."""

    @property
    @abc.abstractmethod
    def context(self) -> ts.Context:
        """The TensorStore context arrays of this location are opened with."""

    @abc.abstractmethod
    def identity(self) -> tuple[str, ...]:
        """Equal for two locations of the same store (one writer per store per process)."""

    def path_of(self, key: str) -> PurePath:
        """What I/O observers are told an operation touches (see ``zarr_rb.util.io``)."""
        return PurePosixPath(self.url) / key

    @abc.abstractmethod
    def kvstore(self, key: str) -> dict[str, Any]:
        """The TensorStore kvstore spec of the prefix ``key`` (an array's directory)."""

    def run(self, call: Callable[[], _T], what: str) -> _T:
        """``call()`` (an operation on this location's kvstore), with its errors as the
        location's typed ones."""
        return call()

    # --- objects ---------------------------------------------------------------------------

    @abc.abstractmethod
    def read_versioned(self, key: str) -> Versioned: ...

    def read(self, key: str) -> bytes | None:
        """The bytes of ``key``, or ``None`` if it does not exist."""
        return self.read_versioned(key).value

    @abc.abstractmethod
    def write(self, key: str, value: bytes) -> Generation:
        """Replace ``key`` atomically; returns its new generation."""

    @abc.abstractmethod
    def write_if(
        self, key: str, value: bytes | None, *, generation: Generation
    ) -> Generation | None:
        """Replace (``value=None``: delete) ``key`` only if its generation is still
        ``generation`` (the one :meth:`read_versioned` gave, absent objects included).

        Returns:
            The new generation, or ``None`` if the object changed meanwhile (nothing was
            written).
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix/`` (not atomic)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """The keys under ``prefix`` (``""``: the whole store) and their sizes in bytes."""

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether an object ``key`` is stored (one lookup, whatever else is stored)."""

    def copy_to(
        self,
        target: Location,
        keys: Iterable[str],
        *,
        progress: ProgressCallback | None = None,
    ) -> int:
        """Copy objects to the same keys of ``target``; returns the bytes that passed
        through this process (0 for a server-side copy). The default streams them."""
        copied = 0
        for key in keys:
            value = self.read(key)
            if value is None:
                continue
            target.write(key, value)
            copied += len(value)
            if progress is not None:
                progress(len(value))
        return copied

    # --- the store as a whole --------------------------------------------------------------

    @abc.abstractmethod
    def check_usable(self) -> None:
        """Raise a typed error now, in bounded time, if the store cannot be reached (a
        missing bucket, refused credentials, an unreachable endpoint) or something else is
        in its place (a file where its directory goes)."""

    def check_creatable(self) -> None:
        """Raise a typed error now if a new store could not be made here (a read-only
        filesystem); nothing is made before the store's first write."""
        return  # an object store: check_usable has reached its bucket

    @abc.abstractmethod
    def create_root(self) -> None:
        """Make the store's root exist (a directory; nothing on an object store)."""

    @abc.abstractmethod
    def acquire_writer(self) -> WriterHold:
        """Take the store's writer hold or raise :class:`~zarr_rb.errors.LockedError`
        naming the holder (never waits for it); :class:`~zarr_rb.errors.MixedWritersError`
        when shared writers hold it."""

    @abc.abstractmethod
    def join_writers(self, writer: str) -> WriterHold:
        """Hold the store as one of its shared writers, named ``writer`` (a new id), until
        released; raise :class:`~zarr_rb.errors.MixedWritersError` at once if a single
        writer holds it."""

    @abc.abstractmethod
    def writer_alive(self, writer: str) -> bool:
        """Whether the shared writer ``writer`` still holds the store (once ``False``,
        never ``True`` again: a writer id is never reused)."""

    @abc.abstractmethod
    def holders(self) -> builtins.list[dict[str, Any]]:
        """Who writes the store now, as each writer recorded itself (host, pid, since; a
        shared writer's ``writer`` id), found without taking, waiting for or changing
        anything: for ``zarr-rb info``."""

    def live_writers(self) -> builtins.list[str]:
        """The shared writers that hold the store now."""
        names = {key.partition("/")[2] for key in self.list(WRITERS_DIR)}
        return sorted(name for name in names if name and self.writer_alive(name))

    def creates_once(self) -> bool:
        """Whether this location refuses to create an object that exists (a conditional
        create, ``If-None-Match: *`` on S3): a writer then creates each data object once
        and never writes over it (see :mod:`zarr_rb.engine.once`)."""
        return False

    def remove_leftovers(self) -> builtins.list[str]:
        """Delete what interrupted writes left behind (only the writer calls this)."""
        return []

    def exists(self) -> bool:
        """Whether anything at all is stored under the root."""
        return bool(self.list())

    # --- durability --------------------------------------------------------------------

    def written(  # noqa: B027 (optional hook)
        self, keys: Iterable[str], *, synced: bool = False
    ) -> None:
        """Objects written since the last :meth:`sync` (by TensorStore, say). ``synced``:
        :meth:`sync_objects` made their content durable since they were written; the next
        :meth:`sync` makes the rest (their names) durable."""

    def sync(self) -> None:  # noqa: B027 (optional hook)
        """Make every object written so far durable (the barrier before a commit)."""

    def sync_objects(self, keys: Iterable[str]) -> None:  # noqa: B027 (optional hook)
        """Make these objects' content durable now (from any thread: it changes no state of
        this location; the next :meth:`sync` still syncs what they are in)."""

    def child(self, key: str) -> Location:
        """The location of the store at ``key`` below this one (a snapshot's target)."""
        raise NotImplementedError(f"{type(self).__name__} has no child locations")


def join(*parts: str) -> str:
    """Keys joined with ``/`` (empty parts skipped)."""
    return "/".join(part.strip("/") for part in parts if part.strip("/"))
