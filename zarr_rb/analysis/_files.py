"""A local store read as plain files, for ``zarr-rb info``: its root record, JSON documents,
listings, writers and a few small leaves, without TensorStore or torch (each takes a second
or more to import, longer than reading all of this). Rows are read with zarr-python, never
torn, as forked readers read them (:mod:`zarr_rb.engine.forked`).

And what a local path that is not a store holds instead (a folder of stores, a TorchRL
dump, a file), said with what to do.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zarr_rb.analysis._keys import shown
from zarr_rb.engine.forked import FilePieces
from zarr_rb.errors import (
    NoEpisodeFlagsError,
    NotAStoreError,
    StoreCorruptedError,
    StoreNotFoundError,
)
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.format.record import StoreMeta, parse_current_record
from zarr_rb.format.schema import LeafSpec, leaves_by_key
from zarr_rb.util.io import load_json, read_json_object
from zarr_rb.util.keys import Key

ROOT_METADATA = "zarr.json"
# The writer lock files of zarr_rb.locations.lock, which imports TensorStore on the way
# (tests/test_cli_startup.py checks that both report the same writers).
_LOCK_FILE = ".zarr_rb.lock"
_WRITERS_DIR = ".zarr_rb.writers"
_DUMP_FILES = ("buffer_metadata.json", "storage/storage_metadata.json")
"""What TorchRL's ``rb.dumps(dir)`` always writes (and ``zarr-rb import`` needs)."""
_LISTED = 5
"""Stores named when a folder holds several."""
_PARENTS = 6
"""Folders up from a path searched for the store it may be inside."""


