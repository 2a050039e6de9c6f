"""Whole-buffer persistence: ``save`` a replay buffer into its store, ``load`` it back.

A save writes the rows still in RAM and the buffer's state (sampler, writer,
generator, transforms) into the store; rows already on disk are never rewritten, so
saving costs the same for a thousand rows as for ten million. ``load`` rebuilds the
same buffer class with the same components from the path alone, without reading a
row.

Examples:
    >>> import zarr_rb
    >>> from torchrl.data import TensorDictPrioritizedReplayBuffer
    >>> rb = TensorDictPrioritizedReplayBuffer(
    ...     alpha=0.7, beta=0.5, storage=zarr_rb.ZarrStorage(10_000, "runs/run1.zarr"))
    >>> zarr_rb.save(rb)                                   # in place
    >>> zarr_rb.save(rb, "runs/snapshot.zarr")             # an independent snapshot
    >>> rb = zarr_rb.load("runs/run1.zarr")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from zarr_rb import _compat
from zarr_rb._transfer import fill_memory, memory_storage, save_foreign
from zarr_rb.core.format import STATE_GROUP, Saved
from zarr_rb.core.open import open_store
from zarr_rb.core.store import Store
from zarr_rb.errors import (
    NoSavedBufferError,
    ReadOnlyError,
    StoreCorruptedError,
    ZarrRBError,
)
from zarr_rb.locations import StoreURL, is_remote, open_location
from zarr_rb.state import load_buffer, save_buffer
from zarr_rb.storage import ZarrStorage

__all__ = ["load", "save"]


def save(
    rb: Any,
    path: StoreURL | None = None,
    *,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Save a replay buffer (data and state) into a Zarr store.

    Args:
        rb: a ``ReplayBuffer``, ``TensorDictReplayBuffer``, ``PrioritizedReplayBuffer`` or
            ``TensorDictPrioritizedReplayBuffer``, on a :class:`ZarrStorage` or on one of
            TorchRL's storages.
        path: where to save: a path or a URL (``s3://bucket/snapshots/100k.zarr``).
            ``None`` or the storage's own path saves in place: the rows held in RAM and
            the state are written, nothing else. Another path receives an independent
            snapshot, which later training on ``rb`` does not change: hard links on one
            filesystem, a server-side copy on one S3 endpoint, a copy elsewhere.
        progress: show a progress bar while a snapshot copies.
        storage_options: for an object-store ``path`` (see :class:`ZarrStorage`); by
            default those of ``rb``'s own store when it is on an object store too.

    Returns:
        The path (local stores) or URL of the saved store.

    Raises:
        UnsupportedDataError: a component has no state adapter (nothing is written).
        ReadOnlyError: the buffer's storage was opened read-only.
    """
    if not isinstance(rb.storage, ZarrStorage):
        if path is None:
            raise ValueError(
                f"zarr_rb.save of a buffer on {type(rb.storage).__name__} needs the path of "
                "the store to create",
            )
        return save_foreign(rb, path, progress=progress, storage_options=storage_options)
    storage = rb.storage
    if storage.read_only:
        raise ReadOnlyError(f"cannot save into read-only store {storage.url!r}")
    saved = Saved(slot=0, length=len(storage), cursor=storage.cursor)
    source = storage._store.engine.location
    if storage_options is None and is_remote(path or "") and is_remote(storage.url):
        storage_options = storage.storage_options
    target = source if path is None else open_location(path, storage_options)
    if target.identity() == source.identity():
        _save_into(rb, storage._store, saved)
        return storage.path
    target.check_usable()
    storage._store.ensure_on_disk()  # a buffer never written: a snapshot of its empty store
    storage.flush()
    storage._store.engine.snapshot_to(target, progress=progress)
    snapshot = open_store(
        target,
        mode="r+",
        max_size=storage.max_size,
        ndim=storage.ndim,
        compression=storage._store.compression,
    )
    try:
        _save_into(rb, snapshot, saved)
    finally:
        snapshot.close()
    return snapshot.path


def save_state(rb: Any, storage: ZarrStorage) -> None:
    """Save ``rb``'s state into its (new) storage's store, at the storage's length."""
    _save_into(rb, storage._store, Saved(slot=0, length=len(storage), cursor=storage.cursor))


def _save_into(rb: Any, store: Store, saved: Saved) -> None:
    previous = store.meta.saved
    # Alternate between two slots: the previous save stays intact until the new root
    # record, which names the new slot, is published.
    slot = 0 if previous is None else 1 - previous.slot
    store.ensure_on_disk()  # a save is a write: it makes a new store
    store.check_hold()  # the slot may be a newer writer's last save
    with store.writing("saving the buffer state"):
        save_buffer(rb, store.engine, f"{STATE_GROUP}/{slot}")
    store.publish_saved(Saved(slot=slot, length=saved.length, cursor=saved.cursor))


