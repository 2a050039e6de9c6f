"""A store on disk: its schema, its arrays, the rows waiting in RAM and the commit protocol.

The commit protocol (see DESIGN.md):

* The root group's attributes are the commit record. They are replaced
  atomically and declare which rows are readable (``length`` minus ``holes``).
* Rows are declared readable only after every leaf of those rows is on disk.
* Before rows that the last commit declared readable are overwritten, a commit
  withdraws them, so no reader and no crash can pair one key's new row with
  another key's old row.
* Readers re-read the commit after each read; if its generation moved, the
  read is retried (a seqlock), so a read never returns a torn transition.

This module works with leaf dictionaries ``{key: tensor[rows, ...]}`` and row
numbers; it knows nothing about TorchRL.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from zarr_rb._engine import LocalLocation, RowArray
from zarr_rb._format import (
    ATTRS_KEY,
    DATA_GROUP,
    Commit,
    LeafSpec,
    Saved,
    Schema,
    StoreMeta,
    commit_from_mask,
    leaves_by_key,
    parse_store_meta,
    preview_rows,
)
from zarr_rb._layout import Compression, choose_block_rows, leaf_layout, row_nbytes
from zarr_rb._staging import Block, Key, WriteBuffer
from zarr_rb.errors import (
    NotAStoreError,
    ReadOnlyError,
    RowsNotCommittedError,
    SchemaMismatchError,
    StoreCorruptedError,
)

_MAX_STAGED_BLOCKS = 8
_READ_RETRIES = 20
MIRROR_LIMIT_BYTES = 256 * 2**20
"""Small leaves (actions, rewards, flags, trajectory ids) are mirrored in RAM by the writer
when all of them together take at most this much."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor in its stored dtype (bfloat16 bits as uint16)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


