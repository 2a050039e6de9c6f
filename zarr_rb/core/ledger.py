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
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

Key = tuple[str, ...]


class Ledger:
    """The published and intact rows of one store, and cells written key by key."""

    def __init__(self, published: np.ndarray, keys: Iterable[Key]) -> None:
        self.published = published
        self.intact = published.copy()
        self._keys = set(keys)
        self._cells: dict[Key, np.ndarray] = {}
        """Per key: rows not intact whose cell of that key was written since."""

    @property
    def rows(self) -> int:
        return int(self.published.size)

    def add_keys(self, keys: Iterable[Key]) -> None:
        """New columns: every intact row holds them (their values are written with them)."""
        self._keys.update(keys)

    def withdrawal_for(self, touched: np.ndarray) -> np.ndarray | None:
        """The readable mask to publish before rewriting ``touched`` rows, or ``None`` when
        no published row is among them."""
        if not (self.published & touched).any():
            return None
        readable: np.ndarray = self.published & ~touched
        return readable

    def start_write(self, touched: np.ndarray) -> np.ndarray:
        """Rows about to be rewritten stop being intact; returns which ones were."""
        was_intact: np.ndarray = self.intact & touched
        self.intact &= ~touched
        return was_intact

    def finish_write(
        self, touched: np.ndarray, was_intact: np.ndarray, keys: Collection[Key]
    ) -> None:
        """A write of ``keys`` to ``touched`` rows has landed."""
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
            cells = self._cells.setdefault(key, np.zeros(self.rows, dtype=bool))
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

    def withdraw(self, rows: np.ndarray) -> None:
        """Rows known to be damaged: not intact until rewritten whole."""
        self.intact &= ~rows
        for cells in self._cells.values():
            cells &= ~rows

    def readable(self, rows: np.ndarray, key: Key) -> np.ndarray:
        """Whether each of ``rows`` (any order) holds data of ``key`` written here."""
        out: np.ndarray = self.intact[rows]
        cells = self._cells.get(key)
        if cells is not None:
            out |= cells[rows]
        return out

    def published_as(self, readable: np.ndarray) -> None:
        self.published = readable.copy()
