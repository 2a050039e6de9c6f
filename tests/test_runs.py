"""The row runs of shared stores (``zarr_rb/format/runs.py``) against a dense model: one
physical row (or none) per position."""

from __future__ import annotations

import base64
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.runs import RunMap, parse_run_map

BLOCK_ROWS = 4


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 80),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 79), st.integers(1, 90), st.booleans()),
        min_size=1,
        max_size=12,
    ),
)
def test_runs_map_each_position_as_a_dense_map_does(rows, steps):
    dense = np.full(rows, -1, dtype=np.int64)
    runs = RunMap.empty()
    written = 0
    for extend, start, count, withdraw in steps:
        if extend:  # an extend from a cursor, wrapping
            positions = np.unique((start + np.arange(count)) % rows)
        else:  # scattered positions
            positions = np.unique((start * np.arange(1, count + 1)) % rows)
        physical = written + np.arange(positions.size, dtype=np.int64)
        if withdraw:
            physical[::3] = -1  # positions withdrawn: no row any longer
        written += positions.size
        before = runs
        runs = runs.assign(positions, physical)
        previous = dense.copy()
        dense[positions] = physical
        everything = np.arange(rows)
        assert np.array_equal(runs.physical(everything), dense)
        assert np.array_equal(runs.mapped_mask(rows), dense >= 0)
        moved = np.flatnonzero((previous != dense) & (dense >= 0))
        assert sorted(runs.moved_since(before).tolist()) == moved.tolist()
        length = int(np.flatnonzero(dense >= 0).max(initial=-1)) + 1
        covered = np.ones(length, dtype=bool)
        for a, b in runs.holes(length):
            covered[a:b] = False
        assert np.array_equal(covered, dense[:length] >= 0)
        capacity = written // BLOCK_ROWS + 1
        used = np.zeros(capacity, dtype=bool)
        used[dense[dense >= 0] // BLOCK_ROWS] = True
        assert np.array_equal(runs.used_slots(BLOCK_ROWS, capacity), used)
        slots = np.unique(np.asarray([start % capacity, (start * 7) % capacity]))
        inside = (dense >= 0) & np.isin(dense // BLOCK_ROWS, slots)
        assert (
            sorted(runs.positions_in(slots, BLOCK_ROWS).tolist()) == np.flatnonzero(inside).tolist()
        )
        assert parse_run_map(runs.to_json(), rows=rows) == runs
        # Runs that go on where the one before ends are one run.
        r = runs.runs
        joined = (r[1:, 0] == r[:-1, 0] + r[:-1, 2]) & (r[1:, 1] == r[:-1, 1] + r[:-1, 2])
        assert not joined.any()


def _record(runs: list[list[int]], count: int | None = None) -> dict:
    raw = np.asarray(runs, dtype="<i8").reshape(-1, 3).tobytes()
    data = base64.b64encode(zlib.compress(raw)).decode()
    return {"runs": len(runs) if count is None else count, "data": data}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ([1, 2], "'runs' to be an object"),
        ({"runs": 1, "data": "%%%"}, "base64 of zlib"),
        ({"runs": 1, "data": base64.b64encode(b"not zlib").decode()}, "base64 of zlib"),
        (_record([[0, 0, 4]], count=2), "hold 2 runs"),
        (_record([[0, 0, 4], [2, 8, 4]]), "sorted, disjoint"),
        (_record([[0, 0, 0]]), "sorted, disjoint"),
        (_record([[0, -4, 4]]), "sorted, disjoint"),
        (_record([[10, 0, 4]]), "inside \\[0, 12\\)"),
        ({"runs": 10**9, "data": ""}, "at most 12 runs"),
    ],
)
def test_a_damaged_map_is_a_typed_error_naming_what_is_wrong(value, says):
    with pytest.raises(StoreCorruptedError, match=says):
        parse_run_map(value, rows=12)


def test_a_map_inflating_past_what_it_declares_is_refused_without_inflating_it():
    bomb = {"runs": 1, "data": base64.b64encode(zlib.compress(bytes(10**7))).decode()}
    with pytest.raises(StoreCorruptedError, match="hold 1 runs"):
        parse_run_map(bomb, rows=12)
