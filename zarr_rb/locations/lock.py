"""Who may write a local store: advisory locks on files inside it.

The writer lock is ``flock(2)`` on ``<store>/.zarr_rb.lock``: the kernel releases it
when the holder exits or dies (even by SIGKILL), so a crashed writer never
leaves a store locked. The holder writes who it is (host, pid, since when) into
the file so that the next writer can say who holds it. Readers never touch it.
On NFS, Linux maps ``flock`` onto NFS byte-range locks.

The writers of a shared store each hold that file's lock *shared* (so no single writer
gets in while they are there, and none of them while a single writer is) and an
exclusive lock on a file of their own, ``.zarr_rb.writers/<writer id>``: whoever can take
that lock knows its writer is gone, at once, however it ended.

An ``flock`` belongs to the open file, which a forked child shares with its parent through
its copy of the descriptor: the lock would outlive a writer that died while a child it
forked (a DataLoader worker, an evaluator) lives on. A forked child therefore closes its
copies at once, which releases nothing of the parent's.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr_rb.errors import LockedError, LocksUnsupportedError, MixedWritersError
from zarr_rb.locations.base import LOCK_FILE, WRITERS_DIR
from zarr_rb.util.io import read_json_object

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""What ``flock`` fails with on a filesystem that has no working locks (NFS mounted with
``nolock`` and no local locking, some FUSE filesystems)."""


class WriterLock:
    """The writer lock of one store, held from :meth:`acquire` until :meth:`release`."""

    needs_claim = False
    late_writes = False

    def __init__(self, path: Path, fd: int, holder: dict[str, Any]) -> None:
        self.path = path
        self.holder = holder
        self._fd: int | None = fd
        _HELD.add(self)

    @classmethod
    def acquire(
        cls, root: Path, *, shared_writers: Callable[[], list[str]] | None = None
    ) -> WriterLock:
        """Take the lock or raise :class:`LockedError` at once (never waits);
        :class:`MixedWritersError` if shared writers hold it (``shared_writers`` names
        them)."""
        path = root / LOCK_FILE
        try:
            fd = _take(path, fcntl.LOCK_EX)
        except _HeldError as held:
            holder = held.holder
            others = shared_writers() if shared_writers is not None else []
            if others:
                raise mixed_writers(str(root), len(others)) from None
            who = (
                f"pid {holder.get('pid')} on host {holder.get('host')!r} since "
                f"{holder.get('since')}"
                if holder
                else "another process"
            )
            raise LockedError(
                f"store {str(root)!r} is open for writing by {who}; one writer per store: "
                "close it there first, open this one read-only (read_only=True), or make "
                "every writer a shared one (shared=True)",
                holder=holder,
            ) from None
        holder = _me()
        lock = cls(path, fd, holder)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode("utf-8"), 0)
        except BaseException:
            lock.release()  # a full disk: the next attempt must find the lock free
            raise
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def check(self) -> None:
        """Nothing to check: the kernel holds an flock until the holder closes it."""

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def forget_in_child(self) -> None:
        """In a forked child: close this copy of the parent's descriptor (see the module's
        doc), unlocking nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()
"""The locks this process opened."""


def _forget_in_child() -> None:
    for lock in list(_HELD):
        lock.forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)


class SharedLock:
    """One writer's hold on a shared store: the writer lock taken shared, and its own
    file's lock taken exclusively (see the module's docstring)."""

    needs_claim = False
    late_writes = False

    def __init__(self, shared: WriterLock, own: WriterLock) -> None:
        self._shared = shared
        self._own = own
        self.holder = own.holder

    @classmethod
    def acquire(cls, root: Path, writer: str) -> SharedLock:
        path = root / LOCK_FILE
        try:
            fd = _take(path, fcntl.LOCK_SH)
        except _HeldError as held:
            raise single_writer_holds(str(root), held.holder) from None
        shared = WriterLock(path, fd, {})
        try:
            (root / WRITERS_DIR).mkdir(exist_ok=True)
            own_path = root / WRITERS_DIR / writer
            own_fd = _take(own_path, fcntl.LOCK_EX)  # a new file: nobody else holds it
            holder = {**_me(), "writer": writer}
            os.pwrite(own_fd, json.dumps(holder).encode("utf-8"), 0)
        except BaseException:
            shared.release()
            raise
        return cls(shared, WriterLock(own_path, own_fd, holder))

    @property
    def held(self) -> bool:
        return self._own.held

    def check(self) -> None:
        """Nothing to check: the kernel holds an flock until the holder closes it."""

    def release(self) -> None:
        if not self._own.held:
            return
        with contextlib.suppress(FileNotFoundError):
            self._own.path.unlink()
        self._own.release()
        self._shared.release()


def shared_writer_alive(root: Path, writer: str) -> bool:
    """Whether a shared writer of the store at ``root`` holds its lock file; the file of
    one that is gone is removed."""
    path = root / WRITERS_DIR / writer
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return False


def lock_holders(root: Path) -> list[dict[str, Any]]:
    """The writers that hold the store at ``root`` (see ``Location.holders``): its single
    writer, or its shared writers. Linux lists every flock in ``/proc/locks``; elsewhere
    the records of the lock files are reported as they are, unchecked."""
    files = [root / LOCK_FILE, *sorted((root / WRITERS_DIR).glob("*"))]
    held = _flocked_inodes()
    out = []
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            inode = os.fstat(fd).st_ino
            holder = read_json_object(fd)
        finally:
            os.close(fd)
        exclusive = held.get(inode) if held is not None else "WRITE"
        if path.name == LOCK_FILE and exclusive == "WRITE" and holder:
            out.append({**holder, "kind": "single writer"})
        elif path.name != LOCK_FILE and exclusive is not None:
            out.append({**holder, "kind": "shared writer"})
    return out


def _flocked_inodes() -> dict[int, str] | None:
    """Inode -> ``"WRITE"`` (exclusive) or ``"READ"`` (shared) of every file with an flock,
    from ``/proc/locks`` (``None`` where there is none)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    out: dict[int, str] = {}
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a process waiting for the lock, not holding it
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK":
            with contextlib.suppress(ValueError, IndexError):
                inode = int(fields[5].rsplit(":", 1)[1])
                out[inode] = "WRITE" if out.get(inode) == "WRITE" else fields[3]
    return out


