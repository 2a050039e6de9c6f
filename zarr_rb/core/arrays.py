"""A store's data arrays: opened and checked against the schema, created, grown, written
by slot, and their unreferenced slots deleted. Rows here are rows of the arrays (physical);
where a position is among them is the owner of the positions' business
(:attr:`Store.commits <zarr_rb.core.store.Store.commits>`). Reads are
:mod:`zarr_rb.core.disk_reads`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import tensorstore as ts
import torch

from zarr_rb.core.disk_reads import RowsOwner, padded, read_rows, read_rows_all
from zarr_rb.core.dtypes import to_numpy
from zarr_rb.core.write_cache import Write
from zarr_rb.engine import Engine, RowArray, once
from zarr_rb.engine.layout import Compression, leaf_layout
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.locations.base import ROOT_METADATA
from zarr_rb.util.keys import Key

ARRAYS_WAIT_SECONDS = 10.0
"""How long a store that just got its schema from another writer waits for its arrays."""


class _Hold(Protocol):
    def check_hold(self) -> None: ...
    @property
    def creates_once(self) -> bool: ...


class ArraysOwner(RowsOwner, Protocol):
    """What the arrays use of their store (:class:`~zarr_rb.core.store.Store`)."""

    @property
    def engine(self) -> Engine: ...
    @property
    def compression(self) -> Compression: ...
    @property
    def physical_rows(self) -> int: ...
    @property
    def lifetime(self) -> _Hold: ...

    def writing(
        self, what: str, *, kept: bool = True
    ) -> contextlib.AbstractContextManager[None]: ...


@dataclasses.dataclass(eq=False)
class PendingWrite:
    """A write of rows started and not waited for (see :meth:`StoreArrays.start_rows`)."""

    futures: list[ts.WriteFutures]
    behind: bool
    """Whether commits made until it finishes do not depend on it (see
    :meth:`StoreArrays.start_rows`)."""
    written: list[tuple[RowArray, list[str]]]
    """The chunk objects each array writes: durable at the first commit after the write
    completes (a commit while it runs may sync them before they hold their data)."""
    landed: concurrent.futures.Future[list[ValueError]] | None = None
    """A write ``behind``: its wait and the sync of its objects, on a thread of its own (the
    errors of the write)."""
    lent: list[weakref.ref[np.ndarray]] = dataclasses.field(default_factory=list)
    """A write ``behind``: the arrays TensorStore writes without a copy (see
    :meth:`released`)."""

    def has_landed(self) -> bool:
        """Whether a write ``behind`` has finished (written and synced, or failed): waiting
        for it returns at once."""
        return self.landed is not None and self.landed.done()

    def released(self) -> bool:
        """Whether TensorStore holds none of the arrays it wrote without a copy: their
        memory may take other values. (TensorStore may keep them after the write; it lets
        go of them when it completes, as measured, and this checks it each time.)"""
        return all(ref() is None for ref in self.lent)


class StoreArrays:
    """The data arrays of one open store, opened once each."""

    def __init__(self, store: ArraysOwner) -> None:
        self.store = store
        self._open: dict[Key, RowArray] = {}
        self._pending: list[PendingWrite] = []
        """Writes started and not finished: waited for at close."""
        self._landing: concurrent.futures.ThreadPoolExecutor | None = None
        """The thread that waits for writes ``behind`` and syncs what they wrote."""

    def expected_shape(self, leaf: LeafSpec) -> tuple[int | None, ...]:
        """The shape a leaf's array must have (``None``: any length along that dimension:
        the rows, at least the capacity's and more once slots were added for copies; a
        ragged array's width)."""
        if leaf.ragged:
            return (None, None, *leaf.shape)
        return (None, *self.store.element_shape(leaf))

    def wait_for(self, schema: Schema) -> None:
        """The arrays of a shared store are created by the writer that set its schema,
        right after it published it: wait for the last of them."""
        last = schema.leaves[-1]
        deadline = time.monotonic() + ARRAYS_WAIT_SECONDS
        while self.store.engine.location.read(f"{last.path}/{ROOT_METADATA}") is None:
            if time.monotonic() > deadline:
                return  # reported by the checks that follow
            time.sleep(0.01)

    def check_metadata(self, schema: Schema) -> None:
        """Check the schema against an array on disk (row masks are sized from it)."""
        first = next(leaf for leaf in schema.leaves if not leaf.ragged)
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
        # (A shared store's writers grow its arrays after they took more slots: other
        # writers may not have yet; reads and writes past them grow or reopen them.)
        least = store.rows if store.committed.ring is not None else store.physical_rows
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
            self._landing.shutdown()
            self._landing = None
        self._open.clear()

    def create(
        self,
        leaves: Sequence[LeafSpec],
        batch_shape: tuple[int, ...],
        block_rows: int,
        *,
        replace: bool = True,
        samples: Mapping[Key, torch.Tensor] | None = None,
    ) -> None:
        """Create the arrays of ``leaves``. ``samples``: the first rows written of some of
        them; a large leaf among those that the codec does not shrink is stored raw.

        Raises:
            UnsupportedDataError: a leaf that cannot be laid out in chunks; raised before
                any array is created.
        """
        store = self.store
        store.lifetime.check_hold()
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
            )

    def ensure_capacity(self, slots: int) -> None:
        """Give the arrays rows for ``slots`` slots (a shared store whose writers took
        more): their metadata only. Resizes only ever grow an array, so that writers
        growing it at once leave it at the largest size asked."""
        if self.store.schema is None:
            return
        rows = slots * (self.store.meta.block_rows or 1)
        with self.store.writing("adding slots to the arrays"):
            for key in self.store.leaves:
                array = self.get(key)
                for _ in range(5):
                    if array.shape[0] >= rows:
                        break
                    try:
                        array.grow_rows(rows)
                    except ValueError:
                        array.refresh()  # another writer resized it meanwhile
                else:
                    array.grow_rows(rows)

    # --- writing ---------------------------------------------------------------------------

    def write_rows(
        self,
        writes: Sequence[Write],
        *,
        physical: bool = False,
        seeds: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Write rows to the slots the writer's map gives their blocks (``physical``: the
        rows are rows of the arrays already: a shared writer's). ``seeds``: when objects
        are created once, ``(slot, new slot)`` whose objects (of the arrays sharded by
        block) the new slot's start from, as stored."""
        store = self.store
        if physical:
            # (Its slots were taken with room in the arrays: Sharing._take.)
            store.lifetime.check_hold()
        if store.lifetime.creates_once:
            self._create_rows(writes, seeds, physical=physical)
            return
        assert not seeds
        self.finish(self.start_rows(writes, physical=physical))

    def start_rows(
        self, writes: Sequence[Write], *, physical: bool = False, behind: bool = False
    ) -> PendingWrite:
        """Start writing rows (as :meth:`write_rows`, to objects that may be written over)
        and return without waiting: :meth:`finish` waits. The values must not change until
        then. ``behind``: no commit made before it finishes depends on the objects it
        writes (they hold no row such a commit declares), and the values must never change
        (TensorStore writes them without a copy, and may keep them)."""
        store = self.store
        pending = PendingWrite([], behind, [])
        with store.writing("writing rows"):
            try:
                for rows, values in writes:
                    at = rows if physical else store.physical(rows)
                    for key, tensor in values.items():
                        array = self.get(key)
                        if array.ragged:
                            tensor = _whole_chunks(tensor, array)
                            if not tensor.shape[1]:
                                continue  # empty rows: nothing to write
                            array.grow(tensor.shape[1])
                        source = to_numpy(tensor)
                        future, keys = array.start_write_rows(at, source, behind=behind)
                        if behind:
                            pending.lent.append(weakref.ref(source))
                        del source
                        pending.futures.append(future)
                        pending.written.append((array, keys))
            except BaseException:
                self._wait(pending)  # what was started ends before the error is raised
                raise
        if behind:
            if self._landing is None:
                self._landing = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="zarr_rb-landing"
                )
            pending.landed = self._landing.submit(self._land, pending)
        self._pending.append(pending)
        return pending

    def finish(self, pending: PendingWrite, *, what: str = "writing rows") -> None:
        """Wait for a write :meth:`start_rows` started; raises the first of its errors."""
        self._pending.remove(pending)
        with self.store.writing(what):
            errors = self._wait(pending)
            if errors:
                raise errors[0]
        for array, keys in pending.written:
            # (Again: a commit while it ran may have synced them before they were whole.)
            array.mark_written(keys, behind=pending.behind)

    @classmethod
    def _land(cls, pending: PendingWrite) -> list[ValueError]:
        """Wait for a write and sync what it wrote (on the landing thread)."""
        errors = cls._wait_futures(pending)
        if not errors:
            for array, keys in pending.written:
                array.sync_objects(keys)
        return errors

    @classmethod
    def _wait(cls, pending: PendingWrite) -> list[ValueError]:
        """Wait for a write; returns its errors."""
        if pending.landed is not None:
            return pending.landed.result()
        return cls._wait_futures(pending)

    @staticmethod
    def _wait_futures(pending: PendingWrite) -> list[ValueError]:
        errors = []
        for future in pending.futures:
            try:
                future.result()
            except ValueError as err:
                errors.append(err)
        return errors

    def _create_rows(
        self, writes: Sequence[Write], seeds: Sequence[tuple[int, int]], *, physical: bool
    ) -> None:
        """:meth:`write_rows`, every object created once: the rows of each key together."""
        store = self.store
        seeded = self.whole_block_keys() if seeds else []
        by_key: dict[Key, list[tuple[np.ndarray, torch.Tensor]]] = {key: [] for key in seeded}
        for rows, values in writes:
            at = rows if physical else store.physical(rows)
            for key, tensor in values.items():
                by_key.setdefault(key, []).append((at, tensor))
        with store.writing("writing rows"):
            started = []
            try:
                for key, pieces in by_key.items():
                    array = self.get(key)
                    width = None
                    if array.ragged and pieces:
                        pieces = [(at, _whole_chunks(tensor, array)) for at, tensor in pieces]
                        width = max(int(tensor.shape[1]) for _, tensor in pieces)
                        if not width and key not in seeded:
                            continue  # empty rows: nothing to write
                        array.grow(width)
                        pieces = [(at, padded(tensor, width)) for at, tensor in pieces]
                    writes_of_key = [(at, to_numpy(tensor)) for at, tensor in pieces if width != 0]
                    key_seeds = seeds if key in seeded else ()
                    # A shared writer's slots are mostly taken again once free: with the
                    # objects of the rows they held (deleted first, in one round).
                    creation = array.create_rows(
                        writes_of_key, width=width, seeds=key_seeds, clear=physical
                    )
                    started.append((array, creation))
            finally:
                # (Every key's requests in flight at once; those started are waited for.)
                once.finish_all([creation for _, creation in started])
            for array, creation in started:
                array.forget(creation)

    # --- slots -----------------------------------------------------------------------------

    def whole_block_keys(self) -> list[Key]:
        """The leaves whose write chunks (objects) each hold one block: one object per
        slot, which a collection can delete (larger shards keep their slots' rows, written
        over when the slots are reused)."""
        block_rows = self.store.meta.block_rows or 1
        return [key for key in self.store.leaves if self.get(key).chunk_rows == block_rows]

    def stored_slots(self, keys: Sequence[Key]) -> set[int]:
        """The slots of which an array of ``keys`` holds an object (one listing each)."""
        return set().union(*(self.get(key).stored_chunks() for key in keys))

    def drop_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Delete the objects of ``slots`` in the arrays of ``keys`` (slots no record
        refers to, that no writer writes)."""
        with self.store.writing("deleting slots no record refers to"):
            for key in keys:
                self.get(key).drop_chunks(slots)

    def forget_slots(self, slots: Sequence[int]) -> None:
        """Drop the cached objects of ``slots`` (a reader: their objects were created
        anew since it cached them)."""
        cache = self.store.engine.cache
        if cache is None or not slots or self.store.schema is None:
            return
        block_rows = self.store.meta.block_rows or 1
        rows = np.asarray(sorted(set(slots)), dtype=np.int64) * block_rows
        for key in self.store.leaves:
            cache.invalidate(self.get(key).chunk_keys(rows, run=False))

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


def _whole_chunks(tensor: torch.Tensor, array: RowArray) -> torch.Tensor:
    """Ragged rows padded with zeros to whole chunks along their length (no chunk is
    partly written, which would read it back first)."""
    width = tensor.shape[1]
    return padded(tensor, -(-width // array.chunk_length) * array.chunk_length)
