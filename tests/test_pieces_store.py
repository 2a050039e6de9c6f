"""Stores whose run maps are kept in pieces (``zarr_rb/format/pieces.py``, written by
``zarr_rb/core/pieces.py``): shared writers, saves and versions, archives and plain
zarr-python readers, with pieces of a few positions and every map in pieces (as a buffer
of 10^8 rows fed by small extends has them), so that every commit writes pieces and drops
the ones it replaced.

Besides the tests written here, this module runs tests of other modules again with small
pieces (imported below): each checks its store against TorchRL's storages as it does there.
"""

from __future__ import annotations

import base64
import json
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from sample_runner import python_c
from tensordict import TensorDict
from test_archive import (  # noqa: F401 (run again here, with small pieces)
    test_shared_writers_append_in_the_order_their_extends_commit,
    test_the_history_of_a_ring_turned_over_reads_every_row_and_episode,
)
from test_interop import (  # noqa: F401 (run again here, with small pieces)
    test_zarr_python_reads_a_ring_of_several_writers_through_its_runs,
)
from test_shared_model import SharedWriters
from test_versions import (  # noqa: F401 (run again here, with small pieces)
    test_a_version_of_a_shared_store_keeps_its_rows_while_its_writers_go_on,
)
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.metadata import parse_record, read_root
from zarr_rb.engine import Engine
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format import pieces as pieces_module
from zarr_rb.format import runs as runs_module
from zarr_rb.format.pieces import MAPS_GROUP, MapPieceMissingError, piece_keys
from zarr_rb.locations.local import LocalLocation

SPAN = 4


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(runs_module, "SPAN", SPAN)
    monkeypatch.setattr(runs_module, "INLINE_RUNS", 0)


def stored_pieces(path: Path) -> set[str]:
    maps = path / MAPS_GROUP
    return {f"{MAPS_GROUP}/{p.name}" for p in maps.iterdir()} if maps.exists() else set()


def named_pieces(path: Path) -> set[str]:
    engine = Engine(LocalLocation(path))
    document = read_root(engine)
    assert document is not None
    return piece_keys(parse_record(document, "store", engine=engine).run_maps())


def assert_reads_as(path: Path, twin: LazyTensorStorage) -> None:
    """A reader opened now reads every position as ``twin`` holds it."""
    reader = ZarrStorage(path=path, read_only=True)
    try:
        everything = torch.arange(32)
        assert torch.equal(reader.get(everything)["step"], twin.get(everything)["step"])
    finally:
        reader.close()


def forget_decoded() -> None:
    """Drop the pieces this process decoded, so that the next parse reads them."""
    pieces_module._ASSEMBLED.clear()
    pieces_module._DECODED.clear()


def steps(first: int, count: int) -> TensorDict:
    step = torch.arange(first, first + count)
    return TensorDict({"step": step, "obs": step[:, None] * 2.0}, [count])


def interleaved(path: Path, rounds: int, twin: LazyTensorStorage) -> list[ZarrStorage]:
    compression = Compression(block_rows=4)
    writers = [ZarrStorage(32, path, shared=True, compression=compression)]
    writers.append(ZarrStorage(path=path, mode="r+", shared=True))
    cursor = 0
    for i in range(rounds):  # writers take turns: a run per extend, the ring turns over
        data = steps(5 * i, 5)
        writers[i % 2].set(torch.arange(5), data)
        twin.set((cursor + torch.arange(5)) % 32, data)
        cursor = (cursor + 5) % 32
    return writers


def test_shared_writers_keep_their_map_in_pieces_and_the_store_only_the_pieces_named(
    tmp_path,
):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 20, twin)
    record = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    assert "pieces" in record["commit"]["runs"]
    assert stored_pieces(path) == named_pieces(path)  # each replaced piece was deleted
    assert len(stored_pieces(path)) == 32 // SPAN
    reader = ZarrStorage(path=path, read_only=True)
    assert torch.equal(reader.get(torch.arange(32))["step"], twin.get(torch.arange(32))["step"])
    writers[0].set(torch.arange(3), steps(1000, 3))  # the reader's pieces go, it reads on
    twin.set((torch.arange(3) + 100) % 32, steps(1000, 3))
    reader.refresh()
    assert torch.equal(reader.get(torch.arange(32))["step"], twin.get(torch.arange(32))["step"])
    reader.close()
    for writer in writers:
        writer.close()


