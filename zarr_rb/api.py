"""Whole-buffer persistence: ``save`` a replay buffer into its store, ``load`` it back.

A save writes the rows still in RAM and the buffer's state (sampler, writer,
generator, transforms) into the store; rows already on disk are never rewritten, so
saving costs the same for a thousand rows as for ten million. ``load`` rebuilds the
same buffer class with the same components from the path alone, without reading a
row.

Examples:
    >>> import torch, zarr_rb
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictPrioritizedReplayBuffer
    >>> rb = TensorDictPrioritizedReplayBuffer(
    ...     alpha=0.7, beta=0.5, storage=zarr_rb.ZarrStorage(10_000, "runs/run1.zarr"))
    >>> _ = rb.extend(TensorDict({"obs": torch.ones(100, 3)}, [100]))
    >>> zarr_rb.save(rb)                                   # in place: metadata only
    PosixPath('.../runs/run1.zarr')
    >>> zarr_rb.save(rb, "runs/snapshot.zarr")             # an independent snapshot
    PosixPath('.../runs/snapshot.zarr')
    >>> zarr_rb.save(rb, tag="before-finetune")            # a version kept by name
    PosixPath('.../runs/run1.zarr')
    >>> rb.storage.close()
    >>> rb = zarr_rb.load("runs/run1.zarr")                # sampler and priorities too
    >>> len(rb), type(rb.sampler).__name__
    (100, 'PrioritizedSampler')
    >>> [v.tag for v in zarr_rb.versions("runs/run1.zarr")]
    ['before-finetune']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from zarr_rb.core.open import open_store
from zarr_rb.core.store import Store
from zarr_rb.errors import (
    NoSavedBufferError,
    NotSupportedError,
    ReadOnlyError,
    StateChangedError,
    StoreCorruptedError,
    VersionExistsError,
    VersionNotFoundError,
    ZarrRBError,
)
from zarr_rb.format.record import TAG, Saved
from zarr_rb.interop.buffers import fill_memory, memory_storage, save_foreign
from zarr_rb.locations import StoreURL, is_remote, open_location
from zarr_rb.state import LOAD_ATTEMPTS, load_buffer, save_buffer
from zarr_rb.state._buffer import check_buffer_class
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.checkpoint_versions import kept_by_checkpoint
from zarr_rb.torchrl.storage import ZarrStorage

__all__ = ["Version", "drop_version", "load", "save", "versions"]


def save(
    rb: Any,
    path: StoreURL | None = None,
    *,
    tag: str | None = None,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Save a replay buffer (data and state) into a Zarr store.

    A save in place keeps the rows it covered, whatever training writes since:
    ``load`` gives back exactly the saved buffer, rows included, until the next save
    replaces it. A save with a ``tag`` is kept besides, until
    :func:`drop_version`; the rows of every kept save stay on disk (only the blocks
    written over since take room of their own).

    Args:
        rb: a ``ReplayBuffer``, ``TensorDictReplayBuffer``, ``PrioritizedReplayBuffer`` or
            ``TensorDictPrioritizedReplayBuffer``, on a :class:`ZarrStorage` or on one of
            TorchRL's storages.
        path: where to save: a path or a URL (``s3://bucket/snapshots/100k.zarr``).
            ``None`` or the storage's own path saves in place: the rows held in RAM and
            the state are written, nothing else. Another path receives an independent
            snapshot, which later training on ``rb`` does not change: hard links on one
            filesystem, a server-side copy on one S3 endpoint, a copy elsewhere.
        tag: keep this save as a version of that name (letters, digits, ``.``, ``_``,
            ``-``; at most 100), loaded with ``load(path, version=tag)``.
        progress: show a progress bar while a snapshot copies.
        storage_options: for an object-store ``path`` (see :class:`ZarrStorage`); by
            default those of ``rb``'s own store when it is on an object store too.

    Returns:
        The path (local stores) or URL of the saved store.

    Raises:
        UnsupportedDataError: a component has no state adapter (nothing is written).
        ReadOnlyError: the buffer's storage was opened read-only.
        VersionExistsError: the store keeps a version named ``tag`` (nothing is written).
        ValueError: ``tag`` is not a valid name.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import TensorDictReplayBuffer
        >>> rb = TensorDictReplayBuffer(storage=zarr_rb.ZarrStorage(1000, "runs/save.zarr"))
        >>> _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, [10]))
        >>> zarr_rb.save(rb, tag="v1")                  # in place, kept as "v1"
        PosixPath('.../runs/save.zarr')
        >>> _ = rb.extend(TensorDict({"obs": torch.zeros(5, 3)}, [5]))
        >>> zarr_rb.save(rb, "runs/copy.zarr", progress=False)  # an independent snapshot
        PosixPath('.../runs/copy.zarr')
    """
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"expected a version tag (a string), got {tag!r}")
    if tag is not None and TAG.fullmatch(tag) is None:
        raise ValueError(
            f"expected a version tag of letters, digits, '.', '_' and '-' (at most 100, "
            f"starting with a letter or digit), got {tag!r}"
        )
    check_buffer_class(rb)  # a class refused by name says why, whatever its storage
    if not isinstance(rb.storage, ZarrStorage):
        if tag is not None:
            raise NotSupportedError(
                f"zarr_rb.save(..., tag={tag!r}) of a buffer on {type(rb.storage).__name__}: "
                "a new store keeps its first save as its last one; save without a tag, then "
                "load it (zarr_rb.load(path)) and save it with the tag",
            )
        if path is None:
            raise ValueError(
                f"zarr_rb.save of a buffer on {type(rb.storage).__name__} needs the path of "
                "the store to create",
            )
        return save_foreign(
            rb, path, progress=progress, save_state=save_state, storage_options=storage_options
        )
    storage = rb.storage
    if storage.read_only:
        raise ReadOnlyError(f"cannot save into read-only store {storage.url!r}")
    saved = Saved(slot=0, length=len(storage), cursor=storage.cursor)
    source = storage.store.engine.location
    if storage_options is None and is_remote(path or "") and is_remote(storage.url):
        storage_options = storage.storage_options
    target = source if path is None else open_location(path, storage_options)
    if target.identity() == source.identity():
        _save_into(rb, storage.store, saved, tag=tag)
        return storage.path
    target.check_usable()
    storage.store.lifetime.ensure_on_disk()  # a buffer never written: a snapshot of its empty store
    storage.flush()
    storage.store.engine.snapshot_to(target, progress=progress)
    snapshot = open_store(
        target,
        mode="r+",
        max_size=storage.max_size,
        ndim=storage.ndim,
        compression=storage.store.compression,
    )
    try:
        _save_into(rb, snapshot, saved, tag=tag)
    finally:
        snapshot.close()
    return snapshot.path


