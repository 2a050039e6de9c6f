"""Opening a store in one of zarr's modes: what must exist, what is created, what is reused.

``"r"``: read only, the store must exist. ``"r+"``: write, the store must exist.
``"a"``: write, created when missing. ``"w"``: write, starting over (an existing
store's rows and saved state are removed). ``"w-"``: create, failing if a store
exists. Writers take the store's lock for as long as the store is open.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from zarr_rb.core.history import as_history
from zarr_rb.core.metadata import check_is_store, check_meta, parse_meta, parse_record, read_root
from zarr_rb.core.sharing import Sharing, new_writer_id
from zarr_rb.core.store import Store
from zarr_rb.engine import Engine
from zarr_rb.engine.layout import Compression
from zarr_rb.errors import (
    LockedError,
    NotAStoreError,
    SchemaMismatchError,
    StoreExistsError,
    StoreNotFoundError,
)
from zarr_rb.format.commit import Commit, Ring
from zarr_rb.format.names import ATTRS_KEY, DATA_GROUP, LENGTHS_GROUP, STATE_GROUP
from zarr_rb.format.record import StoreMeta
from zarr_rb.locations import LocalLocation, StoreURL, is_remote, open_location
from zarr_rb.locations.base import NOT_DATA, ROOT_METADATA, Location, WriterHold

Mode = Literal["r", "r+", "a", "w", "w-"]
MODES: tuple[Mode, ...] = ("r", "r+", "a", "w", "w-")

_WRITERS: dict[tuple[str, ...], Store] = {}
"""The stores this process has open for writing. A store has one writer per process:
storages opened on a store already open here share it (its rows, its RAM buffer, its
lock), which is how pickling a buffer within a process, reopening a path in a notebook
or ``zarr_rb.load`` right after ``zarr_rb.save`` work."""


def one_path(
    path: str | os.PathLike[str] | None, scratch_dir: str | os.PathLike[str] | None
) -> str | os.PathLike[str] | None:
    """``path``, also accepted under LazyMemmapStorage's name ``scratch_dir``."""
    if path is not None and scratch_dir is not None and not _same(path, scratch_dir):
        raise ValueError(
            f"got path={str(path)!r} and scratch_dir={str(scratch_dir)!r}; scratch_dir is "
            "another name for path: pass one of them",
        )
    return path if path is not None else scratch_dir


def _same(a: StoreURL, b: StoreURL) -> bool:
    if is_remote(a) or is_remote(b):
        return a == b
    return Path(a) == Path(b)


