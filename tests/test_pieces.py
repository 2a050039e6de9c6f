"""Run maps kept in pieces (``zarr_rb/format/pieces.py``): what a record names reads back
as the map it was written from, a change writes only the pieces it touched, and a record
that names pieces wrongly gets a typed error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zarr_rb.core.pieces import store_pieces
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format import runs as runs_module
from zarr_rb.format.pieces import (
    MAPS_GROUP,
    MapPieceMissingError,
    encode_piece,
    parse_map,
    piece_keys,
)
from zarr_rb.format.runs import RunMap

SPAN = 8


class Objects(dict[str, bytes]):
    """A store's objects, in a dict."""

    def read(self, key: str) -> bytes | None:
        return self.get(key)

    def identity(self) -> tuple[str, ...]:
        return ("objects", str(id(self)))


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(runs_module, "SPAN", SPAN)
    monkeypatch.setattr(runs_module, "INLINE_RUNS", 0)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 90),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 89), st.integers(1, 40), st.booleans()),
        min_size=1,
        max_size=10,
    ),
)
def test_a_map_in_pieces_reads_back_and_a_change_writes_the_pieces_it_touched(rows, steps):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs_module, "SPAN", SPAN)
        patch.setattr(runs_module, "INLINE_RUNS", 0)
        objects = Objects()
        dense = np.full(rows, -1, dtype=np.int64)
        runs = RunMap.empty()
        written = 0
        for extend, start, count, withdraw in steps:
            if extend:
                positions = np.unique((start + np.arange(count)) % rows)
            else:
                positions = np.unique((start * np.arange(1, count + 1)) % rows)
            physical = written + np.arange(positions.size, dtype=np.int64)
            if withdraw:
                physical[::3] = -1
            written += positions.size
            before = runs
            runs = runs.assign(positions, physical)
            dense[positions] = physical
            for k in runs.names:  # kept: those it did not change
                assert k in before.names
                assert np.array_equal(runs.piece(k), before.piece(k))
            new = store_pieces([runs], objects.__setitem__)
            touched = set((positions // SPAN).tolist())
            assert len(new) <= len(touched) or not before.names
            record = runs.to_json()
            assert "pieces" in record or not len(runs)
            assert piece_keys([runs]) <= set(objects)
            read = parse_map(record, rows=rows, pieces=objects)
            assert read is not None
            assert np.array_equal(read.physical(np.arange(rows)), dense)
            assert read == runs


def test_a_history_appended_to_writes_its_last_pieces_only(small_pieces):
    objects = Objects()
    history = RunMap.empty()
    for first in range(0, 100, 10):
        history = history.appended(np.arange(first, first + 10) * 3)  # no two rows in a run
        new = store_pieces([history], objects.__setitem__)
        assert 1 <= len(new) <= 2  # the piece it goes on in, and one it starts
    read = parse_map(history.to_json(), rows=2**40, pieces=objects)
    assert read is not None
    assert np.array_equal(read.physical(np.arange(100)), np.arange(100) * 3)


def test_small_maps_stay_inline():
    runs = RunMap.of(np.arange(10), np.arange(10) * 2)
    assert store_pieces([runs], pytest.fail) == []
    assert "data" in runs.to_json()


def stored_record(objects: Objects) -> dict:
    runs = RunMap.of(np.arange(40), np.arange(40) * 2)
    store_pieces([runs], objects.__setitem__)
    return runs.to_json()


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda r: r.update(span=0), "span"),
        (lambda r: r.update(span=True), "span"),
        (lambda r: r.update(runs=-1), "'runs'"),
        (lambda r: r.update(runs=r["runs"] - 1), "in all"),
        (lambda r: r.update(pieces="x"), "'pieces'"),
        (lambda r: r["pieces"][0].__setitem__(1, "../../../etc/passwd"), "hex"),
        (lambda r: r["pieces"][0].__setitem__(1, "A" * 32), "hex"),
        (lambda r: r["pieces"][0].__setitem__(0, 10**9), "inside"),
        (lambda r: r["pieces"][0].__setitem__(2, 0), "inside"),
        (lambda r: r["pieces"].reverse(), "sorted"),
        (lambda r: r["pieces"].append(list(r["pieces"][-1])), "sorted"),
    ],
)
def test_a_record_that_names_pieces_wrongly_gets_a_typed_error(small_pieces, change, what):
    objects = Objects()
    record = stored_record(objects)
    change(record)
    with pytest.raises(StoreCorruptedError, match=what):
        parse_map(record, rows=40, pieces=objects)


def test_a_missing_or_damaged_piece_gets_a_typed_error_naming_it(small_pieces):
    objects = Objects()
    record = stored_record(objects)
    key = f"{MAPS_GROUP}/{record['pieces'][1][1]}"
    good = objects.pop(key)
    with pytest.raises(MapPieceMissingError, match=key):
        parse_map(record, rows=40, pieces=objects)
    for damaged in (good[:-3], b"not zlib", encode_piece(np.array([[0, 0, 1]])), b""):
        objects[key] = damaged
        with pytest.raises(StoreCorruptedError, match=key):
            parse_map(record, rows=40, pieces=objects)
    objects[key] = encode_piece(np.array([[8, 0, 30]] * 1))  # past its piece's bound
    with pytest.raises(StoreCorruptedError):
        parse_map(record, rows=40, pieces=objects)
    with pytest.raises(StoreCorruptedError, match="cannot read"):
        parse_map(record, rows=40, pieces=None)