def load(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    transform: Any = None,
    collate_fn: Any = None,
    sample_unit: Any = None,
    checkpointer: Any = None,
    device: str = "cpu",
    read_only: bool = False,
    storage: Literal["zarr", "memory"] = "zarr",
    progress: bool = True,
    ram_bytes: int = 0,
) -> Any:
    """Rebuild a replay buffer saved with :func:`save`, without reading any row.

    The buffer comes back as it was at the last save: same class, storage, sampler,
    writer (and their state), every constructor setting (batch size, ``pin_memory``,
    ``prefetch``, ``sync``, sample unit, checkpointer, ...), generator state and transforms.

    In the process that saved it, the buffer may still be open: the loaded one shares its
    store (see :class:`~zarr_rb.ZarrStorage`), at the saved length and cursor.

    Args:
        path: the store: a path or a URL (``s3://bucket/runs/pong.zarr``).
        storage_options: for object stores (see :class:`ZarrStorage`).
        allow_pickle: unpickle the saved transforms and other code (a custom ``collate_fn``,
            sample unit or checkpointer). Unpickling runs code stored in the buffer: only
            pass ``True`` for stores you trust.
        transform: a transform built like the saved one; receives the saved state without
            any unpickling (an alternative to ``allow_pickle``).
        collate_fn, sample_unit, checkpointer: the custom ones the buffer was built with,
            instead of unpickling them.
        device: device of the tensors the storage returns.
        read_only: open the store for reading only: the buffer samples but cannot be
            extended or saved, takes no writer lock and writes nothing, so it can be
            opened while the store's writer is at work. It stays at the save (its length
            and cursor) until ``rb.storage.refresh()``.
        storage: ``"zarr"`` (default) samples from the store; ``"memory"`` copies its rows
            into a ``LazyTensorStorage``.
        progress: show a progress bar while rows are copied into memory.
        ram_bytes: RAM the loaded storage may take to keep a copy of its rows, frames
            included, for sampling at RAM speed (see :class:`ZarrStorage`).

    Raises:
        NoSavedBufferError: the store holds data but no saved buffer.
        zarr_rb.state.PickleNotAllowedError: code needs ``allow_pickle`` or the argument of
            the same name.
    """
    if storage not in ("zarr", "memory"):
        raise ValueError(f"expected storage='zarr' or storage='memory', got {storage!r}")
    if ram_bytes and storage == "memory":
        raise ValueError("ram_bytes is for storage='zarr'; storage='memory' holds every row in RAM")
    code_objects = {
        "collate_fn": collate_fn,
        "sample_unit": sample_unit,
        "checkpointer": checkpointer,
    }
    if storage == "memory":
        return _load_into_memory(
            path,
            storage_options=storage_options,
            allow_pickle=allow_pickle,
            transform=transform,
            code_objects=code_objects,
            device=device,
            progress=progress,
        )
    return _load_on_store(
        path,
        storage_options=storage_options,
        allow_pickle=allow_pickle,
        transform=transform,
        code_objects=code_objects,
        device=device,
        read_only=read_only,
        ram_bytes=ram_bytes,
    )


def _saved_of(storage: ZarrStorage) -> Saved:
    """The store's last save, checked to still hold its rows (see
    :meth:`~zarr_rb.core.store.Store.check_loadable`)."""
    saved = storage._store.meta.saved
    if saved is None:
        storage.close()
        raise NoSavedBufferError(
            f"store {storage.url!r} holds no saved buffer (none was saved there, or the "
            "buffer was emptied since its last save); open the data with "
            "ZarrStorage(path=...), or save a buffer there with zarr_rb.save(rb, path)",
        )
    try:
        storage._store.check_loadable(
            length=saved.length, cursor=saved.cursor, epoch=saved.epoch, exact=False
        )
    except BaseException:
        storage.close()
        raise
    return saved


def _load_into_memory(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None,
    allow_pickle: bool,
    transform: Any,
    code_objects: dict[str, Any],
    device: str,
    progress: bool,
) -> Any:
    stored = ZarrStorage(path=path, read_only=True, storage_options=storage_options)
    try:
        saved = _saved_of(stored)
        memory = memory_storage(stored, device)
        return _built(
            stored,
            saved,
            storage=memory,
            restore_storage=lambda read: fill_memory(
                memory, stored, length=read.length, progress=progress
            ),
            allow_pickle=allow_pickle,
            transform=transform,
            code_objects=code_objects,
        )
    finally:
        stored.close()


def _built(
    stored: ZarrStorage,
    saved: Saved,
    *,
    storage: Any,
    restore_storage: Any,
    allow_pickle: bool,
    transform: Any,
    code_objects: dict[str, Any],
) -> Any:
    """The saved buffer rebuilt around ``storage``; damaged state is a typed error."""

    def refreshed() -> Saved:
        stored.refresh()  # a newer save replaced the one read: its commit, and its record
        return _saved_of(stored)

    try:
        return load_buffer(
            stored._store.engine,
            saved,
            storage=storage,
            restore_storage=restore_storage,
            refresh=refreshed,
            transform=transform,
            code_objects=code_objects,
            allow_pickle=allow_pickle,
        )
    except _INVALID_STATE as err:
        if isinstance(err, ZarrRBError):
            raise
        raise StoreCorruptedError(
            f"store {stored.url!r}: the saved buffer state in {saved.group!r} is "
            f"invalid ({type(err).__name__}: {str(err)[:200]}); open the data with "
            "ZarrStorage(path=...) and save a buffer again",
        ) from None


def _load_on_store(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None,
    allow_pickle: bool,
    transform: Any,
    code_objects: dict[str, Any],
    device: str,
    read_only: bool,
    ram_bytes: int,
) -> Any:
    storage = ZarrStorage(
        path=path,
        mode="r" if read_only else "r+",
        device=device,
        storage_options=storage_options,
        ram_bytes=ram_bytes,
    )
    saved = _saved_of(storage)
    committed_length = len(storage)
    _compat.set_length(storage, 0)
    try:
        return _built(
            storage,
            saved,
            storage=storage,
            restore_storage=lambda read: storage.restore(length=read.length, cursor=read.cursor),
            allow_pickle=allow_pickle,
            transform=transform,
            code_objects=code_objects,
        )
    except BaseException:
        _compat.set_length(storage, committed_length)  # leave the store as it was
        storage.close()
        raise


# What rebuilding TorchRL components from damaged or hostile state raises.
_INVALID_STATE = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    IndexError,
    RuntimeError,
    OverflowError,
    RecursionError,
    AssertionError,
)