def test_a_reader_with_the_default_span_reads_pieces_in_another_process(tmp_path):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    for writer in interleaved(path, 13, twin):
        writer.close()
    child = python_c(
        textwrap.dedent(
            f"""
                import torch
                from zarr_rb import ZarrStorage
                from zarr_rb.format import runs
                assert runs.SPAN != {SPAN}
                reader = ZarrStorage(path={str(path)!r}, read_only=True)
                print(reader.get(torch.arange(len(reader)))["step"].tolist())
                """
        ),
        cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout) == twin.get(torch.arange(32))["step"].tolist()


def test_a_record_read_before_its_pieces_were_replaced_is_read_again(tmp_path):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 10, twin)
    engine = Engine(LocalLocation(path))
    old = read_root(engine)
    assert old is not None
    writers[1].set(torch.arange(32), steps(500, 32))  # every piece replaced, twice
    writers[0].set(torch.arange(32), steps(600, 32))
    forget_decoded()  # (pieces decoded once stay decoded: they never change)
    meta = parse_record(old, "store", engine=engine)  # its pieces are gone: read again
    assert meta.commit.generation > old["attributes"]["zarr_rb"]["commit"]["generation"]
    # A piece missing from the record as it is now is damage, named.
    (path / sorted(stored_pieces(path))[0]).unlink()
    forget_decoded()
    current = read_root(engine)
    assert current is not None
    with pytest.raises(MapPieceMissingError, match=MAPS_GROUP):
        parse_record(current, "store", engine=engine)
    for writer in writers:
        writer._store.lifetime.abandon()


def test_a_commit_that_lost_its_swap_deletes_the_pieces_it_wrote(tmp_path, monkeypatch):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 8, twin)
    first, second = writers
    store = first._store
    original = store.pieces.store
    lost = []

    def other_writer_first(meta):
        written = original(meta)
        if written and not lost:  # the other writer commits between these and the swap
            lost.extend(written)
            second.set(torch.arange(2), steps(900, 2))
        return written

    monkeypatch.setattr(store.pieces, "store", other_writer_first)
    first.set(torch.arange(3), steps(800, 3))
    assert lost
    assert not set(lost) & stored_pieces(path)
    assert stored_pieces(path) == named_pieces(path)
    twin.set((torch.arange(2) + 40) % 32, steps(900, 2))
    twin.set((torch.arange(3) + 42) % 32, steps(800, 3))
    assert_reads_as(path, twin)
    for writer in writers:
        writer.close()


def test_a_dropped_version_takes_its_pieces_along(tmp_path):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 9, twin)
    zarr_rb.save(TensorDictReplayBuffer(storage=writers[0]), tag="kept")
    kept = named_pieces(path)
    for i in range(9, 20):
        writers[i % 2].set(torch.arange(5), steps(5 * i, 5))
    assert kept <= stored_pieces(path) == named_pieces(path)
    for writer in writers:
        writer.close()
    zarr_rb.drop_version(path, "kept")
    assert stored_pieces(path) == named_pieces(path)
    assert not kept & stored_pieces(path) - named_pieces(path)


class SharedWritersInPieces(SharedWriters):
    """The many-writer model with every map in pieces: the store holds exactly the pieces
    its record names after every step (none leaked, none missing)."""

    @initialize(rows=st.sampled_from([12, 48]), block_rows=st.sampled_from([2, 4]))
    def setup(self, rows: int, block_rows: int) -> None:
        self._before = (runs_module.SPAN, runs_module.INLINE_RUNS)
        runs_module.SPAN, runs_module.INLINE_RUNS = SPAN, 0
        super().setup(rows, block_rows)

    @invariant()
    def the_store_holds_the_pieces_its_record_names(self) -> None:
        if hasattr(self, "writers") and (Path(self.url) / "zarr.json").exists():
            assert stored_pieces(Path(self.url)) == named_pieces(Path(self.url))

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if hasattr(self, "_before"):
                runs_module.SPAN, runs_module.INLINE_RUNS = self._before