def resolve_mode(mode: Mode | None, *, read_only: bool, existsok: bool | None) -> Mode:
    """One mode from ``mode``, ``read_only`` and LazyMemmapStorage's ``existsok`` (``True``
    is ``"a"``, ``False`` is ``"w-"``); ``"a"`` when none is given."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"expected mode among {MODES}, got {mode!r}")
    implied: list[Mode] = []
    if read_only:
        implied.append("r")
    if existsok is not None:
        implied.append("a" if existsok else "w-")
    if mode is not None:
        implied.append(mode)
    if len(set(implied)) > 1:
        raise ValueError(
            f"read_only={read_only}, existsok={existsok} and mode={mode!r} ask for different "
            "modes; pass only one of them",
        )
    return implied[0] if implied else "a"


def open_store(
    path: StoreURL | Location,
    *,
    mode: Mode,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
    storage_options: Mapping[str, Any] | None = None,
    shared: bool = False,
    history: bool = False,
) -> Store:
    """Open the store at ``path`` (a local path or a URL) in ``mode`` (see the module's
    docstring).

    ``max_size`` and ``ndim`` must match an existing store's (``None``: take its own);
    ``compression`` too (``None``: the store's own settings). ``shared``: write it as one
    of several writers (see :mod:`zarr_rb.core.sharing`). ``history``: read an archive's
    every row extended, in order (read-only; see :func:`zarr_rb.core.history.as_history`).
    """
    if history and mode != "r":
        raise ValueError(
            "history=True reads a store's history, which is read-only: pass read_only=True"
        )
    if shared and mode == "w":
        raise ValueError(
            "mode='w' removes what a store holds, rows of other writers included; shared "
            "writers open a store with mode='a' (created if missing) or 'r+'"
        )
    location = open_location(path, storage_options)
    location.check_usable()
    engine = Engine(location)
    where = f"store {location.url!r}"
    key = location.identity()
    open_here = _WRITERS.get(key)
    if open_here is not None and mode != "r" and not (shared and open_here.is_shared):
        # One writer per process, unless shared: a shared store takes any number of
        # writers, in this process as in others.
        if shared:
            open_here.become_shared()
        return _share(open_here, mode, max_size=max_size, ndim=ndim, compression=compression)
    document = read_root(engine)
    if document is not None:
        check_is_store(document, where)
    elif location.exists():
        what = (
            "is a non-empty directory without a zarr_rb store"
            if isinstance(location, LocalLocation)
            else "holds objects but no zarr_rb store"
        )
        raise NotAStoreError(
            f"{where} {what} (a snapshot interrupted before it was published leaves that "
            "too); choose a new or empty directory, or delete it",
        )
    if mode == "r":
        if document is None:
            raise StoreNotFoundError(f"no zarr_rb store at {location.url!r}")
        meta = parse_meta(
            document, where, max_size=None if history else max_size, ndim=ndim, engine=engine
        )
        compression = _compression_of(meta, compression, where)
        if history:
            meta = as_history(meta, where)
        return Store(engine, meta, read_only=True, compression=compression, history=history)
    if document is None:
        if mode == "r+":
            raise StoreNotFoundError(
                f"no zarr_rb store at {location.url!r} (mode='r+' opens an existing store; "
                "mode='a' creates a missing one)"
            )
        if max_size is None:
            raise StoreNotFoundError(
                f"no zarr_rb store at {location.url!r}; to create one there, give its "
                "capacity (ZarrStorage(max_size, path))",
            )
    elif mode == "w-":
        raise _exists_error(where)
    if document is None and not shared:
        location.check_creatable()
        store = _new_store(engine, max_size=max_size, ndim=ndim, compression=compression)
    elif shared:
        location.create_root()
        store = _open_shared(engine, max_size=max_size, ndim=ndim, compression=compression)
    else:
        store = _open_single(engine, mode, max_size=max_size, ndim=ndim, compression=compression)
    if key not in _WRITERS:
        _WRITERS[key] = store
        store.lifetime.on_close(functools.partial(_forget, store))
    return store


def _new_store(
    engine: Engine,
    *,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
) -> Store:
    """A new store, made on disk at its first write (see :meth:`Lifetime.ensure_on_disk`)."""
    assert max_size is not None
    compression = compression or Compression()
    meta = _empty(max_size, ndim, compression, Commit())
    store = Store(
        engine,
        meta,
        read_only=False,
        compression=compression,
        create=lambda: _make_place(store),
    )
    return store


def _make_place(store: Store) -> WriterHold:
    """The directory of a new store and its writer lock, at its first write; nothing may
    have been made there since the store was opened."""
    engine = store.engine
    location = engine.location
    location.create_root()
    lock = location.acquire_writer()
    try:
        if read_root(engine, adopt=True) is not None:
            # This process's storages on the path must see that store, not this one.
            _forget(store)
            raise StoreExistsError(
                f"store {location.url!r} was made by another writer after this storage was "
                "opened and before its first write: nothing was written. Close this storage "
                "(storage.close()) and open the store again to add to it "
                "(ZarrStorage(path=...)), or choose another path",
            )
        if location.exists():
            raise NotAStoreError(
                f"store {location.url!r}: files that are not a zarr_rb store were put there "
                "after this storage was opened and before its first write; nothing was "
                "written. Choose a new or empty directory",
            )
        if lock.needs_claim:
            engine.claim(lock.holder)
    except BaseException:
        lock.release()
        raise
    return lock


def _open_single(
    engine: Engine,
    mode: Mode,
    *,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
) -> Store:
    """Open (or create) the store as its one writer."""
    lock = engine.location.acquire_writer()
    try:
        store = _open_locked(
            engine, lock, mode, max_size=max_size, ndim=ndim, compression=compression
        )
    except BaseException:
        lock.release()
        raise
    return store


def _open_shared(
    engine: Engine,
    *,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
) -> Store:
    """Open (or create) the store as one of its shared writers: no cleanup (other writers'
    writes are under way), the record created by compare-and-swap if missing."""
    where = f"store {engine.url!r}"
    writer = new_writer_id()
    hold = engine.location.join_writers(writer)
    try:
        document = read_root(engine, adopt=True)
        if document is None:
            assert max_size is not None
            meta = _empty(max_size, ndim, compression or Compression(), Commit(ring=Ring()))
            # Create-only: of writers creating it at once, one record wins; all join it.
            engine.try_write_root_attributes({ATTRS_KEY: meta.to_json()})
            engine.create_group(DATA_GROUP)
            document = read_root(engine, adopt=True)
            assert document is not None
        check_is_store(document, where)
        meta = parse_meta(document, where, max_size=max_size, ndim=ndim, engine=engine, adopt=True)
        if meta.commit.ring is not None:
            # Its arrays may still be being created by the writer that set its schema:
            # the schema is taken (and missing arrays created) as the store is joined.
            meta = dataclasses.replace(meta, schema=None, block_rows=None)
        recorded = _compression_of(meta, compression, where)
        store = Store(engine, meta, read_only=False, compression=recorded, lock=hold)
        Sharing.start(store, writer)
    except BaseException:
        hold.release()
        raise
    return store


def _forget(store: Store) -> None:
    key = store.engine.location.identity()
    if _WRITERS.get(key) is store:
        del _WRITERS[key]


def _share(
    store: Store,
    mode: Mode,
    *,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
) -> Store:
    """The store this process already has open for writing, for one more storage."""
    where = f"store {store.url!r}"
    if mode in ("w", "w-"):
        if mode == "w-":
            raise _exists_error(where)
        raise LockedError(
            f"{where} is open for writing by another ZarrStorage of this process; mode='w' "
            "would remove rows under it: close that storage first (storage.close(), or "
            "rb.storage.close())",
            holder={"pid": os.getpid(), "this_process": True},
        )
    if store.is_shared:
        store.refresh()  # what other writers published since: the new user starts there
    meta = dataclasses.replace(store.meta, commit=store.committed)
    check_meta(meta, where, max_size=max_size, ndim=ndim)
    _compression_of(meta, compression, where)
    store.lifetime.acquire()
    return store


def _open_locked(
    engine: Engine,
    lock: WriterHold,
    mode: Mode,
    *,
    max_size: int | None,
    ndim: int | None,
    compression: Compression | None,
) -> Store:
    """Open (or create) the store once its writer lock is held."""
    where = f"store {engine.url!r}"
    # Now that no other writer can, re-read (another one may have committed or
    # created the store meanwhile) and clear what interrupted writes left behind.
    document = read_root(engine, adopt=True)
    generation = 0
    if document is not None:
        check_is_store(document, where)
        if mode == "w-":
            raise _exists_error(where)
        if mode != "w":
            meta = parse_meta(
                document, where, max_size=max_size, ndim=ndim, engine=engine, adopt=True
            )
            if meta.schema is None and compression is not None:
                # Nothing was written with the recorded settings yet: take the new ones.
                meta = dataclasses.replace(meta, compression=compression.to_json())
            engine.remove_temporaries()
            if lock.needs_claim:
                engine.claim(lock.holder)
            store = Store(
                engine,
                meta,
                read_only=False,
                compression=_compression_of(meta, compression, where),
                lock=lock,
            )
            ring = meta.commit.ring
            if meta.commit.runs is not None or (ring is not None and not ring.legacy):
                # Written by shared writers (or made shared before its first write): its
                # rows stay where the runs put them, and this writer commits as they do
                # (alone, under its own lock).
                Sharing.start(store, new_writer_id())
            return store
        old = parse_record(document, where, engine=engine, adopt=True)
        max_size = old.max_size if max_size is None else max_size
        ndim = old.ndim if ndim is None else ndim
        generation = old.commit.generation + 1
        if lock.late_writes:
            # The writer it replaces may have stalled with writes under way: its slots of
            # the old arrays are the same keys in the new ones (unless it closed cleanly).
            store = _create(engine, lock, max_size, ndim or 1, compression, generation, document)
            lease = old.commit.lease
            store.write_past(lease.floor if lease and not lease.held else _slots_of(old))
            return store
    assert max_size is not None
    return _create(engine, lock, max_size, ndim or 1, compression, generation, document)


def _slots_of(meta: StoreMeta) -> int:
    """The slots a store's arrays have, as its record names them."""
    commit = meta.commit
    if commit.slots is not None:
        return commit.slots.capacity
    if commit.ring is not None and commit.ring.capacity:
        return commit.ring.capacity
    if meta.schema is None:
        return 0
    return -(-meta.schema.rows // (meta.block_rows or 1))


def _create(
    engine: Engine,
    lock: WriterHold,
    max_size: int,
    ndim: int,
    compression: Compression | None,
    generation: int,
    previous: object,
) -> Store:
    """A new, empty store (``previous``: the root record of the store it replaces)."""
    compression = compression or Compression()
    meta = _empty(max_size, ndim, compression, Commit(generation=generation))
    if lock.needs_claim:
        engine.claim(lock.holder)  # (its records name it, as any writer's on a lease)
    store = Store(engine, meta, read_only=False, compression=compression, lock=lock)
    if lock.late_writes:
        store.write_past(0)  # made by this writer: no other writes into it
    # The root record first: once it exists, the directory is a store (an empty one when
    # starting over), and a crash before or after it leaves something that reopens. Only
    # then are the old rows and state removed.
    store.publish_meta()
    with store.writing("creating the data group"):
        if previous is not None:
            # A fresh store holds its root record and no group: the old rows, the lengths
            # of its ragged rows, its saved state and whatever else it held all go (the
            # writers' lock files stay).
            for group in (DATA_GROUP, LENGTHS_GROUP, STATE_GROUP):
                engine.remove_tree(group)
            left = engine.location.list()
            for name in sorted({key.partition("/")[0] for key in left}):
                if name == ROOT_METADATA or name in NOT_DATA:
                    continue
                if name in left:  # an object, not a group
                    engine.location.delete(name)
                engine.remove_tree(name)
        engine.create_group(DATA_GROUP)
    return store


def _empty(max_size: int, ndim: int | None, compression: Compression, commit: Commit) -> StoreMeta:
    """The record of a store that holds nothing yet."""
    return StoreMeta(
        max_size=max_size,
        ndim=ndim or 1,
        schema=None,
        commit=commit,
        compression=compression.to_json(),
        store_id=secrets.token_hex(8),
    )


def _exists_error(where: str) -> StoreExistsError:
    return StoreExistsError(
        f"{where} already exists and mode='w-' (or existsok=False) refuses to reuse it; pass "
        "mode='a' to append to it, mode='w' to start over, or choose a new path",
    )


def _compression_of(meta: StoreMeta, given: Compression | None, where: str) -> Compression:
    """The store's own compression settings; ``given`` must match them once rows were written
    with them."""
    recorded = Compression.recorded(meta.compression, meta.schema)
    if recorded is None:
        return given or Compression()
    if given is not None and not recorded.matches(given):
        raise SchemaMismatchError(
            f"{where} was created with {recorded!r}, got compression={given!r}; a store keeps "
            "the compression it was created with: pass compression=None to reopen it, or "
            "mode='w' to start over with new settings",
        )
    if recorded.frames is None and given is not None:
        return given  # (an empty store: its first write decides with these)
    return recorded
