"""Where each position of a shared store lives on disk: row runs.

The writers of a shared store append into slots of their own (``block_rows`` consecutive
rows of the data arrays, see :mod:`zarr_rb.format.ring`) and learn the positions of their
rows only when they commit them: the commit maps ``[cursor, cursor + n)`` to the rows just
written. Writers interleave, so this map is row-granular: runs ``[first position, first
physical row, rows]``, sorted by position, that never overlap. A position no run covers
holds no row.

In the commit record (``commit.runs``), the runs are one little-endian ``int64`` array of
shape ``[runs, 3]``, zlib-compressed and base64-encoded: what any reader decodes with the
standard library and numpy alone. See ``docs/design/ring.md``, "Step 2". A map of more
runs than that is kept in pieces of ``span`` positions, objects of their own that the
record names (:mod:`zarr_rb.format.pieces`, "Step 3"); a map remembers the names of the
pieces it was read from or stored as (:attr:`RunMap.names`), and a map derived from it
keeps the names of the pieces it did not change.
"""

from __future__ import annotations

import base64
import binascii
import functools
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.ring import invalid_metadata

_EMPTY = np.empty((0, 3), dtype=np.int64)


SPAN = 2**18
"""Positions per piece of a map kept in pieces (a record keeps the span its pieces have)."""


