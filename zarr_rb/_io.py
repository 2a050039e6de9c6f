"""The file operations that make a commit durable, and a way to watch them.

Every change the engine makes to a store is announced here before it happens:
``"write"`` (rows, a chunk, a metadata file), ``"remove"`` (a leftover
temporary), ``"fsync"`` (a file or a directory) and ``"publish"`` (the rename
that makes a commit visible). Observers installed with :func:`observe_io` see
them in order, and may raise (an injected ``ENOSPC``) or stop the process (a
simulated crash) at any of them; the reliability tests are built on this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

IOKind = Literal["write", "remove", "fsync", "publish"]
IOObserver = Callable[[IOKind, Path], None]

_observers: list[IOObserver] = []


@contextlib.contextmanager
def observe_io(observer: IOObserver) -> Iterator[None]:
    """Call ``observer(kind, path)`` before every store file operation inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def announce(kind: IOKind, path: Path) -> None:
    for observer in tuple(_observers):
        observer(kind, path)


def fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    announce("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: Path, document: Any, *, publish: bool = False) -> None:
    """Replace ``path`` with a JSON document: a crash leaves the old or the new one.

    Write a temporary file, fsync it, rename it over ``path``, fsync the directory.
    ``publish`` marks the rename as a commit point for observers.
    """
    payload = json.dumps(document, indent=2, sort_keys=True).encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            announce("write", Path(tmp))
            fh.write(payload)
            fh.flush()
            fsync(Path(tmp))
        announce("publish" if publish else "write", path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync(path.parent)


LOCK_FILE = ".zarr_rb.lock"
"""The writer lock (see ``_lock.py``); not part of the store's data, never copied."""

TEMPORARY_SUFFIXES = (".tmp", ".__lock", ".partial")
"""Files of interrupted writes: ours (``.tmp``), TensorStore's (``.__lock``) and
zarr-python's (``.partial``). They are never part of a commit."""


def is_temporary(path: Path) -> bool:
    return path.name.endswith(TEMPORARY_SUFFIXES)


class Durability:
    """Files written since the last commit, made durable together before it is published.

    A file is durable once it has been fsynced and its directory entry has been
    fsynced in its parent, and so on up to the store root for directories created
    since (new chunk directories).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._written: set[Path] = set()
        self._durable_dirs: set[Path] = {root}

    def written(self, paths: Iterable[Path]) -> None:
        self._written.update(paths)

    def sync(self) -> None:
        """fsync every file written since the last call, then the directories they are in."""
        files = sorted(self._written)
        dirs: set[Path] = set()
        new_dirs: set[Path] = set()
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                fsync(path)
            dirs.add(path.parent)
            parent = path.parent
            while parent not in self._durable_dirs and self.root in parent.parents:
                new_dirs.add(parent)
                dirs.add(parent.parent)
                parent = parent.parent
        # Deepest first: a directory's own entries before its entry in its parent.
        for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(FileNotFoundError):
                fsync(directory)
        self._durable_dirs |= new_dirs
        self._written.difference_update(files)


def errno_of(err: BaseException) -> int | None:
    """The OS error number of a failed write (TensorStore reports it in its message)."""
    number = getattr(err, "errno", None)
    if isinstance(number, int):
        return number
    found = re.search(r"OS error (\d+)", str(err))
    return int(found.group(1)) if found else None


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
