"""A ZarrStorage's state in TorchRL's format, and any TorchRL storage's state loaded into one.

TorchRL's tensor storages describe themselves as ``{"_storage": rows, "initialized": ...,
"_len": ...}``, where ``rows`` is the full-capacity tensor, or a TensorDict's
``state_dict()``. A ZarrStorage hands out the same, with its rows as lazy columns (read
from disk only when the receiver copies them), plus the path, cursor and epoch of its
store, so that loading it back into the same store copies nothing while the rows it covered
are still there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict, is_non_tensor, is_tensor_collection
from torchrl.data.replay_buffers.storages import Storage

from zarr_rb.errors import RowsNotCommittedError
from zarr_rb.torchrl.columns import LazyColumn
from zarr_rb.torchrl.data_kinds import clone, flip_list, nbytes_per_row, select
from zarr_rb.torchrl.reads import StorageReads
from zarr_rb.util.progress import copy_in_blocks

STATE_KEY = "zarr_rb"
"""Where a ZarrStorage's state dict names its store (ignored by TorchRL's storages)."""

COPY_BLOCK_BYTES = 64 * 2**20


def state_of(storage: StorageReads) -> dict[str, Any]:
    storage.flush()
    rows: Any = {}
    if storage.initialized and not _tensor_columns_only(storage):
        # As ListStorage (LazyStackStorage) has it: one state dict per row, read now.
        every = torch.arange(len(storage))
        rows = [_row_state(row) for row in storage.get(every).unbind(0)]
    elif storage.initialized:
        rows = storage.full_view()
        if is_tensor_collection(rows):
            rows = rows.state_dict()
    return {
        "_storage": rows,
        "initialized": storage.initialized,
        "_len": len(storage),
        STATE_KEY: {
            "path": storage.url,
            "store_id": storage.store_id,
            "cursor": storage.cursor,
            "epoch": storage.committed_epoch(),
        },
    }


def _row_state(row: Any) -> dict[str, Any]:
    """A row as ListStorage's state has it, a nested dict, but with its non-tensor entries
    kept (as ``NonTensorData``, which ``TensorDict.load_state_dict`` takes back): a
    TensorDict's own ``state_dict()`` leaves them out."""
    return {
        key: _row_state(value)
        if is_tensor_collection(value) and not is_non_tensor(value)
        else value
        for key, value in row.items()
    }


