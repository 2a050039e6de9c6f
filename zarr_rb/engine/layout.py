"""How leaves are chunked and compressed: the public :class:`Compression` settings
and the policy that turns them into Zarr chunk and shard shapes.

Large leaves (images) are sharded along rows: one shard holds ``block_rows``
rows and is written whole, inner chunks of a few rows keep random row reads
cheap. Small leaves (rewards, actions, flags) use plain chunks of one block.
A block is thus the unit no two writers of a shared store ever write at once: no
object on disk holds rows of two blocks.

No chunk, inner or shard, holds more than :data:`MAX_CHUNK_ELEMENTS` elements, the bound
readers check an array's metadata against. Rows too wide for the usual blocks of at least
256 rows (a block past that bound, or a row past a block's 32 MiB) get blocks of about
32 MiB, down to one row, and a block whose rows still do not fit in one chunk is cut along
the rows' own dimensions into chunks of one row each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from zarr_rb.errors import UnsupportedDataError
from zarr_rb.format.schema import LeafSpec, Schema

__all__ = ["Compression"]

Codec = Literal["zstd", "lz4", "none"]

_TARGET_SHARD_BYTES = 32 * 2**20
_TARGET_RAGGED_CHUNK_BYTES = 16 * 2**10
_MIN_BLOCK_ROWS = 256
_MAX_BLOCK_ROWS = 4096
_MIN_BLOCKS = 32
"""A store has at least this many blocks (when its rows allow): the writers of a shared
store each hold one at a time."""
MAX_CHUNK_ELEMENTS = 2**27
"""Largest chunk (inner chunk or shard) in elements. Readers refuse metadata past it (a read
allocates a whole chunk, so a hostile ``chunk_shape`` must not size one), so no layout
makes one larger; TensorStore itself reads and writes larger ones."""


SAMPLE_BYTES = 2**20
"""Bytes of a leaf's first rows compressed to tell whether the codec shrinks it."""
MIN_RATIO = 1.1
"""A large leaf the codec shrinks less than this (random frames, already compressed bytes)
is stored raw: compressing it would cost time on every write and read, for nothing."""


