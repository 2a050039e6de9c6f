"""``ZarrStorage``: a drop-in, out-of-core TorchRL storage on sharded Zarr v3 arrays.

This module adapts a :class:`~zarr_rb._store.Store` to TorchRL's
``TensorStorage`` contract (index forms, length and cursor bookkeeping, lazy
initialisation from the first write). It is the only module that touches
TorchRL's storage internals.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.utils import _is_int

from zarr_rb import _convert
from zarr_rb._checkpointer import ZarrStorageCheckpointer
from zarr_rb._dtypes import TORCH_DTYPES
from zarr_rb._engine import copy_in_blocks
from zarr_rb._format import Schema, preview_rows
from zarr_rb._layout import Compression
from zarr_rb._lazy import LazyColumn
from zarr_rb._store import Store
from zarr_rb.errors import RowIndexError

__all__ = ["ZarrStorage"]


def _close(store: Store, tmpdir: str | None) -> None:
    try:
        store.close()
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _flip_list(data: list[Any]) -> Any:
    from tensordict import is_tensor_collection
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if all(is_tensor_collection(item) for item in data):
        return torch.stack(data)
    flat, specs = zip(*(tree_flatten(item) for item in data), strict=True)
    return tree_unflatten([torch.stack(items) for items in zip(*flat, strict=True)], specs[0])


def _as_index_tensor(index: Any) -> torch.Tensor:
    tensor = torch.as_tensor(index)
    if tensor.dtype == torch.bool:
        return tensor.nonzero().squeeze(-1)
    if tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"expected an integer or boolean index, got dtype {tensor.dtype}")
    return tensor.to(torch.int64).cpu()


class ZarrStorage(TensorStorage):  # type: ignore[misc]
    """A TorchRL storage whose data lives in chunked, compressed Zarr v3 arrays.

    A drop-in for :class:`~torchrl.data.LazyMemmapStorage`: the schema is taken
    from the first write, and the storage works with TorchRL's replay buffers,
    samplers and writers unchanged. Rows are written in place, so the store on
    disk is at once the buffer, its checkpoint and a dataset that other processes
    can open read-only.

    Rows are gathered in RAM by block (a shard of the large leaves) and written
    when a block is full, on :meth:`flush` and on :meth:`close`; rows still in RAM
    are visible to this storage but not to other processes until they are
    committed.

    Args:
        max_size: capacity in elements (as for ``LazyMemmapStorage``). May be
            ``None`` when ``path`` holds a store; must match it otherwise.
        path: directory of the store. An existing store is reopened with its
            schema, length and cursor (no row is read); a missing one is created.
            ``None`` uses a temporary directory removed with the storage.

    Keyword Args:
        ndim: number of batch dimensions counted by ``max_size`` (1 or 2; 2 for
            ``[time, n_envs]`` layouts). ``None``: the store's own when reopening, 1 for a
            new store.
        device: device of the tensors returned by :meth:`get`.
        read_only: open an existing store for reading, next to its writer (any number
            of readers; they take no lock and write nothing). :meth:`refresh` picks up
            commits made by the writer.
        refresh_interval: for read-only storages, refresh automatically when the length is
            asked for (every sample does) and at least this many seconds have passed since
            the last refresh. ``None``: only explicit :meth:`refresh` calls.
        compression: chunking and compression; see :class:`~zarr_rb.Compression`.

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
    _default_checkpointer = ZarrStorageCheckpointer

    def __init__(
        self,
        max_size: int | None = None,
        path: str | os.PathLike[str] | None = None,
        *,
        ndim: int | None = None,
        device: torch.device | str = "cpu",
        read_only: bool = False,
        compression: Compression | None = None,
        refresh_interval: float | None = None,
    ) -> None:
        if refresh_interval is not None and not read_only:
            raise ValueError(
                "refresh_interval is for read-only storages (the writer always sees its own "
                "rows); pass read_only=True",
            )
        if refresh_interval is not None and refresh_interval < 0:
            raise ValueError(f"expected refresh_interval >= 0, got {refresh_interval}")
        if ndim is not None and ndim < 1:
            raise ValueError(f"expected ndim >= 1, got {ndim}")
        if max_size is not None and int(max_size) < 1:
            raise ValueError(f"expected max_size >= 1, got {max_size}")
        tmpdir = None
        if path is None:
            if read_only:
                raise ValueError("read_only=True needs the path of an existing store")
            tmpdir = tempfile.mkdtemp(prefix="zarr_rb-")
            path = Path(tmpdir) / "buffer.zarr"
        store = Store.open(
            path,
            max_size=None if max_size is None else int(max_size),
            ndim=ndim,
            read_only=read_only,
            compression=compression or Compression(),
        )
        length = store.length
        self.__dict__["_store"] = store
        super().__init__(
            storage=None, max_size=store.meta.max_size, device=device, ndim=store.meta.ndim
        )
        store.length = length
        self.initialized = store.schema is not None
        if self.initialized and store.committed.length:
            self._set_last_cursor((store.cursor - 1) % store.rows)
        self._finalizer = weakref.finalize(self, _close, store, tmpdir)
        self.__dict__["_refresh_interval"] = refresh_interval
        self.__dict__["_refreshed_at"] = time.monotonic()

    # --- TorchRL bookkeeping, backed by the store ------------------------------------------

    @property
    def _len(self) -> int:
        interval = self.__dict__.get("_refresh_interval")
        if interval is not None and time.monotonic() - self._refreshed_at >= interval:
            self.refresh()
        return int(self.__dict__["_store"].length)

    @_len.setter
    def _len(self, value: int) -> None:
        self.__dict__["_store"].length = int(value)

    @property
    def _total_shape(self) -> torch.Size | None:
        schema = self._store.schema
        return None if schema is None else torch.Size(schema.batch_shape)

    @property
    def _storage(self) -> Any:
        """A lazy view of the full capacity (schema only; rows are read on use)."""
        schema = self.__dict__["_store"].schema if "_store" in self.__dict__ else None
        return None if schema is None else self._lazy_view(schema.rows)

    @_storage.setter
    def _storage(self, value: Any) -> None:
        if value is not None:
            raise TypeError("ZarrStorage keeps its data on disk; it cannot adopt a tensor")

    # --- public API ------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """Directory of the store."""
        return self._store.path

    @property
    def cursor(self) -> int:
        """Row the next sequential write goes to: one past the last row written.

        A new replay buffer's writer starts at row 0. To append to a reopened store rather
        than overwrite its oldest rows, hand this to the writer::

            rb.writer.load_state_dict({"_cursor": storage.cursor, "_write_count": len(storage)})
        """
        return int(self._store.cursor)

    @property
    def read_only(self) -> bool:
        return self._store.read_only

    @property
    def schema(self) -> Schema | None:
        """Keys, dtypes and shapes of the stored data (``None`` before the first write)."""
        return self._store.schema

    def flush(self) -> None:
        """Write the rows held in RAM and commit: other processes then see every row."""
        self._store.flush()

    def close(self) -> None:
        """Flush and release the store. The storage cannot be used afterwards."""
        self._finalizer()

    def refresh(self) -> None:
        """Pick up the writer's latest commit (read-only storages)."""
        self.__dict__["_refreshed_at"] = time.monotonic()
        self._store.refresh()
        self.initialized = self._store.schema is not None
        self._bump_mutation_revision()

    def nbytes_on_disk(self) -> int:
        """Bytes of all files of the store."""
        return self._store.location.nbytes()

    def nbytes_raw(self) -> int:
        """Uncompressed bytes of the rows currently held (``len(self)`` elements)."""
        schema = self._store.schema
        if schema is None:
            return 0
        rows = self._len_along_dim0 or 0
        return rows * schema.row_nbytes

    def __enter__(self) -> ZarrStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "ZarrStorage cannot be pickled: it holds open file handles. To share a buffer "
            "with another process, flush() it and open ZarrStorage(path=..., read_only=True) "
            "there.",
        )

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

    def _initialize(self, data: Any, *, batched: bool) -> None:
        schema = _convert.infer_schema(
            data, batched=batched, ndim=self.ndim, max_size=self.max_size
        )
        self._store.initialize(schema)
        self.initialized = True

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        store = self._store
        store._check_writable()
        if isinstance(data, list):
            data = _flip_list(data)
        if not self.initialized:
            self._initialize(data, batched=not _is_int(cursor))
        schema = store.schema
        assert schema is not None
        where = f"store {str(self.path)!r}"
        # Validate everything before touching the length or the cursor: a rejected
        # write leaves the storage as it was.
        if isinstance(cursor, tuple):
            rows, leaves = self._patch_elements(cursor, data, schema)
        else:
            index, index_shape = self._write_rows_index(cursor, schema.rows)
            all_leaves = _convert.leaves_for_write(
                data, schema=schema, index_shape=index_shape, where=where
            )
            rows, last = _unique_last(index)
            if rows.size == index.size and (rows == index).all():
                leaves = all_leaves  # already sorted and unique: no gather, no copy
            else:
                position = torch.from_numpy(last)
                leaves = {key: value[position] for key, value in all_leaves.items()}
        if set_cursor:
            self._set_last_cursor(cursor)
            self._get_new_len(data, cursor)
        store.write(rows, leaves)
        if set_cursor and self._last_cursor_index is not None:
            store.cursor = (self._last_cursor_index + 1) % schema.rows
        self._bump_mutation_revision()

    def _write_rows_index(self, cursor: Any, rows: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """Rows addressed by a write cursor (relative to capacity, like TorchRL's storages)."""
        if isinstance(cursor, slice):
            index = np.arange(*cursor.indices(rows))
            return index, (index.size,)
        if _is_int(cursor):
            index = np.array([int(cursor)])
            shape: tuple[int, ...] = ()
        else:
            tensor = _as_index_tensor(cursor)
            index, shape = tensor.reshape(-1).numpy(), tuple(tensor.shape)
        return self._check_rows(index, rows, what="write index").astype(np.int64), shape

    def _patch_elements(
        self, cursor: tuple[Any, ...], data: Any, schema: Schema
    ) -> tuple[np.ndarray, dict[tuple[str, ...], torch.Tensor]]:
        """Rows touched by a multi-dimensional index, read and patched with ``data``."""
        head, rest = cursor[0], cursor[1:]
        length = schema.rows
        rows, position = self._rows_of(head, length)
        block = self._read(rows, schema)
        block[(position, *rest)] = data
        leaves = _convert.leaves_for_write(
            block, schema=schema, index_shape=(rows.size,), where=f"store {str(self.path)!r}"
        )
        return rows, leaves

    def _empty(self) -> None:
        self._store._check_writable()
        self._store.discard()
        self._len = 0
        self._store.flush()
        self._bump_mutation_revision()

    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
        """Patch some keys of some elements (``rb.update_if_present``), through ``set``."""
        where = tuple(index.unbind(-1)) if index.ndim > 1 else index
        current = self.get(where)
        for key, value in patch.items():
            current.set(key, value)
        self.set(where, current, set_cursor=False)

    # --- reads -----------------------------------------------------------------------------

    def _rows_of(self, head: Any, length: int) -> tuple[np.ndarray, Any]:
        """Sorted unique rows addressed by ``head`` and how to pick them from a block of them."""
        if isinstance(head, slice):
            start, stop, step = head.indices(length)
            if step < 0:
                raise ValueError("negative slice steps are not supported (as in torch)")
            rows = np.arange(start, stop, step, dtype=np.int64)
            return rows, slice(0, rows.size)
        if _is_int(head):
            row = int(head) + (length if int(head) < 0 else 0)
            if not 0 <= row < length:
                raise RowIndexError(
                    f"store {str(self.path)!r}: index {int(head)} is out of range for "
                    f"{length} rows",
                )
            return np.array([row], dtype=np.int64), 0
        tensor = _as_index_tensor(head)
        flat = self._check_rows(tensor.reshape(-1).numpy(), length)
        rows, inverse = np.unique(flat, return_inverse=True)
        return rows, torch.from_numpy(inverse.reshape(tensor.shape))

    def _check_rows(self, rows: np.ndarray, length: int, *, what: str = "index") -> np.ndarray:
        """Rows with negative indices wrapped; raises for any outside ``[0, length)``."""
        rows = np.where(rows < 0, rows + length, rows)
        if rows.size and (rows.min() < 0 or rows.max() >= length):
            raise RowIndexError(
                f"store {str(self.path)!r}: {what} out of range for {length} rows: "
                f"{preview_rows(rows[(rows < 0) | (rows >= length)])}",
            )
        return rows

    def _read(self, rows: np.ndarray, schema: Schema) -> Any:
        leaves = self._store.read(rows, (leaf.key for leaf in schema.leaves))
        batch_shape = (rows.size, *schema.batch_shape[1:])
        return _convert.build(leaves, schema=schema, batch_shape=batch_shape, device=None)

    def get(self, index: Any) -> Any:
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        schema = self._store.schema
        assert schema is not None
        length = self._len_along_dim0 or 0
        head, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if isinstance(index, tuple) and not index:
            head = slice(None)
        if isinstance(head, slice) and not rest and head.indices(length) == (0, length, 1):
            out = self._lazy_view(length)
        elif not rest and not isinstance(head, slice) and not _is_int(head):
            out = self._gather(_as_index_tensor(head), schema, length)
        else:
            rows, position = self._rows_of(head, length)
            block = self._read(rows, schema)
            whole = isinstance(position, slice) and not rest
            out = block if whole else block[(position, *rest)]
        if self.device != torch.device("cpu") and self.device != "auto":
            out = out.to(self.device)
        return out

    def _gather(self, index: torch.Tensor, schema: Schema, length: int) -> Any:
        """Rows at a row index (a sampler's output), in the order asked, repeats included.

        Samplers such as SliceSampler read ``storage[index]`` for a few flags, then the
        buffer reads the very same rows: the last gather is kept and a copy of it is
        handed out when the same index comes again, with no write in between and its
        tensors untouched.
        """
        last = self.__dict__.get("_last_gather")
        revision = self._mutation_revision
        if last is not None and last.matches(index, revision):
            return last.result.clone()
        rows = self._check_rows(index.reshape(-1).numpy(), length)
        leaves = self._store.read(rows, (leaf.key for leaf in schema.leaves))
        out = _convert.build(
            {key: v.reshape(*index.shape, *v.shape[1:]) for key, v in leaves.items()},
            schema=schema,
            batch_shape=(*index.shape, *schema.batch_shape[1:]),
            device=None,
        )
        self.__dict__["_last_gather"] = _Gather(index.clone(), revision, out)
        return out

    def _lazy_view(self, length: int) -> Any:
        """Every leaf as a :class:`LazyColumn` over rows ``[0, length)``."""
        schema = self._store.schema
        assert schema is not None
        store = self._store
        columns = {}
        for leaf in schema.leaves:

            def reader(rows: np.ndarray, key: tuple[str, ...] = leaf.key) -> torch.Tensor:
                tensor: torch.Tensor = store.read(rows, [key])[key]
                return tensor

            shape = (length, *store.element_shape(leaf))
            columns[leaf.key] = LazyColumn(shape, TORCH_DTYPES[leaf.dtype], reader)
        return _convert.build(
            columns, schema=schema, batch_shape=(length, *schema.batch_shape[1:]), device=None
        )

    # --- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A small dict (path, length, cursor) after flushing; the rows stay on disk."""
        self.flush()
        return {
            "path": str(self.path),
            "initialized": self.initialized,
            "_len": self._len,
            "cursor": self._store.cursor,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore length and cursor; rows are copied when the state names another store."""
        source = Path(state_dict["path"]).absolute()
        if source != self.path:
            self._copy_from(source)
        self.restore(length=int(state_dict["_len"]), cursor=int(state_dict["cursor"]))

    def restore(self, *, length: int, cursor: int) -> None:
        """Set length and cursor (e.g. to those of a save) and commit them."""
        self._len = length
        self._store.cursor = cursor
        if self.initialized and length:
            self._set_last_cursor((cursor - 1) % self._store.rows)
        self._store.flush()
        self._bump_mutation_revision()

    def _copy_from(self, source: Path) -> None:
        with ZarrStorage(path=source, ndim=self.ndim, read_only=True) as other:
            if other.schema is not None:
                self.copy_rows_from(other, rows=other._len_along_dim0 or 0)

    def copy_rows_from(self, source: Any, *, rows: int, progress: bool = False) -> None:
        """Copy rows ``[0, rows)`` of ``source`` (anything sliceable by rows: a storage,
        a memory-mapped TensorDict) into this storage, in blocks of about 64 MiB."""
        if rows <= 0:
            return
        first = source[0:1]
        copy_in_blocks(
            lambda start, stop: source[start:stop].clone(),
            lambda where, block: self.set(where, block, set_cursor=False),
            rows=rows,
            row_nbytes=int(first.bytes()) if hasattr(first, "bytes") else first.nbytes,
            block_bytes=64 * 2**20,
            progress=progress,
            desc="copy rows",
        )


class _Gather:
    """The last row gather: its index, the storage revision it saw, and its result."""

    def __init__(self, index: torch.Tensor, revision: int, result: Any) -> None:
        self.index = index
        self.revision = revision
        self.result = result
        self._versions = self._leaf_versions()

    def _leaf_versions(self) -> list[tuple[int, int]]:
        tensors = (
            [self.result]
            if isinstance(self.result, torch.Tensor)
            else list(self.result.values(include_nested=True, leaves_only=True))
        )
        return [(id(t), t._version) for t in tensors]

    def matches(self, index: torch.Tensor, revision: int) -> bool:
        return (
            revision == self.revision
            and index.shape == self.index.shape
            and bool(torch.equal(index, self.index))
            # The first caller may have modified the result in place: then it is stale.
            and self._leaf_versions() == self._versions
        )


def _unique_last(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique rows, and for each the position of its last occurrence (last write wins)."""
    reversed_rows = index[::-1]
    rows, first_in_reversed = np.unique(reversed_rows, return_index=True)
    return rows, (index.size - 1 - first_in_reversed).astype(np.int64)
