"""Buffers between TorchRL's own storages and stores.

:func:`save_foreign` writes a buffer built on ``LazyTensorStorage``, ``LazyMemmapStorage``,
``ListStorage``, ``LazyStackStorage`` or ``CompressedListStorage`` into a new store: its rows
are streamed in blocks of bounded size, then its state is saved as for a buffer on
ZarrStorage. :func:`memory_storage` and :func:`fill_memory` do the reverse for
``zarr_rb.load(path, storage="memory")``: a ``LazyTensorStorage`` (or, for rows of
different lengths, a ``LazyStackStorage``) holding the saved rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import is_tensor_collection
from torchrl.data.replay_buffers.storages import (
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    Storage,
    TensorStorage,
)
from torchrl.data.replay_buffers.writers import RoundRobinWriter, TensorDictMaxValueWriter

from zarr_rb.errors import RowsNotCommittedError, UnsupportedDataError
from zarr_rb.format.messages import preview_rows
from zarr_rb.locations import StoreURL, open_location
from zarr_rb.state import check_savable
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.compat import default_collate as _get_default_collate
from zarr_rb.torchrl.data_kinds import key_tuple
from zarr_rb.torchrl.state_dict import copy_rows
from zarr_rb.torchrl.storage import ZarrStorage

SOURCES = (TensorStorage, ListStorage)
"""TorchRL storages whose buffers :func:`save_foreign` takes (and their subclasses:
``LazyTensorStorage``, ``LazyMemmapStorage``, ``LazyStackStorage``,
``CompressedListStorage``)."""


def save_foreign(
    rb: Any,
    path: StoreURL,
    *,
    progress: bool,
    save_state: Callable[[Any, ZarrStorage], None],
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Save a buffer on one of TorchRL's storages into a new store at ``path``: its rows,
    then its state, by ``save_state(rb, storage)`` with the buffer on the new store's
    storage (``zarr_rb.save``'s own way of saving a buffer's state)."""
    source = rb.storage
    if not isinstance(source, SOURCES) or isinstance(source, ZarrStorage):
        raise UnsupportedDataError(
            f"zarr_rb.save takes buffers on ZarrStorage, LazyTensorStorage, LazyMemmapStorage, "
            f"ListStorage, LazyStackStorage or CompressedListStorage, got "
            f"{type(source).__name__}",
        )
    check_savable(rb)  # before anything is written
    ndim = int(getattr(source, "ndim", 1))
    location = open_location(path, storage_options)
    created = not location.exists()
    target = ZarrStorage(
        source.max_size,
        path,
        mode="w-",
        ndim=ndim,
        ragged=_ragged_keys(source),
        storage_options=storage_options,
    )
    try:
        rows = _length_rows(source)
        left_out = _sample_info_in_some_rows(rb)
        copy_rows(
            source,
            target,
            rows=rows,
            progress=progress,
            prepare=(lambda block: block.exclude(*left_out)) if left_out else None,
        )
        target.restore(length=len(source), cursor=_cursor(rb, target))
        previous = compat.swap_storage(rb, target)
        collate = compat.get(rb, "_collate_fn")
        default = _get_default_collate(previous, _is_tensordict=compat.get(rb, "_is_tensordict"))
        if compat.same_function(collate, default):
            compat.put(rb, "_collate_fn", _get_default_collate(target))
        try:
            save_state(rb, target)
        finally:
            compat.swap_storage(rb, previous)
            compat.put(rb, "_collate_fn", collate)
    except BaseException:
        target.close()
        if created:
            location.delete_prefix("")
        raise
    target.close()
    return target.path


def _ragged_keys(source: Storage) -> bool | list[tuple[str, ...]]:
    """Which keys to store as rows of different lengths: every key of a LazyStackStorage
    (each row kept on its own, of any length, as it does); for the other list storages,
    the keys whose rows differ in shape (rows are read once to find them)."""
    if isinstance(source, LazyStackStorage):
        return True
    if not isinstance(source, ListStorage):
        return False
    first: dict[tuple[str, ...], tuple[int, ...]] = {}
    ragged: set[tuple[str, ...]] = set()
    for i in range(len(source)):
        row = source.get(i)
        if not is_tensor_collection(row):
            return False  # tensors and pytrees: rows of one shape
        for key, value in row.items(include_nested=True, leaves_only=True):
            if isinstance(value, torch.Tensor):
                shape = tuple(value.shape)
                if first.setdefault(key_tuple(key), shape) != shape:
                    ragged.add(key_tuple(key))
    return sorted(ragged)


