"""Array I/O: Zarr v3 metadata through zarr-python, row reads and writes through TensorStore.

This layer knows about arrays and rows on a location; it knows nothing about TorchRL.
zarr-python writes the arrays' metadata (so the files are whatever zarr-python writes and
reads), TensorStore does the hot path: it gathers scattered rows from sharded arrays one
to two orders of magnitude faster than zarr-python's own codec pipeline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from zarr_rb.engine.cache import EncodedCache
from zarr_rb.engine.damage import damaged_runs
from zarr_rb.engine.layout import MAX_CHUNK_ELEMENTS, Compression, LeafLayout
from zarr_rb.engine.rows import RowArray, as_bits
from zarr_rb.errors import (
    ChunkCorruptedError,
    FencedError,
    StoreCorruptedError,
    StoreNotFoundError,
)
from zarr_rb.format.messages import describe_runs
from zarr_rb.locations.base import (
    ROOT_METADATA,
    Generation,
    Location,
    is_store_object,
    join,
)
from zarr_rb.util.io import load_json, short_reason
from zarr_rb.util.progress import progress_bar

STATE_CHUNK_BYTES = 2**20
CHUNK_KEY_ENCODING: dict[str, Any] = {"name": "default", "separator": "."}
"""How the arrays created name their chunks: ``c.3.0.0``, each in its array's directory.
With ``/`` (Zarr's default), every chunk of an image leaf makes a directory per dimension
(``c/3/0/0``): a store of 8,192 Atari rows held 245 directories for 271 chunks, each
created, and fsynced at its commit. Stores made before keep their own (each array's
metadata names it; a store may hold arrays of both)."""
WRITER_KEY = "zarr_rb_writer"
"""Root attribute naming the writer that claimed the store (object stores)."""

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
        settings.setdefault("chunk_key_encoding", CHUNK_KEY_ENCODING)
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
            old = as_bits(array.read_rows(np.arange(rows)).result())
        except ValueError:
            # A save into this (unpublished) slot was interrupted: rewrite every chunk.
            return int(values.nbytes), [array.write_rows(np.arange(rows), values)]
        new = as_bits(values)
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
                f"store {self.url!r}: cannot open state array {path!r} ({short_reason(err)})"
            ) from None
        try:
            return np.asarray(array.read_rows(np.arange(array.shape[0])).result())
        except ValueError as err:
            damaged = damaged_runs(array, 0, array.shape[0]) or [
                (0, array.shape[0], short_reason(err))
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


def _group_metadata(attributes: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` of a group with these attributes."""
    document = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
    return json.dumps(document, indent=2, sort_keys=True).encode("utf-8")