class LocalFiles:
    """The local store at ``root``, as ``zarr-rb info`` reads it (see the module)."""

    def __init__(self, root: str | os.PathLike[str], *, command: Callable[[str], str]) -> None:
        """``command(path)``: the command line to suggest for another path, should ``root``
        not be a store."""
        self.root = Path(root)
        self.url = str(root)
        self.meta = read_meta(self.root, command=command)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def sizes(self, prefix: str) -> dict[str, int]:
        """Bytes of each file under ``prefix`` (as ``Location.list``)."""
        found = {}
        for dirpath, _dirs, names in os.walk(self.root / prefix):
            for name in names:
                path = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    found[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return found

    def holders(self) -> list[dict[str, Any]]:
        """The writers holding the store now (as ``zarr_rb.locations.lock.lock_holders``)."""
        files = [self.root / _LOCK_FILE, *sorted((self.root / _WRITERS_DIR).glob("*"))]
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
            if path.name == _LOCK_FILE and exclusive == "WRITE" and holder:
                out.append({**holder, "kind": "single writer"})
            elif path.name != _LOCK_FILE and exclusive is not None:
                out.append({**holder, "kind": "shared writer"})
        return out

    def column(self, key: Key) -> np.ndarray:
        """The committed rows ``[0, length)`` of a small leaf (holes as zeros; bfloat16 as
        float32)."""
        from zarr_rb.engine.forked import ForkedReader

        schema = self.meta.schema
        assert schema is not None
        leaf = leaves_by_key(schema.leaves)[key]
        if leaf.ragged:
            raise NoEpisodeFlagsError(
                f"key {shown(key)} holds rows of different lengths; episodes are marked by "
                "one flag or trajectory id per row"
            )
        commit = self.meta.commit
        valid = commit.readable_mask(commit.length)
        read = ForkedReader(self.root, [leaf]).read(np.flatnonzero(valid))[key]
        out = np.zeros((commit.length, *read.shape[1:]), dtype=read.dtype)
        out[valid] = read
        return _decoded(out, leaf)


def _decoded(values: np.ndarray, leaf: LeafSpec) -> np.ndarray:
    if leaf.dtype == "bfloat16":  # stored as its uint16 bits: the top half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def read_meta(root: Path, *, command: Callable[[str], str]) -> StoreMeta:
    """The root record of the store at ``root``, or an error saying what is there instead
    and what to do (``command(path)``: the command line to suggest for another path)."""

    def read() -> dict[str, Any]:
        document = _root_document(root)
        if not _is_root(document):
            raise not_a_store(root, command=command)
        assert document is not None
        return document

    where = f"store {str(root)!r}"
    return parse_current_record(read(), read, where=where, pieces=FilePieces(root))


def check_store(path: Path, *, command: Callable[[str], str]) -> None:
    """Raise :func:`not_a_store`'s error unless a store's root record is at ``path``."""
    if not _is_root(_root_document(path)):
        raise not_a_store(path, command=command)


def _root_document(path: Path) -> dict[str, Any] | None:
    """The parsed ``zarr.json`` at ``path`` (``None``: there is none, or not an object).

    Raises:
        StoreCorruptedError: it is not valid JSON.
    """
    try:
        raw = (path / ROOT_METADATA).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        document = load_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise StoreCorruptedError(
            f"store {str(path)!r}: root zarr.json is not valid JSON ({type(err).__name__}: "
            f"{str(err)[:200]})"
        ) from None
    return document if isinstance(document, dict) else None


def _is_root(document: dict[str, Any] | None) -> bool:
    """Whether ``document`` is the root record of a store (its arrays carry a ``zarr_rb``
    attribute too)."""
    if document is None or document.get("node_type") != "group":
        return False
    attributes = document.get("attributes")
    return isinstance(attributes, dict) and ATTRS_KEY in attributes


def not_a_store(path: Path, *, command: Callable[[str], str]) -> Exception:
    """The error for a local ``path`` that holds no store: what it holds, what to do."""
    if not path.exists():
        return StoreNotFoundError(f"no zarr_rb store at {str(path)!r}: nothing is there")
    inside = _inside_a_store(path, command=command)
    if inside is not None:
        return inside
    if not path.is_dir():
        return NotAStoreError(
            f"{str(path)!r} is a file, not a zarr_rb store (a store is a directory holding "
            "zarr.json); give the store's directory"
        )
    if (path / ROOT_METADATA).exists():
        return NotAStoreError(
            f"store {str(path)!r} is a Zarr hierarchy but not a zarr_rb store (no "
            f"{ATTRS_KEY!r} attribute on its root group); choose another path",
        )
    if all((path / name).exists() for name in _DUMP_FILES):
        target = shlex.quote(f"{str(path).rstrip('/')}.zarr")
        return NotAStoreError(
            f"{str(path)!r} is a TorchRL dump (written by rb.dumps), not a zarr_rb store: "
            f"import it into a new store first, zarr-rb import {shlex.quote(str(path))} "
            f"{target}, then read that store"
        )
    stores = stores_under(path)
    if stores:
        named = ", ".join(shlex.quote(str(p)) for p in stores[:_LISTED])
        more = f" and {len(stores) - _LISTED} more" if len(stores) > _LISTED else ""
        return NotAStoreError(
            f"{str(path)!r} is a folder of {len(stores)} zarr_rb store(s), not a store: "
            f"{named}{more}. Name one of them, e.g. {command(str(stores[0]))}"
        )
    if not any(path.iterdir()):
        return StoreNotFoundError(f"no zarr_rb store at {str(path)!r}: the directory is empty")
    return NotAStoreError(
        f"{str(path)!r} holds no zarr.json: it is not a zarr_rb store, nor a folder of stores "
        "or a TorchRL dump (a copy interrupted before it finished leaves such a directory "
        "too); give the directory that holds the store's zarr.json"
    )


def _inside_a_store(path: Path, *, command: Callable[[str], str]) -> Exception | None:
    """The error for a ``path`` inside a store (a group, an array, a chunk of it)."""
    for parent in list(path.absolute().parents)[:_PARENTS]:
        if _is_store(parent):
            store = os.path.relpath(parent) if not path.is_absolute() else str(parent)
            part = path.absolute().relative_to(parent).as_posix()
            return NotAStoreError(
                f"{str(path)!r} is {part!r} inside the zarr_rb store {store!r}, not a store; "
                f"name the store: {command(store)}"
            )
    return None


def stores_under(path: Path, *, depth: int = 2) -> list[Path]:
    """The zarr_rb stores in the folders under ``path``, ``depth`` levels down at most
    (a store's own folders are not searched)."""
    found: list[Path] = []
    try:
        children = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return found
    for child in children:
        if _is_store(child):
            found.append(child)
        elif depth > 1:
            found.extend(stores_under(child, depth=depth - 1))
    return found


def _is_store(path: Path) -> bool:
    try:
        return _is_root(_root_document(path))
    except StoreCorruptedError:
        return False


def _flocked_inodes() -> dict[int, str] | None:
    """Inode -> ``"WRITE"`` or ``"READ"`` of every file with an flock, from
    ``/proc/locks`` (``None`` where there is none)."""
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
