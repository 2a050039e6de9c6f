"""Which rows of a store may be read, by whom: the row masks behind every commit.

Two questions are kept apart:

* **published**: the rows the last commit declares readable, which is what other
  processes (and a reopening writer) trust;
* **intact**: the rows whose every leaf holds the data this process wrote last, on
  disk. A row stops being intact the moment a write to it starts (a crash or a failed
  write may leave it torn) and becomes intact again when the write has landed.

A write of some keys only (``storage[:].set_(key, ...)``, a column added later) leaves
a row intact if it was intact before. On a row that was not (never written, or lost),
it makes just those cells readable here; the row becomes intact once every key has
been written. A commit publishes intact rows only, so no reader ever pairs one key's
new value with another key's old one.

The masks cover the rows written so far (the ledger's *extent*), not the store's
capacity: rows past the extent are neither published nor intact. The extent grows (by
doubling, up to the capacity) as writes reach further, so a store of 100M rows holding a
few thousand commits as fast as one of 1M.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from zarr_rb.util.keys import Key


class Ledger:
    """The published and intact rows of one store, and cells written key by key."""

    def __init__(self, published: np.ndarray, keys: Iterable[Key], *, capacity: int) -> None:
        self.capacity = capacity
        self.published = published[:capacity].copy()
        self.intact = self.published.copy()
        self._keys = set(keys)
        self._cells: dict[Key, np.ndarray] = {}
        """Per key: rows not intact whose cell of that key was written since."""

    @property
    def extent(self) -> int:
        """How many rows the masks cover (rows past them were never written here)."""
        return int(self.published.size)

    def grow(self, rows: int) -> None:
        """Cover at least ``rows`` rows (at most the capacity)."""
        if rows <= self.extent:
            return
        size = min(self.capacity, max(rows, 2 * self.extent))
        self.published = _padded(self.published, size)
        self.intact = _padded(self.intact, size)
        self._cells = {key: _padded(cells, size) for key, cells in self._cells.items()}

    def mask(self) -> np.ndarray:
        """A mask of no rows, over the extent."""
        return np.zeros(self.extent, dtype=bool)

    def fit(self, mask: np.ndarray) -> np.ndarray:
        """``mask`` (over any number of rows) over the extent: the ledger grows to take in
        any row it sets, rows it does not cover are not set."""
        if mask.size > self.extent:
            if mask[self.extent :].any():
                self.grow(mask.size)
            else:
                return mask[: self.extent]
        return _padded(mask, self.extent)

    def published_rows(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` is published."""
        return _lookup(self.published, rows)

    def unpublished(self, rows: int) -> np.ndarray:
        """Which of the first ``rows`` rows are not published (sorted)."""
        if rows <= self.extent and self.published[:rows].all():
            return np.empty(0, dtype=np.int64)  # (every sample asks: one pass, no copy)
        return np.flatnonzero(~self.first(self.published, rows))

    def first(self, mask: np.ndarray, rows: int) -> np.ndarray:
        """The first ``rows`` rows of a mask over the extent (unset past it)."""
        return _padded(mask[:rows], rows)

    def add_keys(self, keys: Iterable[Key], zeroed: np.ndarray | None = None) -> None:
        """New columns: every intact row holds them (their values are written with them),
        and so do the rows ``zeroed`` (a mask) that are not: zeros were written into their
        cells of the new keys, and their other cells stand as they were."""
        keys = set(keys)
        self._keys.update(keys)
        if zeroed is None:
            return
        partial = self.fit(zeroed) & ~self.intact
        if partial.any():
            for key in keys:
                cells = self._cells.setdefault(key, self.mask())
                cells |= partial

    def withdrawal_for(self, touched: np.ndarray) -> np.ndarray | None:
        """The readable mask to publish before rewriting ``touched`` rows, or ``None`` when
        no published row is among them."""
        touched = self.fit(touched)
        if not (self.published & touched).any():
            return None
        readable: np.ndarray = self.published & ~touched
        return readable

    def start_write(self, touched: np.ndarray) -> np.ndarray:
        """Rows about to be rewritten stop being intact; returns which ones were."""
        touched = self.fit(touched)
        was_intact: np.ndarray = self.intact & touched
        self.intact &= ~touched
        return was_intact

    def finish_write(
        self, touched: np.ndarray, was_intact: np.ndarray, keys: Collection[Key]
    ) -> None:
        """A write of ``keys`` to ``touched`` rows has landed."""
        touched, was_intact = self.fit(touched), self.fit(was_intact)
        if self._keys <= set(keys):
            self.intact |= touched
            for cells in self._cells.values():
                cells &= ~touched
            return
        self.intact |= was_intact
        fresh = touched & ~was_intact
        if not fresh.any():
            return
        for key in keys:
            cells = self._cells.setdefault(key, self.mask())
            cells |= fresh
        complete = fresh.copy()
        for key in self._keys:
            written = self._cells.get(key)
            if written is None:
                return
            complete &= written
        if complete.any():
            self.intact |= complete
            for cells in self._cells.values():
                cells &= ~complete

    def fail_write(self, lost: np.ndarray, keys: Collection[Key]) -> None:
        """A write of ``keys`` failed; ``lost``: the rows it made stop being intact (they
        were). Its cells may be torn, so the rows stay not intact, but their cells of the
        other keys still hold their data."""
        lost = self.fit(lost)
        if not lost.any():
            return
        for key in self._keys - set(keys):
            cells = self._cells.setdefault(key, self.mask())
            cells |= lost

    def rebase(self, readable: np.ndarray) -> None:
        """The rows held are now those of another commit (a save being loaded):
        ``readable``, whole, and nothing written key by key."""
        self.intact = self.fit(readable).copy()
        self._cells.clear()

    def withdraw(self, rows: np.ndarray) -> None:
        """Rows known to be damaged: not intact until rewritten whole."""
        rows = self.fit(rows)
        self.intact &= ~rows
        for cells in self._cells.values():
            cells &= ~rows

    def readable(self, rows: np.ndarray, key: Key) -> np.ndarray:
        """Whether each of ``rows`` (any order) holds data of ``key`` written here."""
        out = _lookup(self.intact, rows)
        cells = self._cells.get(key)
        if cells is not None:
            out |= _lookup(cells, rows)
        return out

    def held(self) -> np.ndarray:
        """Rows that hold data on disk that a commit declares or may declare readable
        (published, intact, or with cells of some keys written): their slot's objects
        hold data to keep."""
        held: np.ndarray = self.published | self.intact
        for cells in self._cells.values():
            held = held | cells
        return held

    def published_as(self, readable: np.ndarray) -> None:
        """What the last commit publishes: ``readable``, a mask over any number of rows."""
        self.published = self.fit(readable).copy()


def _padded(mask: np.ndarray, rows: int) -> np.ndarray:
    """``mask`` over ``rows`` rows: cut, or extended with unset rows."""
    if mask.size == rows:
        return mask
    if mask.size > rows:
        return mask[:rows]
    out = np.zeros(rows, dtype=bool)
    out[: mask.size] = mask
    return out


def _lookup(mask: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``mask[rows]``, unset for rows past the mask."""
    if not rows.size or int(rows.max()) < mask.size:
        found: np.ndarray = mask[rows]
        return found
    out = np.zeros(rows.shape, dtype=bool)
    inside = rows < mask.size
    out[inside] = mask[rows[inside]]
    return out
