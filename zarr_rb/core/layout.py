"""How leaves are chunked and compressed: the public :class:`Compression` settings
and the policy that turns them into Zarr chunk and shard shapes.

Large leaves (images) are sharded along rows: one shard holds ``block_rows``
rows and is written whole, inner chunks of a few rows keep random row reads
cheap. Small leaves (rewards, actions, flags) use plain chunks of one block.
A block is thus the unit no two writers of a shared store ever write at once: no
object on disk holds rows of two blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from zarr_rb.core.format import LeafSpec

__all__ = ["Compression"]

Codec = Literal["zstd", "lz4", "none"]

_TARGET_SHARD_BYTES = 32 * 2**20
_TARGET_RAGGED_CHUNK_BYTES = 16 * 2**10
_MIN_BLOCK_ROWS = 256
_MAX_BLOCK_ROWS = 4096
_MIN_BLOCKS = 32
"""A store has at least this many blocks (when its rows allow): the writers of a shared
store each hold one at a time."""


SAMPLE_BYTES = 2**20
"""Bytes of a leaf's first rows compressed to tell whether the codec shrinks it."""
MIN_RATIO = 1.1
"""A large leaf the codec shrinks less than this (random frames, already compressed bytes)
is stored raw: compressing it would cost time on every write and read, for nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class Compression:
    """Chunking and compression settings of a :class:`~zarr_rb.ZarrStorage`.

    Args:
        codec: ``"zstd"`` (default), ``"lz4"`` (Blosc-LZ4 without shuffle) or ``"none"``.
        level: compression level (zstd 1-22, lz4 1-9). Level 1 is fast and already
            shrinks Atari frames by one to two orders of magnitude.
        chunk_rows: rows per inner chunk of large leaves. Random row reads decode one
            inner chunk per row, so keep it small.
        block_rows: rows per shard of large leaves, which is also the unit in which
            rows are buffered in RAM and written. ``None`` picks a power of two that
            puts about 32 MiB of raw data in a shard (256-4096 rows).
        large_row_bytes: leaves with at least this many bytes per row are sharded;
            smaller ones are stored in plain chunks of one block.

    Examples:
        >>> from zarr_rb import Compression, ZarrStorage
        >>> storage = ZarrStorage(100_000, compression=Compression(codec="lz4"))
    """

    codec: Codec = "zstd"
    level: int = 1
    chunk_rows: int = 2
    block_rows: int | None = None
    large_row_bytes: int = 1024

    def __post_init__(self) -> None:
        if self.codec not in ("zstd", "lz4", "none"):
            raise ValueError(f"expected codec 'zstd', 'lz4' or 'none', got {self.codec!r}")
        if self.chunk_rows < 1:
            raise ValueError(f"expected chunk_rows >= 1, got {self.chunk_rows}")
        if self.block_rows is not None and (
            self.block_rows < 1 or self.block_rows % self.chunk_rows
        ):
            raise ValueError(
                f"expected block_rows to be a positive multiple of chunk_rows={self.chunk_rows}, "
                f"got {self.block_rows}",
            )

    def compressors(self) -> list[Any]:
        """The Zarr v3 bytes-to-bytes codecs for this setting."""
        from zarr.codecs import BloscCodec, ZstdCodec

        if self.codec == "zstd":
            return [ZstdCodec(level=self.level)]
        if self.codec == "lz4":
            # Blosc's default shuffle for 1-byte types is bitshuffle, which hurts frames.
            return [BloscCodec(cname="lz4", clevel=self.level, shuffle="noshuffle")]
        return []

    def shrinks(self, sample: np.ndarray) -> bool:
        """Whether this codec shrinks ``sample`` (the first rows written of a leaf, up to
        :data:`SAMPLE_BYTES` of them) by at least :data:`MIN_RATIO`; numcodecs' twin of each
        codec of :meth:`compressors` measures it."""
        if self.codec == "none":
            return False
        from numcodecs import Blosc, Zstd

        raw = np.ascontiguousarray(sample).reshape(-1).view(np.uint8)[:SAMPLE_BYTES]
        if not raw.size:
            return True
        codec = (
            Zstd(level=self.level)
            if self.codec == "zstd"
            else Blosc(cname="lz4", clevel=self.level, shuffle=Blosc.NOSHUFFLE)
        )
        return raw.size >= MIN_RATIO * len(codec.encode(raw))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Compression:
        """The settings recorded by :meth:`to_json` (already checked by the format parser)."""
        return cls(**{field.name: value[field.name] for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, slots=True)
class LeafLayout:
    """Chunk shape, and shard shape for sharded leaves, of one array, and the names of its
    dimensions (Zarr v3 ``dimension_names``, which xarray reads)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None
    dimension_names: tuple[str, ...] = ()


