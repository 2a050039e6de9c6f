"""Array I/O: Zarr v3 metadata through zarr-python, row reads and writes through TensorStore.

This layer knows about arrays and rows on a location; it knows nothing about TorchRL.
zarr-python writes the arrays' metadata (so the files are whatever zarr-python writes and
reads), TensorStore does the hot path: it gathers scattered rows from sharded arrays one
to two orders of magnitude faster than zarr-python's own codec pipeline.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np
import tensorstore as ts

from zarr_rb._io import announce, load_json
from zarr_rb._progress import progress_bar
from zarr_rb.core.format import describe_runs
from zarr_rb.core.layout import MAX_CHUNK_ELEMENTS, Compression, LeafLayout
from zarr_rb.engine import once
from zarr_rb.engine.cache import EncodedCache
from zarr_rb.errors import (
    ChunkCorruptedError,
    FencedError,
    StoreCorruptedError,
    StoreNotFoundError,
)
from zarr_rb.locations.base import (
    ROOT_METADATA,
    Generation,
    Location,
    is_store_object,
    join,
)

STATE_CHUNK_BYTES = 2**20
WRITER_KEY = "zarr_rb_writer"
"""Root attribute naming the writer that claimed the store (object stores)."""


MAX_CACHED_OBJECT_BYTES = 4 * 2**20
"""Arrays whose stored objects (shards) are at most this large on average are read from
the cache of encoded objects; larger ones by byte ranges, an inner chunk at a time."""
MAX_RAGGED_WIDTH = 2**40
"""The widest a ragged array may claim to be (a bound on hostile metadata)."""


def array_metadata_problem(document: Any, shape: list[int | None]) -> str | None:
    """What is wrong with an array's parsed ``zarr.json`` for an array of ``shape``
    (``None``: any bounded length along that dimension, a ragged array's width)."""
    if not isinstance(document, dict) or document.get("node_type") != "array":
        return "zarr.json does not describe an array"
    found = document.get("shape")
    if not (
        isinstance(found, list)
        and len(found) == len(shape)
        and all(
            n == want
            if want is not None
            else isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_RAGGED_WIDTH
            for n, want in zip(found, shape, strict=True)
        )
    ):
        return f"shape {str(found)[:80]}, expected {shape}"
    grid = document.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunk_shapes = [config.get("chunk_shape") if isinstance(config, dict) else None]
    codecs = document.get("codecs")
    for codec in codecs if isinstance(codecs, list) else []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            config = codec.get("configuration")
            chunk_shapes.append(config.get("chunk_shape") if isinstance(config, dict) else None)
    for chunks in chunk_shapes:
        valid = (
            isinstance(chunks, list)
            and len(chunks) == len(shape)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in chunks)
        )
        if not valid or math.prod(chunks or ()) > MAX_CHUNK_ELEMENTS:
            return f"invalid chunk shape {str(chunks)[:80]}"
    return None


def _checksummed(compressors: list[Any]) -> list[Any]:
    """Codecs ending with a CRC32C of each stored chunk, so damage is detected on read."""
    from zarr.codecs import Crc32cCodec

    return [*compressors, Crc32cCodec()]