def flock(fd: int, operation: int, path: Path) -> None:
    """``flock(2)``, failing with :class:`LocksUnsupportedError` where the filesystem has
    no working locks."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        raise
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        raise LocksUnsupportedError(
            err.errno,
            f"cannot lock {str(path)!r}: the filesystem has no working file locks "
            f"({os.strerror(err.errno)}). A store's writers rely on them: mount it with "
            "locking (NFS: without 'nolock'), or put the store on a local disk or on S3",
        ) from None


def single_writer_holds(where: str, holder: dict[str, Any]) -> MixedWritersError:
    who = f" (pid {holder.get('pid')} on host {holder.get('host')!r})" if holder else ""
    return MixedWritersError(
        f"store {where!r} is open by a single writer{who}, which writes rows wherever its "
        "cursor points; shared writers cannot join it. Close it there and reopen every "
        "writer with shared=True",
        holder=holder,
    )


def mixed_writers(where: str, count: int) -> MixedWritersError:
    return MixedWritersError(
        f"store {where!r} is written by {count} shared writer(s) (opened with shared=True), "
        "which place rows by blocks; a single writer would overwrite their rows. Open this "
        "one with shared=True too, or close the shared writers first",
        holder={"shared_writers": count},
    )


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class _HeldError(Exception):
    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder


def _take(path: Path, operation: int) -> int:
    """Open ``path`` and lock it (``LOCK_EX`` or ``LOCK_SH``) without waiting: the file
    descriptor, or :class:`_HeldError` with what its holder wrote in it."""
    # 0o666 less the umask, as every file of the store: writers of other users (a group
    # sharing the store) open it too.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        flock(fd, operation | fcntl.LOCK_NB, path)
    except BlockingIOError:
        holder = read_json_object(fd)
        os.close(fd)
        raise _HeldError(holder) from None
    except BaseException:
        os.close(fd)
        raise
    return fd
