"""An archive's history, seen from the one writer of a store: the positions it extended
since its last commit, and which of them the next commit publishes.

The history itself is ``commit.history`` (a :class:`~zarr_rb.format.runs.RunMap` from
history index to row of the data arrays, see ``docs/design/ring.md``, "Archive mode"); a
commit appends to it the rows of the positions this module hands it, at the rows the
commit's slot map gives them. Shared writers append in their commit's compare-and-swap
(:mod:`zarr_rb.core.sharing`) and need none of this.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zarr_rb.errors import NoHistoryError
from zarr_rb.format.commit import Commit
from zarr_rb.format.record import StoreMeta

_NONE = np.empty(0, dtype=np.int64)


class Extended:
    """The positions extended since the last commit, in the order they were written."""

    __slots__ = ("_positions",)

    def __init__(self) -> None:
        self._positions = _NONE

    def add(self, rows: np.ndarray, cursor: int, ring_rows: int) -> None:
        """An extend wrote ``rows`` (sorted) and left the cursor at ``cursor``: in the order
        written, the row just before the cursor comes last."""
        order = np.argsort((rows - cursor) % ring_rows, kind="stable")
        self._positions = np.concatenate([self._positions, rows[order].astype(np.int64)])

    def overlaps(self, rows: np.ndarray) -> bool:
        """Whether a write of ``rows`` goes over positions extended since the last commit
        (their rows would not reach the history as extended: commit them first)."""
        return bool(self._positions.size) and bool(np.isin(rows, self._positions).any())

    def drop(self, rows: np.ndarray) -> None:
        """An extend of ``rows`` failed before it kept them: they were not extended."""
        self._positions = self._positions[~np.isin(self._positions, rows)]

    def restart(self) -> None:
        """The cursor moved (a load, an empty): what was extended before is not appended."""
        self._positions = _NONE

    def pending(self) -> np.ndarray:
        """The positions extended since the last commit, in the order written, each once."""
        positions = self._positions
        if positions.size:
            _, last = np.unique(positions[::-1], return_index=True)
            positions = positions[np.sort(positions.size - 1 - last)]
        return positions

    def keep(self, positions: np.ndarray) -> None:
        """After a commit: only ``positions`` (those of :meth:`pending` it did not publish,
        still in RAM) wait."""
        self._positions = positions


def as_history(meta: StoreMeta, where: str) -> StoreMeta:
    """The record of a store as the record of its history: a store of read-only rows whose
    positions are history indices (every row extended, in commit order), none written over
    and none collected, at the commit ``meta`` has.

    Raises:
        NoHistoryError: the store keeps no history.
    """
    history = meta.commit.history
    if history is None:
        raise NoHistoryError(
            f"{where} keeps no history: only rows still in its ring are there. Write it "
            "with ZarrStorage(..., archive=True) to keep every row extended from then on",
        )
    rows = history.end
    commit = Commit(
        generation=meta.commit.generation, length=rows, cursor=0, runs=history, history=history
    )
    schema = meta.schema
    if schema is None:
        return dataclasses.replace(meta, commit=commit, saved=None, versions={})
    schema = dataclasses.replace(schema, batch_shape=(max(rows, 1), *schema.batch_shape[1:]))
    return dataclasses.replace(
        meta,
        max_size=schema.rows * schema.elements_per_row,
        schema=schema,
        commit=commit,
        saved=None,
        versions={},
    )