class Engine:
    """The arrays and metadata of one store, on a :class:`~zarr_rb.locations.Location`.

    Every object goes through the location's primitives; chunks go through TensorStore's
    kvstore for the same location. The commit record (the root ``zarr.json``) is written
    by compare-and-swap on the generation this engine last read or wrote, so a writer
    whose hold on the store was taken over can never overwrite a newer commit.
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        self._root_generation: Generation | None = None
        self._writer: dict[str, Any] | None = None
        """The writer that claimed the store (:meth:`claim`): named in every record it
        publishes, so that no two writers ever publish the same bytes."""
        self.cache: EncodedCache | None = None
        """Encoded objects in RAM that arrays are read from (remote locations)."""
        self.arrays_replaced = 0
        """Arrays this engine created again at a path (their objects deleted): a store
        whose objects are created once then draws a new ``ObjectEra`` for readers."""
        if location.cache_bytes > 0:
            source = location.run(
                lambda: ts.KvStore.open(location.kvstore(""), context=location.context).result(),
                "open",
            )
            self.cache = EncodedCache(source, limit=location.cache_bytes, errors=location.run)

    def __repr__(self) -> str:
        return f"Engine({self.location!r})"

    @property
    def url(self) -> str:
        return self.location.url

    # --- root metadata (the commit point) ------------------------------------------------

    def read_root_metadata(self, *, adopt: bool = False) -> dict[str, Any] | None:
        """The parsed root ``zarr.json``, or ``None`` if there is none.

        Args:
            adopt: make the generation read the one the next commit is conditional on (a
                writer that just took its hold). A writer's later reads never move it: a
                record changed by someone else must fail its next commit.
        """
        found = self.location.read_versioned(ROOT_METADATA)
        if adopt or self._root_generation is None:
            self._root_generation = found.generation
        if found.value is None:
            return None
        value = load_json(found.value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        return value

    def root_if_changed(self) -> dict[str, Any] | None:
        """The root document if it changed since this engine last read or wrote it (its
        generation adopted), else ``None``: one read, no parse when unchanged."""
        found = self.location.read_versioned(ROOT_METADATA)
        if found.generation == self._root_generation or found.value is None:
            return None
        self._root_generation = found.generation
        value = load_json(found.value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        return value

    def write_root_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Publish new root attributes (a commit): make every object written since the
        last commit durable, then replace the root ``zarr.json`` in one atomic write.

        A crash leaves either the old or the new metadata, never a mix, and the new one
        never refers to data that a power loss could take back.

        Raises:
            FencedError: the record changed since this writer last read or wrote it.
        """
        if not self.try_write_root_attributes(attributes):
            if self.location.read(ROOT_METADATA) is None:
                raise StoreNotFoundError(
                    f"store {self.url!r} was deleted while this writer had it open (by "
                    "another program, or with the temporary directory it lived in); nothing "
                    "was published. Give the storage a path that outlives it, or write the "
                    "rows again into a new store",
                )
            raise FencedError(
                f"store {self.url!r}: its commit record was changed by another writer since "
                "this one last committed; nothing was published. Reopen the store to write "
                "again",
                holder={},
            )

    def try_write_root_attributes(self, attributes: Mapping[str, Any]) -> bool:
        """:meth:`write_root_attributes`, returning ``False`` instead of raising when the
        record changed since this engine last read or wrote it (the writers of a shared
        store then read it again, merge and retry)."""
        self.location.sync()
        if self._writer is not None:
            attributes = {**attributes, WRITER_KEY: self._writer}
        payload = _group_metadata(attributes)
        if self._root_generation is None:
            self.read_root_metadata()
        assert self._root_generation is not None
        generation = self.location.write_if(
            ROOT_METADATA, payload, generation=self._root_generation
        )
        if generation is None:
            # A retried request whose first attempt landed fails its condition: the record
            # is then ours, byte for byte (each commit's record is unique, see claim()).
            current = self.location.read_versioned(ROOT_METADATA)
            if current.value == payload:
                generation = current.generation
        if generation is None:
            return False
        self._root_generation = generation
        return True

    def claim(self, writer: Mapping[str, Any]) -> None:
        """Rewrite the commit record as it is, naming ``writer`` (a compare-and-swap on the
        record read now, under the new writer's hold): a writer that held the store before
        and stalled can then no longer commit, even if it passed its last lease check.

        Every later record of this writer names it too: a record it publishes is then
        never byte for byte one that another writer published (were it, a refused commit
        would pass for its own retried request that landed, see
        :meth:`try_write_root_attributes`)."""
        self._writer = dict(writer)
        document = self.read_root_metadata(adopt=True)
        if document is None:
            return
        self.write_root_attributes(dict(document.get("attributes") or {}))

    def remove_tree(self, path: str) -> None:
        """Delete a group and everything under it (only the store's writer calls this, and
        only for nodes that the published root record no longer refers to)."""
        self.location.delete_prefix(path)

    def remove_temporaries(self) -> list[str]:
        """Delete what interrupted writes left (only ever called by the store's writer)."""
        return self.location.remove_leftovers()

    def _write_metadata(self, path: str, payload: bytes) -> None:
        key = join(path, ROOT_METADATA)
        self.location.write(key, payload)
        if self.cache is not None:
            self.cache.invalidate([key])

    def _ensure_groups(self, path: str) -> None:
        """Group metadata for ``path`` and each group above it that has none yet."""
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            group = "/".join(parts[:i])
            if self.location.read(join(group, ROOT_METADATA)) is None:
                self._write_metadata(group, _group_metadata({}))

    def create_root(self) -> None:
        self.location.create_root()

    # --- arrays ----------------------------------------------------------------------------

    def create_array(
        self,
        path: str,
        *,
        layout: LeafLayout,
        dtype: str,
        compression: Compression,
        attributes: Mapping[str, Any],
        replace: bool = True,
    ) -> None:
        """Create an array (and its parent groups), replacing any array at ``path``.

        zarr-python writes the metadata (so it is exactly what zarr-python writes and
        reads), into memory; the location stores it.

        Args:
            replace: remove what is at ``path`` first. ``False``: leave an array that is
                there alone (the writers of a shared store all create the arrays of the
                schema they agreed on; the same metadata, whoever writes it first).
        """
        if not replace and self.location.read(join(path, ROOT_METADATA)) is not None:
            return
        self._create(
            path,
            replace=replace,
            shape=layout.shape,
            dtype=dtype,
            chunks=layout.chunks,
            shards=layout.shards,
            compressors=_checksummed(compression.compressors()),
            attributes=dict(attributes),
            dimension_names=layout.dimension_names or None,
        )

    def _create(self, path: str, *, replace: bool = True, **settings: Any) -> None:
        import zarr
        from zarr.storage import MemoryStore

        documents: dict[str, Any] = {}
        zarr.create_array(MemoryStore(documents), fill_value=0, zarr_format=3, **settings)
        self._ensure_groups(path.rpartition("/")[0])
        if replace:
            # Chunks of an array previously at this path would be read as this one's.
            self.arrays_replaced += 1
            self.location.delete_prefix(path)
        if self.cache is not None:
            self.cache.invalidate(self.cache.keys_under(path))
        self._write_metadata(path, documents[ROOT_METADATA].to_bytes())

    def create_group(self, path: str) -> None:
        self._ensure_groups(path)

    def open_array(self, path: str, *, read_only: bool, ragged: bool = False) -> RowArray:
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": self.location.kvstore(path),
            # A chunk inside the committed range is never legitimately missing: reading
            # one is an error, not fill values. For that, every written chunk is stored,
            # even one that equals the fill value.
            "fill_missing_data_reads": False,
            "store_data_equal_to_fill_value": True,
        }

        def reopen() -> ts.TensorStore:
            return ts.open(
                spec, open=True, read=True, write=not read_only, context=self.location.context
            ).result()

        cache = self.cache
        if cache is None:
            return RowArray(
                reopen(),
                path,
                location=self.location,
                ragged=ragged,
                reopen=reopen,
            )
        metadata = join(path, ROOT_METADATA)
        cached_spec = {**spec, "kvstore": cache.kvstore(path)}

        def reopen_cached() -> ts.TensorStore:
            return cache.read(
                [metadata],
                lambda: ts.open(cached_spec, open=True, read=True, context=cache.context).result(),
            )

        return RowArray(
            self.location.run(reopen, f"opening array {path!r}"),
            path,
            location=self.location,
            ragged=ragged,
            reopen=reopen,
            cache=cache,
            reopen_cached=reopen_cached,
        )

    # --- state groups: small arrays and JSON attributes -------------------------------------

    def write_group_attributes(self, path: str, attributes: Mapping[str, Any]) -> None:
        self._write_metadata(path, _group_metadata(attributes))

    def _read_metadata(self, path: str, where: str) -> Any:
        """The parsed ``zarr.json`` of the node at ``path`` (``None``: there is none).

        Raises:
            StoreCorruptedError: it is not valid JSON, or nested too deep.
        """
        raw = self.location.read(join(path, ROOT_METADATA))
        if raw is None:
            return None
        try:
            return load_json(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise StoreCorruptedError(
                f"{where}: zarr.json is not valid JSON ({type(err).__name__})"
            ) from None

    def read_group_attributes(self, path: str) -> dict[str, Any]:
        document = self._read_metadata(path, f"store {self.url!r}: group {path!r}")
        if document is None:
            raise FileNotFoundError(f"no group {path!r} in store {self.url!r}")
        attributes = document.get("attributes", {}) if isinstance(document, dict) else None
        if not isinstance(attributes, dict):
            raise StoreCorruptedError(
                f"store {self.url!r}: group {path!r}: expected a JSON object of attributes"
            )
        return attributes

    def write_state_array(self, path: str, values: np.ndarray) -> tuple[int, list[Any]]:
        """Start writing a (small) state array, rewriting only the chunks whose bytes changed.

        Returns:
            The number of bytes (uncompressed) being written, and the futures to wait for.
        """
        values = np.ascontiguousarray(values)
        if values.ndim == 0:
            values = values.reshape(1)
        try:
            array = self.open_array(path, read_only=False)
        except (ValueError, FileNotFoundError):
            array = None
        if array is None or array.shape != values.shape or array.dtype != values.dtype:
            self._create_state_array(path, values)
            array = self.open_array(path, read_only=False)
            return int(values.nbytes), [array.write_rows(np.arange(values.shape[0]), values)]
        chunk = array.chunk_rows
        rows = values.shape[0]
        try:
            old = _as_bits(array.read_rows(np.arange(rows)).result())
        except ValueError:
            # A save into this (unpublished) slot was interrupted: rewrite every chunk.
            return int(values.nbytes), [array.write_rows(np.arange(rows), values)]
        new = _as_bits(values)
        futures = []
        written = 0
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            # Bitwise comparison: NaNs equal themselves, -0.0 differs from 0.0.
            if not np.array_equal(old[start:stop], new[start:stop]):
                futures.append(array.write_rows(np.arange(start, stop), values[start:stop]))
                written += values[start:stop].nbytes
        return written, futures

    def _create_state_array(self, path: str, values: np.ndarray) -> None:
        from zarr.codecs import ZstdCodec

        row_nbytes = max(1, values[:1].nbytes)
        chunk_rows = max(1, min(values.shape[0], STATE_CHUNK_BYTES // row_nbytes))
        self._create(
            path,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(chunk_rows, *values.shape[1:]),
            compressors=_checksummed([ZstdCodec(level=1)]),
        )

    def check_array_metadata(self, path: str, shape: tuple[int | None, ...]) -> None:
        """Read an array's ``zarr.json`` with a bounded parser before TensorStore sees it,
        and check it against the expected ``shape`` (before anything is sized from it).

        Raises:
            StoreCorruptedError: missing, unreadable, or not an array of that shape with
                bounded chunks.
        """
        where = f"store {self.url!r}: array {path!r}"
        document = self._read_metadata(path, where)
        if document is None:
            raise StoreCorruptedError(f"{where} is missing (no zarr.json)")
        problem = array_metadata_problem(document, list(shape))
        if problem is not None:
            raise StoreCorruptedError(f"{where}: {problem}")

    def read_state_array(self, path: str, *, size: int) -> np.ndarray:
        """Read a whole state array, which must hold ``size`` elements."""
        self.check_array_metadata(path, (size,))
        try:
            array = self.open_array(path, read_only=True)
        except ValueError as err:
            raise StoreCorruptedError(
                f"store {self.url!r}: cannot open state array {path!r} ({_short_reason(err)})"
            ) from None
        try:
            return np.asarray(array.read_rows(np.arange(array.shape[0])).result())
        except ValueError as err:
            damaged = array.damaged_runs(0, array.shape[0]) or [
                (0, array.shape[0], _short_reason(err))
            ]
            raise ChunkCorruptedError(
                f"store {self.url!r}: state array {path!r}, {describe_runs(damaged)}, "
                f"cannot be read back intact ({damaged[0][2]}); the saved buffer state is "
                "damaged: open the data with ZarrStorage(path=...) and save a buffer again",
                array=path,
                rows=[(a, b) for a, b, _ in damaged],
            ) from None

    def snapshot_to(self, target: Location, *, progress: bool = False) -> int:
        """Make ``target`` an independent copy of this store; returns the bytes that passed
        through this process.

        The location copies on the server, or by hard links on one filesystem, where it
        can. The root record is copied last, so an interrupted snapshot is no store at
        all (not one that misses chunks).
        """
        if target.exists():
            raise FileExistsError(
                f"snapshot target {target.url!r} exists and is not empty; save the snapshot "
                "to a new path, or delete the old one first",
            )
        # Temporaries of interrupted writes are not part of the store, nor is the writer's
        # lock or lease (a hard-linked lock file would even be shared with it).
        sizes = {k: max(0, n) for k, n in self.location.list().items() if is_store_object(k)}
        keys = sorted(sizes, key=lambda key: key == ROOT_METADATA)
        with progress_bar(sum(sizes.values()), desc="snapshot", unit="B", enabled=progress) as bar:
            return self.location.copy_to(target, keys, progress=bar.update)

    def nbytes(self) -> int:
        """Bytes of all objects of the store (0 for those whose size the location cannot
        tell)."""
        return sum(max(0, n) for n in self.location.list().values())


def _delete(kvstore: ts.KvStore, key: str) -> None:
    """Delete one key of ``kvstore`` (missing: nothing to do), and wait until it is gone."""
    kvstore.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()


def _group_metadata(attributes: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a group with these attributes."""
    document = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
    return json.dumps(document, indent=2, sort_keys=True).encode("utf-8")


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


def _as_bits(array: np.ndarray) -> np.ndarray:
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

    def damaged_runs(
        self, start: int, stop: int, width: int | None = None
    ) -> list[tuple[int, int, str]]:
        """The stored chunks among rows ``[start, stop)`` (up to ``width``) that cannot be
        read back intact.

        Returns:
            ``(first_row, end_row, reason)`` for each damaged chunk (rows clipped to the
            range asked).
        """
        try:
            self._read(slice(start, stop), width).result()
            return []
        except ValueError:
            pass
        step = self.read_chunk_rows
        damaged = []
        for first in range(start - start % step, stop, step):
            a, b = max(first, start), min(first + step, stop)
            try:
                self._read(slice(a, b), width).result()
            except ValueError as err:
                damaged.append((a, b, _short_reason(err)))
        return damaged

    def damage_error(
        self, rows: np.ndarray, err: ValueError, width: int | None = None
    ) -> ValueError:
        """Why reading ``rows`` failed: a :class:`ChunkCorruptedError` naming the damaged
        chunks among them, or ``err`` when none is damaged now (a chunk replaced while it
        was read)."""
        step = self.read_chunk_rows
        damaged: list[tuple[int, int, str]] = []
        for chunk in np.unique(rows // step).tolist():
            stop = min(self.shape[0], (chunk + 1) * step)
            damaged.extend(self.damaged_runs(chunk * step, stop, width))
        if not damaged:
            return err
        return ChunkCorruptedError(
            f"store {self._location.url!r}: array {self.path!r}, "
            f"{describe_runs(damaged)}, cannot be read back intact ({damaged[0][2]}). "
            "Nothing was returned. `python -m zarr_rb verify <store>` lists every damaged "
            "chunk; `--repair` withdraws the damaged rows from the readable range",
            array=self.path,
            rows=[(a, b) for a, b, _ in damaged],
        )

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
        """Start writing ``values[i]`` to row ``rows[i]`` (``rows`` unique); rows of a ragged
        array up to the width of ``values`` (widen it first with :meth:`grow`).

        The chunk files written are made durable by the next commit.
        """
        width = int(values.shape[1]) if self.ragged else None
        announce("write", self._location.path_of(self.path))
        run = is_run(rows)
        keys = self.chunk_keys(rows, width, run=run)
        self._location.written(keys)
        if self._cache is not None:
            self._cache.invalidate(keys)
        if run:
            return self._region(slice(int(rows[0]), int(rows[0]) + rows.size), width).write(values)
        return self._region(rows, width).write(values)

    def create_rows(
        self,
        writes: Sequence[tuple[np.ndarray, np.ndarray]],
        *,
        width: int | None = None,
        seeds: Sequence[tuple[int, int]] = (),
    ) -> once.Creation:
        """Start writing ``values`` to ``rows`` for each pair of ``writes``, every object
        they make created once (see :mod:`zarr_rb.engine.once`): encoded in RAM, then
        created on the store by a conditional PUT (wait with :func:`once.finish_all`). The
        objects are made of these rows alone, never merged with what the store holds: the
        writes cover every row of a slot that holds data. Rows of a ragged array up to
        ``width`` (widen it first with :meth:`grow`). ``seeds``: ``(slot, new slot)``
        pairs (write chunks along the rows) whose objects the new slot's start from, as
        stored (the write goes over them, as over the objects of a slot in place)."""
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
            shadow, target, where=lambda key: str(self._location.path_of(join(self.path, key)))
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
                _delete(kvstore, new[prefix:])
                copied.append(new)  # its directory changed: made durable with the rest
        self._location.written(copied)
        if self._cache is not None:
            self._cache.invalidate([self.chunk_key(target, t) for t in self._tail_positions(None)])

    def stored_chunks(self) -> set[int]:
        """The write chunks (shards) along the rows that have an object in the store."""
        prefix = len(self.path) + 1
        out = set()
        for key in self._location.list(self.path):
            parts = key[prefix:].split(self._separator)
            if not self._v2_keys:
                if parts[0] != "c":
                    continue  # the array's zarr.json
                parts = parts[1:]
            if parts and parts[0].isdigit():
                out.add(int(parts[0]))
        return out

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
            _delete(kvstore, key[prefix:])
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


def _rows_of(grid: Any) -> int:
    """Rows (first dimension) of a TensorStore chunk grid."""
    shape = grid.shape
    assert shape is not None
    assert shape[0] is not None
    return int(shape[0])


def _short_reason(err: Exception) -> str:
    """TensorStore's error message without the source locations it appends."""
    return str(err).split(" [source locations=")[0]


def is_run(rows: np.ndarray) -> bool:
    """Whether ``rows`` is ``start, start + 1, ...`` (read or written as one slice)."""
    if rows.size == 0:
        return False
    return rows.size == 1 or bool(
        rows[-1] - rows[0] + 1 == rows.size and (np.diff(rows) == 1).all()
    )