class RunMap:
    """Positions to physical rows of the data arrays, by runs (immutable).

    ``names``: the piece objects that hold pieces of this map as stored (piece ``k`` holds
    positions ``[k * span, (k + 1) * span)``): ``{k: (name, runs)}``. A memo of where the
    map is stored, filled when it is read from pieces or its pieces are written.
    ``columns``: the runs as ``(starts, firsts, counts)``, in place of ``runs``.
    """

    __slots__ = ("_ends", "_held", "counts", "firsts", "names", "span", "starts")

    def __init__(
        self,
        runs: np.ndarray,
        *,
        span: int = 0,
        names: dict[int, tuple[str, int]] | None = None,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if columns is None:
            runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
            columns = (runs[:, 0], runs[:, 1], runs[:, 2])
        self._columns(*columns)
        self.span = span or SPAN
        self.names: dict[int, tuple[str, int]] = {} if names is None else names
        self._held: np.ndarray | None = None

    def _columns(self, starts: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> None:
        self.starts = np.ascontiguousarray(starts, dtype=np.int64)
        self.firsts = np.ascontiguousarray(firsts, dtype=np.int64)
        self.counts = np.ascontiguousarray(counts, dtype=np.int64)
        self._ends = self.starts + self.counts
        for array in (self.starts, self.firsts, self.counts, self._ends):
            array.flags.writeable = False  # shared by every record that decodes to it

    @classmethod
    def from_columns(
        cls,
        starts: np.ndarray,
        firsts: np.ndarray,
        counts: np.ndarray,
        *,
        span: int = 0,
        names: dict[int, tuple[str, int]] | None = None,
    ) -> RunMap:
        """The map of runs ``[starts, firsts, counts]`` (sorted, disjoint, merged)."""
        return cls(_EMPTY, span=span, names=names, columns=(starts, firsts, counts))

    def _derived(self, runs: np.ndarray, changed: np.ndarray) -> RunMap:
        """A map of ``runs`` that differs from this one in the pieces ``changed`` only (it
        keeps the names of the others)."""
        return RunMap(runs, span=self.span, names=self._names_but(changed))

    def _names_but(self, changed: np.ndarray) -> dict[int, tuple[str, int]]:
        """The names of the pieces but those ``changed`` (none while the map is small enough
        to keep inline: the record that keeps it so names no piece, and the one it replaced
        had its pieces deleted)."""
        if len(self) <= INLINE_RUNS:
            return {}
        changed_set = set(np.unique(changed).tolist())
        return {k: v for k, v in self.names.items() if k not in changed_set}

    @classmethod
    def empty(cls) -> RunMap:
        return cls(_EMPTY)

    @classmethod
    def of(cls, positions: np.ndarray, physical: np.ndarray) -> RunMap:
        """The map of ``positions`` (sorted, unique) to ``physical`` rows."""
        return cls(_compress(np.asarray(positions, np.int64), np.asarray(physical, np.int64)))

    @property
    def runs(self) -> np.ndarray:
        """``[first position, first physical row, rows]`` per run, sorted by position."""
        return np.stack([self.starts, self.firsts, self.counts], axis=1)

    def __len__(self) -> int:
        return int(self.starts.size)

    @property
    def end(self) -> int:
        """The position after the last one mapped (``0``: none is)."""
        return int(self._ends[-1]) if self._ends.size else 0

    def appended(self, physical: np.ndarray) -> RunMap:
        """This map with ``physical`` rows mapped to the positions after :attr:`end`, in
        order (an archive's history grows so)."""
        physical = np.asarray(physical, dtype=np.int64)
        if not physical.size:
            return self
        end = self.end
        tail = _compress(np.arange(end, end + physical.size, dtype=np.int64), physical)
        changed = np.arange(end // self.span, (end + physical.size - 1) // self.span + 1)
        return self._derived(merged_runs(np.concatenate([self.runs, tail])), changed)

    def physical(self, positions: np.ndarray) -> np.ndarray:
        """The physical row of each position (``-1``: no row there)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.starts.size:
            return np.full(positions.shape, -1, dtype=np.int64)
        run = np.searchsorted(self.starts, positions, side="right") - 1
        inside = run >= 0
        run = np.maximum(run, 0)
        offset = positions - self.starts[run]
        inside &= offset < self.counts[run]
        out: np.ndarray = np.where(inside, self.firsts[run] + offset, -1)
        return out

    def assign(self, positions: np.ndarray, physical: np.ndarray) -> RunMap:
        """This map with ``positions`` (sorted, unique) mapped to ``physical`` rows (``-1``:
        to none; what they held before is no longer referred to).

        Its cost follows the runs that reach into ``[positions[0], positions[-1]]`` and
        the positions given, plus one copy of the runs: the runs around are slices."""
        positions = np.asarray(positions, dtype=np.int64)
        physical = np.asarray(physical, dtype=np.int64)
        if not positions.size:
            return self
        lo, hi = int(positions[0]), int(positions[-1]) + 1
        i = int(np.searchsorted(self._ends, lo, side="right"))  # runs before: end <= lo
        j = int(np.searchsorted(self.starts, hi, side="left"))  # runs after: start >= hi
        kept = _without(self.starts[i:j], self.firsts[i:j], self.counts[i:j], positions)
        mapped = physical >= 0
        middle = np.concatenate([kept, _compress(positions[mapped], physical[mapped])])
        middle = middle[np.argsort(middle[:, 0], kind="stable")]
        # The runs around are merged already: only the middle and its two neighbours may
        # join.
        left, right = max(i - 1, 0), min(j + 1, len(self))
        middle = merged_runs(
            np.concatenate([self.runs_slice(left, i), middle, self.runs_slice(j, right)])
        )
        return RunMap.from_columns(
            np.concatenate([self.starts[:left], middle[:, 0], self.starts[right:]]),
            np.concatenate([self.firsts[:left], middle[:, 1], self.firsts[right:]]),
            np.concatenate([self.counts[:left], middle[:, 2], self.counts[right:]]),
            span=self.span,
            names=self._names_but(positions // self.span),
        )

    def runs_slice(self, start: int, stop: int) -> np.ndarray:
        """Runs ``start`` to ``stop`` (in position order), as ``[runs, 3]``."""
        return np.stack(
            [self.starts[start:stop], self.firsts[start:stop], self.counts[start:stop]], axis=1
        )

    # --- pieces ----------------------------------------------------------------------------

    def held_pieces(self) -> np.ndarray:
        """The pieces that hold a run (sorted)."""
        if self._held is None:
            first = self.starts // self.span
            last = (self._ends - 1) // self.span
            # (Runs are sorted and disjoint: so are their first pieces, repeats together.)
            held = first[np.concatenate(([True], first[1:] != first[:-1]))]
            crossing = last > first
            if crossing.any():  # and the pieces the runs that cross a bound reach into
                more = _spread(first[crossing] + 1, (last - first)[crossing])
                held = np.union1d(held, more)
            self._held = held
        return self._held

    def piece(self, k: int) -> np.ndarray:
        """The runs of piece ``k`` (positions ``[k * span, (k + 1) * span)``), the runs
        that cross its bounds cut at them."""
        lo, hi = k * self.span, (k + 1) * self.span
        i = int(np.searchsorted(self._ends, lo, side="right"))
        j = int(np.searchsorted(self.starts, hi, side="left"))
        runs = self.runs_slice(i, j)
        if runs.size:
            cut = max(0, lo - int(runs[0, 0]))
            runs[0] += (cut, cut, -cut)
            runs[-1, 2] = min(int(runs[-1, 2]), hi - int(runs[-1, 0]))
        return runs

    def stored(self) -> bool:
        """Whether every piece holding a run has a name (the record can name them)."""
        names = self.names
        return len(names) >= self.held_pieces().size and all(
            k in names for k in self.held_pieces().tolist()
        )

    def positions_in(self, slots: np.ndarray, block_rows: int) -> np.ndarray:
        """The positions whose rows lie in ``slots`` (sorted, unique)."""
        if not len(self) or not slots.size:
            return np.empty(0, dtype=np.int64)
        first = self.firsts // block_rows
        last = (self.firsts + self.counts - 1) // block_rows
        at = np.searchsorted(slots, first)
        hit = at < slots.size
        hit[hit] &= slots[at[hit]] <= last[hit]
        starts, counts = self.starts[hit], self.counts[hit]
        if not starts.size:
            return np.empty(0, dtype=np.int64)
        positions = _spread(starts, counts)
        inside = np.isin(self.physical(positions) // block_rows, slots)
        out: np.ndarray = positions[inside]
        return out

    def mapped_mask(self, rows: int) -> np.ndarray:
        """Boolean mask over ``rows`` positions: which hold a row."""
        edges = np.zeros(rows + 1, dtype=np.int64)
        np.add.at(edges, np.minimum(self.starts, rows), 1)
        np.add.at(edges, np.minimum(self._ends, rows), -1)
        out: np.ndarray = np.cumsum(edges[:rows]) > 0
        return out

    def used_slots(self, block_rows: int, capacity: int) -> np.ndarray:
        """Boolean mask over ``capacity`` slots: which hold a row the map refers to."""
        edges = np.zeros(capacity + 1, dtype=np.int64)
        if self.starts.size:
            first = self.firsts // block_rows
            last = (self.firsts + self.counts - 1) // block_rows + 1
            np.add.at(edges, np.minimum(first, capacity), 1)
            np.add.at(edges, np.minimum(last, capacity), -1)
        out: np.ndarray = np.cumsum(edges[:capacity]) > 0
        return out

    def holes(self, length: int) -> tuple[tuple[int, int], ...]:
        """The ranges of ``[0, length)`` that no run covers (one pass over the runs)."""
        inside = self.starts < length
        starts, ends = self.starts[inside], np.minimum(self._ends[inside], length)
        gap_starts = np.concatenate(([0], ends))
        gap_ends = np.concatenate((starts, [length]))
        keep = gap_ends > gap_starts
        return tuple(
            (int(a), int(b))
            for a, b in zip(gap_starts[keep].tolist(), gap_ends[keep].tolist(), strict=True)
        )

    def moved_since(self, old: RunMap) -> np.ndarray:
        """The positions this map puts in other rows than ``old`` does (or that ``old``
        leaves unmapped): those of its runs that ``old`` has not, compared row by row."""
        if not len(self):
            return np.empty(0, dtype=np.int64)
        at = np.searchsorted(old.starts, self.starts)
        same = at < len(old)
        if len(old):
            near = np.minimum(at, len(old) - 1)
            same &= (
                (old.starts[near] == self.starts)
                & (old.firsts[near] == self.firsts)
                & (old.counts[near] == self.counts)
            )
        starts, counts = self.starts[~same], self.counts[~same]
        if not starts.size:
            return np.empty(0, dtype=np.int64)
        positions = _spread(starts, counts)
        out: np.ndarray = positions[old.physical(positions) != self.physical(positions)]
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunMap):
            return NotImplemented
        return bool(
            np.array_equal(self.starts, other.starts)
            and np.array_equal(self.firsts, other.firsts)
            and np.array_equal(self.counts, other.counts)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunMap({self.runs.tolist()[:8]}{'...' if len(self) > 8 else ''})"

    def to_json(self) -> dict[str, Any]:
        """The record's form: the pieces' names once they are stored and the map is too
        large to keep inline (:func:`zarr_rb.core.pieces.store_pieces`), else the runs."""
        if len(self) > INLINE_RUNS and self.stored():
            held = self.held_pieces().tolist()
            pieces = [[k, *self.names[k]] for k in held]
            return {
                "runs": sum(count for _, _, count in pieces),
                "span": self.span,
                "pieces": pieces,
            }
        raw = self.runs.astype("<i8").tobytes()
        encoded = {"runs": len(self), "data": base64.b64encode(zlib.compress(raw, 1)).decode()}
        _remember(encoded, self)
        return encoded


def parse_run_map(value: object, *, rows: int) -> RunMap | None:
    """Runs from the commit record (untrusted): sorted, disjoint, inside ``rows``
    positions, at physical rows that are not negative (their bound is checked against the
    arrays' capacity by the caller)."""
    if value is None:
        return None

    def bad(what: str) -> StoreCorruptedError:
        return invalid_metadata(what, value)

    if not isinstance(value, Mapping):
        raise bad("'runs' to be an object or null")
    count, data = value.get("runs"), value.get("data")
    if not (isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= rows):
        raise bad(f"'runs' to count at most {rows} runs")
    if not isinstance(data, str):
        raise bad("'runs' data to be a base64 string")
    known = _KNOWN.get((count, data))
    if known is not None and known.end <= rows:
        return known
    return _decoded(count, data, rows)


_KNOWN: dict[tuple[int, str], RunMap] = {}
"""The maps last encoded, by their encoding: a writer reads again the record it wrote (a
commit's positions and its history)."""
_KNOWN_MAPS = 4


def _remember(encoded: dict[str, Any], runs: RunMap) -> None:
    while len(_KNOWN) >= _KNOWN_MAPS:
        del _KNOWN[next(iter(_KNOWN))]
    _KNOWN[(encoded["runs"], encoded["data"])] = runs


@functools.lru_cache(maxsize=4)
def _decoded(count: int, data: str, rows: int) -> RunMap:
    """The runs of a record, decoded once: readers read records again and again."""

    def bad(what: str) -> StoreCorruptedError:
        return invalid_metadata(what, data)

    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(data, validate=True), count * 24 + 1)
    except (binascii.Error, zlib.error, ValueError):
        raise bad("'runs' data to be base64 of zlib-compressed int64 runs") from None
    if len(raw) != count * 24 or inflater.unconsumed_tail or not inflater.eof:
        raise bad(f"'runs' data to hold {count} runs of 3 int64")
    runs = np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(count, 3)
    starts, firsts, counts = runs[:, 0], runs[:, 1], runs[:, 2]
    if count and not (
        (counts >= 1).all()
        and (starts >= 0).all()
        and no_overflow(starts, firsts, counts, bound=rows)
        and int((starts + counts).max()) <= rows
        and (starts[1:] >= starts[:-1] + counts[:-1]).all()
    ):
        raise bad(f"runs sorted, disjoint and inside [0, {rows})")
    return RunMap(runs)


def no_overflow(starts: np.ndarray, firsts: np.ndarray, counts: np.ndarray, *, bound: int) -> bool:
    """Whether runs read from a record (counts of at least 1) start and hold fewer than
    ``bound`` positions each, at rows that are not negative and whose ends fit in an int64:
    the checks that add them up then see no sum wrapped around."""
    return bool(
        (starts < bound).all()
        and (counts <= bound).all()
        and (firsts >= 0).all()
        and (firsts <= np.iinfo(np.int64).max - counts).all()
    )


INLINE_RUNS = 2048
"""The most runs a map keeps inline in the record; a larger one is kept in pieces."""


def _without(
    starts: np.ndarray, firsts: np.ndarray, counts: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """The runs ``[starts, firsts, counts]`` without ``positions`` (sorted, unique): each
    run cut into the parts between the positions removed from it."""
    if not starts.size:
        return _EMPTY
    # The gaps between the positions removed, as half-open ranges [gap_lo, gap_hi).
    big = np.iinfo(np.int64).max
    gap_lo = np.concatenate(([-1], positions + 1))
    gap_hi = np.concatenate((positions, [big]))
    open_gap = gap_hi > gap_lo
    gap_lo, gap_hi = gap_lo[open_gap], gap_hi[open_gap]
    ends = starts + counts
    first_gap = np.searchsorted(gap_hi, starts, side="right")  # first gap ending past start
    stop_gap = np.searchsorted(gap_lo, ends, side="left")  # first gap starting at or past end
    pairs = np.maximum(stop_gap - first_gap, 0)
    run = np.repeat(np.arange(starts.size), pairs)
    gap = _spread(first_gap[pairs > 0], pairs[pairs > 0])
    lo = np.maximum(starts[run], gap_lo[gap])
    hi = np.minimum(ends[run], gap_hi[gap])
    keep = hi > lo
    run, lo, hi = run[keep], lo[keep], hi[keep]
    return np.stack([lo, firsts[run] + lo - starts[run], hi - lo], axis=1).astype(np.int64)


def _spread(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Every position of the runs that start at ``starts`` and hold ``counts`` rows."""
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    out: np.ndarray = np.repeat(starts, counts) + offsets
    return out


def _compress(positions: np.ndarray, physical: np.ndarray) -> np.ndarray:
    """Runs of sorted, unique ``positions`` and their ``physical`` rows."""
    if not positions.size:
        return _EMPTY
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(physical) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [positions.size])))
    return np.stack([positions[starts], physical[starts], counts], axis=1).astype(np.int64)


def merged_runs(runs: np.ndarray) -> np.ndarray:
    """Sorted runs with each run that goes on where the one before ends joined to it."""
    if len(runs) < 2:
        return runs
    starts, firsts, counts = runs[:, 0], runs[:, 1], runs[:, 2]
    continues = (starts[1:] == starts[:-1] + counts[:-1]) & (
        firsts[1:] == firsts[:-1] + counts[:-1]
    )
    if not continues.any():
        return runs
    heads = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = runs[heads]
    merged[:, 2] = np.add.reduceat(counts, heads)
    return merged