def load_state(storage: StorageReads, state: dict[str, Any]) -> None:
    ours = state.get(STATE_KEY)
    rows = state["_storage"]
    if isinstance(rows, list):  # ListStorage's form (LazyStackStorage): one element per row
        _load_rows(storage, rows, cursor=None if ours is None else int(ours["cursor"]))
        return
    length = int(state["_len"])
    if (
        ours is not None
        and _same_store(str(ours["path"]), storage)
        and ours.get("store_id") == storage.store_id  # (not a store made there since)
    ):
        # Nothing to copy where the rows it covered are still the store's, or where it
        # holds the store's own lazy columns (kept in memory: the rows as they are now,
        # as LazyTensorStorage's state holds its live tensor). A state saved and loaded
        # holds its values: those of rows written over since are copied below.
        epoch = ours.get("epoch")
        if _holds_columns(rows):
            if not storage.holds_readable_rows(length):
                raise RowsNotCommittedError(
                    f"store {storage.url!r}: this state holds the store's own rows, by "
                    f"reference, and some of the {length} it covered are no longer in the "
                    "store (emptied, or withdrawn by a repair, since): it cannot be loaded. "
                    "A state saved with torch.save keeps its rows"
                )
            storage.restore(length=length, cursor=int(ours["cursor"]))
            return
        if epoch is not None and storage.holds_rows_of(length=length, epoch=int(epoch)):
            storage.restore(length=length, cursor=int(ours["cursor"]))
            return
    if isinstance(rows, (dict, tuple)) and (not rows or not state.get("initialized", True)):
        storage.restore(length=0, cursor=0)
        return
    if _is_pytree(rows, storage):
        # Rows of pytrees (a tensor storage keeps them as a pytree of tensors).
        shape = pytree.tree_leaves(rows)[0].shape
    elif isinstance(rows, dict):
        # By reference: lazy columns stay lazy until copied block by block.
        rows = TensorDict().load_state_dict(rows, strict=False)
        shape = rows.shape
    elif isinstance(rows, torch.Tensor):
        shape = rows.shape
    else:
        raise TypeError(
            f"expected the rows of a tensor storage (a tensor, a TensorDict state dict or a "
            f"pytree of tensors), got {type(rows).__name__}; for other storages use "
            "rb.dumps/rb.loads or zarr_rb.save",
        )
    per_row = math.prod(shape[1 : storage.ndim])
    n_rows = min(shape[0], -(-length // per_row))
    copy_rows(rows, storage, rows=n_rows)
    cursor = int(ours["cursor"]) if ours is not None else n_rows % shape[0]
    storage.restore(length=length, cursor=cursor)


def _is_pytree(rows: Any, storage: StorageReads) -> bool:
    """Whether the rows of a state are a pytree of tensors rather than a TensorDict's state
    dict (whose values are all tensors): a tuple, or a dict holding containers, or rows of
    a storage of pytrees."""
    schema = storage.schema
    if schema is not None:
        return schema.kind == "pytree"
    if isinstance(rows, tuple):
        return True
    return isinstance(rows, dict) and any(
        isinstance(value, (dict, tuple, list)) for value in rows.values()
    )


def _holds_columns(rows: Any) -> bool:
    """Whether the rows of a state are lazy columns (a ZarrStorage's, not pickled since)."""
    if isinstance(rows, dict):
        return any(_holds_columns(value) for value in rows.values())
    if isinstance(rows, (list, tuple)):
        return any(_holds_columns(value) for value in rows)
    return isinstance(rows, LazyColumn)


def _load_rows(storage: StorageReads, rows: list[Any], *, cursor: int | None) -> None:
    if not rows:
        storage.restore(length=0, cursor=0)
        return
    elements = [
        TensorDict().load_state_dict(row, strict=False) if isinstance(row, dict) else row
        for row in rows
    ]
    for start in range(0, len(elements), _ROWS_PER_BLOCK):
        block = elements[start : start + _ROWS_PER_BLOCK]
        where = torch.arange(start, start + len(block))
        storage.set(where, block, set_cursor=False)  # a list: stacked, or lazily
    storage.restore(
        length=len(rows), cursor=len(rows) % storage.max_size if cursor is None else cursor
    )


_ROWS_PER_BLOCK = 1024


def copy_store(source: str | os.PathLike[str], storage: StorageReads) -> None:
    """Copy the committed rows of the store at ``source`` into ``storage`` (opened read-only
    by a storage of ``storage``'s class)."""
    with type(storage)(path=source, ndim=storage.ndim, read_only=True) as other:
        if other.schema is not None:
            rows = other[:] if _tensor_columns_only(other) else other
            copy_rows(rows, storage, rows=other.rows_held)


def _tensor_columns_only(storage: StorageReads) -> bool:
    schema = storage.schema
    return schema is None or all(leaf.value == "tensor" for leaf in schema.leaves)


def copy_rows(
    source: Any,
    storage: Storage,
    *,
    rows: int,
    progress: bool = False,
    prepare: Callable[[Any], Any] | None = None,
    desc: str = "copy rows",
) -> None:
    """Copy rows ``[0, rows)`` of ``source`` (anything sliceable by rows: a storage, a
    TensorDict, a tensor) into ``storage`` (a ZarrStorage, or one of TorchRL's), in blocks
    of about 64 MiB; ``prepare`` is applied to each block of a storage's rows before it is
    written."""
    if rows <= 0:
        return
    if isinstance(source, Storage):
        # Rows read (and decoded) by the storage, a block at a time; a ZarrStorage reads an
        # index (a slice of every row would be its lazy view).
        get = source.get
        if isinstance(source, StorageReads):
            get = lambda index: source.get(torch.arange(index.start, index.stop))  # noqa: E731
        read = get if prepare is None else lambda index: prepare(get(index))
        first = read(slice(0, 1))
        per_row = nbytes_per_row(flip_list(first) if isinstance(first, list) else first)
    else:
        read = lambda index: clone(select(source, index))  # noqa: E731
        per_row = nbytes_per_row(source)
    copy_in_blocks(
        lambda start, stop: read(slice(start, stop)),
        lambda where, block: storage.set(where, block, set_cursor=False),
        rows=rows,
        row_nbytes=per_row,
        block_bytes=COPY_BLOCK_BYTES,
        progress=progress,
        desc=desc,
    )


def _same_store(url: str, storage: StorageReads) -> bool:
    """Whether the store recorded as ``url`` in a state dict is ``storage``'s."""
    if isinstance(storage.path, Path):
        return "://" not in url and Path(url).resolve() == storage.path.resolve()
    return url == storage.url