DEFAULT_LEVELS: dict[str, int] = {"zstd": -1, "lz4": 1, "none": 1}
"""The level of each codec when none is given (``"none"`` has no use for one)."""
LEVELS: dict[str, tuple[int, int]] = {"zstd": (-(2**17), 22), "lz4": (0, 9), "none": (-(2**17), 22)}
"""The levels each codec takes (zstd's negative ones are its fast levels)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Compression:
    """Chunking and compression settings of a :class:`~zarr_rb.ZarrStorage`.

    Args:
        codec: ``"zstd"`` (default), ``"lz4"`` (Blosc-LZ4 without shuffle) or ``"none"``.
        level: compression level: zstd -131072 to 22 (negative levels are its fast ones),
            lz4 0-9. ``None`` (default): zstd -1, lz4 1. zstd -1 shrinks Atari frames by one
            to two orders of magnitude (Pong 1/140, Ms. Pac-Man 1/28), and reads them
            10-13% faster than level 1 (1/143, 1/31), with ``benchmarks/compression.py``.
        chunk_rows: rows per inner chunk of large leaves. Random row reads decode one
            inner chunk per row, so keep it small.
        block_rows: rows per shard of large leaves, which is also the unit in which
            rows are buffered in RAM and written. ``None`` picks a power of two that
            puts about 32 MiB of raw data in a shard (256-4096 rows; fewer, down to one,
            for rows too wide for 256 in a shard).
        large_row_bytes: leaves with at least this many bytes per row are sharded;
            smaller ones are stored in plain chunks of one block.
        frames: which large leaves are stored as frames, each once per block, instead of
            as stacks (stacks of images, ``[4, 84, 84]``, with their ``("next", ...)`` twin:
            extends encode and sync about an eighth of the bytes of Atari transitions, and
            reads from the store rebuild the stacks; ``docs/design/frames-on-disk.md``).
            ``None`` (default): decided per leaf at the first write, a stack of images or a
            leaf with a ``("next", ...)`` twin unless its first rows share no frame, and
            recorded (``True`` if any leaf is, else ``False``); ``False``: none (plain
            arrays of stacks, as other programs read them); ``True``: every large leaf.

    Examples:
        >>> from zarr_rb import Compression, ZarrStorage
        >>> storage = ZarrStorage(100_000, compression=Compression(codec="lz4"))
    """

    codec: Codec = "zstd"
    level: int | None = None
    chunk_rows: int = 2
    block_rows: int | None = None
    large_row_bytes: int = 1024
    frames: bool | None = None

    def __post_init__(self) -> None:
        if self.frames is not None and not isinstance(self.frames, bool):
            raise ValueError(f"expected frames to be None, True or False, got {self.frames!r}")
        if self.codec not in ("zstd", "lz4", "none"):
            raise ValueError(f"expected codec 'zstd', 'lz4' or 'none', got {self.codec!r}")
        if self.level is None:
            object.__setattr__(self, "level", DEFAULT_LEVELS[self.codec])
        lo, hi = LEVELS[self.codec]
        if not lo <= self._level <= hi:
            raise ValueError(
                f"expected a {self.codec} compression level from {lo} to {hi}, got {self.level}"
            )
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

        level = self._level
        if self.codec == "zstd":
            return [ZstdCodec(level=level)]
        if self.codec == "lz4":
            # Blosc's default shuffle for 1-byte types is bitshuffle, which hurts frames.
            return [BloscCodec(cname="lz4", clevel=level, shuffle="noshuffle")]
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
            Zstd(level=self._level)
            if self.codec == "zstd"
            else Blosc(cname="lz4", clevel=self._level, shuffle=Blosc.NOSHUFFLE)
        )
        return raw.size >= MIN_RATIO * len(codec.encode(raw))

    @property
    def _level(self) -> int:
        """:attr:`level`, set (``__post_init__`` gives ``None`` the codec's default)."""
        assert self.level is not None
        return self.level

    def resolved(self, stores_frames: bool) -> Compression:
        """These settings as a store records them once its first write fixed its schema:
        ``frames=None`` becomes whether it stores a leaf as frames."""
        return self if self.frames is not None else dataclasses.replace(self, frames=stores_frames)

    def matches(self, other: Compression) -> bool:
        """Whether a store recorded with these settings opens with ``other``: the same,
        ``frames=None`` (decided at the first write) matching ``True`` or ``False``."""
        if self.frames is None or other.frames is None:
            return dataclasses.replace(self, frames=None) == dataclasses.replace(other, frames=None)
        return self == other

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Compression:
        """The settings recorded by :meth:`to_json` (already checked by the format parser)."""
        return cls(**{field.name: value[field.name] for field in dataclasses.fields(cls)})

    @classmethod
    def recorded(cls, value: Mapping[str, Any] | None, schema: Schema | None) -> Compression | None:
        """The settings a store's record holds (``value``, checked by the format parser;
        ``None`` if it holds none) with its ``schema`` (``None``: no schema yet). A record
        with a schema whose ``frames`` is left out was written before that setting: its
        schema says."""
        if value is None:
            return None
        settings = cls.from_json(value)
        return settings if schema is None else settings.resolved(bool(schema.frames))


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


def leaf_row_nbytes(leaf: LeafSpec, batch_shape: tuple[int, ...]) -> int:
    """Bytes of one row of one fixed-shape leaf, trailing batch dimensions included (the sum
    over a schema's leaves is ``Schema.row_nbytes``)."""
    return math.prod(batch_shape[1:]) * leaf.element_nbytes


def choose_block_rows(
    compression: Compression, leaves: tuple[LeafSpec, ...], batch_shape: tuple[int, ...]
) -> int:
    """Rows per write block: the shard height of every large leaf.

    Raises:
        UnsupportedDataError: a leaf whose rows cannot be laid out in chunks at that block
            height (checked for every leaf before any array is created).
    """
    block = _usual_block_rows(compression, leaves, batch_shape)
    if compression.block_rows is None and _too_wide(compression, leaves, batch_shape, block):
        block = _wide_block_rows(compression, leaves, batch_shape)
    for leaf in leaves:
        leaf_layout(leaf, batch_shape=batch_shape, block_rows=block, compression=compression)
    return block


def _usual_block_rows(
    compression: Compression, leaves: tuple[LeafSpec, ...], batch_shape: tuple[int, ...]
) -> int:
    """The block height of every store whose chunks fit (the format of existing stores)."""
    rows = batch_shape[0]
    chunk = compression.chunk_rows
    if compression.block_rows is not None:
        block = compression.block_rows
    else:
        widest = max(leaf_row_nbytes(leaf, batch_shape) for leaf in leaves)
        block = _MAX_BLOCK_ROWS
        while block > _MIN_BLOCK_ROWS and block * widest > _TARGET_SHARD_BYTES:
            block //= 2
        while block > chunk and block * _MIN_BLOCKS > rows:
            block //= 2
        block = _round_up(block, chunk)
    # A block never needs to be taller than the array itself.
    return max(chunk, min(block, _round_up(rows, chunk)))


def _too_wide(
    compression: Compression,
    leaves: tuple[LeafSpec, ...],
    batch_shape: tuple[int, ...],
    block_rows: int,
) -> bool:
    """Whether rows are too wide for the usual blocks: one row of a leaf is more than a
    block's target bytes, or a chunk of whole rows would pass :data:`MAX_CHUNK_ELEMENTS`."""
    if max(leaf_row_nbytes(leaf, batch_shape) for leaf in leaves) > _TARGET_SHARD_BYTES:
        return True
    return not all(
        _fits(
            _whole_rows(
                leaf, batch_shape=batch_shape, block_rows=block_rows, compression=compression
            )
        )
        for leaf in leaves
    )


def _wide_block_rows(
    compression: Compression, leaves: tuple[LeafSpec, ...], batch_shape: tuple[int, ...]
) -> int:
    """The block height of rows too wide for blocks of 256 rows: about 32 MiB of the widest
    leaf, down to a single row, since a block is also what waits in RAM (several per store)
    and what a shared writer reserves."""
    rows = batch_shape[0]
    chunk = compression.chunk_rows
    widest = max(leaf_row_nbytes(leaf, batch_shape) for leaf in leaves)
    block = _MAX_BLOCK_ROWS
    while block > 1 and block * widest > _TARGET_SHARD_BYTES:
        block //= 2
    while block > chunk and block * _MIN_BLOCKS > rows:
        block //= 2
    if block >= chunk:
        block = _round_up(block, chunk)
    return min(block, _round_up(rows, chunk))


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
    layout = _whole_rows(
        leaf, batch_shape=batch_shape, block_rows=block_rows, compression=compression
    )
    return fitted(layout, block_rows, name=".".join(leaf.key) or "tensor")


def _whole_rows(
    leaf: LeafSpec,
    *,
    batch_shape: tuple[int, ...],
    block_rows: int,
    compression: Compression,
) -> LeafLayout:
    """The layout whose chunks hold whole rows (that of every store whose chunks fit)."""
    rows = batch_shape[0]
    # Blocks shorter than chunk_rows (rows of tens of MiB): an inner chunk per block.
    chunk_rows = min(compression.chunk_rows, block_rows)
    if leaf.ragged:
        # Rows padded along their varying dimension: one chunk column to start with, more as
        # longer rows come (the array grows wider); shards of a block of rows, one chunk wide.
        length = ragged_chunk_length(leaf, compression)
        part = _at_least_one((length, *leaf.shape))
        return LeafLayout(
            shape=(rows, length, *leaf.shape),
            chunks=(chunk_rows, *part),
            shards=(block_rows, *part),
        )
    tail = (*batch_shape[1:], *leaf.shape)
    shape = (rows, *tail)
    part = _at_least_one(tail)
    nbytes = leaf_row_nbytes(leaf, batch_shape)
    if nbytes >= compression.large_row_bytes:
        return LeafLayout(shape=shape, chunks=(chunk_rows, *part), shards=(block_rows, *part))
    # Small leaves: a chunk per block, so that writers of different blocks never write
    # one object (the writer reads them from its RAM mirror, see core.store).
    return LeafLayout(shape=shape, chunks=(block_rows, *part), shards=None)


def _at_least_one(extents: tuple[int, ...]) -> tuple[int, ...]:
    """Chunk extents along dimensions of ``extents`` (Zarr chunks are never empty, even
    along a dimension of length 0)."""
    return tuple(max(1, n) for n in extents)


def _fits(layout: LeafLayout) -> bool:
    return all(
        math.prod(shape) <= MAX_CHUNK_ELEMENTS
        for shape in (layout.chunks, layout.shards)
        if shape is not None
    )


def fitted(layout: LeafLayout, block_rows: int, *, name: str) -> LeafLayout:
    """``layout`` as it is if each of its chunks fits :data:`MAX_CHUNK_ELEMENTS`, else cut
    as :func:`_cut_rows` cuts a leaf's (the layouts zarr_rb makes of its own, such as the
    cells of frames; ``name``: the key, for the error).

    Raises:
        UnsupportedDataError: a block taller than a chunk's elements (no cut can fit it).
    """
    return layout if _fits(layout) else _cut_rows(name, layout, block_rows)


def _cut_rows(name: str, layout: LeafLayout, block_rows: int) -> LeafLayout:
    """``layout`` with its blocks cut along the rows' own dimensions until a block's part
    fits in one chunk; inner chunks of one row each, so that reading a row decodes nothing
    of the rows around it. ``name``: the leaf's key, for the error.

    Raises:
        UnsupportedDataError: a block taller than a chunk's elements (no cut can fit it).
    """
    room = MAX_CHUNK_ELEMENTS // block_rows
    if room < 1:
        raise UnsupportedDataError(
            f"key {name!r}: a block of {block_rows:,} rows cannot be stored, as a chunk holds "
            f"at most {MAX_CHUNK_ELEMENTS:,} elements (2**27) and a block's rows of one key "
            "share a chunk; pass Compression(block_rows=None), the default, or a block_rows "
            f"of at most {MAX_CHUNK_ELEMENTS:,}",
        )
    part = _cut(layout.chunks[1:], room)
    if layout.shards is None:
        return dataclasses.replace(layout, chunks=(block_rows, *part))
    return dataclasses.replace(layout, chunks=(1, *part), shards=(block_rows, *part))


def _cut(extents: tuple[int, ...], room: int) -> tuple[int, ...]:
    """The largest part of ``extents`` with at most ``room`` elements that keeps the last
    dimensions whole (contiguous in C order), cutting the first one that does not fit into
    equal pieces."""
    part = list(extents)
    inner = 1
    for i in reversed(range(len(part))):
        if inner * part[i] <= room:
            inner *= part[i]
            continue
        pieces = -(-part[i] // (room // inner))
        part[i] = -(-part[i] // pieces)
        part[:i] = [1] * i
        break
    return tuple(part)