def save_state(rb: Any, storage: ZarrStorage) -> None:
    """Save ``rb``'s state into its (new) storage's store, at the storage's length."""
    _save_into(rb, storage.store, Saved(slot=0, length=len(storage), cursor=storage.cursor))


def _save_into(rb: Any, store: Store, saved: Saved, *, tag: str | None = None) -> None:
    if tag is not None and tag in store.meta.versions:
        raise VersionExistsError(
            f"store {store.url!r} keeps a version tagged {tag!r} already (save "
            f"{store.meta.versions[tag].slot}); pick another tag, or drop it first with "
            f"zarr_rb.drop_version(path, {tag!r})",
        )
    # A group of its own: the previous save stays intact until the new root record, which
    # names the new group, is published.
    store.lifetime.ensure_on_disk()  # a save is a write: it makes a new store
    saved = dataclasses.replace(saved, slot=store.saves.take_slot())
    store.lifetime.check_hold()  # the group may be a newer writer's save
    with store.writing("saving the buffer state"):
        save_buffer(rb, store.engine, saved.group)
    store.saves.publish(saved, tag=tag)


def load(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    transform: Any = None,
    collate_fn: Any = None,
    sample_unit: Any = None,
    checkpointer: Any = None,
    reward_fn: Any = None,
    device: str = "cpu",
    read_only: bool = False,
    storage: Literal["zarr", "memory"] = "zarr",
    progress: bool = True,
    ram_bytes: int | Literal["auto"] = "auto",
    version: str | int | None = None,
) -> Any:
    """Rebuild a replay buffer saved with :func:`save`, without reading any row.

    The buffer comes back as it was at the last save (or at ``version``): same class,
    storage, sampler, writer (and their state), every constructor setting (batch size,
    ``pin_memory``, ``prefetch``, ``sync``, sample unit, checkpointer, ...), generator
    state, transforms, and the rows the save covered (the store keeps them, whatever was
    written since). Loaded for writing, the buffer goes on from the save: the rows
    committed after it are dropped.

    In the process that saved it, the buffer may still be open: the loaded one shares its
    store (see :class:`~zarr_rb.ZarrStorage`), at the saved length and cursor.

    Args:
        path: the store: a path or a URL (``s3://bucket/runs/pong.zarr``).
        storage_options: for object stores (see :class:`ZarrStorage`).
        allow_pickle: unpickle the saved transforms and other code (a custom ``collate_fn``,
            sample unit or checkpointer, a ``HERReplayBuffer``'s ``reward_fn``). Unpickling
            runs code stored in the buffer: only pass ``True`` for stores you trust.
        transform: a transform built like the saved one; receives the saved state without
            any unpickling (an alternative to ``allow_pickle``).
        collate_fn, sample_unit, checkpointer: the custom ones the buffer was built with,
            instead of unpickling them.
        reward_fn: the reward function a ``HERReplayBuffer`` was built with, instead of
            unpickling it.
        device: device of the tensors the storage returns.
        read_only: open the store for reading only: the buffer samples but cannot be
            extended or saved, takes no writer lock and writes nothing, so it can be
            opened while the store's writer is at work. It stays at the save (its length
            and cursor) until ``rb.storage.refresh()``.
        storage: ``"zarr"`` (default) samples from the store; ``"memory"`` copies its rows
            into a ``LazyTensorStorage``.
        progress: show a progress bar while rows are copied into memory.
        ram_bytes: RAM the loaded storage may take to keep rows in RAM, each frame once,
            for sampling at RAM speed (see :class:`ZarrStorage`): ``"auto"`` (default) holds
            the rows it writes from now on; a number of bytes also reads the loaded rows
            into RAM at the first read; ``0`` keeps only small entries.
        version: a kept save: its tag, or its number (see :func:`versions`); ``None``:
            the last save.

    Raises:
        NoSavedBufferError: the store holds data but no saved buffer.
        VersionNotFoundError: the store keeps no such version.
        zarr_rb.state.PickleNotAllowedError: code needs ``allow_pickle`` or the argument of
            the same name.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import TensorDictReplayBuffer
        >>> rb = TensorDictReplayBuffer(
        ...     storage=zarr_rb.ZarrStorage(1000, "runs/load.zarr"), batch_size=4)
        >>> _ = rb.extend(TensorDict({"obs": torch.arange(10.0)}, [10]))
        >>> _ = zarr_rb.save(rb)
        >>> rb.storage.close()
        >>> rb = zarr_rb.load("runs/load.zarr")               # on the store, no row read
        >>> len(rb), rb.sample().batch_size
        (10, torch.Size([4]))
        >>> rb.storage.close()
        >>> in_ram = zarr_rb.load("runs/load.zarr", storage="memory")  # rows read into RAM
        >>> type(in_ram.storage).__name__
        'LazyTensorStorage'
    """
    if storage not in ("zarr", "memory"):
        raise ValueError(f"expected storage='zarr' or storage='memory', got {storage!r}")
    if ram_bytes not in (0, "auto") and storage == "memory":
        raise ValueError("ram_bytes is for storage='zarr'; storage='memory' holds every row in RAM")
    code_objects = {
        "collate_fn": collate_fn,
        "sample_unit": sample_unit,
        "checkpointer": checkpointer,
        "reward_fn": reward_fn,
    }
    if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
        raise TypeError(f"expected version to be a tag or a save's number, got {version!r}")
    if storage == "memory":
        return _load_into_memory(
            path,
            storage_options=storage_options,
            allow_pickle=allow_pickle,
            transform=transform,
            code_objects=code_objects,
            device=device,
            progress=progress,
            version=version,
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
        version=version,
    )


