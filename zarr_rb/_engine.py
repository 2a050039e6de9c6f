"""Array I/O: Zarr v3 metadata through zarr-python, row reads and writes through TensorStore.

This layer knows about directories, arrays and rows; it knows nothing about
TorchRL. zarr-python creates arrays (so the files are whatever zarr-python
writes and reads), TensorStore does the hot path: it gathers scattered rows
from sharded arrays one to two orders of magnitude faster than zarr-python's
own codec pipeline.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from zarr_rb._format import describe_runs
from zarr_rb._io import (
    LOCK_FILE,
    Durability,
    announce,
    fsync,
    is_temporary,
    load_json,
    write_json_atomically,
)
from zarr_rb._layout import Compression, LeafLayout
from zarr_rb.errors import ChunkCorruptedError, StoreCorruptedError

ROOT_METADATA = "zarr.json"
STATE_CHUNK_BYTES = 2**20


MAX_CHUNK_ELEMENTS = 2**27
"""Largest chunk (or shard) accepted from an array's metadata, in elements: a read
allocates a whole chunk, so a hostile ``chunk_shape`` must not size one."""
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


class LocalLocation:
    """A store on a local (or network-mounted) filesystem."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.durability = Durability(self.root)
        self._context = ts.Context(
            {
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
                "file_io_concurrency": {"limit": 32},
                # Written files are fsynced once per commit (Durability.sync), together,
                # rather than one by one as TensorStore writes them.
                "file_io_sync": False,
            }
        )

    def __repr__(self) -> str:
        return f"LocalLocation({str(self.root)!r})"

    # --- root metadata (the commit point) ------------------------------------------------

    def read_root_metadata(self) -> dict[str, Any] | None:
        """The parsed root ``zarr.json``, or ``None`` if there is none."""
        try:
            raw = (self.root / ROOT_METADATA).read_bytes()
        except FileNotFoundError:
            return None
        value = load_json(raw)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        return value

    def write_root_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Publish new root attributes (a commit): make every file written since the last
        commit durable, then atomically replace the root ``zarr.json``.

        A crash leaves either the old or the new metadata, never a mix, and the new one
        never refers to data that a power loss could take back.
        """
        self.durability.sync()
        document = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
        write_json_atomically(self.root / ROOT_METADATA, document, publish=True)

    def remove_tree(self, path: str) -> None:
        """Delete a group and everything under it (only the store's writer calls this, and
        only for nodes that the published root record no longer refers to)."""
        target = self.root / path
        if target.exists():
            announce("remove", target)
            shutil.rmtree(target)

    def remove_temporaries(self) -> list[Path]:
        """Delete files left by interrupted writes (only ever called by the store's writer)."""
        removed = []
        for path in _walk_files(self.root):
            if is_temporary(path):
                announce("remove", path)
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def _written_metadata(self, path: str) -> None:
        """Announce a zarr-python write at ``path``; it may also create the groups above it."""
        announce("write", self.root / path)
        node = self.root / path
        self.durability.written(
            [node / ROOT_METADATA]
            + [p / ROOT_METADATA for p in node.parents if self.root in p.parents]
        )

    def create_root(self) -> None:
        """Create the store's directory, durably (its entry in its parent included)."""
        missing = [p for p in (self.root, *self.root.parents) if not p.exists()]
        self.root.mkdir(parents=True, exist_ok=True)
        for directory in [self.root, *(p.parent for p in missing)]:
            fsync(directory)

    # --- arrays ----------------------------------------------------------------------------

    def create_array(
        self,
        path: str,
        *,
        layout: LeafLayout,
        dtype: str,
        compression: Compression,
        attributes: Mapping[str, Any],
    ) -> None:
        """Create an array (and its parent groups) with zarr-python."""
        import zarr

        self._written_metadata(path)
        group_path, _, name = path.rpartition("/")
        group = zarr.open_group(self.root / group_path, mode="a", zarr_format=3)
        group.create_array(
            name,
            shape=layout.shape,
            dtype=dtype,
            chunks=layout.chunks,
            shards=layout.shards,
            compressors=_checksummed(compression.compressors()),
            fill_value=0,
            attributes=dict(attributes),
            overwrite=True,
        )

    def create_group(self, path: str) -> None:
        import zarr

        if not (self.root / path / ROOT_METADATA).exists():
            self._written_metadata(path)
            zarr.open_group(self.root / path, mode="a", zarr_format=3)

    def open_array(self, path: str, *, read_only: bool, ragged: bool = False) -> RowArray:
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(self.root / path)},
            # A chunk inside the committed range is never legitimately missing: reading
            # one is an error, not fill values. For that, every written chunk is stored,
            # even one that equals the fill value.
            "fill_missing_data_reads": False,
            "store_data_equal_to_fill_value": True,
        }

        def reopen() -> ts.TensorStore:
            return ts.open(
                spec, open=True, read=True, write=not read_only, context=self._context
            ).result()

        return RowArray(
            reopen(),
            path,
            root=self.root,
            durability=self.durability,
            ragged=ragged,
            reopen=reopen,
        )

    # --- state groups: small arrays and JSON attributes -------------------------------------

    def write_group_attributes(self, path: str, attributes: Mapping[str, Any]) -> None:
        document = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
        (self.root / path).mkdir(parents=True, exist_ok=True)
        write_json_atomically(self.root / path / ROOT_METADATA, document)
        self.durability.written([self.root / path / ROOT_METADATA])

    def read_group_attributes(self, path: str) -> dict[str, Any]:
        try:
            raw = (self.root / path / ROOT_METADATA).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"no group {path!r} in store {str(self.root)!r}") from None
        try:
            document = load_json(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise StoreCorruptedError(
                f"store {str(self.root)!r}: group {path!r} has an invalid zarr.json "
                f"({type(err).__name__})"
            ) from None
        attributes = document.get("attributes", {}) if isinstance(document, dict) else None
        if not isinstance(attributes, dict):
            raise StoreCorruptedError(
                f"store {str(self.root)!r}: group {path!r}: expected a JSON object of attributes"
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
        import zarr
        from zarr.codecs import ZstdCodec

        self._written_metadata(path)
        group_path, _, name = path.rpartition("/")
        row_nbytes = max(1, values[:1].nbytes)
        chunk_rows = max(1, min(values.shape[0], STATE_CHUNK_BYTES // row_nbytes))
        group = zarr.open_group(self.root / group_path, mode="a", zarr_format=3)
        group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(chunk_rows, *values.shape[1:]),
            compressors=_checksummed([ZstdCodec(level=1)]),
            fill_value=0,
            overwrite=True,
        )

    def check_array_metadata(self, path: str, shape: tuple[int | None, ...]) -> None:
        """Read an array's ``zarr.json`` with a bounded parser before TensorStore sees it,
        and check it against the expected ``shape`` (before anything is sized from it).

        Raises:
            StoreCorruptedError: missing, unreadable, or not an array of that shape with
                bounded chunks.
        """
        where = f"store {str(self.root)!r}: array {path!r}"
        try:
            document = load_json((self.root / path / ROOT_METADATA).read_bytes())
        except FileNotFoundError:
            raise StoreCorruptedError(f"{where} is missing (no zarr.json)") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise StoreCorruptedError(
                f"{where}: zarr.json is not valid JSON ({type(err).__name__})"
            ) from None
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
                f"store {str(self.root)!r}: cannot open state array {path!r} ({_short_reason(err)})"
            ) from None
        try:
            return np.asarray(array.read_rows(np.arange(array.shape[0])).result())
        except ValueError as err:
            damaged = array.damaged_runs(0, array.shape[0]) or [
                (0, array.shape[0], _short_reason(err))
            ]
            raise ChunkCorruptedError(
                f"store {str(self.root)!r}: state array {path!r}, {describe_runs(damaged)}, "
                f"cannot be read back intact ({damaged[0][2]}); the saved buffer state is "
                "damaged: open the data with ZarrStorage(path=...) and save a buffer again",
                array=path,
                rows=[(a, b) for a, b, _ in damaged],
            ) from None

    def snapshot_to(self, target: str | os.PathLike[str], *, progress: bool = False) -> int:
        """Make ``target`` an independent copy of this store; returns bytes copied.

        On the same filesystem files are hard-linked instead of copied. That is safe
        because nothing ever writes into an existing file of a store: TensorStore and
        zarr-python write a new file and rename it over the old one, and so does the
        commit. Elsewhere the files are copied.
        """
        target = Path(target).absolute()
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(
                f"snapshot target {str(target)!r} exists and is not empty; save the snapshot to "
                "a new path, or delete the old one first",
            )
        # Temporaries of interrupted writes (ours end in .tmp, TensorStore's in .__lock) are
        # not part of the store; a hard-linked lock file would even be shared with it.
        files = [p for p in _walk_files(self.root) if not is_temporary(p) and p.name != LOCK_FILE]
        target.mkdir(parents=True, exist_ok=True)
        same_device = os.stat(self.root).st_dev == os.stat(target).st_dev
        copied = 0
        total = sum(p.stat().st_size for p in files)
        bar = progress_bar(total, desc="snapshot", unit="B", enabled=progress)
        for source in files:
            destination = target / source.relative_to(self.root)
            destination.parent.mkdir(parents=True, exist_ok=True)
            size = source.stat().st_size
            if same_device:
                try:
                    os.link(source, destination)
                except OSError:
                    shutil.copy2(source, destination)
                    copied += size
            else:
                shutil.copy2(source, destination)
                copied += size
            bar.update(size)
        bar.close()
        # The snapshot is published by its own commit: make its files durable first.
        durability = Durability(target)
        durability.written([target / p.relative_to(self.root) for p in files])
        durability.sync()
        return copied

    def nbytes(self) -> int:
        """Bytes of all files of the store."""
        return sum(p.stat().st_size for p in _walk_files(self.root))


class PendingRead(Protocol):
    def result(self) -> np.ndarray: ...


class _Runs:
    """Reads of several row runs, concatenated in order when their result is asked for."""

    def __init__(self, futures: list[ts.Future[np.ndarray]]) -> None:
        self._futures = futures

    def result(self) -> np.ndarray:
        return np.concatenate([future.result() for future in self._futures])


def progress_bar(total: int, *, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar, silent unless ``enabled``."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False
    )


def copy_in_blocks(
    read: Callable[[int, int], Any],
    write: Callable[[slice, Any], None],
    *,
    rows: int,
    row_nbytes: int,
    block_bytes: int,
    progress: bool,
    desc: str,
) -> None:
    """Copy rows ``[0, rows)`` block by block, ``write(slice(a, b), read(a, b))``, holding
    about ``block_bytes`` bytes of rows in RAM at once."""
    step = max(1, block_bytes // max(1, row_nbytes))
    with progress_bar(rows, desc=desc, unit="row", enabled=progress) as bar:
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            write(slice(start, stop), read(start, stop))
            bar.update(stop - start)


def _as_bits(array: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers of the same width (for bitwise comparison)."""
    width = array.dtype.itemsize
    if width in (1, 2, 4, 8):
        return array.view(np.dtype(f"u{width}"))
    return array.view(np.uint8)


def _walk_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            yield Path(dirpath) / name


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
        root: Path,
        durability: Durability,
        ragged: bool = False,
        reopen: Callable[[], ts.TensorStore] | None = None,
    ) -> None:
        self._array = array
        self.path = path
        self.ragged = ragged
        self._root = root
        self._dir = root / path
        self._durability = durability
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

    def chunk_file(self, chunk: int, tail: tuple[int, ...] = ()) -> Path:
        """The file holding write chunk (shard) ``chunk`` along the rows."""
        indices = [str(chunk), *(str(i) for i in tail)]
        key: str = self._separator.join(indices if self._v2_keys else ["c", *indices])
        return self._dir / key

    def chunk_files(self, rows: np.ndarray, width: int | None = None) -> list[Path]:
        tails = self._tail_positions(width)
        return [
            self.chunk_file(int(chunk), tail)
            for chunk in np.unique(rows // self.chunk_rows)
            for tail in tails
        ]

    def _region(self, first: Any, width: int | None) -> ts.TensorStore:
        region: ts.TensorStore = (
            self._array[first] if width is None else self._array[first, 0:width]
        )
        return region

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
            self._region(slice(start, stop), width).read().result()
            return []
        except ValueError:
            pass
        step = self.read_chunk_rows
        damaged = []
        for first in range(start - start % step, stop, step):
            a, b = max(first, start), min(first + step, stop)
            try:
                self._region(slice(a, b), width).read().result()
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
            f"store {str(self._root)!r}: array {self.path!r}, "
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
        if _is_run(rows):
            return self._region(slice(int(rows[0]), int(rows[0]) + rows.size), width).read()
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
                [
                    self._region(slice(int(rows[a]), int(rows[a]) + b - a), width).read()
                    for a, b in bounds
                ]
            )
        return self._region(rows, width).read()

    def write_rows(self, rows: np.ndarray, values: np.ndarray) -> ts.WriteFutures:
        """Start writing ``values[i]`` to row ``rows[i]`` (``rows`` unique); rows of a ragged
        array up to the width of ``values`` (widen it first with :meth:`grow`).

        The chunk files written are made durable by the next commit.
        """
        width = int(values.shape[1]) if self.ragged else None
        announce("write", self._dir)
        self._durability.written(self.chunk_files(rows, width))
        if _is_run(rows):
            return self._region(slice(int(rows[0]), int(rows[0]) + rows.size), width).write(values)
        return self._region(rows, width).write(values)

    def grow(self, width: int) -> None:
        """Make a ragged array at least ``width`` wide (doubling, in whole chunks): only its
        metadata changes, no chunk is rewritten."""
        if width <= self.width:
            return
        wider = max(width, 2 * self.width)
        wider = -(-wider // self.chunk_length) * self.chunk_length
        metadata = self._dir / ROOT_METADATA
        announce("write", metadata)
        self._durability.written([metadata])
        shape = list(self.shape)
        shape[1] = wider
        self._array = self._array.resize(exclusive_max=shape, resize_metadata_only=True).result()

    def refresh(self) -> None:
        """Reopen the array to see the shape its writer gave it since."""
        if self._reopen is not None:
            self._array = self._reopen()


def _rows_of(grid: Any) -> int:
    """Rows (first dimension) of a TensorStore chunk grid."""
    shape = grid.shape
    assert shape is not None
    assert shape[0] is not None
    return int(shape[0])


def _short_reason(err: Exception) -> str:
    """TensorStore's error message without the source locations it appends."""
    return str(err).split(" [source locations=")[0]


def _is_run(rows: np.ndarray) -> bool:
    """Whether ``rows`` is ``start, start + 1, ...`` (read or written as one slice)."""
    if rows.size == 0:
        return False
    return rows.size == 1 or bool(
        rows[-1] - rows[0] + 1 == rows.size and (np.diff(rows) == 1).all()
    )