def _sample_info_keys(rb: Any) -> set[tuple[str, ...]]:
    """Keys TorchRL writes into each sample, recomputed at every sample: the row index,
    the weights of prioritized samplers, the end-of-slice flags of slice samplers."""
    keys: set[tuple[str, ...]] = {("index",), ("priority_weight",)}
    truncated = getattr(compat.get(rb, "_sampler"), "truncated_key", None)
    if truncated is not None:
        truncated = key_tuple(truncated)
        keys |= {truncated, (*truncated[:-1], "done"), (*truncated[:-1], "terminated")}
    return keys


def _sample_info_in_some_rows(rb: Any) -> list[tuple[str, ...]]:
    """The sample-info keys that the rows of a list storage hold differently.

    ``ListStorage`` and ``LazyStackStorage`` keep the very TensorDicts they were given, and
    a sample of them can be a lazy stack of those rows: TorchRL then writes the sample's
    info (``index``, ``priority_weight``, a slice's ``("next", "done")``...) into the stored
    rows that were sampled, in the sample's shapes. Such a key is not data (each sample
    recomputes it), and rows that differ in keys or shapes cannot be stored together, so a
    key some rows lack, or hold in another shape, is left out, with a warning; any other
    difference between rows is refused when written.
    """
    source = rb.storage
    if not isinstance(source, ListStorage):
        return []
    stored = compat.get(source, "_storage")[: len(source)]
    rows = [row for row in stored if is_tensor_collection(row)]
    left_out = []
    for key in sorted(_sample_info_keys(rb)):
        shapes = {tuple(row.get(key).shape) if key in row.keys(True) else None for row in rows}
        if len(shapes) > 1:
            left_out.append(key)
    if left_out:
        warnings.warn(
            f"zarr_rb.save leaves out {left_out}: TorchRL wrote them into the rows of the "
            f"{type(source).__name__} it sampled, in the sample's shapes, so its rows "
            "disagree there; they are recomputed at every sample",
            stacklevel=3,
        )
    return left_out


def _length_rows(source: Storage) -> int:
    if isinstance(source, TensorStorage):
        return compat.length_along_dim0(source)
    return len(source)


def _cursor(rb: Any, target: ZarrStorage) -> int:
    """Where the buffer's writer writes next, as a row of ``target``."""
    writer = compat.get(rb, "_writer")
    cursor = None
    if isinstance(writer, (RoundRobinWriter, TensorDictMaxValueWriter)):
        cursor = compat.get(writer, "_cursor")
    rows = target.rows
    if isinstance(cursor, int) or (isinstance(cursor, torch.Tensor) and cursor.numel() == 1):
        return int(cursor) % rows
    return _length_rows(rb.storage) % rows


def memory_storage(stored: ZarrStorage, device: Any) -> Storage:
    """An empty in-RAM storage for the rows of ``stored``: a ``LazyTensorStorage``, or a
    ``LazyStackStorage`` for rows that ``LazyTensorStorage`` cannot hold."""
    schema = stored.schema
    if schema is not None and any(leaf.value == "ragged" for leaf in schema.leaves):
        return LazyStackStorage(stored.max_size, device=device)
    return LazyTensorStorage(stored.max_size, ndim=stored.ndim, device=device)


def fill_memory(memory: Storage, stored: ZarrStorage, *, length: int, progress: bool) -> None:
    """Copy the first ``length`` elements of ``stored`` into ``memory``."""
    if stored.unreadable_rows().size:
        raise RowsNotCommittedError(
            f"store {str(stored.path)!r} has rows {preview_rows(stored.unreadable_rows())} "
            "that hold no data (withdrawn by a crash or a repair, or never written), which an "
            "in-RAM storage cannot leave out when sampling; load it on ZarrStorage (the "
            "default storage='zarr'), whose samplers skip them, or rewrite those rows first",
        )
    rows = -(-length // (stored.schema.elements_per_row if stored.schema else 1))
    copy_rows(stored, memory, rows=rows, progress=progress, desc="load rows")
    if isinstance(memory, TensorStorage):
        compat.set_length(memory, length)
        if length:
            compat.set_last_cursor(memory, rows - 1)
