"""A writer's RAM copies of whole small leaves: which leaves it keeps, and the copies.

A writer keeps a copy of the rows it reached of its small leaves (actions, rewards, flags,
trajectory ids: samplers scan them whole); its writes update the copies, so they are read
from RAM, never from disk again. The store fills a copy when it is first needed
(:class:`Mirror` asks it through ``load``) and says which rows other writers changed. Large
leaves (frames) are kept by the RAM tier instead (:mod:`zarr_rb.core.frames`).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.engine.layout import leaf_row_nbytes
from zarr_rb.engine.rows import is_run
from zarr_rb.format.schema import LeafSpec
from zarr_rb.util.keys import Key

MIRROR_LIMIT_BYTES = 256 * 2**20
"""Small leaves (actions, rewards, flags, trajectory ids) are mirrored in RAM by the writer
while all of them together, over the rows written so far, take at most this much."""
_MAPPED_BYTES = 2**20
"""Mirrors of at least this many bytes are private anonymous mappings of their own."""


class Mirror:
    """The small leaves a writer mirrors in RAM and their copies, ``rows`` rows at most.

    ``load(key, rows)``: a new copy of ``key`` covering ``rows`` rows, as the store holds
    them (called when a mirrored leaf is first read or written).
    """

    def __init__(self, *, rows: int, large_row_bytes: int, read_only: bool) -> None:
        self._rows = rows
        self._large_row_bytes = large_row_bytes
        self._read_only = read_only
        self._copies: dict[Key, torch.Tensor] = {}
        self.keys: frozenset[Key] = frozenset()
        """The leaves mirrored now."""
        self._small: frozenset[Key] = frozenset()
        self.row_bytes = 0
        """Bytes of one row of the small leaves together."""
        self._cap = 0
        """The most rows the copies may cover."""
        self.ram_bytes = 0
        """RAM the writer may take in RAM copies (the small leaves take at least
        :data:`MIRROR_LIMIT_BYTES` of it)."""

    @property
    def held(self) -> bool:
        """Whether a copy is held (rows other writers change must be read again)."""
        return bool(self._copies)

    def choose(
        self, leaves: Sequence[LeafSpec], batch_shape: tuple[int, ...], rows_reached: int
    ) -> None:
        """Choose the leaves to mirror among a schema's ``leaves``."""
        self._rows = batch_shape[0]
        sizes = {leaf.key: leaf_row_nbytes(leaf, batch_shape) for leaf in leaves if not leaf.ragged}
        self._small = frozenset(key for key, size in sizes.items() if size < self._large_row_bytes)
        self.row_bytes = sum(sizes[key] for key in self._small)
        self.fit(rows_reached)

    @property
    def limit(self) -> int:
        """The most bytes the copies may take."""
        return max(self.ram_bytes, MIRROR_LIMIT_BYTES)

    def fit(self, rows_reached: int) -> None:
        """Mirror the small leaves while their rows fit the limit; drop the copies past it."""
        if self._read_only or not self._small or rows_reached * self.row_bytes > self.limit:
            self.keys, self._cap = frozenset(), 0
        else:
            self.keys = self._small
            self._cap = self.limit // max(1, self.row_bytes)
        for key in self._copies.keys() - self.keys:
            del self._copies[key]  # read from disk from now on

    def missing(self) -> frozenset[Key]:
        """Mirrored leaves that have no copy yet."""
        return self.keys - self._copies.keys()

    def copy_of(self, key: Key, covered: int, load: Callable[[Key, int], torch.Tensor]) -> None:
        """Make the copy of ``key`` (``covered``: rows the store reached) if it has none."""
        if key not in self._copies:
            self._copies[key] = load(key, self.rows_for(key, covered, 0))

    def put(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], reached: int) -> None:
        """Write ``values`` into the copies of the leaves that have one (``rows`` unique;
        ``reached``: one past the highest row written)."""
        for key in self._copies.keys() & values.keys():
            put_rows(self._covering(key, reached), rows, values[key])

    def gather(
        self, key: Key, index: torch.Tensor, covered: int, load: Callable[[Key, int], torch.Tensor]
    ) -> torch.Tensor:
        """``index`` rows of the copy of ``key`` (zeros for rows never written)."""
        self.copy_of(key, covered, load)
        copy = self._copies[key]
        # index_select: several times faster than copy[index] on frames, on some CPUs.
        if not index.numel() or int(index.max()) < copy.shape[0]:
            return copy.index_select(0, index)
        out = copy.new_zeros((index.numel(), *copy.shape[1:]))
        inside = index < copy.shape[0]
        out[inside] = copy.index_select(0, index[inside])
        return out

    def held_keys(self) -> list[Key]:
        """The leaves that have a copy."""
        return list(self._copies)

    def __contains__(self, key: Key) -> bool:
        """Whether ``key`` has a copy."""
        return key in self._copies

    def __getitem__(self, key: Key) -> torch.Tensor:
        """The copy of ``key``."""
        return self._copies[key]

    def clear(self) -> None:
        """Drop every copy (each is read whole again when next needed)."""
        self._copies.clear()

    def _covering(self, key: Key, rows: int) -> torch.Tensor:
        """The copy of ``key``, grown to cover ``rows``."""
        copy = self._copies[key]
        if rows > copy.shape[0]:
            grown = zeros((self.rows_for(key, rows, copy.shape[0]), *copy.shape[1:]), copy.dtype)
            grown[: copy.shape[0]] = copy
            self._copies[key] = copy = grown
        return copy

    def rows_for(self, key: Key, rows: int, now: int) -> int:
        """Rows for a copy of ``now`` rows to cover ``rows``: it grows by doubling."""
        return min(self._rows, max(rows, min(2 * now, self._cap)))


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in memory the OS maps on first write: rows of a mirror not yet written take no
    RAM.

    Large ones are anonymous mappings rather than numpy's ``calloc``: numpy asks the kernel
    for huge pages (``MADV_HUGEPAGE``) on large arrays, and where the kernel's ``defrag``
    setting is ``madvise`` (a common default) each first write then waits for memory to be
    compacted into huge pages, which made filling a 0.5 GB mirror 2-5 times slower than
    copying the rows into ``torch.empty`` memory. A plain mapping gets huge pages only as the
    kernel's own settings give them, without that wait.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    if nbytes >= _MAPPED_BYTES and hasattr(mmap, "MAP_ANONYMOUS"):
        # Private: copy-on-write in forked children, as any other memory of the process.
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).reshape(shape)
    return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).reshape(shape)


def put_rows(tensor: torch.Tensor, rows: np.ndarray, values: torch.Tensor) -> None:
    """``tensor[rows] = values`` (``rows`` unique): a copy for a run of rows."""
    if is_run(rows):
        tensor[int(rows[0]) : int(rows[0]) + rows.size] = values
    elif rows.size:
        tensor.index_copy_(0, torch.from_numpy(rows), values.to(tensor.dtype))
