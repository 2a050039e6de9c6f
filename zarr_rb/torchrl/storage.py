"""``ZarrStorage``: a drop-in, out-of-core TorchRL storage on sharded Zarr v3 arrays.

This module adapts a :class:`~zarr_rb.core.store.Store` to TorchRL's ``TensorStorage``
contract: constructor keywords, attaching to a buffer, state dicts and pickling. Its
bookkeeping (:mod:`~zarr_rb.torchrl.store_backed`), writes (:mod:`~zarr_rb.torchrl.writes`)
and reads (:mod:`~zarr_rb.torchrl.reads`) are the classes it derives from. The private
TorchRL names it relies on go through :mod:`zarr_rb.torchrl.compat`.
"""

from __future__ import annotations

import numbers
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from zarr_rb.core.metadata import capacity_of
from zarr_rb.core.open import Mode, one_path, open_store, resolve_mode
from zarr_rb.core.ram_budget import auto_ram_bytes
from zarr_rb.engine.layout import Compression
from zarr_rb.errors import LockedError, MixedWritersError, StoreNotFoundError
from zarr_rb.locations import LocalLocation
from zarr_rb.torchrl import compat, dataloader, sharing
from zarr_rb.torchrl.checkpointer import ZarrStorageCheckpointer
from zarr_rb.torchrl.guards import guard_sampler, guard_writer
from zarr_rb.torchrl.leaves import ragged_keys
from zarr_rb.torchrl.reads import StorageReads
from zarr_rb.torchrl.state_dict import load_state, state_of

__all__ = ["ZarrStorage"]

_HANDLE = "_zarr_rb_handle"


class ZarrStorage(StorageReads):
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
        ram_bytes: RAM this writer may take to keep the rows it writes, next to the store
            (which stays the durable copy): ``get`` and ``sample`` gather those rows in RAM
            and never decode them. Frames are kept once each (a stack of 4 frames and its
            next observation share 7 of their 8 frames with the rows around them, found by
            exact comparison, so every row comes back bit for bit); past the budget the
            oldest rows are read from the store again. ``"auto"`` (default): a quarter of
            the memory available when the storage opens (a memory cgroup's room too), at
            most 16 GiB; it fills as this writer writes, and from the first read on a
            thread of the store reads the rows already in the store into it (newest
            first, a few hundred at a time, between the buffer's own calls). A number of
            bytes: that budget, and rows already in the store are read into RAM within
            the first read. ``0``:
            only small entries (actions, rewards, flags, trajectory ids) are kept, up to
            256 MiB. Reading processes keep none.
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

    _default_checkpointer = ZarrStorageCheckpointer

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
        ram_bytes: int | Literal["auto"] = "auto",
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
        fill_ram = ram_bytes != "auto"  # asked for: the rows in the store are read too
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
            store.commits.set_length(length)
            self.initialized = store.schema is not None
            if self.initialized:
                self.max_size = capacity_of(store.meta)
            if self.initialized and store.committed.length:
                compat.set_last_cursor(self, (store.cursor - 1) % store.rows)
            self.existsok = existsok
            self.shared_init = shared_init
            store.ram.keep_in_ram(
                ram_bytes, fill=fill_ram and ram_bytes > 0, behind=not fill_ram and ram_bytes > 0
            )
            self.__dict__["_ragged"] = ragged_keys(ragged)
            self.__dict__["_storage_options"] = dict(storage_options or {})
            self.auto_cleanup = tmpdir is not None if auto_cleanup is None else bool(auto_cleanup)
            self.__dict__["_refresh_interval"] = refresh_interval
            self.__dict__["_refreshed_at"] = time.monotonic()
        except BaseException:
            if tmpdir is not None:
                store.lifetime.remove_when_closed(LocalLocation(tmpdir))
            store.close()
            raise
        if tmpdir is not None:
            store.lifetime.remove_when_closed(LocalLocation(tmpdir))
        elif self.auto_cleanup:
            store.lifetime.remove_when_closed(store.engine.location)
        self._attach_store(store)

    def attach(self, buffer: Any) -> None:
        """Attach a replay buffer: its sampler will skip rows that cannot be read (withdrawn
        by a crash or a repair), and a buffer built on a reopened store appends after its
        last row."""
        super().attach(buffer)
        if not compat.is_buffer_being_built(buffer):
            return
        guard_sampler(compat.sampler_to_build(buffer), self)
        writer = compat.writer_to_build(buffer)
        guard_writer(writer, self)
        if (
            len(self)
            and not self.read_only
            and not compat.set_writer_position(writer, cursor=self.cursor, write_count=len(self))
        ):
            compat.rebuild_top_values(writer, self)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as a handle: the store's location and the storage's settings, never its
        open files or rows. Unpickled in this process, it shares the open store; in
        another process, it opens the store there, as one more writer (a writer's storage
        sent to a new process makes its store shared first) or as a reader. A
        ``DataLoader`` worker always gets a reader: it only reads."""
        store = self._store
        dataloader.check_open(self)
        for_worker = dataloader.pickled_for_a_worker()
        if not store.read_only:
            store.lifetime.ensure_on_disk()  # another process opens it by its path
        if not store.read_only and not store.is_shared and sharing.spawning() and not for_worker:
            store.become_shared()
        self.flush()
        state = compat.storage_state(self)
        if for_worker:  # the buffers reading it (samplers, transforms) are not a worker's
            state.pop("_attached_entities_list", None)
        for name in (
            "_store",
            "_finalizer",
            "_thread_state",
            "_gathers",
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
        compat.set_storage_state(self, state)
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

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's storage state: the rows (lazily: read only when copied), ``initialized``
        and ``_len``, plus where they live, so that another storage of any type (TorchRL's
        or a ZarrStorage) loads them, and this store reloads them without a copy."""
        return state_of(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state of any TorchRL tensor storage, or of a ZarrStorage (no copy when it
        names this very store)."""
        load_state(self, state_dict)


def _ram_bytes(value: object) -> int:
    if value == "auto":
        return auto_ram_bytes()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'expected ram_bytes to be a number of bytes or "auto", got {value!r}')
    if value < 0:
        raise ValueError(f"expected ram_bytes >= 0, got {value}")
    return int(value)
