"""Fault injection: an error raised at a chosen file operation of a store's engine."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path, PurePath

from zarr_rb.locations.base import LEASE_KEY
from zarr_rb.util.io import IOKind

ALL_KINDS: tuple[IOKind, ...] = ("write", "remove", "fsync", "publish")


class FaultInjector:
    """An I/O observer that fails or kills the process at the ``at``-th operation.

    Args:
        at: 1-based number of the operation (counting only ``kinds``) to break; ``None``
            only counts.
        kinds: the operations counted.
        error: the ``errno`` of the injected ``OSError`` (``ENOSPC``, ``EIO``, ...).
        persistent: fail every operation from the ``at``-th on (a disk that stays full),
            rather than only that one.
        kill: SIGKILL the process instead of raising (a crash at that exact point).
        under: count only the operations on files below this directory (one store), not
            those of other stores of the process (one closed by the garbage collector
            meanwhile would move the count).

    Renewals of an S3 writer's lease are not counted: a clock times them, so counting them
    would make the operations of one workload differ from run to run.
    """

    def __init__(
        self,
        *,
        at: int | None = None,
        kinds: tuple[IOKind, ...] = ("write", "publish"),
        error: int = errno.ENOSPC,
        persistent: bool = False,
        kill: bool = False,
        under: Path | None = None,
    ) -> None:
        self.at = at
        self.under = None if under is None else Path(under).absolute()
        self.kinds = kinds
        self.error = error
        self.persistent = persistent
        self.kill = kill
        self.count = 0
        self.fired = 0
        self.events: list[tuple[IOKind, PurePath]] = []

    def __call__(self, kind: IOKind, path: PurePath) -> None:
        if kind not in self.kinds or PurePath(path).name == LEASE_KEY:
            return
        if self.under is not None and not Path(path).absolute().is_relative_to(self.under):
            return
        self.count += 1
        self.events.append((kind, path))
        if self.at is None or self.count < self.at:
            return
        if self.count > self.at and not self.persistent:
            return
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        self.fired += 1
        raise OSError(
            self.error, f"{os.strerror(self.error)} (injected at {kind} #{self.count})", str(path)
        )
