"""The length and cursor a commit of a store of one writer records: the rows past the last
commit that it declares, and where a writer reopened from it goes on (``docs/design/ring.md``,
"Rows land in the order they were extended", "A commit declares rows past").

:class:`SoloCursor` is the part of :class:`~zarr_rb.core.solo.SoloCommits` (which derives
from it) that keeps where the rows written since the last commit start and how far they
went, and answers, for the rows a commit could declare, which cursor it records and
whether it declares a state the buffer went through.
"""

from __future__ import annotations

import numpy as np

from zarr_rb.core.solo_keys import SoloKeys
from zarr_rb.format.commit import mask_to_ranges


class SoloCursor(SoloKeys):
    """The rows written since the last commit, as its cursor rules see them."""

    def _init_cursor(self, cursor: int) -> None:
        self._written_from = cursor
        """Where the rows written since the last commit (or since the cursor was moved)
        start: the commit records how far from there they are committed."""
        self._advanced = 0
        """Rows extended since then: from a whole ring on, the cursor is back where they
        started, and every position holds one of them."""
        self._out_of_order = False
        """Rows written since then that moved the cursor without running on from it
        (``storage.set`` at given rows, as TorchRL's max-value writer makes): the rows
        since no longer run on from :attr:`_written_from` (see :meth:`_length_extended`)."""

    def _declares_no_state(self, length: int, cut: int | None, cursor: int, after: int) -> bool:
        """Whether a commit of ``length`` rows (cut at row ``cut``: rows past the last commit
        from there on are not on disk), with ``cursor`` and ``after`` rows extended past
        it, would declare rows of the ring's first lap that no state the buffer went through
        holds (see ``docs/design/ring.md``, "A commit declares rows past")."""
        cache = self.store.write_cache
        assert cache is not None
        if length >= cache.rows:
            return False
        if cursor > length:
            return True  # (rows between the length and the cursor: never a state)
        if not self._out_of_order:
            return length < self._length_extended(after)
        # Writes at given rows moved the cursor since the last commit: the rows since do
        # not run on from it. A cut at a row waiting in RAM, after rows the last commit
        # declared were written over, may be such an extend's.
        return self._rewrote_published and cut is not None and bool(np.isin(cut, cache.held_rows()))

    def _length_extended(self, after: int) -> int:
        """The length a commit whose cursor ``after`` rows extended since the last commit
        precede must declare at least: one past the last row extended before that cursor
        (the whole ring once they went around it)."""
        assert self.store.write_cache is not None
        extended = self._advanced - after
        if not extended:
            return 0
        return min(self.store.write_cache.rows, self._written_from + extended)

    def _settled(self, readable: np.ndarray, unheld: np.ndarray) -> np.ndarray:
        """A copy of ``readable`` with the rows set that no commit need wait for: rows
        nothing holds, neither on disk nor in RAM, which nothing will write unless they are
        written again. They are holes: those of a call that failed before it kept them, and
        those TorchRL's ``len`` counts that ``storage.set`` never wrote (``docs/design/
        ring.md``, "Rows nothing holds"); ``unheld``: :meth:`_unheld`)."""
        if not unheld.size:
            return readable.copy()  # (callers change it and ``readable`` apart)
        settled = np.zeros(max(readable.size, int(unheld[-1]) + 1), dtype=bool)
        settled[: readable.size] = readable
        settled[unheld] = True
        return settled

    def _unwritten(
        self, readable: np.ndarray, length: int, unheld: np.ndarray
    ) -> tuple[tuple[int, int], ...]:
        """The holes of a commit of ``length`` rows declaring ``readable`` that no call
        wrote: the last commit's still holes, and rows past its length nothing holds
        (``Commit.unwritten``; rows withdrawn, or lost to a failed write, are not)."""
        last = self.committed
        unwritten = np.zeros(length, dtype=bool)
        for start, stop in last.unwritten:
            unwritten[start : min(stop, length)] = True
        unwritten[unheld[(unheld >= last.length) & (unheld < length)]] = True
        inside = min(length, readable.size)
        unwritten[:inside] &= ~readable[:inside]
        return mask_to_ranges(unwritten)

    def _unheld(self) -> np.ndarray:
        """The rows of the buffer nothing holds, neither on disk nor in RAM (sorted)."""
        return self.store.ram.unreadable_rows(self.store.length_rows)

    def _committable_cursor(self, readable: np.ndarray, unheld: np.ndarray) -> tuple[int, int]:
        """The cursor a commit that declares the ``readable`` rows records: this writer's,
        unless rows it wrote since the last commit still wait in RAM or are not readable in
        it (withdrawn while they are rewritten); then the first of them in ring order, so
        that a writer reopened after a crash appends right after the rows the commit
        publishes (or, in a full ring, rewrites the oldest or withdrawn ones first), never
        over rows it published. Rows past the buffer's length hold it back nowhere, and a
        cursor past the length (rows set past it, in the first lap) is recorded at the
        length. Also returns how many rows were extended from there."""
        assert self.store.write_cache is not None
        start, rows = self._written_from, self.store.write_cache.rows
        span = (self.cursor - start) % rows
        if self._advanced >= rows:
            # A whole ring or more: the oldest of the newest rows is at the cursor.
            start, span = self.cursor, rows
        first = span
        # The span in ring order: one or two runs of rows (never a mask over all of them).
        runs = [(start, min(start + span, rows))]
        if start + span > rows:
            runs.append((0, start + span - rows))
        offset = 0
        settled = self._settled(readable, unheld)  # (holes: nothing to wait for)
        # Rows past the buffer's length (rows set past it, or a cursor loaded past them)
        # are in no state: nothing to wait for there either.
        inside = self.store.length_rows
        for lo, hi in runs:
            found = first_unset(settled, lo, min(hi, inside))
            if found is not None:
                first = offset + found - lo
                break
            offset += hi - lo
        distance = (self.arrivals.unlanded() - start) % rows
        waiting = distance[distance < first]
        if waiting.size:
            first = int(waiting.min())
        cursor = (start + first) % rows
        if cursor > inside:
            # (The first lap: a writer reopened goes on at the rows the buffer holds.)
            return inside, 0
        return cursor, span - first


def first_unset(mask: np.ndarray, start: int, stop: int) -> int | None:
    """The first row of ``[start, stop)`` that ``mask`` leaves unset (rows past the mask are
    unset), or ``None``."""
    end = min(stop, mask.size)
    if start < end:
        unset = np.flatnonzero(~mask[start:end])
        if unset.size:
            return start + int(unset[0])
    past = max(start, mask.size)
    return past if past < stop else None