class Store:
    """One zarr_rb store: open it with :meth:`open`, never construct it directly."""

    def __init__(
        self,
        location: LocalLocation,
        meta: StoreMeta,
        *,
        read_only: bool,
        compression: Compression,
    ) -> None:
        self.location = location
        self.meta = meta
        self.read_only = read_only
        self.compression = compression
        self.committed = meta.commit
        self.length = meta.commit.length * self._elements_per_row(meta.schema)
        self.cursor = meta.commit.cursor
        self._arrays: dict[Key, RowArray] = {}
        self._mirror: dict[Key, torch.Tensor] = {}
        self._mirrorable: frozenset[Key] = frozenset()
        self._leaves: dict[Key, LeafSpec] = {}
        self._buffer: WriteBuffer | None = None
        self._published: np.ndarray | None = None
        self._valid: np.ndarray | None = None
        self.closed = False
        if meta.schema is not None:
            self._attach_schema(meta.schema, meta.block_rows or 1)

    # --- opening ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        max_size: int | None,
        ndim: int | None,
        read_only: bool,
        compression: Compression,
    ) -> Store:
        """Open the store at ``path``, creating it when it does not exist (and not read-only)."""
        location = LocalLocation(path)
        root = location.root
        where = f"store {str(root)!r}"
        if root.exists() and not root.is_dir():
            raise NotAStoreError(
                f"{where} is a file, not a zarr_rb store; pass a directory path "
                "(e.g. 'runs/buffer.zarr')",
            )
        try:
            document = location.read_root_metadata()
        except (ValueError, UnicodeDecodeError) as err:
            raise StoreCorruptedError(
                f"{where}: root zarr.json is not valid JSON ({err})"
            ) from None
        if document is None:
            if read_only:
                raise FileNotFoundError(f"no zarr_rb store at {str(root)!r}")
            if root.exists() and any(root.iterdir()):
                raise NotAStoreError(
                    f"{where} is a non-empty directory without a zarr_rb store; "
                    "choose a new or empty directory",
                )
            if max_size is None:
                raise ValueError(f"max_size is required to create a new store at {str(root)!r}")
            root.mkdir(parents=True, exist_ok=True)
            meta = StoreMeta(max_size=max_size, ndim=ndim or 1, schema=None, commit=Commit())
            location.write_root_attributes({ATTRS_KEY: meta.to_json()})
            location.create_group(DATA_GROUP)
            return cls(location, meta, read_only=False, compression=compression)
        attributes = document.get("attributes")
        if not isinstance(attributes, dict) or ATTRS_KEY not in attributes:
            raise NotAStoreError(
                f"{where} is a Zarr hierarchy but not a zarr_rb store (no "
                f"{ATTRS_KEY!r} attribute on its root group); choose another path",
            )
        meta = parse_store_meta(attributes, where=where)
        if max_size is not None and max_size != meta.max_size:
            raise SchemaMismatchError(
                f"{where} holds a buffer of max_size={meta.max_size}, got max_size={max_size}; "
                f"pass max_size={meta.max_size} (or None) to reopen it, or use another path",
            )
        if ndim is not None and ndim != meta.ndim:
            raise SchemaMismatchError(
                f"{where} holds a buffer with ndim={meta.ndim}, got ndim={ndim}",
            )
        return cls(location, meta, read_only=read_only, compression=compression)

    # --- schema ----------------------------------------------------------------------------

    @property
    def schema(self) -> Schema | None:
        return self.meta.schema

    @staticmethod
    def _elements_per_row(schema: Schema | None) -> int:
        return 1 if schema is None else math.prod(schema.batch_shape[1:])

    @property
    def rows(self) -> int:
        assert self.schema is not None
        return self.schema.rows

    def element_shape(self, leaf: LeafSpec) -> tuple[int, ...]:
        """Shape of one row of a leaf's array."""
        assert self.schema is not None
        return (*self.schema.batch_shape[1:], *leaf.shape)

    def _attach_schema(self, schema: Schema, block_rows: int) -> None:
        self._leaves = leaves_by_key(schema.leaves)
        self._buffer = WriteBuffer(
            element_shapes={leaf.key: self.element_shape(leaf) for leaf in schema.leaves},
            dtypes={leaf.key: TORCH_DTYPES[leaf.dtype] for leaf in schema.leaves},
            block_rows=block_rows,
            rows=schema.rows,
        )
        small = [
            leaf
            for leaf in schema.leaves
            if row_nbytes(leaf, schema.batch_shape) < self.compression.large_row_bytes
        ]
        small_bytes = sum(row_nbytes(leaf, schema.batch_shape) for leaf in small)
        if not self.read_only and schema.rows * small_bytes <= MIRROR_LIMIT_BYTES:
            self._mirrorable = frozenset(leaf.key for leaf in small)
        readable = self.committed.readable_mask(schema.rows)
        self._published = readable
        # Rows past the committed length hold fill values or rows of an interrupted write:
        # they are rewritten before they are ever declared readable again.
        self._valid = readable.copy()
        self._valid[self.committed.length :] = True

    def initialize(self, schema: Schema) -> None:
        """Create the arrays of ``schema`` (first write of a new store)."""
        self._check_writable()
        block_rows = choose_block_rows(self.compression, schema.leaves, schema.batch_shape)
        groups = sorted(
            {
                "/".join(leaf.path.split("/")[:i])
                for leaf in schema.leaves
                for i in range(2, leaf.path.count("/") + 1)
            }
        )
        for group in groups:
            self.location.create_group(group)
        for leaf in schema.leaves:
            layout = leaf_layout(
                leaf,
                batch_shape=schema.batch_shape,
                block_rows=block_rows,
                compression=self.compression,
            )
            self.location.create_array(
                leaf.path,
                layout=layout,
                dtype=leaf.stored_dtype,
                compression=self.compression,
                attributes={
                    ATTRS_KEY: {"dtype": leaf.dtype, "batch_dims": len(schema.batch_shape)}
                },
            )
        self.meta = dataclasses.replace(self.meta, schema=schema, block_rows=block_rows)
        self._attach_schema(schema, block_rows)
        self._publish(self.committed)

    def array(self, key: Key) -> RowArray:
        array = self._arrays.get(key)
        if array is None:
            assert self.schema is not None
            leaf = self._leaf(key)
            try:
                array = self.location.open_array(leaf.path, read_only=self.read_only)
            except ValueError as err:
                raise StoreCorruptedError(
                    f"store {str(self.location.root)!r}: cannot open array {leaf.path!r} ({err})"
                ) from None
            expected = (self.rows, *self.element_shape(leaf))
            if array.shape != expected or array.dtype != np.dtype(leaf.stored_dtype):
                raise StoreCorruptedError(
                    f"store {str(self.location.root)!r}: array {leaf.path!r} has shape "
                    f"{array.shape} and dtype {array.dtype}, expected {expected} and "
                    f"{leaf.stored_dtype}",
                )
            self._arrays[key] = array
        return array

    # --- writing ---------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(
                f"store {str(self.location.root)!r} was opened read-only; open it with "
                "read_only=False (one writer per store) to write",
            )
        if self.closed:
            raise ValueError(f"store {str(self.location.root)!r} is closed")

    def write(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> None:
        """Write ``values[key][i]`` to row ``rows[i]`` (``rows`` sorted and unique)."""
        self._check_writable()
        assert self._buffer is not None
        if self._mirror:
            index = torch.from_numpy(rows)
            for key, mirror in self._mirror.items():
                mirror[index] = values[key]
        direct, full = self._buffer.stage(rows, values)
        blocks = [self._buffer.pop(index) for index in full]
        if len(self._buffer) > _MAX_STAGED_BLOCKS:
            # Too many partially filled blocks: write the oldest ones as they are.
            oldest = [block.index for block in self._buffer][
                : len(self._buffer) - _MAX_STAGED_BLOCKS
            ]
            blocks.extend(self._buffer.pop(index) for index in oldest)
        writes = [_block_rows(block) for block in blocks]
        # Slices of the caller's tensors: views, not copies.
        writes.extend(
            (rows[start:stop], {key: value[start:stop] for key, value in values.items()})
            for start, stop in direct
        )
        if writes:
            self._write_to_disk(writes)
            self._commit()

    def _write_to_disk(
        self, writes: Sequence[tuple[np.ndarray, Mapping[Key, torch.Tensor]]]
    ) -> None:
        assert self._published is not None
        assert self._valid is not None
        touched = np.zeros(self.rows, dtype=bool)
        for rows, _ in writes:
            touched[rows] = True
        if (self._published & touched).any():
            # Withdraw the rows about to change before touching a byte of them; the length
            # stays, so readers see holes rather than a shrinking buffer.
            self._publish_mask(self._published & ~touched, length=self.committed.length)
        self._valid &= ~touched
        futures = [
            self.array(key).write_rows(rows, to_numpy(tensor))
            for rows, values in writes
            for key, tensor in values.items()
        ]
        for future in futures:
            future.result()
        self._valid |= touched

    def flush(self) -> None:
        """Write every row held in RAM and publish a commit that covers them."""
        if self.read_only or self.closed or self._buffer is None:
            return
        blocks = list(self._buffer)
        if blocks:
            self._buffer.clear()
            self._write_to_disk([_block_rows(block) for block in blocks])
        self._commit()

    def discard(self) -> None:
        """Forget rows held in RAM (after ``empty``)."""
        if self._buffer is not None:
            self._buffer.clear()
        self._mirror.clear()

    def _staged_mask(self) -> np.ndarray:
        mask = np.zeros(self.rows, dtype=bool)
        assert self._buffer is not None
        for block in self._buffer:
            start = block.index * self._buffer.block_rows
            mask[start : start + block.length] |= block.dirty[: block.length]
        return mask

    def _commit(self) -> None:
        """Publish every row that is on disk and within the storage's length."""
        if self.schema is None:
            self._publish(dataclasses.replace(self.committed, length=0, holes=()))
            return
        assert self._valid is not None
        assert self._published is not None
        length_rows = -(-self.length // self._elements_per_row(self.schema))
        # Rows waiting in RAM keep their previous, still intact, committed content.
        readable = self._valid & ~(self._staged_mask() & ~self._published)
        readable[length_rows:] = False
        self._publish_mask(readable)

    def _publish_mask(self, readable: np.ndarray, *, length: int | None = None) -> None:
        commit = commit_from_mask(
            readable, generation=self.committed.generation + 1, cursor=self.cursor, length=length
        )
        if (
            commit.length == self.committed.length
            and commit.holes == self.committed.holes
            and commit.cursor == self.committed.cursor
        ):
            return
        self._publish(commit)
        self._published = readable.copy()

    def publish_saved(self, saved: Saved) -> None:
        """Flush, then publish the data commit together with a new save record."""
        self.flush()
        self.meta = dataclasses.replace(self.meta, saved=saved)
        self._publish(self.committed)

    def _publish(self, commit: Commit) -> None:
        self.meta = dataclasses.replace(self.meta, commit=commit)
        self.location.write_root_attributes({ATTRS_KEY: self.meta.to_json()})
        self.committed = commit

    # --- reading ---------------------------------------------------------------------------

    def read(self, rows: np.ndarray, keys: Iterable[Key]) -> dict[Key, torch.Tensor]:
        """Read rows (any order, repeats allowed) of some leaves, RAM-held rows included."""
        keys = list(keys)
        if self.read_only:
            return self._read_committed(rows, keys)
        mirrored = [key for key in keys if key in self._mirrorable]
        if mirrored:
            index = torch.from_numpy(rows)
            out = {key: self._mirror_of(key)[index] for key in mirrored}
            rest = [key for key in keys if key not in self._mirrorable]
            return {**out, **self.read(rows, rest)} if rest else out
        assert self._buffer is not None
        hit, served = self._buffer.staged_rows(rows)
        out = self._read_disk(rows[~hit] if hit.any() else rows, keys)
        if not hit.any():
            return out
        assert self.schema is not None
        result: dict[Key, torch.Tensor] = {}
        miss = torch.from_numpy(np.flatnonzero(~hit))
        for key in keys:
            leaf_dtype = TORCH_DTYPES[self._leaf(key).dtype]
            tensor = torch.empty(
                (rows.size, *self.element_shape(self._leaf(key))), dtype=leaf_dtype
            )
            tensor[miss] = out[key]
            for block, positions in served:
                offsets = rows[positions] - block.index * self._buffer.block_rows
                tensor[torch.from_numpy(positions)] = block.values[key][torch.from_numpy(offsets)]
            result[key] = tensor
        return result

    def _mirror_of(self, key: Key) -> torch.Tensor:
        """The whole array of a small leaf in RAM, read once, then kept up to date by writes."""
        mirror = self._mirror.get(key)
        if mirror is None:
            assert self._buffer is not None
            mirror = self._read_disk(np.arange(self.rows), [key])[key].clone()
            _, served = self._buffer.staged_rows(np.arange(self.rows))
            for block, positions in served:
                offsets = torch.from_numpy(positions - block.index * self._buffer.block_rows)
                mirror[torch.from_numpy(positions)] = block.values[key][offsets]
            self._mirror[key] = mirror
        return mirror

    def _leaf(self, key: Key) -> LeafSpec:
        return self._leaves[key]

    def _read_disk(self, rows: np.ndarray, keys: list[Key]) -> dict[Key, torch.Tensor]:
        if rows.size == 0:
            return {
                key: torch.empty(
                    (0, *self.element_shape(self._leaf(key))),
                    dtype=TORCH_DTYPES[self._leaf(key).dtype],
                )
                for key in keys
            }
        futures = {key: self.array(key).read_rows(rows) for key in keys}
        return {
            key: from_numpy(future.result(), TORCH_DTYPES[self._leaf(key).dtype])
            for key, future in futures.items()
        }

    def refresh(self) -> Commit:
        """Re-read the commit record (readers); returns it."""
        document = self.location.read_root_metadata()
        attributes = {} if document is None else document.get("attributes", {})
        meta = parse_store_meta(attributes, where=f"store {str(self.location.root)!r}")
        if meta.schema is not None and self.schema is None:
            self.meta = meta
            self._attach_schema(meta.schema, meta.block_rows or 1)
        self.meta = dataclasses.replace(self.meta, commit=meta.commit, saved=meta.saved)
        self.committed = meta.commit
        self.length = meta.commit.length * self._elements_per_row(self.schema)
        self.cursor = meta.commit.cursor
        if self.schema is not None:
            self._published = meta.commit.readable_mask(self.rows)
        return meta.commit

    def _read_committed(self, rows: np.ndarray, keys: list[Key]) -> dict[Key, torch.Tensor]:
        last_error: Exception | None = None
        for attempt in range(_READ_RETRIES):
            commit = self.committed
            assert self._published is not None
            unreadable = rows[~self._published[rows]]
            if unreadable.size:
                raise RowsNotCommittedError(
                    f"store {str(self.location.root)!r}: rows {preview_rows(unreadable)} are not "
                    f"readable in commit {commit.generation} (length {commit.length}, holes "
                    f"{list(commit.holes)}); call refresh() to pick up newer commits",
                )
            try:
                out = self._read_disk(rows, keys)
            except ValueError as err:  # a shard replaced while it was being read
                out, last_error = None, err
            if self.refresh().generation == commit.generation and out is not None:
                return out
            time.sleep(0.001 * (attempt + 1))
        raise RowsNotCommittedError(
            f"store {str(self.location.root)!r}: rows kept changing while being read "
            f"({_READ_RETRIES} attempts; last error: {last_error})",
        )

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            self._arrays.clear()

    @property
    def path(self) -> Path:
        return self.location.root


def _block_rows(block: Block) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
    """The rows a block holds and their values (all of them when the block is full)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}
