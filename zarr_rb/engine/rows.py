"""One Zarr array addressed by rows (:class:`RowArray`): reads and writes of rows through
TensorStore, and the keys of its objects (what a read that failed found damaged:
:mod:`zarr_rb.engine.damage`).

:class:`~zarr_rb.engine.tensorstore.Engine` opens them; this module knows nothing of stores
or commits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import numpy as np
import tensorstore as ts

from zarr_rb.engine import once
from zarr_rb.engine.cache import EncodedCache
from zarr_rb.locations.base import ROOT_METADATA, Location, is_temporary, join
from zarr_rb.util.io import announce

MAX_CACHED_OBJECT_BYTES = 4 * 2**20
"""Arrays whose stored objects (shards) are at most this large on average are read from
the cache of encoded objects; larger ones by byte ranges, an inner chunk at a time."""


def delete_key(kvstore: ts.KvStore, key: str) -> None:
    """Delete one key of ``kvstore`` (missing: nothing to do), and wait until it is gone."""
    kvstore.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()


class PendingRead(Protocol):
    def result(self) -> np.ndarray: ...


class _Done:
    """A read already done (or failed)."""

    def __init__(self, values: np.ndarray | None = None, *, error: Exception | None = None):
        self._values = values
        self._error = error

    def result(self) -> np.ndarray:
        if self._error is not None:
            raise self._error
        assert self._values is not None
        return self._values


class _Runs:
    """Reads of several row runs, concatenated in order when their result is asked for."""

    def __init__(self, futures: list[PendingRead]) -> None:
        self._futures = futures

    def result(self) -> np.ndarray:
        return np.concatenate([future.result() for future in self._futures])


def as_bits(array: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers of the same width (for bitwise comparison)."""
    width = array.dtype.itemsize
    if width in (1, 2, 4, 8):
        return array.view(np.dtype(f"u{width}"))
    return array.view(np.uint8)


