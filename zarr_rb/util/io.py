"""Watching a store's I/O, and small helpers for it (fsync, the error number and the short
message of a TensorStore error, bounded JSON parsing).

Every change the engine makes to a store is announced here before it happens:
``"write"`` (rows, a chunk, a metadata file), ``"remove"`` (a leftover
temporary), ``"fsync"`` (a file or a directory) and ``"publish"`` (the rename
that makes a commit visible); ``"behind"`` and ``"landed"`` (per file) bracket the
write of a block that runs while the next rows come, which no commit made meanwhile
depends on. Observers installed with :func:`observe_io` see
them in order, and may raise (an injected ``ENOSPC``) or stop the process (a
simulated crash) at any of them; the reliability tests are built on this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import Any, Literal

IOKind = Literal["write", "remove", "fsync", "publish", "behind", "landed"]
IOObserver = Callable[[IOKind, PurePath], None]

_observers: list[IOObserver] = []


@contextlib.contextmanager
def observe_io(observer: IOObserver) -> Iterator[None]:
    """Call ``observer(kind, path)`` before every store file operation inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def announce(kind: IOKind, path: PurePath) -> None:
    for observer in tuple(_observers):
        observer(kind, path)


def fsync(path: Path, *, announced: bool = True) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable).
    ``announced=False``: not told to observers (a sync off the writer's thread, ahead of
    the announced one that a commit makes: its instant follows no order a test can
    replay)."""
    if announced:
        announce("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def errno_of(err: BaseException) -> int | None:
    """The OS error number of a failed write (TensorStore reports it in its message:
    ``[os_error_code='28']`` in recent releases, ``OS error 28`` in older ones)."""
    number = getattr(err, "errno", None)
    if isinstance(number, int):
        return number
    found = _OS_ERROR_CODE.search(str(err))
    return int(found.group(1) or found.group(2)) if found else None


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'|OS error (\d+)")


def short_reason(err: BaseException) -> str:
    """TensorStore's error message without the source locations it appends."""
    return str(err).split(" [source locations=")[0]


MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:\\.|[^"\\])*"')


def load_json(raw: bytes) -> Any:
    """Parse a metadata file, refusing nesting deeper than :data:`MAX_JSON_DEPTH` before
    any recursive parser sees it (metadata of a store is never deep).

    Raises:
        ValueError: invalid JSON (``UnicodeDecodeError`` included) or too deep.
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        import numpy as np

        skeleton = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
        steps = (skeleton == ord("[")).astype(np.int32) + (skeleton == ord("{"))
        steps -= (skeleton == ord("]")).astype(np.int32) + (skeleton == ord("}"))
        if steps.size and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(raw.decode("utf-8"))


def json_object(raw: bytes | None) -> dict[str, Any]:
    """The JSON object in ``raw`` (a writer's lock or lease record), or ``{}``: nothing,
    not valid JSON, nested too deep, or not an object."""
    try:
        value = load_json(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def read_json_object(fd: int, size: int = 4096) -> dict[str, Any]:
    """:func:`json_object` of the first ``size`` bytes of the open file ``fd`` (``{}``:
    it cannot be read)."""
    try:
        raw = os.pread(fd, size, 0)
    except OSError:
        return {}
    return json_object(raw)
