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

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from zarr_rb._dtypes import TORCH_DTYPES, from_numpy, to_numpy
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
    describe_runs,
    leaves_by_key,
    parse_store_meta,
    preview_rows,
)
from zarr_rb._io import LOCK_FILE, errno_of, is_temporary
from zarr_rb._layout import Compression, choose_block_rows, leaf_layout, row_nbytes
from zarr_rb._lock import WriterLock
from zarr_rb._metadata import check_is_store, parse_meta, read_root
from zarr_rb._staging import Block, Key, WriteBuffer
from zarr_rb.errors import (
    ChunkCorruptedError,
    NotAStoreError,
    ReadOnlyError,
    RowsNotCommittedError,
    StoreCorruptedError,
    StoreWriteError,
    ZarrRBError,
)

_MAX_STAGED_BLOCKS = 8
_READ_RETRIES = 20
MIRROR_LIMIT_BYTES = 256 * 2**20
"""Small leaves (actions, rewards, flags, trajectory ids) are mirrored in RAM by the writer
when all of them together take at most this much."""


class Store:
    """One zarr_rb store: open it with :meth:`open`, never construct it directly."""

    def __init__(
        self,
        location: LocalLocation,
        meta: StoreMeta,
        *,
        read_only: bool,
        compression: Compression,
        lock: WriterLock | None = None,
    ) -> None:
        self.location = location
        self._lock = lock
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
        document = read_root(location)
        if document is None:
            if read_only:
                raise FileNotFoundError(f"no zarr_rb store at {str(root)!r}")
            if root.exists() and any(
                p.name != LOCK_FILE and not is_temporary(p) for p in root.iterdir()
            ):
                raise NotAStoreError(
                    f"{where} is a non-empty directory without a zarr_rb store; "
                    "choose a new or empty directory",
                )
            if max_size is None:
                raise ValueError(f"max_size is required to create a new store at {str(root)!r}")
            location.create_root()
        else:
            check_is_store(document, where)
        if read_only:
            assert document is not None
            meta = parse_meta(document, where, max_size=max_size, ndim=ndim)
            return cls(location, meta, read_only=True, compression=compression)
        lock = WriterLock.acquire(root)
        try:
            # Now that no other writer can, re-read (another one may have committed or
            # created the store meanwhile) and clear what interrupted writes left behind.
            document = read_root(location)
            if document is None:
                assert max_size is not None
                meta = StoreMeta(max_size=max_size, ndim=ndim or 1, schema=None, commit=Commit())
                store = cls(location, meta, read_only=False, compression=compression, lock=lock)
                # The root record first: once it exists, the directory is a store, and a
                # crash before or after it leaves something that reopens.
                store._publish(meta.commit)
                with store.writing("creating the data group"):
                    location.create_group(DATA_GROUP)
                return store
            check_is_store(document, where)
            meta = parse_meta(document, where, max_size=max_size, ndim=ndim)
            location.remove_temporaries()
            return cls(location, meta, read_only=False, compression=compression, lock=lock)
        except BaseException:
            lock.release()
            raise

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
        # Row masks are sized from the schema: check it against an array on disk first.
        first = schema.leaves[0]
        self.location.check_array_metadata(first.path, (schema.rows, *self.element_shape(first)))
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
        # Rows known to hold intact data: those of the commit. Rows past it were never
        # written or belong to an interrupted write; they become valid when written.
        self._valid = readable.copy()

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
        with self.writing("creating the arrays"):
            self._create_arrays(schema, groups, block_rows)
        self.meta = dataclasses.replace(self.meta, schema=schema, block_rows=block_rows)
        self._attach_schema(schema, block_rows)
        self._publish(self.committed)

    def _create_arrays(self, schema: Schema, groups: list[str], block_rows: int) -> None:
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

    def array(self, key: Key) -> RowArray:
        array = self._arrays.get(key)
        if array is None:
            assert self.schema is not None
            leaf = self._leaf(key)
            expected = (self.rows, *self.element_shape(leaf))
            self.location.check_array_metadata(leaf.path, expected)
            try:
                array = self.location.open_array(leaf.path, read_only=self.read_only)
            except ValueError as err:
                raise StoreCorruptedError(
                    f"store {str(self.location.root)!r}: cannot open array {leaf.path!r} ({err})"
                ) from None
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
            try:
                self._write_to_disk(writes)
            except BaseException:
                self._keep_in_ram(writes)
                raise
            self._commit()

    def _keep_in_ram(self, writes: Sequence[tuple[np.ndarray, Mapping[Key, torch.Tensor]]]) -> None:
        """Stage the rows of failed writes, so that the next flush writes them again."""
        assert self._buffer is not None
        for rows, values in writes:
            self._buffer.stage(rows, values, force=True)

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
        with self.writing("writing rows"):
            futures = []
            try:
                for rows, values in writes:
                    for key, tensor in values.items():
                        futures.append(self.array(key).write_rows(rows, to_numpy(tensor)))
            finally:
                errors = []
                for future in futures:
                    try:
                        future.result()
                    except ValueError as err:
                        errors.append(err)
            if errors:
                raise errors[0]
        self._valid |= touched

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn a failed write (a full disk, an I/O error) into a :class:`StoreWriteError`."""
        try:
            yield
        except (OSError, ValueError) as err:
            if isinstance(err, ZarrRBError):
                raise
            reason = str(err).split(" [source locations=")[0]
            raise StoreWriteError(
                errno_of(err),
                f"store {str(self.location.root)!r}: {what} failed ({reason}). The store "
                f"stays at its last commit (generation {self.committed.generation}, length "
                f"{self.committed.length}); rows not yet committed are kept in RAM. Free "
                "space or fix the disk, then retry with flush() or zarr_rb.save(), or reopen "
                "the store",
            ) from None

    def withdraw(self, rows: np.ndarray) -> int:
        """Withdraw rows (a boolean mask) from the readable range until they are rewritten;
        returns how many were readable."""
        self._check_writable()
        assert self._valid is not None
        assert self._published is not None
        withdrawn = int((self._published & rows).sum())
        self._valid &= ~rows
        if withdrawn:
            self._publish_mask(self._published & ~rows, length=self.committed.length)
        return withdrawn

    def flush(self) -> None:
        """Write every row held in RAM and publish a commit that covers them."""
        if self.read_only or self.closed or self._buffer is None:
            return
        blocks = list(self._buffer)
        if blocks:
            writes = [_block_rows(block) for block in blocks]
            self._buffer.clear()
            try:
                self._write_to_disk(writes)
            except BaseException:
                self._keep_in_ram(writes)
                raise
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
        self._publish(self.committed, saved=saved)

    def _publish(self, commit: Commit, *, saved: Saved | None = None) -> None:
        meta = dataclasses.replace(self.meta, commit=commit)
        if saved is not None:
            meta = dataclasses.replace(meta, saved=saved)
        with self.writing("publishing a commit"):
            self.location.write_root_attributes({ATTRS_KEY: meta.to_json()})
        self.meta = meta
        self.committed = commit

    # --- reading ---------------------------------------------------------------------------

    def read(self, rows: np.ndarray, keys: Iterable[Key]) -> dict[Key, torch.Tensor]:
        """Read rows (any order, repeats allowed) of some leaves, RAM-held rows included."""
        keys = list(keys)
        if self.read_only:
            return self._read_committed(rows, keys)
        assert self._buffer is not None
        assert self._valid is not None
        lost = ~self._valid[rows]
        if lost.any():
            lost &= ~self._buffer.staged_rows(rows)[0]
            if lost.any():
                raise RowsNotCommittedError(
                    f"store {str(self.location.root)!r}: rows {preview_rows(rows[lost])} "
                    "hold no intact data: a write to them was interrupted (a crash or a failed "
                    "write) and they have not been rewritten since",
                )
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
            assert self._valid is not None
            leaf = self._leaf(key)
            mirror = torch.zeros(
                (self.rows, *self.element_shape(leaf)), dtype=TORCH_DTYPES[leaf.dtype]
            )
            # Only rows known to be on disk: others were never written, or were lost to a
            # crash or a failed write, and are not readable until they are rewritten.
            on_disk = np.flatnonzero(self._valid)
            mirror[torch.from_numpy(on_disk)] = self._read_disk(on_disk, [key])[key]
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
        out = {}
        for key, future in futures.items():
            try:
                out[key] = from_numpy(future.result(), TORCH_DTYPES[self._leaf(key).dtype])
            except ValueError as err:
                raise self._damage(key, rows, err) from None
        return out

    def _damage(self, key: Key, rows: np.ndarray, err: ValueError) -> ValueError:
        """Why reading ``rows`` of a leaf failed: the damaged chunks among them, if any."""
        array = self.array(key)
        step = array.read_chunk_rows
        damaged: list[tuple[int, int, str]] = []
        for chunk in np.unique(rows // step).tolist():
            damaged.extend(array.damaged_runs(chunk * step, min(self.rows, (chunk + 1) * step)))
        if not damaged:
            return err  # nothing is damaged now: the chunk changed while it was read
        return ChunkCorruptedError(
            f"store {str(self.location.root)!r}: array {array.path!r}, "
            f"{describe_runs(damaged)}, cannot be read back intact ({damaged[0][2]}). "
            "Nothing was returned. `python -m zarr_rb verify <store>` lists every damaged "
            "chunk; `--repair` withdraws the damaged rows from the readable range",
            array=array.path,
            rows=[(a, b) for a, b, _ in damaged],
        )

    def refresh(self) -> Commit:
        """Re-read the commit record (readers); returns it."""
        where = f"store {str(self.location.root)!r}"
        document = read_root(self.location)
        if document is None:
            raise StoreCorruptedError(f"{where}: its root zarr.json is gone")
        check_is_store(document, where)
        meta = parse_store_meta(document["attributes"], where=where)
        if (meta.max_size, meta.ndim) != (self.meta.max_size, self.meta.ndim) or (
            self.schema is not None and meta.schema != self.schema
        ):
            raise StoreCorruptedError(f"{where}: its size or schema changed while it was open")
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
            except ValueError as err:  # damaged, or a shard replaced while it was read
                out, last_error = None, err
            unchanged = self.refresh().generation == commit.generation
            if unchanged and out is not None:
                return out
            if unchanged and isinstance(last_error, ChunkCorruptedError):
                raise last_error
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
            if self._lock is not None:
                self._lock.release()

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
