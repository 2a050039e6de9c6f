"""A store's data arrays: opened and checked against the schema, created, grown, and their
unreferenced slots deleted. Rows here are rows of the arrays (physical); where a position is
among them is the owner of the positions' business
(:attr:`Store.commits <zarr_rb.core.store.Store.commits>`). Writes are
:mod:`zarr_rb.core.array_writes`, reads :mod:`zarr_rb.core.disk_reads`, the leaves stored
as frames :mod:`zarr_rb.core.frame_arrays`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.array_writes import ArraysOwner, ArrayWrites, PendingWrite, least_rows
from zarr_rb.core.disk_reads import read_rows, read_rows_all
from zarr_rb.core.dtypes import to_numpy
from zarr_rb.core.frame_arrays import FrameArrays
from zarr_rb.engine import RowArray
from zarr_rb.engine.layout import leaf_layout
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.locations.base import ROOT_METADATA
from zarr_rb.util.keys import Key

__all__ = ["ArraysOwner", "PendingWrite", "StoreArrays"]

ARRAYS_WAIT_SECONDS = 10.0
"""How long a store that just got its schema from another writer waits for its arrays."""


class StoreArrays(ArrayWrites):
    """The data arrays of one open store, opened once each."""

    frames: FrameArrays

    def __init__(self, store: ArraysOwner) -> None:
        self.store = store
        self._open: dict[Key, RowArray] = {}
        self._pending: list[PendingWrite] = []
        """Writes started and not finished: waited for at close."""
        self._landing: concurrent.futures.ThreadPoolExecutor | None = None
        """The thread that waits for writes ``behind`` and syncs what they wrote."""
        self.frames = FrameArrays(store)
        """The leaves stored as frames (``Compression(frames=True)``): their own arrays."""

    def expected_shape(self, leaf: LeafSpec) -> tuple[int | None, ...]:
        """The shape a leaf's array must have (``None``: any length along that dimension:
        the rows, at least the capacity's and more once slots were added for copies; a
        ragged array's width)."""
        if leaf.ragged:
            return (None, None, *leaf.shape)
        return (None, *self.store.element_shape(leaf))

    def wait_for(self, schema: Schema) -> None:
        """The arrays of a shared store are created by the writer that set its schema,
        right after it published it: wait for the last of them (:meth:`create` makes the
        frames leaves' arrays first)."""
        framed = schema.frame_keys
        plain = [leaf.path for leaf in schema.leaves if leaf.key not in framed]
        last = plain[-1] if plain else self.frames.paths(schema)[-1]
        deadline = time.monotonic() + ARRAYS_WAIT_SECONDS
        while self.store.engine.location.read(f"{last}/{ROOT_METADATA}") is None:
            if time.monotonic() > deadline:
                return  # reported by the checks that follow
            time.sleep(0.01)

    def check_metadata(self, schema: Schema) -> None:
        """Check the schema against an array on disk (row masks are sized from it)."""
        framed = schema.frame_keys
        first = next(
            (leaf for leaf in schema.leaves if not leaf.ragged and leaf.key not in framed), None
        )
        if first is not None:
            self.store.engine.check_array_metadata(first.path, self.expected_shape(first))

    def get(self, key: Key) -> RowArray:
        """The array of ``key``, opened and checked against the schema at its first use.

        Raises:
            StoreCorruptedError: it does not match the schema.
        """
        array = self._open.get(key)
        if array is not None:
            return array
        store = self.store
        leaf = store.leaf(key)
        expected = self.expected_shape(leaf)
        store.engine.check_array_metadata(leaf.path, expected)
        try:
            array = store.engine.open_array(
                leaf.path, read_only=store.read_only, ragged=leaf.ragged
            )
        except ValueError as err:
            raise StoreCorruptedError(
                f"store {store.url!r}: cannot open array {leaf.path!r} ({err})"
            ) from None
        least = least_rows(store)
        shape_ok = (
            len(array.shape) == len(expected)
            and array.shape[0] >= least
            and all(
                want is None or want == got
                for want, got in zip(expected[1:], array.shape[1:], strict=False)
            )
        )
        if not shape_ok or array.dtype != np.dtype(leaf.stored_dtype):
            want = (store.physical_rows, *expected[1:])
            raise StoreCorruptedError(
                f"store {store.url!r}: array {leaf.path!r} has shape "
                f"{array.shape} and dtype {array.dtype}, expected {want} (at least as "
                f"many rows) and {leaf.stored_dtype}",
            )
        self._open[key] = array
        return array

    def forget(self, keys: Iterable[Key]) -> None:
        """Forget the opened arrays of ``keys`` (keys the store did not take after all: made
        again, they are opened again)."""
        for key in keys:
            self._open.pop(key, None)

    def close(self) -> None:
        """Forget the opened arrays (the store is closed), once the writes started have
        ended (whatever their outcome: no write lands after the store is let go)."""
        for pending in self._pending:
            try:
                self._wait(pending)
            except KeyboardInterrupt:
                raise
            except BaseException:
                pass
        self._pending.clear()
        if self._landing is not None:
            # Its writes were waited for above: its thread only has to end. Not joined: a
            # store closed by its finalizer may close from inside the threading module's
            # own bookkeeping (a garbage collection there), whose lock a join takes again.
            self._landing.shutdown(wait=False)
            self._landing = None
        self._open.clear()
        self.frames.forget()

    def create(
        self,
        leaves: Sequence[LeafSpec],
        batch_shape: tuple[int, ...],
        block_rows: int,
        *,
        replace: bool = True,
        samples: Mapping[Key, torch.Tensor] | None = None,
        schema: Schema | None = None,
    ) -> None:
        """Create the arrays of ``leaves``. ``samples``: the first rows written of some of
        them; a large leaf among those that the codec does not shrink is stored raw.
        ``schema``: the schema being set, whose frames leaves get their own arrays.

        Raises:
            UnsupportedDataError: a leaf that cannot be laid out in chunks; raised before
                any array is created.
        """
        store = self.store
        store.lifetime.check_hold()
        framed = schema.frame_keys if schema is not None else frozenset()
        plain = [leaf for leaf in leaves if leaf.key not in framed]
        if schema is not None and schema.frames:
            self.frames.create(schema, batch_shape[0], block_rows, replace=replace, samples=samples)
        leaves = plain
        layouts = [
            leaf_layout(
                leaf, batch_shape=batch_shape, block_rows=block_rows, compression=store.compression
            )
            for leaf in leaves
        ]
        groups = sorted(
            {
                "/".join(leaf.path.split("/")[:i])
                for leaf in leaves
                for i in range(2, leaf.path.count("/") + 1)
            }
        )
        for group in groups:
            store.engine.create_group(group)
        for leaf, layout in zip(leaves, layouts, strict=True):
            compression = store.compression
            sample = None if samples is None else samples.get(leaf.key)
            large = layout.shards is not None and not leaf.ragged
            if large and sample is not None and not compression.shrinks(to_numpy(sample)):
                compression = dataclasses.replace(compression, codec="none")
            store.engine.create_array(
                leaf.path,
                layout=layout,
                dtype=leaf.stored_dtype,
                compression=compression,
                attributes={ATTRS_KEY: {"dtype": leaf.dtype, "batch_dims": len(batch_shape)}},
                replace=replace,
            )

    def ensure(self) -> None:
        """Create the arrays of the schema that are missing (shared stores: whichever
        writer gets there first; the same metadata from every one)."""
        schema = self.store.schema
        assert schema is not None
        with self.store.writing("creating the arrays"):
            self.create(
                schema.leaves,
                (self.store.physical_rows, *schema.batch_shape[1:]),
                self.store.meta.block_rows or 1,
                replace=False,
                schema=schema,
            )

    def ensure_capacity(self, slots: int) -> None:
        """Give the arrays rows for ``slots`` slots (a shared store whose writers took
        more): their metadata only. Resizes only ever grow an array, so that writers
        growing it at once leave it at the largest size asked."""
        if self.store.schema is None:
            return
        rows = slots * (self.store.meta.block_rows or 1)
        with self.store.writing("adding slots to the arrays"):
            for array in self.row_arrays():
                for _ in range(5):
                    if array.shape[0] >= rows:
                        break
                    try:
                        array.grow_rows(rows)
                    except ValueError:
                        array.refresh()  # another writer resized it meanwhile
                else:
                    array.grow_rows(rows)

    # --- slots -----------------------------------------------------------------------------

    def whole_block_keys(self) -> list[Key]:
        """The leaves whose write chunks (objects) each hold one block and are copied as
        stored to move a block: one object per slot, which a collection can delete (larger
        shards keep their slots' rows, written over when the slots are reused). Not the
        frames leaves, copied by value (:meth:`block_arrays` has their arrays)."""
        block_rows = self.store.meta.block_rows or 1
        framed = self.frames.keys()
        return [
            key
            for key in self.store.leaves
            if key not in framed and self.get(key).chunk_rows == block_rows
        ]

    def block_arrays(self) -> list[RowArray]:
        """Every array whose objects each hold one block: those of :meth:`whole_block_keys`
        and the frames leaves' (what a collection deletes by slot)."""
        return [*(self.get(key) for key in self.whole_block_keys()), *self.frames.arrays()]

    def objects_by_block(self) -> bool:
        """Whether every leaf is stored in objects of one block each."""
        framed = self.frames.keys()
        return len(self.whole_block_keys()) + len(framed) == len(self.store.leaves)

    def row_arrays(self) -> list[RowArray]:
        """Every array that holds rows: each leaf's, but the frames leaves', whose cells
        and ids arrays hold theirs."""
        framed = self.frames.keys()
        arrays = [self.get(key) for key in self.store.leaves if key not in framed]
        return [*arrays, *self.frames.arrays()]

    def grow_rows(self, rows: int) -> None:
        """Give every array ``rows`` rows (metadata only)."""
        for array in self.row_arrays():
            array.grow_rows(rows)

    @staticmethod
    def stored_slots(arrays: Sequence[RowArray]) -> set[int]:
        """The slots of which one of ``arrays`` (of :meth:`block_arrays`) holds an object
        (one listing each)."""
        return set().union(*(array.stored_chunks() for array in arrays))

    def drop_slots(self, arrays: Sequence[RowArray], slots: Sequence[int]) -> None:
        """Delete the objects of ``slots`` in ``arrays`` (of :meth:`block_arrays`: slots no
        record refers to, that no writer writes)."""
        with self.store.writing("deleting slots no record refers to"):
            for array in arrays:
                array.drop_chunks(slots)

    def forget_slots(self, slots: Sequence[int]) -> None:
        """Drop the cached objects of ``slots`` (a reader: their objects were created
        anew since it cached them)."""
        cache = self.store.engine.cache
        if cache is None or not slots or self.store.schema is None:
            return
        block_rows = self.store.meta.block_rows or 1
        rows = np.asarray(sorted(set(slots)), dtype=np.int64) * block_rows
        for array in self.row_arrays():
            cache.invalidate(array.chunk_keys(rows, run=False))

    # --- reading ---------------------------------------------------------------------------

    def read(
        self,
        requests: Mapping[Key, np.ndarray],
        lengths: Mapping[Key, np.ndarray] | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Read the rows at positions ``requests[key]`` of each key, from disk (see
        :func:`~zarr_rb.core.disk_reads.read_rows`)."""
        return read_rows(self, requests, lengths)

    def read_all(
        self,
        requests: Mapping[Key, np.ndarray],
        *,
        physical: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> dict[Key, torch.Tensor]:
        """:meth:`read` of leaves and of the lengths of their ragged ones (``physical``:
        where positions are, if not where the store has them now)."""
        return read_rows_all(self, requests, physical=physical)