BATCH_DIMENSIONS = {1: ("row",), 2: ("time", "env")}
"""Names of a store's batch dimensions by ``ndim`` (TorchRL's ``ndim=2`` layout is
``[time, n_envs]``)."""


def batch_dimension_names(ndim: int) -> tuple[str, ...]:
    return BATCH_DIMENSIONS.get(ndim) or ("row", *(f"batch_{i}" for i in range(1, ndim)))


def dimension_names(key: tuple[str, ...], ndim: int, array_ndim: int) -> tuple[str, ...]:
    """Names of the dimensions of the array of ``key``: the batch dimensions, shared by
    every array, then ``<key>_<i>`` for each dimension of an element (unique to the key,
    so that arrays of different element shapes never share a dimension name)."""
    name = ".".join(key) or "tensor"
    batch = batch_dimension_names(ndim)
    return (*batch, *(f"{name}_{i}" for i in range(array_ndim - ndim)))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def row_nbytes(leaf: LeafSpec, batch_shape: tuple[int, ...]) -> int:
    return math.prod(batch_shape[1:]) * leaf.element_nbytes


def choose_block_rows(
    compression: Compression, leaves: tuple[LeafSpec, ...], batch_shape: tuple[int, ...]
) -> int:
    """Rows per write block: the shard height of every large leaf."""
    rows = batch_shape[0]
    chunk = compression.chunk_rows
    if compression.block_rows is not None:
        block = compression.block_rows
    else:
        widest = max(row_nbytes(leaf, batch_shape) for leaf in leaves)
        block = _MAX_BLOCK_ROWS
        while block > _MIN_BLOCK_ROWS and block * widest > _TARGET_SHARD_BYTES:
            block //= 2
        while block > chunk and block * _MIN_BLOCKS > rows:
            block //= 2
        block = _round_up(block, chunk)
    # A block never needs to be taller than the array itself.
    return max(chunk, min(block, _round_up(rows, chunk)))


def ragged_chunk_length(leaf: LeafSpec, compression: Compression) -> int:
    """Elements of a ragged leaf's rows per inner chunk: a power of two making an inner chunk
    about 16 KiB, so that a short row reads one chunk and a long one a few."""
    per_element = leaf.itemsize * math.prod(leaf.shape) * compression.chunk_rows
    length = 8
    while length * 2 * per_element <= _TARGET_RAGGED_CHUNK_BYTES:
        length *= 2
    return length


def leaf_layout(
    leaf: LeafSpec,
    *,
    batch_shape: tuple[int, ...],
    block_rows: int,
    compression: Compression,
) -> LeafLayout:
    layout = _chunking(
        leaf, batch_shape=batch_shape, block_rows=block_rows, compression=compression
    )
    names = dimension_names(leaf.key, len(batch_shape), len(layout.shape))
    return dataclasses.replace(layout, dimension_names=names)


def _chunking(
    leaf: LeafSpec,
    *,
    batch_shape: tuple[int, ...],
    block_rows: int,
    compression: Compression,
) -> LeafLayout:
    rows = batch_shape[0]
    if leaf.ragged:
        # Rows padded along their varying dimension: one chunk column to start with, more as
        # longer rows come (the array grows wider); shards of a block of rows, one chunk wide.
        length = ragged_chunk_length(leaf, compression)
        return LeafLayout(
            shape=(rows, length, *leaf.shape),
            chunks=(compression.chunk_rows, length, *leaf.shape),
            shards=(block_rows, length, *leaf.shape),
        )
    tail = (*batch_shape[1:], *leaf.shape)
    shape = (rows, *tail)
    nbytes = row_nbytes(leaf, batch_shape)
    if nbytes >= compression.large_row_bytes:
        return LeafLayout(
            shape=shape,
            chunks=(compression.chunk_rows, *tail),
            shards=(block_rows, *tail),
        )
    # Small leaves: a chunk per block, so that writers of different blocks never write
    # one object (the writer reads them from its RAM mirror, see core.store).
    return LeafLayout(shape=shape, chunks=(block_rows, *tail), shards=None)