class RowArray:
    """One Zarr array addressed by rows (its first dimension).

    A *ragged* array keeps rows of different lengths along its second dimension: each row
    is written and read up to a width (its length, or the longest of the rows asked for),
    and the array grows wider when a longer row comes.
    """

    def __init__(
        self,
        array: ts.TensorStore,
        path: str,
        *,
        location: Location,
        ragged: bool = False,
        reopen: Callable[[], ts.TensorStore] | None = None,
        cache: EncodedCache | None = None,
        reopen_cached: Callable[[], ts.TensorStore] | None = None,
    ) -> None:
        self._array = array
        self._cache = cache
        self._reopen_cached = reopen_cached
        self._cached_array = None if reopen_cached is None else reopen_cached()
        """The same array read from the cache, if there is one."""
        self._through_cache: bool | None = None if cache is not None else False
        """Whether reads go through the cache (decided at the first read)."""
        self.path = path
        self.ragged = ragged
        self._location = location
        self._reopen = reopen
        encoding = array.spec().to_json().get("metadata", {}).get("chunk_key_encoding", {})
        self._v2_keys = encoding.get("name") == "v2"
        self._separator = encoding.get("configuration", {}).get("separator", "/")
        self._write_chunk = [int(c or 1) for c in array.chunk_layout.write_chunk.shape or ()]

    @property
    def location(self) -> Location:
        """Where the array's objects are."""
        return self._location

    @property
    def url(self) -> str:
        """The URL of the store the array is in."""
        return self._location.url

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self._array.shape)

    @property
    def width(self) -> int:
        """How long a row of a ragged array can be now."""
        return self.shape[1]

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self._array.dtype.numpy_dtype)

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk (per shard for sharded arrays: the unit written without reading)."""
        return _rows_of(self._array.chunk_layout.write_chunk)

    @property
    def read_chunk_rows(self) -> int:
        """Rows per stored (inner) chunk: the unit a checksum covers."""
        return _rows_of(self._array.chunk_layout.read_chunk)

    @property
    def chunk_length(self) -> int:
        """Elements of a row per chunk along the second dimension (ragged arrays)."""
        return self._write_chunk[1]

    def _tail_positions(self, width: int | None) -> list[tuple[int, ...]]:
        """Chunk grid positions along the dimensions after the first (up to ``width`` along
        the second one of a ragged array)."""
        extents = list(self.shape[1:])
        if width is not None:
            extents[0] = width
        grid = [
            math.ceil(n / max(c, 1)) for n, c in zip(extents, self._write_chunk[1:], strict=True)
        ]
        return list(itertools.product(*(range(n) for n in grid)))

    def chunk_key(self, chunk: int, tail: tuple[int, ...] = ()) -> str:
        """The key (below the store's root) of write chunk (shard) ``chunk`` along the
        rows."""
        indices = [str(chunk), *(str(i) for i in tail)]
        key: str = self._separator.join(indices if self._v2_keys else ["c", *indices])
        return join(self.path, key)

    def chunk_keys(
        self, rows: np.ndarray, width: int | None = None, *, run: bool | None = None
    ) -> list[str]:
        """Keys of the chunks (shards) holding ``rows``; ``run``: whether ``rows`` is one
        run (``start, start + 1, ...``), whose chunks follow from its ends."""
        tails = self._tail_positions(width)
        if run is None:
            run = is_run(rows)
        if run:
            chunks: Any = range(
                int(rows[0]) // self.chunk_rows, int(rows[-1]) // self.chunk_rows + 1
            )
        else:
            chunks = np.unique(rows // self.chunk_rows).tolist()
        return [self.chunk_key(chunk, tail) for chunk in chunks for tail in tails]

    def _region(
        self, first: Any, width: int | None, array: ts.TensorStore | None = None
    ) -> ts.TensorStore:
        """``self[first]``, up to ``width`` along a ragged array's second dimension, of
        ``array`` (by default the array itself)."""
        array = self._array if array is None else array
        region: ts.TensorStore = array[first] if width is None else array[first, 0:width]
        return region

    def _cached(self) -> bool:
        """Whether reads go through the cache (decided at the first read)."""
        if self._through_cache is None:
            self._through_cache = self._worth_caching()
        return self._through_cache

    def _read_region(self, first: Any, rows: np.ndarray, width: int | None) -> PendingRead:
        """Start reading ``self[first]`` (rows ``rows``). Through the cache the read is
        done before this returns: the objects it needs stay cached only until then."""
        if not self._cached():
            return cast(PendingRead, self._region(first, width).read())
        assert self._cache is not None
        region = self._region(first, width, self._cached_array)
        try:
            values = self._cache.read(self.chunk_keys(rows, width), lambda: region.read().result())
        except ValueError as err:
            return _Done(error=err)  # raised by result(), as TensorStore's futures do
        return _Done(values)

    def _worth_caching(self) -> bool:
        """Whether whole objects of this array are small enough to fetch for a few rows
        (compressed frames are; incompressible ones are read by byte ranges instead)."""
        sizes = [
            size
            for key, size in self._location.list(self.path).items()
            if not key.endswith(ROOT_METADATA) and size >= 0
        ]
        if sizes:
            return sum(sizes) / len(sizes) <= MAX_CACHED_OBJECT_BYTES
        return math.prod(self._write_chunk) * self.dtype.itemsize <= MAX_CACHED_OBJECT_BYTES

    def _read(self, first: slice, width: int | None) -> PendingRead:
        return self._read_region(first, np.arange(first.start, first.stop), width)

    def read_rows(self, rows: np.ndarray, width: int | None = None) -> PendingRead:
        """Start reading ``rows`` (any order, repeats allowed): ``[len(rows), ...]``, up to
        ``width`` along the second dimension of a ragged array."""
        if width is not None and width > self.width:
            self.refresh()  # the writer made it wider since it was opened
        if is_run(rows):
            return self._read(slice(int(rows[0]), int(rows[0]) + rows.size), width)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        if (breaks.size + 1) * 4 <= rows.size:
            # Runs of consecutive rows (trajectory slices): one slice read per run is
            # several times faster than a TensorStore index-array read of the same rows.
            bounds = zip(
                np.concatenate(([0], breaks)).tolist(),
                np.concatenate((breaks, [rows.size])).tolist(),
                strict=True,
            )
            return _Runs(
                [self._read(slice(int(rows[a]), int(rows[a]) + b - a), width) for a, b in bounds]
            )
        return self._read_region(rows, rows, width)

    def write_rows(self, rows: np.ndarray, values: np.ndarray) -> ts.WriteFutures:
        """Start writing ``values[i]`` to row ``rows[i]`` (``rows`` unique; see
        :meth:`start_write_rows`), made durable by the next commit."""
        future, _ = self.start_write_rows(rows, values)
        return future

    def start_write_rows(
        self, rows: np.ndarray, values: np.ndarray, *, behind: bool = False
    ) -> tuple[ts.WriteFutures, list[str]]:
        """Start writing rows (of a ragged array, up to the width of ``values``: widen it
        first with :meth:`grow`); returns the write and the chunk objects it writes.
        ``behind``: commits made before it completes neither depend on them (announced)
        nor sync them (see :meth:`mark_written`); ``values``, written without a copy, are
        TensorStore's to keep: they must never change."""
        width = int(values.shape[1]) if self.ragged else None
        announce("write", self._location.path_of(self.path))
        run = is_run(rows)
        keys = self.chunk_keys(rows, width, run=run)
        if behind:
            for key in keys:
                announce("behind", self._location.path_of(key))
        else:
            self._location.written(keys)
        if self._cache is not None:
            self._cache.invalidate(keys)
        at = slice(int(rows[0]), int(rows[0]) + rows.size) if run else rows
        return self._region(at, width).write(
            values, can_reference_source_data_indefinitely=behind
        ), keys

    @staticmethod
    def sync_objects(written: Sequence[tuple[RowArray, list[str]]]) -> None:
        """Make these objects of these arrays durable now (any thread), together for each
        location (the write-back of a local store's files started at once: see
        ``LocalLocation.sync_objects``)."""
        by_location: dict[int, tuple[Location, list[str]]] = {}
        for array, keys in written:
            location = array.location
            by_location.setdefault(id(location), (location, []))[1].extend(keys)
        for location, keys in by_location.values():
            location.sync_objects(keys)

    def mark_written(self, keys: list[str], *, behind: bool = False) -> None:
        """Objects written: made durable by the next commit (``behind``: by a write
        started with ``behind``, which has landed, and whose objects were synced since
        with :meth:`sync_objects`: the commit makes their names durable)."""
        if behind:
            for key in keys:
                announce("landed", self._location.path_of(key))
        self._location.written(keys, synced=behind)

    def create_rows(
        self,
        writes: Sequence[tuple[np.ndarray, np.ndarray]],
        *,
        width: int | None = None,
        seeds: Sequence[tuple[int, int]] = (),
        clear: bool = False,
    ) -> once.Creation:
        """Start writing ``values`` to ``rows`` for each pair of ``writes``, every object
        they make created once (see :mod:`zarr_rb.engine.once`): encoded in RAM, then
        created on the store by a conditional PUT (wait with :func:`once.finish_all`). The
        objects are made of these rows alone, never merged with what the store holds: the
        writes cover every row of a slot that holds data. Rows of a ragged array up to
        ``width`` (widen it first with :meth:`grow`). ``seeds``: ``(slot, new slot)``
        pairs (write chunks along the rows) whose objects the new slot's start from, as
        stored (the write goes over them, as over the objects of a slot in place).
        ``clear``: delete the objects first (slots that likely hold leftovers)."""
        announce("write", self._location.path_of(self.path))
        shadow = once.shadow_of(self._array)
        if seeds:
            source, memory = self._array.kvstore, shadow.kvstore
            assert source is not None
            assert memory is not None
            prefix = len(self.path) + 1
            tails = self._tail_positions(None)
            pairs = [
                (self.chunk_key(old, tail)[prefix:], self.chunk_key(new, tail)[prefix:])
                for old, new in seeds
                for tail in tails
            ]
            reads = [(new, source.read(old)) for old, new in pairs]
            for new, read in reads:
                found = read.result()
                if found.state == "value":
                    memory.write(new, found.value).result()
        futures = []
        for rows, values in writes:
            first: Any = slice(int(rows[0]), int(rows[0]) + rows.size) if is_run(rows) else rows
            futures.append(self._region(first, width, shadow).write(values))
        for future in futures:
            future.result()
        target = self._array.kvstore
        assert target is not None
        creation = once.Creation(
            shadow,
            target,
            where=lambda key: str(self._location.path_of(join(self.path, key))),
            clear=clear,
        )
        keys = [join(self.path, key) for key in creation.keys]
        self._location.written(keys)
        if self._cache is not None:  # (again once written: see forget)
            self._cache.invalidate(keys)
        return creation

    def forget(self, creation: once.Creation) -> None:
        """Drop the objects of a finished ``creation`` from the cache (a read between its
        start and its end may have fetched an object it replaced)."""
        if self._cache is not None:
            self._cache.invalidate([join(self.path, key) for key in creation.keys])

    def copy_chunk(self, source: int, target: int) -> None:
        """Copy write chunk (shard) ``source`` along the rows, every part of it, onto chunk
        ``target``, as stored (no decoding): the rows of one block into another slot, to
        be written over there. A part ``source`` lacks is removed from ``target``. Through
        the array's own key-value store, as its writes: made durable by the next commit."""
        kvstore = self._array.kvstore
        assert kvstore is not None
        prefix = len(self.path) + 1
        copied = []
        for tail in self._tail_positions(None):
            old, new = self.chunk_key(source, tail), self.chunk_key(target, tail)
            announce("write", self._location.path_of(new))
            found = kvstore.read(old[prefix:]).result()
            if found.state == "value":
                kvstore.write(new[prefix:], found.value).result()
                copied.append(new)
            else:  # (a stale part a crash brings back is never read: no row reaches it)
                delete_key(kvstore, new[prefix:])
                copied.append(new)  # its directory changed: made durable with the rest
        self._location.written(copied)
        if self._cache is not None:
            self._cache.invalidate([self.chunk_key(target, t) for t in self._tail_positions(None)])

    def stored_chunks(self) -> set[int]:
        """The write chunks (shards) along the rows that have an object in the store."""
        prefix = len(self.path) + 1
        out = set()
        for key in self._location.list(self.path):
            if is_temporary(key):
                continue  # (a write interrupted there: TensorStore's c.3.0.__lock)
            parts = key[prefix:].split(self._separator)
            if not self._v2_keys:
                if parts[0] != "c":
                    continue  # the array's zarr.json
                parts = parts[1:]
            if parts and parts[0].isdigit():
                out.add(int(parts[0]))
        return out

    def has_chunk(self, chunk: int) -> bool:
        """Whether write chunk (shard) ``chunk`` along the rows has an object in the store
        (its keys looked up alone: :meth:`stored_chunks` lists every object)."""
        return any(
            self._location.has(self.chunk_key(chunk, tail)) for tail in self._tail_positions(None)
        )

    def drop_chunks(self, chunks: Iterable[int]) -> None:
        """Delete write chunks (shards) along the rows, every part of each: objects of
        slots no record refers to any longer."""
        kvstore = self._array.kvstore
        assert kvstore is not None
        prefix = len(self.path) + 1
        tails = self._tail_positions(None)
        keys = [self.chunk_key(chunk, tail) for chunk in chunks for tail in tails]
        for key in keys:
            announce("remove", self._location.path_of(key))
            delete_key(kvstore, key[prefix:])
        self._location.written(keys)  # their directories changed: durable at the next commit
        if self._cache is not None:
            self._cache.invalidate(keys)

    def grow_rows(self, rows: int) -> None:
        """Give the array at least ``rows`` rows (slots for copies of blocks): only its
        metadata changes, no chunk is rewritten."""
        if rows > self.shape[0]:
            self._resize(0, rows)

    def grow(self, width: int) -> None:
        """Make a ragged array at least ``width`` wide (doubling, in whole chunks): only its
        metadata changes, no chunk is rewritten."""
        if width <= self.width:
            return
        wider = max(width, 2 * self.width)
        self._resize(1, -(-wider // self.chunk_length) * self.chunk_length)

    def _resize(self, dimension: int, size: int) -> None:
        """Give ``dimension`` the length ``size``, by its metadata alone."""
        metadata = join(self.path, ROOT_METADATA)
        announce("write", self._location.path_of(metadata))
        self._location.written([metadata])
        shape = list(self.shape)
        shape[dimension] = size
        self._array = self._array.resize(
            exclusive_max=shape, resize_metadata_only=True, expand_only=True
        ).result()
        self._refresh_reader()

    def _refresh_reader(self) -> None:
        if self._reopen_cached is not None:
            assert self._cache is not None
            self._cache.invalidate([join(self.path, ROOT_METADATA)])
            self._cached_array = self._reopen_cached()

    def refresh(self) -> None:
        """Reopen the array to see the shape its writer gave it since."""
        if self._reopen is not None:
            self._array = self._reopen()
            self._refresh_reader()


def reaches(array: RowArray, row: int) -> bool:
    """Whether ``array`` has row ``row``; opened again first if it ends before it (a writer
    added slots since it was opened)."""
    if row >= array.shape[0]:
        array.refresh()
    return row < array.shape[0]


def _rows_of(grid: Any) -> int:
    """Rows (first dimension) of a TensorStore chunk grid."""
    shape = grid.shape
    assert shape is not None
    assert shape[0] is not None
    return int(shape[0])


def is_run(rows: np.ndarray) -> bool:
    """Whether ``rows`` is ``start, start + 1, ...`` (read or written as one slice)."""
    if rows.size == 0:
        return False
    return rows.size == 1 or bool(
        rows[-1] - rows[0] + 1 == rows.size and (np.diff(rows) == 1).all()
    )