def _saved_of(storage: ZarrStorage, version: str | int | None = None) -> Saved:
    """The store's last save (or ``version``), checked to still hold its rows (see
    :meth:`~zarr_rb.core.saves.StoreSaves.check_saved`)."""
    try:
        saved = _find_save(storage.store, version)
        storage.store.saves.check_saved(saved)
    except BaseException:
        storage.close()
        raise
    return saved


def _find_save(store: Store, version: str | int | None) -> Saved:
    meta = store.meta
    if version is None:
        if meta.saved is None:
            raise NoSavedBufferError(
                f"store {store.url!r} holds no saved buffer (none was saved there, or the "
                "buffer was emptied since its last save); open the data with "
                "ZarrStorage(path=...), or save a buffer there with zarr_rb.save(rb, path)",
            )
        return meta.saved
    if isinstance(version, str):
        found = meta.versions.get(version)
    else:
        saves = [meta.saved, *meta.versions.values()]
        found = next((s for s in saves if s is not None and s.slot == version), None)
    if found is None:
        kept = ", ".join(_describe(v) for v in _versions_of(store)) or "none"
        raise VersionNotFoundError(
            f"store {store.url!r} keeps no version {version!r} (never saved, dropped, or "
            f"replaced by a later save); it keeps: {kept}. zarr_rb.versions(path) lists them",
        )
    tag = next((t for t, saved in meta.versions.items() if saved is found), None)
    if tag is not None and found is not meta.saved and kept_by_checkpoint(store, tag, found):
        raise NotSupportedError(
            f"store {store.url!r}: version {tag!r} was kept by a TorchRL checkpoint "
            "(torchrl.checkpoint): the store keeps its rows, the checkpoint its sampler, "
            "writer and transforms. Restore it with Checkpoint(buffer=rb).load(<checkpoint "
            "path>), rb being a buffer on a ZarrStorage",
        )
    return found


