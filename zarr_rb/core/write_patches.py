"""Failed writes kept in order: the writes of rows not held in a block of the write buffer
(:class:`~zarr_rb.core.write_cache.WriteBuffer`) whose write to disk failed, written again
by the next flush and read from here until then."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.util.keys import Key

Write = tuple[np.ndarray, Mapping[Key, torch.Tensor]]
"""Rows (sorted and unique) and the values of some leaves to write there."""


class Patches:
    """Writes of rows not held in a block, whose write to disk failed, in the order made (of
    some keys, and whole rows written before one of them): the next flush writes them again,
    and reads take those cells from here (a newer write of the same cells drops them, see
    :meth:`supersede`)."""

    def __init__(self) -> None:
        self._writes: list[Write] = []

    def __len__(self) -> int:
        return len(self._writes)

    def keep(self, write: Write) -> None:
        """Keep a write that failed, for the next flush and for reads."""
        self._writes.append(write)

    def take(self) -> list[Write]:
        """Every patch kept, oldest first (to write again: kept again if that fails)."""
        writes, self._writes = self._writes, []
        return writes

    def clear(self) -> None:
        self._writes.clear()

    def supersede(self, rows: np.ndarray, keys: Iterable[Key]) -> None:
        """A newer write holds the cells of ``keys`` in ``rows``: patches drop them (the
        next flush must not write older values over newer ones)."""
        if self._writes:
            self._writes = without_cells(self._writes, rows, keys)

    def add_key(self, key: Key, element_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A new leaf: each patch takes the zeros of its rows (rows kept only here may never
        have been written to disk), so that they land with the patch, in its place in the
        order."""
        self._writes = [
            (rows, {**values, key: torch.zeros((rows.size, *element_shape), dtype=dtype)})
            for rows, values in self._writes
        ]

    def rows(self) -> np.ndarray:
        """The rows some patch holds cells of (sorted, unique)."""
        return np.unique(np.concatenate([np.empty(0, np.int64), *(r for r, _ in self._writes)]))

    def mask(self, rows: np.ndarray, key: Key) -> np.ndarray:
        """Which of ``rows`` have their cell of ``key`` in a patch."""
        mask = np.zeros(rows.size, dtype=bool)
        for positions, _, _ in self._matches(rows, key):
            mask[positions] = True
        return mask

    def cells(self, rows: np.ndarray, key: Key) -> list[tuple[np.ndarray, torch.Tensor]]:
        """The cells of ``key`` that patches hold for ``rows`` (any order, repeats
        allowed), oldest first: the positions (into ``rows``) and their values."""
        return [
            (positions, values[torch.from_numpy(where)])
            for positions, where, values in self._matches(rows, key)
        ]

    def _matches(
        self, rows: np.ndarray, key: Key
    ) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """For each patch holding cells of ``key`` for some of ``rows``, oldest first: the
        positions (into ``rows``), where the patch holds them, and its values of ``key``."""
        for written, values in self._writes:
            if key in values:
                where = np.searchsorted(written, rows).clip(max=written.size - 1)
                positions = np.flatnonzero(written[where] == rows)
                if positions.size:
                    yield positions, where[positions], values[key]


def without_cells(writes: Sequence[Write], rows: np.ndarray, keys: Iterable[Key]) -> list[Write]:
    """``writes`` without the cells of ``keys`` in ``rows`` (a newer write holds them)."""
    keys = set(keys)
    out: list[Write] = []
    for written, values in writes:
        kept = ~np.isin(written, rows)
        index = torch.from_numpy(np.flatnonzero(kept))
        covered = {key: value[index] for key, value in values.items() if key in keys}
        others = {key: value for key, value in values.items() if key not in keys}
        if covered and kept.any():
            out.append((written[kept], covered))
        if others:
            out.append((written, others))
    return out
