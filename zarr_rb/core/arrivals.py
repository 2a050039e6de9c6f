"""The rows a store of one writer is waiting to see on disk: what its commits wait for
(``docs/design/ring.md``: "Rows land in the order they were extended").

:class:`Arrivals` keeps two sets of rows, sorted; :class:`~zarr_rb.core.solo_writes.
SoloWrites` tells it what each call writes and what lands, and
:class:`~zarr_rb.core.solo.SoloCommits` asks it before each commit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_NONE = np.empty(0, dtype=np.int64)


class Arrivals:
    """Rows extended and not on disk yet, and rows written over before they got there."""

    __slots__ = ("_held", "_skipped", "_unlanded")

    def __init__(self, held: Callable[[], np.ndarray]) -> None:
        self._held = held
        """The rows held in RAM (waiting in the write buffer, or being written from it)."""
        self._unlanded = _NONE
        """Rows extended whose extended values are not on disk yet (in RAM, in flight, or
        kept after a failed write): a commit's cursor stops at the first of them. Not
        rows written over in RAM after their extend landed (an overwrite may or may not be
        committed; counted, it held the cursor back before rows on disk)."""
        self._skipped = _NONE
        """Rows written again while their extended value was not on disk yet (a lap, or a
        write over them, after a failed extend kept in RAM): that value never lands, so no
        commit may declare a state that needs it; commits wait until the row lands."""

    @property
    def any_unlanded(self) -> bool:
        return bool(self._unlanded.size)

    def unlanded(self) -> np.ndarray:
        """The rows extended whose values are not on disk yet, of those held in RAM (the
        others were dropped with their values: an empty, a save loaded)."""
        held = self._held()
        self._unlanded = self._unlanded[np.isin(self._unlanded, held)]
        self._skipped = self._skipped[np.isin(self._skipped, held)]
        return self._unlanded

    def skipped_waiting(self) -> bool:
        """Whether a row written again before its extended value landed still waits for
        that value (every state from it on needs one or the other: commits wait)."""
        return bool(np.isin(self._skipped, self.unlanded()).any())

    def written(self, rows: np.ndarray, *, extended: bool) -> None:
        """``rows`` are written now (``extended``: by an extend, whose values are not on
        disk yet). Those whose extended value was not on disk yet never will have it
        there: the value they get replaces it (a lap, or a write over them)."""
        replaced = np.intersect1d(self.unlanded(), rows)
        if replaced.size:
            self._skipped = np.union1d(self._skipped, replaced)
        if extended:
            self._unlanded = np.union1d(self._unlanded, rows)

    def landed(self, rows: np.ndarray) -> None:
        """``rows`` (unique) are on disk with the values last written to them."""
        self._unlanded = np.setdiff1d(self._unlanded, rows, assume_unique=True)
        self._skipped = np.setdiff1d(self._skipped, rows, assume_unique=True)
