"""A store in a directory of a local (or network-mounted) filesystem.

Atomicity: an object is replaced by writing a temporary file, fsyncing it and renaming
it over the old one (then fsyncing the directory). Objects written by TensorStore are
made durable together by :meth:`LocalLocation.sync`, just before a commit. The writer
hold is ``flock(2)`` (see :mod:`zarr_rb.locations.lock`). A compare-and-swap compares and
renames inside a short ``flock`` critical section on ``.zarr_rb.cas.lock``.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tensorstore as ts

from zarr_rb.errors import NotAStoreError, ReadOnlyFilesystemError
from zarr_rb.locations.base import (
    CAS_LOCK_FILE,
    NOT_DATA,
    ROOT_METADATA,
    Generation,
    Location,
    ProgressCallback,
    Versioned,
    WriterHold,
    is_temporary,
)
from zarr_rb.locations.lock import SharedLock, WriterLock, lock_holders, shared_writer_alive
from zarr_rb.util.fork import starting_tensorstore
from zarr_rb.util.io import announce, fsync

ABSENT: Generation = b"absent"


class LocalLocation(Location):
    """A store on a local (or network-mounted) filesystem, rooted at a directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.durability = Durability(self.root)
        starting_tensorstore(f"store {str(self.root)!r}")
        self._context = ts.Context(
            {
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
                "file_io_concurrency": {"limit": 32},
                # Written files are fsynced once per commit (Durability.sync), together,
                # rather than one by one as TensorStore writes them.
                "file_io_sync": False,
            }
        )

    def __repr__(self) -> str:
        return f"LocalLocation({str(self.root)!r})"

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def context(self) -> ts.Context:
        return self._context

    def identity(self) -> tuple[str, ...]:
        return ("file", str(self.root.resolve()))

    def path_of(self, key: str) -> Path:
        return self.root / key

    def kvstore(self, key: str) -> dict[str, Any]:
        return {"driver": "file", "path": str(self.root / key)}

    def child(self, key: str) -> LocalLocation:
        return LocalLocation(self.root / key)

    # --- objects ---------------------------------------------------------------------------

    def read_versioned(self, key: str) -> Versioned:
        try:
            with open(self.root / key, "rb") as fh:
                stat = os.fstat(fh.fileno())
                value = fh.read()
        except (FileNotFoundError, NotADirectoryError):
            return Versioned(None, ABSENT)
        # Every write renames a new file into place, but a freed inode number is soon
        # reused and mtimes are coarse: the content's digest tells two writes apart (the
        # commit record, the one object compared under contention, differs in every write).
        digest = hashlib.blake2b(value, digest_size=8).hexdigest()
        return Versioned(value, f"{stat.st_ino}:{stat.st_mtime_ns}:{digest}".encode())

    def write(self, key: str, value: bytes) -> Generation:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, value, publish=key == ROOT_METADATA)
        self.durability.written([path])
        return self.read_versioned(key).generation

    def write_if(
        self, key: str, value: bytes | None, *, generation: Generation
    ) -> Generation | None:
        with self._exclusive():
            if self.read_versioned(key).generation != generation:
                return None
            if value is None:
                self.delete(key)
                return ABSENT
            return self.write(key, value)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """A critical section among every process (and thread) working on this store."""
        fd = os.open(self.root / CAS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def delete(self, key: str) -> None:
        path = self.root / key
        announce("remove", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def delete_prefix(self, prefix: str) -> None:
        target = self.root / prefix
        if target.exists():
            announce("remove", target)
            shutil.rmtree(target)
            self.durability.removed(target)

    def has(self, key: str) -> bool:
        # (Not Path.is_file, which newer Pythons answer False on any error: an I/O error
        # taken for "no object" would let a write take cells that rows still name.)
        try:
            return stat.S_ISREG(os.stat(self.root / key).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.root / prefix
        if not base.is_dir():
            return {}
        found = {}
        for path in walk_files(base):
            with contextlib.suppress(FileNotFoundError):
                found[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return found

    def copy_to(
        self,
        target: Location,
        keys: Iterable[str],
        *,
        progress: ProgressCallback | None = None,
    ) -> int:
        """Into another directory: hard links on the same filesystem (safe because nothing
        ever writes into an existing file of a store: TensorStore, zarr-python and the
        commit all rename a new file over the old one), copies elsewhere."""
        if not isinstance(target, LocalLocation):
            return super().copy_to(target, keys, progress=progress)
        target.create_root()
        same_device = os.stat(self.root).st_dev == os.stat(target.root).st_dev
        copied = 0
        keys = list(keys)
        # The root record last, once every other file is durable: a crash leaves no store
        # at the target, or a whole one.
        for batch in (
            [k for k in keys if k != ROOT_METADATA],
            [k for k in keys if k == ROOT_METADATA],
        ):
            destinations = []
            for key in batch:
                source, destination = self.root / key, target.root / key
                destination.parent.mkdir(parents=True, exist_ok=True)
                size = source.stat().st_size
                try:
                    if not same_device:
                        raise OSError("another filesystem")
                    os.link(source, destination)
                except OSError:
                    shutil.copy2(source, destination)
                    copied += size
                destinations.append(destination)
                if progress is not None:
                    progress(size)
            target.durability.written(destinations)
            target.sync()
        return copied

    # --- the store as a whole --------------------------------------------------------------

    def check_usable(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise NotAStoreError(
                f"store {str(self.root)!r} is a file, not a zarr_rb store; pass a directory "
                "path (e.g. 'runs/buffer.zarr')",
            )

    def exists(self) -> bool:
        return self.root.is_dir() and any(
            p.name not in NOT_DATA and not is_temporary(p.name) for p in self.root.iterdir()
        )

    def check_creatable(self) -> None:
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        if not existing.is_dir():
            raise NotAStoreError(
                f"store {str(self.root)!r} cannot be made: {str(existing)!r} is a file, not a "
                "directory; choose a path under a directory",
            )
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            with self._writable():
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))

    def create_root(self) -> None:
        """Create the store's directory, durably (its entry in its parent included)."""
        missing = [p for p in (self.root, *self.root.parents) if not p.exists()]
        with self._writable():
            self.root.mkdir(parents=True, exist_ok=True)
        for directory in [self.root, *(p.parent for p in missing)]:
            fsync(directory)

    def acquire_writer(self) -> WriterHold:
        with self._writable():
            return WriterLock.acquire(self.root, shared_writers=self.live_writers)

    def join_writers(self, writer: str) -> WriterHold:
        with self._writable():
            return SharedLock.acquire(self.root, writer)

    @contextlib.contextmanager
    def _writable(self) -> Iterator[None]:
        """Where a writer first writes (the store's directory, its lock file), a read-only
        filesystem is a :class:`ReadOnlyFilesystemError`, before anything is written."""
        try:
            yield
        except OSError as err:
            if err.errno != errno.EROFS:
                raise
            raise ReadOnlyFilesystemError(
                errno.EROFS,
                f"store {str(self.root)!r} is on a read-only filesystem: it cannot be "
                "written there. Open it with read_only=True to read it, or choose a path on "
                "a writable filesystem",
            ) from None

    def writer_alive(self, writer: str) -> bool:
        return shared_writer_alive(self.root, writer)

    def holders(self) -> builtins.list[dict[str, Any]]:
        return lock_holders(self.root)

    def remove_leftovers(self) -> builtins.list[str]:
        removed = []
        for path in walk_files(self.root):
            if is_temporary(path.name):
                announce("remove", path)
                path.unlink(missing_ok=True)
                removed.append(path.relative_to(self.root).as_posix())
        return removed

    # --- durability ------------------------------------------------------------------------

    def written(self, keys: Iterable[str], *, synced: bool = False) -> None:
        self.durability.written((self.root / key for key in keys), synced=synced)

    def sync(self) -> None:
        self.durability.sync()

    def sync_objects(self, keys: Iterable[str]) -> None:
        # (Ahead of the commit's own sync, which announces it: see fsync.)
        _fsync_together([self.root / key for key in keys], announced=False)


def write_atomically(path: Path, payload: bytes, *, publish: bool = False) -> None:
    """Replace ``path``: a crash leaves the old or the new bytes.

    Write a temporary file, fsync it, rename it over ``path``, fsync the directory.
    ``publish`` marks the rename as a commit point for observers.
    """
    fd, tmp = _new_temporary(path)
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


def _new_temporary(path: Path) -> tuple[int, str]:
    """A new file next to ``path``, open for writing, with a name no other writer picks.

    Its mode is what the umask leaves of 0o666, as for the chunks TensorStore writes
    (``mkstemp`` would make it 0o600: once renamed into place, a commit record or group
    metadata that other users of a shared filesystem could not read).
    """
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def walk_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            yield Path(dirpath) / name


class Durability:
    """Files written since the last commit, made durable together before it is published.

    A file is durable once it has been fsynced and its directory entry has been
    fsynced in its parent, and so on up to the store root for directories created
    since (new chunk directories).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._written: set[Path] = set()
        self._synced: set[Path] = set()
        """Files written and fsynced since (off the writer's thread, see
        :meth:`LocalLocation.sync_objects`): only their directories wait for the next sync."""
        self._durable_dirs: set[Path] = {root}

    def written(self, paths: Iterable[Path], *, synced: bool = False) -> None:
        (self._synced if synced else self._written).update(paths)

    def removed(self, tree: Path) -> None:
        """``tree`` was deleted: directories created there again must be fsynced again."""
        self._durable_dirs = {
            d for d in self._durable_dirs if d == self.root or not d.is_relative_to(tree)
        }
        self._written = {p for p in self._written if not p.is_relative_to(tree)}
        self._synced = {p for p in self._synced if not p.is_relative_to(tree)}

    def sync(self) -> None:
        """fsync every file written since the last call, then the directories they are in.

        The files' write-back starts for all of them at once (see
        :func:`_fsync_together`). Files fsynced since they were written are not fsynced
        again (a clean file's fsync still flushes the disk's cache: 74 of them took 3-5
        ms here), only announced, as this sync makes them durable."""
        files = sorted(self._written)
        landed = set(self._synced)
        synced = sorted(landed - self._written)
        dirs: set[Path] = set()
        new_dirs: set[Path] = set()
        for path in synced:
            announce("fsync", path)
        for path in [*files, *synced]:
            dirs.add(path.parent)
            parent = path.parent
            while parent not in self._durable_dirs and self.root in parent.parents:
                new_dirs.add(parent)
                dirs.add(parent.parent)
                parent = parent.parent
        _fsync_together(files)
        ordered = sorted(dirs, key=lambda p: len(p.parts), reverse=True)  # (deepest first)
        found = _fsync_together(ordered)
        missing = {path for path, seen in zip(ordered, found, strict=True) if not seen}
        # (A directory not made yet, by a write still running, is synced once it is.)
        self._durable_dirs |= new_dirs - missing
        self._written.difference_update(files)
        self._synced.difference_update(landed)


def _fsync_together(paths: list[Path], *, announced: bool = True) -> list[bool]:
    """fsync ``paths`` (each announced first, in order, unless not ``announced``: see
    :func:`~zarr_rb.util.io.fsync`); whether each was found (a file or
    directory removed meanwhile is skipped). The write-back of every file is started first
    (:func:`_start_writeback`), so that the disk takes them as one queue and each fsync
    then waits for little (77 files of 750 kB on ext4: 32 ms, against 43 ms for the fsyncs
    alone, ``python benchmarks/sync.py``; as fast as fsyncs on 8 threads, with no thread
    to start, to stop at exit, or to lose in a forked child)."""
    if announced:
        for path in paths:
            announce("fsync", path)
    if len(paths) > 1:
        for path in paths:
            _start_writeback(path)
    found = []
    for path in paths:
        try:
            fsync(path, announced=False)
        except FileNotFoundError:
            found.append(False)
        else:
            found.append(True)
    return found


def _load_sync_file_range() -> Any:
    """Linux's ``sync_file_range`` from the C library, or ``None`` where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
"""Start the write-back of the dirty pages of a range, and return (``linux/fs.h``)."""


def _start_writeback(path: Path) -> None:
    """Start writing a regular file's dirty pages to disk, without waiting (a hint: the fsync
    that follows is what makes them durable, and reports errors)."""
    if _SYNC_FILE_RANGE is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