TestSharedWritersInPieces = SharedWritersInPieces.TestCase
TestSharedWritersInPieces.settings = settings(
    max_examples=8,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _KilledError(Exception):
    pass


def test_pieces_a_crash_left_before_their_record_go_with_the_next_writers_commit(
    tmp_path, monkeypatch
):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 8, twin)
    crashed = writers[0]
    store = crashed._store
    original, wrote = store.pieces.store, []

    def pieces_then_killed(meta):
        wrote.extend(original(meta))
        if wrote:
            raise _KilledError  # between its pieces and its record
        return []

    monkeypatch.setattr(store.pieces, "store", pieces_then_killed)
    with pytest.raises(_KilledError):
        crashed.set(torch.arange(3), steps(800, 3))
    crashed._store.lifetime.abandon()
    left = stored_pieces(path) - named_pieces(path)
    assert left
    joined = ZarrStorage(path=path, mode="r+", shared=True)
    assert stored_pieces(path) - named_pieces(path) == left  # (opening deletes nothing)
    joined.set(torch.arange(2), steps(900, 2))
    assert stored_pieces(path) == named_pieces(path)
    twin.set((torch.arange(2) + 40) % 32, steps(900, 2))
    assert torch.equal(joined.get(torch.arange(32))["step"], twin.get(torch.arange(32))["step"])
    joined.close()
    writers[1].close()


def test_a_map_kept_inline_for_a_while_writes_its_pieces_again_when_it_grows(tmp_path, monkeypatch):
    # A record that keeps the map inline names no piece: the pieces of the record before
    # are deleted, and a map that grows past the bound again must not name them.
    monkeypatch.setattr(runs_module, "INLINE_RUNS", 6)
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    writers = interleaved(path, 8, twin)
    cursor, inline = 8, False
    for n, writer in [(20, 0), (5, 0), (5, 1), (5, 0), (5, 1)]:
        data = steps(1000 + cursor, n)
        writers[writer].set(torch.arange(n), data)
        twin.set((cursor + torch.arange(n)) % 32, data)
        cursor = (cursor + n) % 32
        record = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
        inline |= "pieces" not in record["commit"]["runs"]
        assert named_pieces(path) <= stored_pieces(path)
    assert inline
    assert "pieces" in record["commit"]["runs"]
    forget_decoded()
    assert_reads_as(path, twin)
    for writer in writers:
        writer.close()


def test_a_record_that_names_a_piece_read_before_at_another_place_is_damage(tmp_path):
    path = tmp_path / "rb.zarr"
    twin = LazyTensorStorage(32)
    for writer in interleaved(path, 8, twin):
        writer.close()
    assert_reads_as(path, twin)  # (its pieces are decoded, and kept)
    document = json.loads((path / "zarr.json").read_text())
    entries = document["attributes"]["zarr_rb"]["commit"]["runs"]["pieces"]
    first, other = next(
        (a, b) for a in entries for b in entries if a[0] < b[0] and a[2] == b[2]
    )  # two pieces of as many runs, their names swapped
    first[1], other[1] = other[1], first[1]
    (path / "zarr.json").write_text(json.dumps(document))
    with pytest.raises(StoreCorruptedError, match=MAPS_GROUP):
        ZarrStorage(path=path, read_only=True)


@pytest.mark.parametrize("inline_runs", [0, 100], ids=["pieces", "inline"])
def test_a_run_whose_end_overflows_int64_is_damage(tmp_path, monkeypatch, inline_runs):
    monkeypatch.setattr(runs_module, "INLINE_RUNS", inline_runs)
    path = tmp_path / "rb.zarr"
    for writer in interleaved(path, 8, LazyTensorStorage(32)):
        writer.close()
    document = json.loads((path / "zarr.json").read_text())
    record = document["attributes"]["zarr_rb"]["commit"]["runs"]
    where = path / MAPS_GROUP / record["pieces"][-1][1] if "pieces" in record else None
    raw = zlib.decompress(where.read_bytes() if where else base64.b64decode(record["data"]))
    runs = np.frombuffer(raw, "<i8").reshape(-1, 3).copy()
    runs[-1, 2] = np.iinfo(np.int64).max - runs[-1, 0] + 5  # its end wraps around, negative
    damaged = zlib.compress(runs.astype("<i8").tobytes())
    if where is None:
        record["data"] = base64.b64encode(damaged).decode()
        (path / "zarr.json").write_text(json.dumps(document))
    else:
        where.write_bytes(damaged)
    forget_decoded()  # (read intact by the writers)
    with pytest.raises(StoreCorruptedError):
        ZarrStorage(path=path, read_only=True)
