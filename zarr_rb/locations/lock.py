"""One writer per store: an advisory lock on a file inside the store.

The lock is ``flock(2)`` on ``<store>/.zarr_rb.lock``: the kernel releases it
when the holder exits or dies (even by SIGKILL), so a crashed writer never
leaves a store locked. The holder writes who it is (host, pid, since when) into
the file so that the next writer can say who holds it. Readers never touch it.
On NFS, Linux maps ``flock`` onto NFS byte-range locks.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from zarr_rb.errors import LockedError
from zarr_rb.locations.base import LOCK_FILE


class WriterLock:
    """The writer lock of one store, held from :meth:`acquire` until :meth:`release`."""

    needs_claim = False

    def __init__(self, path: Path, fd: int, holder: dict[str, Any]) -> None:
        self.path = path
        self.holder = holder
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: Path) -> WriterLock:
        """Take the lock or raise :class:`LockedError` at once (never waits)."""
        path = root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (
                f"pid {holder.get('pid')} on host {holder.get('host')!r} since "
                f"{holder.get('since')}"
                if holder
                else "another process"
            )
            raise LockedError(
                f"store {str(root)!r} is open for writing by {who}; one writer per store: "
                "close it there first, or open this one read-only (read_only=True)",
                holder=holder,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode("utf-8"), 0)
        return cls(path, fd, holder)

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


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        value = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
