"""``ZarrStorage``: a drop-in, out-of-core TorchRL storage on sharded Zarr v3 arrays.

This module adapts a :class:`~zarr_rb.core.store.Store` to TorchRL's ``TensorStorage``
contract (constructor keywords, index forms, length and cursor bookkeeping, lazy
initialisation from the first write, writable views). The private TorchRL names it
relies on go through :mod:`zarr_rb._compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import TensorStorage

from zarr_rb import _compat, _convert, _dataloader, _index, _rows, _shared, _torchrl_state
from zarr_rb._checkpointer import ZarrStorageCheckpointer
from zarr_rb._holes import guard_sampler, random_readable_indices
from zarr_rb._lazy import LazyColumn
from zarr_rb._views import Gather, LeafSource, RowsOnlySource
from zarr_rb._writes import guard_writer
from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.format import LeafSpec, Saved, Schema
from zarr_rb.core.layout import Compression
from zarr_rb.core.metadata import capacity_of
from zarr_rb.core.open import Mode, one_path, open_store, resolve_mode
from zarr_rb.core.store import Store
from zarr_rb.errors import (
    LockedError,
    MixedWritersError,
    NotSupportedError,
    ReadOnlyError,
    StoreNotFoundError,
    UnknownKeyError,
)
from zarr_rb.locations import LocalLocation
from zarr_rb.util.fork import refuse_if_forked

__all__ = ["ZarrStorage"]

Key = tuple[str, ...]
_HANDLE = "_zarr_rb_handle"
_ENTRY_KINDS = {
    "ragged": "rows of different lengths",
    "str": "strings",
    "bytes": "bytes",
    "int": "Python ints",
    "float": "Python floats",
    "bool": "Python bools",
    "none": "None values",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def _io_boundary(fn: _F) -> _F:
    """Reads and writes of a store are I/O: ``torch.compile`` runs them as they are (one
    graph break) instead of tracing into them and recompiling whenever the store's state
    moves."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