def _load_into_memory(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None,
    allow_pickle: bool,
    transform: Any,
    code_objects: dict[str, Any],
    device: str,
    progress: bool,
    version: str | int | None,
) -> Any:
    stored = ZarrStorage(path=path, read_only=True, storage_options=storage_options)

    def restore(read: Saved) -> None:
        stored.store.saves.use_save(read)  # the save's rows, whatever was written since
        fill_memory(memory, stored, length=read.length, progress=progress)

    try:
        saved = _saved_of(stored, version)
        memory = memory_storage(stored, device)
        return _built(
            stored,
            saved,
            storage=memory,
            restore_storage=restore,
            version=version,
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
    version: str | int | None = None,
) -> Any:
    """The saved buffer rebuilt around ``storage``; damaged state is a typed error."""

    def refreshed() -> Saved:
        stored.refresh()  # a newer save replaced the one read: its commit, and its record
        return _saved_of(stored, version)

    try:
        return load_buffer(
            stored.store.engine,
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
    ram_bytes: int | Literal["auto"],
    version: str | int | None,
) -> Any:
    storage = ZarrStorage(
        path=path,
        mode="r" if read_only else "r+",
        device=device,
        storage_options=storage_options,
        ram_bytes=ram_bytes,
    )
    committed_length = len(storage)
    try:
        for _ in range(LOAD_ATTEMPTS):
            saved = _saved_of(storage, version)
            compat.set_length(storage, 0)
            attached = compat.attached_count(storage)
            try:
                return _built(
                    storage,
                    saved,
                    storage=storage,
                    restore_storage=lambda read: storage.restore(
                        length=read.length, cursor=read.cursor, save=read
                    ),
                    version=version,
                    allow_pickle=allow_pickle,
                    transform=transform,
                    code_objects=code_objects,
                )
            except VersionNotFoundError:
                # Another writer of a shared store replaced the last save after its state
                # was read, before its rows were put back (they may be collected): the last
                # save is now the newer one, loaded whole again.
                if version is not None:
                    raise
                compat.detach_since(storage, attached)  # the buffer of this attempt
                compat.set_length(storage, committed_length)
                storage.refresh()
        raise StateChangedError(
            f"store {str(storage.path)!r}: the last save was replaced by a newer one each of "
            f"the {LOAD_ATTEMPTS} times it was loaded (writers saving faster than a load). "
            "Load again, or load a tagged version (zarr_rb.save(rb, tag=...))",
        )
    except BaseException:
        compat.set_length(storage, committed_length)  # leave the store as it was
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


@dataclasses.dataclass(frozen=True)
class Version:
    """A save a store keeps (see :func:`versions`)."""

    number: int
    """The save's number (``load(path, version=number)``)."""
    tag: str | None
    """Its tag (``load(path, version=tag)``); ``None``: the last save, untagged."""
    length: int
    cursor: int
    time: float
    """When it was saved (seconds since the epoch; 0 for saves made before it was kept)."""
    last: bool
    """Whether it is the store's last save (what ``load(path)`` loads)."""


def versions(path: StoreURL, *, storage_options: Mapping[str, Any] | None = None) -> list[Version]:
    """The saves a store keeps, oldest first: its last save and its tagged ones.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import ReplayBuffer
        >>> rb = ReplayBuffer(storage=zarr_rb.ZarrStorage(1000, "runs/versions.zarr"))
        >>> _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, [10]))
        >>> _ = zarr_rb.save(rb, tag="warmup")
        >>> _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, [10]))
        >>> _ = zarr_rb.save(rb)
        >>> [(v.tag, v.length) for v in zarr_rb.versions("runs/versions.zarr")]
        [('warmup', 10), (None, 20)]
    """
    store = open_store(
        path, mode="r", max_size=None, ndim=None, compression=None, storage_options=storage_options
    )
    try:
        return _versions_of(store)
    finally:
        store.close()


def drop_version(
    path: StoreURL, tag: str, *, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Stop keeping the version ``tag``: its rows and state are deleted, unless the last
    save is that version too.

    Raises:
        VersionNotFoundError: the store keeps no version of that tag.
        LockedError: another process writes the store.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import ReplayBuffer
        >>> with zarr_rb.ZarrStorage(1000, "runs/drop.zarr") as storage:
        ...     rb = ReplayBuffer(storage=storage)
        ...     _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, [10]))
        ...     _ = zarr_rb.save(rb, tag="old")
        ...     _ = zarr_rb.save(rb)
        >>> zarr_rb.drop_version("runs/drop.zarr", "old")
        >>> [v.tag for v in zarr_rb.versions("runs/drop.zarr")]
        [None]
    """
    store = open_store(
        path, mode="r+", max_size=None, ndim=None, compression=None, storage_options=storage_options
    )
    try:
        if not isinstance(tag, str):
            raise TypeError(f"expected the tag of a version (a string), got {tag!r}")
        if tag not in store.meta.versions:
            _find_save(store, tag)  # raises, listing what is kept
        store.saves.drop_version(tag)
    finally:
        store.close()


def _versions_of(store: Store) -> list[Version]:
    meta = store.meta
    tags = {saved.slot: tag for tag, saved in meta.versions.items()}
    saves = {saved.slot: saved for saved in meta.versions.values()}
    if meta.saved is not None:
        saves[meta.saved.slot] = meta.saved
    last = None if meta.saved is None else meta.saved.slot
    return [
        Version(
            number=slot,
            tag=tags.get(slot),
            length=saved.length,
            cursor=saved.cursor,
            time=saved.time,
            last=slot == last,
        )
        for slot, saved in sorted(saves.items())
    ]


def _describe(version: Version) -> str:
    name = f"{version.number}" + (f" ({version.tag!r})" if version.tag else "")
    return name + (" (the last save)" if version.last else "")