class ZarrStorage(TensorStorage):  # type: ignore[misc]
    """A TorchRL storage whose data lives in chunked, compressed Zarr v3 arrays.

    A drop-in for :class:`~torchrl.data.LazyMemmapStorage` and
    :class:`~torchrl.data.LazyTensorStorage`: it takes their keywords, the schema is taken
    from the first write, and it works with TorchRL's replay buffers, samplers, writers and
    checkpointers unchanged. Rows are written in place, so the store on disk is at once the
    buffer, its checkpoint and a dataset that other processes can open read-only.

    Rows are gathered in RAM by block (a shard of the large leaves) and written when a block
    is full, on :meth:`flush` and on :meth:`close`; rows still in RAM are visible to this
    storage but not to other processes until they are committed.

    Args:
        max_size: capacity in elements (as for ``LazyMemmapStorage``). May be ``None`` when
            ``path`` holds a store; must match it otherwise.
        path: directory of the store. ``None`` uses a temporary directory removed with the
            storage.

    Keyword Args:
        mode: as in zarr: ``"a"`` (default) reopens the store at ``path`` with its schema,
            length and cursor (no row is read) or creates it; ``"r"`` reads an existing
            store (as ``read_only=True``); ``"r+"`` writes an existing store; ``"w"`` starts
            over, removing what the store held; ``"w-"`` creates a store and fails with
            :class:`~zarr_rb.errors.StoreExistsError` if one exists. A buffer built on a
            reopened store appends after its last row.
        ndim: number of batch dimensions counted by ``max_size`` (1 or 2; 2 for
            ``[time, n_envs]`` layouts). ``None``: the store's own when reopening, 1 for a
            new store.
        device: device of the tensors returned by :meth:`get`; ``"auto"`` takes the device
            of the first data written.
        read_only: open an existing store for reading, next to its writer (any number of
            readers; they take no lock and write nothing). :meth:`refresh` picks up commits
            made by the writer.
        refresh_interval: for read-only storages, refresh automatically when the length is
            asked for (every sample does) and at least this many seconds have passed since
            the last refresh. ``None``: only explicit :meth:`refresh` calls.
        compression: chunking and compression of a new store; see
            :class:`~zarr_rb.Compression`. A reopened store keeps its own (``None``), and a
            different setting is an error.
        scratch_dir: ``LazyMemmapStorage``'s name for ``path``.
        existsok: ``LazyMemmapStorage``'s switch: ``True`` is ``mode="a"``, ``False`` is
            ``mode="w-"``.
        auto_cleanup: delete the store when the storage is closed or garbage-collected, and
            at exit. Default: only for temporary stores (``path=None``).
        compilable: as for TorchRL's storages (bookkeeping in plain Python numbers). The I/O
            of a store cannot be traced by ``torch.compile``, which breaks the graph there.
        shared: write the store as one of several writers, in this process and in others,
            on this machine or others (a shared filesystem, S3): each writer appends by whole
            blocks of rows and publishes every extend before it returns, so every writer's
            ``len`` and samples include it. A storage handed to another process (pickled for
            ``multiprocessing``: collectors, ``mp.Process``) becomes shared by itself. See
            ``docs/many-writers.md``.
        shared_init: as for TorchRL's storages: the first write may come from any process
            (always true of a ZarrStorage).
        ragged: tensor entries to store as rows of different lengths (along their first
            dimension), as ``LazyStackStorage`` holds them: ``True`` for every entry with at
            least one dimension, or their keys. Entries whose rows differ in the write that
            creates them are stored so anyway; a store that holds such entries returns rows
            as lazy stacks of one TensorDict per row.
        ram_bytes: RAM this writer may take to keep a copy of the rows it reached, every
            fixed-shape entry (frames too), next to the store: while they fit, ``get`` and
            ``sample`` gather them in RAM, as from a ``LazyTensorStorage``, and the store stays
            the durable copy; once they no longer fit, large entries are read from the store
            again. Default 0: only small entries (actions, rewards, flags, trajectory ids)
            are kept, up to 256 MiB. Reading processes keep none.
        archive: keep every row extended, from now on, after the ring moves past it (an
            archive: the whole run as an offline dataset, at the cost of disk). The store
            keeps the setting; read the rows with ``zarr_rb.open(path, history=True)`` or
            ``ZarrStorage(path=path, read_only=True, history=True)``.
        history: with ``read_only``, the rows of an archive's history instead of its ring:
            every row extended, in the order committed (``len`` counts them all; they stay
            as opened: open again for rows committed since).
        consolidated, cleanup_memmap: layout hints of TorchRL's in-RAM storage, accepted and
            without effect on a store.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import TensorDictReplayBuffer
        >>> from zarr_rb import ZarrStorage
        >>> rb = TensorDictReplayBuffer(storage=ZarrStorage(1000), batch_size=4)
        >>> _ = rb.extend(TensorDict({"obs": torch.zeros(8, 3)}, batch_size=[8]))
        >>> rb.sample()["obs"].shape
        torch.Size([4, 3])
    """

    _store: Store
    writes_begun: int
    """Writes that passed validation (a refused write leaves the writer as it was)."""
    _default_checkpointer = ZarrStorageCheckpointer
    device: torch.device | Literal["auto"] | None

    def __init__(
        self,
        max_size: int | None = None,
        path: str | os.PathLike[str] | None = None,
        *,
        mode: Mode | None = None,
        ndim: int | None = None,
        device: torch.device | str = "cpu",
        read_only: bool = False,
        compression: Compression | None = None,
        refresh_interval: float | None = None,
        scratch_dir: str | os.PathLike[str] | None = None,
        existsok: bool | None = None,
        auto_cleanup: bool | None = None,
        compilable: bool = False,
        shared_init: bool = False,
        shared: bool = False,
        consolidated: bool = False,
        cleanup_memmap: bool = True,
        ragged: bool | str | Sequence[str | tuple[str, ...]] = False,
        storage_options: Mapping[str, Any] | None = None,
        ram_bytes: int = 0,
        archive: bool = False,
        history: bool = False,
    ) -> None:
        del consolidated, cleanup_memmap  # layout hints of TorchRL's in-RAM storages
        mode = resolve_mode(mode, read_only=read_only, existsok=existsok)
        if shared and mode == "r":
            raise ValueError("shared=True is for writers; readers are never in each other's way")
        if archive and mode == "r":
            raise ValueError(
                "archive=True keeps the rows a writer extends; to read a store's history, pass "
                "read_only=True, history=True"
            )
        if refresh_interval is not None and mode != "r":
            raise ValueError(
                "refresh_interval is for read-only storages (the writer always sees its own "
                "rows); pass read_only=True",
            )
        if refresh_interval is not None and refresh_interval < 0:
            raise ValueError(f"expected refresh_interval >= 0, got {refresh_interval}")
        if ndim is not None and ndim < 1:
            raise ValueError(f"expected ndim >= 1, got {ndim}")
        ram_bytes = _ram_bytes(ram_bytes)
        if max_size is not None and int(max_size) < 1:
            raise ValueError(f"expected max_size >= 1, got {max_size}")
        if device != "auto":
            device = torch.device(device)  # a bad device fails here, before the store opens
        path = one_path(path, scratch_dir)
        tmpdir = None
        if path is None:
            if mode in ("r", "r+"):
                raise ValueError(f"mode={mode!r} needs the path of an existing store")
            tmpdir = tempfile.mkdtemp(prefix="zarr_rb-")
            path = Path(tmpdir) / "buffer.zarr"
        store = open_store(
            path,
            mode=mode,
            max_size=None if max_size is None else int(max_size),
            ndim=ndim,
            compression=compression,
            storage_options=storage_options,
            shared=shared,
            history=history,
        )
        try:
            if archive:
                store.start_archive()
            length = store.length
            self.__dict__["_store"] = store
            super().__init__(
                storage=None,
                max_size=store.meta.max_size,
                device=device,
                ndim=store.meta.ndim,
                compilable=compilable,
            )
            store.set_length(length)
            self.initialized = store.schema is not None
            if self.initialized:
                self.max_size = capacity_of(store.meta)
            if self.initialized and store.committed.length:
                _compat.set_last_cursor(self, (store.cursor - 1) % store.rows)
            self.existsok = existsok
            self.shared_init = shared_init
            store.keep_in_ram(ram_bytes)
            self.__dict__["_ragged"] = _convert.ragged_keys(ragged)
            self.__dict__["_storage_options"] = dict(storage_options or {})
            self.auto_cleanup = tmpdir is not None if auto_cleanup is None else bool(auto_cleanup)
            self.__dict__["_refresh_interval"] = refresh_interval
            self.__dict__["_refreshed_at"] = time.monotonic()
        except BaseException:
            if tmpdir is not None:
                store.remove_when_closed(LocalLocation(tmpdir))
            store.close()
            raise
        if tmpdir is not None:
            store.remove_when_closed(LocalLocation(tmpdir))
        elif self.auto_cleanup:
            store.remove_when_closed(store.engine.location)
        self._attach_store(store)

    @property
    def _ragged(self) -> _convert.Ragged:
        ragged: _convert.Ragged = self.__dict__.get("_ragged", False)
        return ragged

    def _attach_store(self, store: Store) -> None:
        self.__dict__["_store"] = store
        self.__dict__["_thread_state"] = threading.local()
        self.__dict__["writes_begun"] = 0  # writes past validation (see _writes)
        # Storages of this process on one store see one data revision (samplers' caches).
        _compat.share_revision(self, store.shared)
        # Dropped without close(): the garbage collector runs this at any allocation,
        # perhaps inside another storage's write to the same store (see Store.drop_user).
        self._finalizer = weakref.finalize(self, store.drop_user)

    # --- TorchRL bookkeeping, backed by the store ------------------------------------------

    def _pick_up_other_writers(self) -> None:
        """A shared store: the rows other writers published, and the schema if another
        writer made it (one read of the commit record)."""
        store = self.__dict__["_store"]
        store.refresh()
        if not self.initialized and store.schema is not None:
            self.initialized = True
            self.max_size = capacity_of(store.meta)
        # Compared with the record this storage last showed, not the one before the
        # refresh: the store may have taken a newer record meanwhile (a commit, a save, a
        # collection read the record as it was, other writers' rows included).
        generation = store.committed.generation
        if self.__dict__.get("_generation_shown") != generation and store.schema is not None:
            self.__dict__["_generation_shown"] = generation
            # The row written last, by any writer (the record's cursor follows it); the
            # rows changed, for the caches of samplers and gathers too.
            _compat.set_last_cursor(self, (store.cursor - 1) % store.rows)
            _compat.bump_revision(self)

    @property
    def _len(self) -> int:
        store = self.__dict__["_store"]
        interval = self.__dict__.get("_refresh_interval")
        if store.is_shared:
            self._pick_up_other_writers()
        elif interval is not None and time.monotonic() - self._refreshed_at >= interval:
            self.refresh()
        return int(store.length)

    @_len.setter
    def _len(self, value: int) -> None:
        self.__dict__["_store"].set_length(int(value))  # (a shared store's is its record's)

    @property
    def _total_shape(self) -> torch.Size | None:
        schema = self._store.schema
        return None if schema is None else torch.Size(schema.batch_shape)

    @property
    def _storage(self) -> Any:
        """What TorchRL's checkpointers and hooks read and write: :meth:`full_view`."""
        return self.full_view() if "_store" in self.__dict__ else None

    @_storage.setter
    def _storage(self, value: Any) -> None:
        if value is not None:
            raise TypeError("ZarrStorage keeps its data on disk; it cannot adopt a tensor")

    def full_view(self) -> Any:
        """The full capacity as lazy, writable columns (``None`` before the first write);
        unused capacity reads as zeros."""
        schema = self._store.schema
        return None if schema is None else self._lazy_view(schema.rows, unused_as_zeros=True)

    def attach(self, buffer: Any) -> None:
        """Attach a replay buffer: its sampler will skip rows that cannot be read (withdrawn
        by a crash or a repair), and a buffer built on a reopened store appends after its
        last row."""
        super().attach(buffer)
        if not _compat.is_buffer_being_built(buffer):
            return
        guard_sampler(_compat.sampler_to_build(buffer), self)
        writer = _compat.writer_to_build(buffer)
        guard_writer(writer, self)
        if (
            len(self)
            and not self.read_only
            and not _compat.set_writer_position(writer, cursor=self.cursor, write_count=len(self))
        ):
            _compat.rebuild_top_values(writer, self)

    @property
    def _unreadable_as_zeros(self) -> bool:
        return bool(getattr(self._thread_state, "unreadable_as_zeros", False))

    @contextlib.contextmanager
    def _reading_holes_as_zeros(self) -> Iterator[None]:
        """Inside the block, and in this thread only, rows that cannot be read (holes) read as
        zeros from lazy views: for trajectory scans that then leave those rows out."""
        state = self._thread_state
        previous = getattr(state, "unreadable_as_zeros", False)
        state.unreadable_as_zeros = True
        try:
            yield
        finally:
            state.unreadable_as_zeros = previous

    # --- public API ------------------------------------------------------------------------

    @property
    def path(self) -> Path | str:
        """Directory of a local store; the URL (``s3://...``) of any other."""
        return self._store.path

    @property
    def url(self) -> str:
        """Where the store is: its absolute path, or its URL."""
        return self._store.url

    @property
    def storage_options(self) -> dict[str, Any]:
        """The ``storage_options`` the store was opened with."""
        return dict(self.__dict__.get("_storage_options") or {})

    @property
    def _where(self) -> str:
        return f"store {self.url!r}"

    @property
    def scratch_dir(self) -> str:
        """``LazyMemmapStorage``'s name for :attr:`path`."""
        return str(self.path)

    @property
    def cursor(self) -> int:
        """Row the next sequential write goes to: one past the last row written. A buffer
        built on a reopened store starts its writer there."""
        return int(self._store.cursor)

    @property
    def read_only(self) -> bool:
        return self._store.read_only

    @property
    def schema(self) -> Schema | None:
        """Keys, dtypes and shapes of the stored data (``None`` before the first write)."""
        return self._store.schema

    @property
    def compression(self) -> Compression:
        """The store's chunking and compression settings."""
        return self._store.compression

    def flush(self) -> None:
        """Write the rows held in RAM and commit: other processes then see every row."""
        self._store.flush()

    def close(self) -> None:
        """Flush and release the store. The storage cannot be used afterwards.

        A temporary store (``path=None``), or any store with ``auto_cleanup=True``, is
        deleted as it closes.
        """
        if self._finalizer.detach() is not None:
            self._store.close()

    @property
    def closed(self) -> bool:
        return self._store.closed

    def cleanup(self) -> bool:
        """Close the storage and delete its store from disk (as ``LazyMemmapStorage.cleanup``).

        Returns:
            Whether a directory was deleted: ``False`` once it is gone (a second call, or a
            store deleted by someone else).
        """
        if self.read_only:
            raise ReadOnlyError(
                f"store {str(self.path)!r} was opened read-only: a reader does not delete the "
                "store; call cleanup() on its writer, or close() this reader",
            )
        if not self._finalizer.alive:
            return False
        self._finalizer.detach()
        self._store.remove_when_closed(self._store.engine.location)
        return self._store.close()

    def refresh(self) -> None:
        """Pick up the writer's latest commit (read-only storages)."""
        self.__dict__["_refreshed_at"] = time.monotonic()
        self._store.refresh()
        self.initialized = self._store.schema is not None
        if self.initialized:
            self.max_size = capacity_of(self._store.meta)
        _compat.bump_revision(self)

    def nbytes_on_disk(self) -> int:
        """Bytes of all files of the store."""
        return self._store.engine.nbytes()

    def nbytes_raw(self) -> int:
        """Uncompressed bytes of the rows currently held (``len(self)`` elements)."""
        schema = self._store.schema
        if schema is None:
            return 0
        return _compat.length_along_dim0(self) * schema.row_nbytes

    def __enter__(self) -> ZarrStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as a handle: the store's location and the storage's settings, never its
        open files or rows. Unpickled in this process, it shares the open store; in
        another process, it opens the store there, as one more writer (a writer's storage
        sent to a new process makes its store shared first) or as a reader. A
        ``DataLoader`` worker always gets a reader: it only reads."""
        store = self._store
        _dataloader.check_open(self)
        for_worker = _dataloader.pickled_for_a_worker()
        if not store.read_only:
            store.ensure_on_disk()  # another process opens it by its path
        if not store.read_only and not store.is_shared and _shared.spawning() and not for_worker:
            store.become_shared()
        self.flush()
        state = _compat.storage_state(self)
        if for_worker:  # the buffers reading it (samplers, transforms) are not a worker's
            state.pop("_attached_entities_list", None)
        for name in (
            "_store",
            "_finalizer",
            "_thread_state",
            "_last_gather",
            "_generation_shown",
            "writes_begun",
        ):
            state.pop(name, None)
        state[_HANDLE] = {
            "path": self.url,
            "read_only": self.read_only or for_worker,
            "shared": store.is_shared and not for_worker,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        handle = state.pop(_HANDLE)
        _compat.set_storage_state(self, state)
        try:
            store = open_store(
                handle["path"],
                mode="r" if handle["read_only"] else "r+",
                max_size=self.max_size,
                ndim=self.ndim,
                compression=None,
                storage_options=self.storage_options or None,
                shared=handle.get("shared", False),
            )
        except StoreNotFoundError:
            raise StoreNotFoundError(
                f"the store this ZarrStorage was pickled from, at {handle['path']!r}, is "
                "gone (deleted since, or a temporary store removed when the storage that "
                "made it closed): keep the storage that made it open while others use it, "
                "and give it a path that outlives it (ZarrStorage(max_size, path))",
            ) from None
        except MixedWritersError:
            raise
        except LockedError as err:
            raise LockedError(
                f"{err}. A ZarrStorage unpickled in another process joins its store as one "
                "more writer: create it with shared=True (or hand it to the other process "
                "through multiprocessing, which makes it shared), or share a read-only "
                "storage (ZarrStorage(path=..., read_only=True))",
                holder=err.holder,
            ) from None
        self._attach_store(store)

    def __repr__(self) -> str:
        schema = self._store.schema
        keys = (
            [] if schema is None else [".".join(leaf.key) or "<tensor>" for leaf in schema.leaves]
        )
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, len={len(self)}, "
            f"max_size={self.max_size}, ndim={self.ndim}, keys={keys}, "
            f"read_only={self.read_only})"
        )

    # --- writes ----------------------------------------------------------------------------

    @_io_boundary
    def _init(self, data: Any) -> None:
        """Create the store's arrays from one element (TorchRL's checkpointers call this)."""
        self._initialize(data, batched=False)

    def _initialize(self, data: Any, *, batched: bool) -> None:
        self._create(self._schema_for(data, batched=batched))

    def _schema_for(self, data: Any, *, batched: bool) -> Schema:
        """The schema a first write of ``data`` gives the store."""
        if self.device == "auto":  # as LazyTensorStorage: the data's (None for a TensorDict
            self.device = _convert.device_of(data)  # without a device)
        return _convert.infer_schema(
            data, batched=batched, ndim=self.ndim, max_size=self.max_size, ragged=self._ragged
        )

    def _create(self, schema: Schema, *, samples: dict[Key, torch.Tensor] | None = None) -> None:
        """Create the store's arrays (the first write; ``samples``: the leaves it writes)."""
        self._store.initialize(schema, samples=samples)
        self.initialized = True
        # As TorchRL's storages: max_size rounded up to whole rows (ndim > 1).
        self.max_size = capacity_of(self._store.meta)

    @_io_boundary
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        store = self._store
        store.check_writable()
        if isinstance(data, list):
            data = _convert.flip_list(data)
        if store.is_shared and set_cursor and not isinstance(cursor, tuple):
            _shared.append(self, cursor, data)
            _compat.bump_revision(self)
            return
        # Validate everything before touching the length or the cursor: a rejected
        # write leaves the storage as it was (and its writer, see _writes.guard_writer).
        rows, leaves = self._rows_to_write(cursor, data)
        self.__dict__["writes_begun"] += 1
        schema = store.schema
        assert schema is not None
        next_cursor = None
        if set_cursor:
            _compat.set_last_cursor(self, cursor)
            _compat.grow_length(self, data, cursor)
            last_row = _compat.last_cursor_index(self)
            if last_row is not None:
                next_cursor = (last_row + 1) % schema.rows
        try:
            store.write(rows, leaves, cursor=next_cursor)
        finally:
            # Also when it failed: its rows are kept (a flush writes them again), and a
            # read made before it must not be served again.
            _compat.bump_revision(self)

    def _rows_to_write(self, cursor: Any, data: Any) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """The sorted unique rows ``cursor`` writes, and the leaves ``data`` puts there."""
        store = self._store
        where = self._where
        first: Schema | None = None
        if not self.initialized:
            first = self._schema_for(data, batched=not _compat.is_int(cursor))
            if isinstance(cursor, tuple):
                self._create(first)
        schema = store.schema or first
        assert schema is not None
        if isinstance(cursor, tuple):
            return self._patch_elements(cursor, data, schema)
        index, index_shape = _index.write_rows(cursor, schema.rows, where=where)
        all_leaves, new = _convert.leaves_for_write(
            data, schema=schema, index_shape=index_shape, where=where, ragged=self._ragged
        )
        if first is not None:  # the rows passed: the store's arrays are made only now
            self._create(first, samples=all_leaves)
        if new:
            store.add_leaves(new, samples=all_leaves)
        rows, last = _index.unique_last(index)
        if rows.size == index.size and (rows == index).all():
            return rows, all_leaves  # already sorted and unique: no gather, no copy
        position = torch.from_numpy(last)
        return rows, {key: value[position] for key, value in all_leaves.items()}

    def _patch_elements(
        self, cursor: tuple[Any, ...], data: Any, schema: Schema
    ) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """Rows touched by a multi-dimensional index, read and patched with ``data``."""
        where = self._where
        head, rest = cursor[0], cursor[1:]
        rows, position = _index.read_rows(head, schema.rows, where=where)
        kind = _convert.kind_of(data)
        lead = 0 if kind in ("tensor", "pytree") else data.ndim - len(schema.item_batch_shape)
        new = _convert.new_leaves(data, schema=schema, lead=lead, where=where, ragged=self._ragged)
        block = self._read(rows, schema, unused_as_zeros=True)
        if new and not (
            isinstance(block, TensorDictBase) and all(leaf.value == "tensor" for leaf in new)
        ):
            self._store.add_leaves(new)  # (rare: such keys are made before the check)
            assert self._store.schema is not None
            schema = self._store.schema
            block = self._read(rows, schema, unused_as_zeros=True)
            new = []
        grown = schema.with_leaves(new)
        for leaf in new:  # new keys: zeros in the rows read, as once they are made
            shape = (rows.size, *schema.batch_shape[1:], *leaf.shape)
            block.set(leaf.key, torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype]))
        _convert.assign(block, (position, *rest), data)
        leaves, _ = _convert.leaves_for_write(
            block, schema=grown, index_shape=(rows.size,), where=where
        )
        if new:  # the patch passed: only now are its new keys made
            self._store.add_leaves(new)
        return rows, leaves

    @_io_boundary
    def write_leaves(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Write ``values[key][i]`` into row ``rows[i]`` of some leaves, together (any order;
        the last of repeated rows wins): what writes into the lazy columns of ``storage[:]``
        and ``rb.update_if_present`` do.

        As with TorchRL's storages, whose views alias their memory, such writes leave the
        storage's mutation revision to the buffer method that made them (``rb.set_``,
        ``rb.update_``...), which moves it once.
        """
        self._store.check_writable()
        where = self._where
        schema = self._store.schema
        kinds = {} if schema is None else {leaf.key: leaf.value for leaf in schema.leaves}
        for key in values:
            if key not in kinds:
                held = ", ".join(repr(k if len(k) > 1 else k[0]) for k in kinds) or "no key"
                raise UnknownKeyError(
                    f"{where}: no entry {key if len(key) > 1 else key[0]!r} to patch (it "
                    f"holds {held}); a patch of some keys (rb.update_if_present, a write into "
                    "storage[:]) changes entries the rows have, as TorchRL's storages do: "
                    "extend with rows that have the new entry to add it",
                )
            if kinds[key] != "tensor":
                what = _ENTRY_KINDS.get(kinds[key], f"{kinds[key]} values")
                raise NotSupportedError(
                    f"{where}: entry {key!r} holds {what}, which a patch of some keys "
                    "(rb.update_if_present, a write into storage[:]) cannot change; write "
                    "whole rows (rb.extend, storage[index] = rows) instead",
                )
        rows = _index.check_rows(
            rows.astype(np.int64), self._store.rows, where=where, what="write index"
        )
        unique, last = _index.unique_last(rows)
        if unique.size != rows.size or (unique != rows).any():
            picked = torch.from_numpy(last)
            values = {key: value[picked] for key, value in values.items()}
        self._store.write(unique, {key: value.detach().to("cpu") for key, value in values.items()})
        # The revision stays (see above), but a gather kept from before must not be served.
        self.__dict__.pop("_last_gather", None)

    @_io_boundary
    def _empty(self) -> None:
        self._store.empty()
        _compat.bump_revision(self)

    @_io_boundary
    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
        """Patch some keys of some elements (``rb.update_if_present``): those keys only are
        written, after TorchRL validated the whole patch."""
        if index.ndim > 1:
            self.set(tuple(index.unbind(-1)), _convert.as_patch(patch, index), set_cursor=False)
            return
        self.write_leaves(
            index.cpu().numpy(),
            {_convert.key_tuple(key): value for key, value in patch.items()},
        )

    # --- reads -----------------------------------------------------------------------------

    @property
    def _build_device(self) -> torch.device | None:
        """The device of returned TensorDicts as they are built (CPU data is built there)."""
        return torch.device("cpu") if self.device == torch.device("cpu") else None

    def _read(self, rows: np.ndarray, schema: Schema, *, unused_as_zeros: bool = False) -> Any:
        keys = [leaf.key for leaf in schema.leaves]
        leaves = self._store.read(rows, keys, unwritten_as_zeros=unused_as_zeros)
        batch_shape = (rows.size, *schema.batch_shape[1:])
        return _convert.build(
            leaves, schema=schema, batch_shape=batch_shape, device=self._build_device
        )

    @_io_boundary
    def get(self, index: Any) -> Any:
        refuse_if_forked(self._where)  # TensorStore would abort the process
        if not self.initialized and self._store.is_shared:
            self._pick_up_other_writers()
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        schema = self._store.schema
        assert schema is not None
        length = _compat.length_along_dim0(self)
        if _index.is_key(index):
            # storage.get("done") or storage.get(("next", "done")): that column, lazily.
            key = _convert.key_tuple(index)
            if any(leaf.key == key and leaf.value != "tensor" for leaf in schema.leaves):
                return self._entry(key)
            return _convert.select(self.get(slice(None)), index)
        head, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if isinstance(index, tuple) and not index:
            head = slice(None)
        if isinstance(head, slice) and head.indices(length) == (0, length, 1):
            # Every row: a lazy, writable view (further indices narrow it, lazily too).
            out = self._lazy_view(length)
            if rest:
                out = _convert.select(out, (slice(None), *rest))
        elif not rest and not isinstance(head, slice) and not _compat.is_int(head):
            if self._store.is_shared and isinstance(head, torch.Tensor):
                out = _shared.gather_redrawing(
                    self,
                    head,
                    lambda i: self._gather(
                        _index.as_index_tensor(i), schema, _compat.length_along_dim0(self)
                    ),
                    self._rand_given_ndim,
                )
            else:
                out = self._gather(_index.as_index_tensor(head), schema, length)
        else:
            rows, position = _index.read_rows(head, length, where=self._where)
            block = self._read(rows, schema)
            whole = isinstance(position, slice) and not rest
            out = block if whole else _convert.select(block, (position, *rest))
        device = self.device
        if self._build_device is None and isinstance(device, torch.device):
            out = _convert.to_device(out, device)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """``[self[i] for i in indices]`` in one read of the store: how a PyTorch
        ``DataLoader`` fetches a batch (``DataLoader(rb.storage, batch_size=256,
        num_workers=2, collate_fn=torch.stack)``; see :mod:`zarr_rb._dataloader`)."""
        return _dataloader.items(self, indices)

    def _gather(self, index: torch.Tensor, schema: Schema, length: int) -> Any:
        """Rows at a row index (a sampler's output), in the order asked, repeats included.

        Samplers such as SliceSampler read ``storage[index]`` for a few flags, then the
        buffer reads the very same rows: the last gather is kept and a copy of it is
        handed out when the same index comes again, with no write in between and its
        tensors untouched.
        """
        last = self.__dict__.get("_last_gather")
        revision = _compat.revision(self)
        if last is not None and last.matches(index, revision):
            return _convert.clone(last.result)
        rows = _index.check_rows(index.reshape(-1).numpy(), length, where=self._where)
        leaves = self._store.read(rows, (leaf.key for leaf in schema.leaves))
        out = _convert.build(
            {key: v.reshape(*index.shape, *v.shape[1:]) for key, v in leaves.items()},
            schema=schema,
            batch_shape=(*index.shape, *schema.batch_shape[1:]),
            device=self._build_device,
        )
        if any(leaf.value != "tensor" for leaf in schema.leaves):
            # Python values (which a caller may replace unseen) or one TensorDict per row
            # (too many tensors to watch for changes cheaply): such reads are not cached.
            self.__dict__.pop("_last_gather", None)
        else:
            self.__dict__["_last_gather"] = Gather(index.clone(), revision, out)
        return out

    def _lazy_view(self, length: int, *, unused_as_zeros: bool = False) -> Any:
        """Every leaf as a writable :class:`LazyColumn` over rows ``[0, length)``; entries no
        tensor column holds (strings, rows of different lengths) as columns that say, when
        read, how to read them."""
        schema = self._store.schema
        assert schema is not None
        columns, leaves = self.lazy_columns(length, unused_as_zeros=unused_as_zeros)
        return _convert.build(
            columns,
            schema=dataclasses.replace(schema, leaves=tuple(leaves)),
            batch_shape=(length, *schema.batch_shape[1:]),
            device=self._build_device,
        )

    def lazy_columns(
        self, length: int, *, unused_as_zeros: bool = False
    ) -> tuple[dict[Key, LazyColumn], list[LeafSpec]]:
        """Every leaf as a :class:`LazyColumn` over rows ``[0, length)``, and the leaves the
        columns stand for (an entry no tensor column holds stands as ``uint8``)."""
        schema = self._store.schema
        assert schema is not None
        columns: dict[Key, LazyColumn] = {}
        leaves = []
        for leaf in schema.leaves:
            if leaf.value == "lengths":
                continue
            if leaf.value == "tensor":
                source: Any = LeafSource(self, leaf.key, length, unused_as_zeros=unused_as_zeros)
                columns[leaf.key] = LazyColumn(
                    (length, *self._store.element_shape(leaf)),
                    TORCH_DTYPES[leaf.dtype],
                    source=source,
                )
                leaves.append(leaf)
                continue
            what = _ENTRY_KINDS.get(leaf.value, f"{leaf.value} values")
            source = RowsOnlySource(self, leaf.key, length, what, values=leaf.value != "ragged")
            shape = (length, *schema.batch_shape[1:])
            columns[leaf.key] = LazyColumn(shape, torch.uint8, source=source)
            leaves.append(LeafSpec(key=leaf.key, dtype="uint8", shape=()))
        return columns, leaves

    def _entry(self, key: Key) -> Any:
        """``storage.get(key)`` of an entry no tensor column holds: every row of it, as a
        list of tensors (rows of different lengths), or the values as ``LazyTensorStorage``
        returns them."""
        rows = _compat.length_along_dim0(self)
        items = self.entry_values(key, np.arange(rows))
        if self._store.leaf(key).value == "ragged":
            return items
        schema = self._store.schema
        assert schema is not None
        shape = (rows, *schema.batch_shape[1:])
        stack = NonTensorStack.from_list(items) if items else NonTensorStack(batch_size=shape)
        # As TensorStorage.get(key) returns them: what a TensorDict's [key] gives.
        return TensorDict({key: stack}, batch_size=shape)[key]

    @_io_boundary
    def entry_values(self, key: Key, rows: np.ndarray) -> list[Any]:
        """The rows of an entry no tensor column holds: its Python values (a list of them
        per row with ``ndim=2``), or its tensors of different lengths."""
        leaf = self._store.leaf(key)
        read = self._store.read(rows, [leaf.key, *([leaf.lengths_key] if leaf.ragged else [])])
        items = _rows.decode(leaf, read[leaf.key], read.get(leaf.lengths_key))
        schema = self._store.schema
        assert schema is not None
        return _convert.nest(items, (rows.size, *schema.batch_shape[1:]))

    @_io_boundary
    def _rand_given_ndim(self, batch_size: int) -> Any:
        """Random element indices (RandomSampler), drawn among the rows that can be read:
        rows withdrawn by a crash or by ``verify --repair`` are never drawn."""
        if not self._store.unreadable_rows().size:
            index = super()._rand_given_ndim(batch_size)
        else:
            index = random_readable_indices(self, batch_size)
        if self._store.is_shared:
            self._thread_state.draw = index  # drawn again if evicted before it is read
        return index

    # --- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's storage state: the rows (lazily: read only when copied), ``initialized``
        and ``_len``, plus where they live, so that another storage of any type (TorchRL's
        or a ZarrStorage) loads them, and this store reloads them without a copy."""
        return _torchrl_state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state of any TorchRL tensor storage, or of a ZarrStorage (no copy when it
        names this very store)."""
        _torchrl_state.load_state_dict(self, state_dict)

    def restore(self, *, length: int, cursor: int, save: Saved | None = None) -> None:
        """Set length and cursor (e.g. to those of a save) and commit them; with ``save``
        (one that kept its rows), the rows are the save's too."""
        if save is not None:
            self._store.use_save(save)
        self._len = length
        self._store.move_cursor(cursor)
        if self.initialized and length:
            _compat.set_last_cursor(self, (cursor - 1) % self._store.rows)
        self._store.flush()
        _compat.bump_revision(self)

    def copy_rows_from(self, source: Any, *, rows: int, progress: bool = False) -> None:
        """Copy rows ``[0, rows)`` of ``source`` (anything sliceable by rows: a storage,
        a memory-mapped TensorDict) into this storage, in blocks of about 64 MiB."""
        _torchrl_state.copy_rows(source, self, rows=rows, progress=progress)


def _ram_bytes(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"expected ram_bytes to be a number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"expected ram_bytes >= 0, got {value}")
    return int(value)
