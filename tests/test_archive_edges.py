"""Archive mode under writes out of ring order, keys added later, damage and bad records.

Each test names the promise it checks: the history holds exactly the rows extended and
committed, each as written (never an older row at its place), every row readable, and a
damaged or corrupted record is a typed error that ``zarr_rb.verify`` reports.
"""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np
import pytest
import torch
from conftest import chunk_file
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

import zarr_rb
from zarr_rb import Compression, StoreCorruptedError, ZarrStorage
from zarr_rb.testing import simulate_crash


def steps(values) -> TensorDict:
    """Rows whose every element derives from their step (a torn or stale row shows)."""
    v = torch.as_tensor(values, dtype=torch.int64)
    obs = ((v[:, None] * 7 + torch.arange(16)) % 251).to(torch.uint8)
    return TensorDict({"step": v, "obs": obs}, [v.numel()])


def history_steps(path) -> list[int]:
    reader = ZarrStorage(path=path, read_only=True, history=True)
    try:
        rows = reader.get(torch.arange(len(reader)))
        assert torch.equal(rows["obs"], steps(rows["step"])["obs"]), "history rows torn"
        return rows["step"].tolist()
    finally:
        reader.close()


def test_a_row_written_out_of_ring_order_is_in_the_history_as_written(tmp_path):
    """``storage.set(index, rows)`` (what TensorDictMaxValueWriter calls) at positions
    before the cursor: the commit made by the next write must not name the old rows of
    those positions, whose new rows still wait in RAM."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    storage.set(torch.arange(4), steps(range(4)))
    storage.flush()
    storage.set(torch.tensor([4]), steps([4]))
    storage.set(torch.tensor([2, 3]), steps([5, 6]))
    storage.close()
    assert history_steps(path) == [0, 1, 2, 3, 4, 5, 6]


def test_a_max_value_writer_archives_the_rows_it_keeps(tmp_path):
    """Every row a TensorDictMaxValueWriter let in is in the history once, as written."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(10, path, archive=True, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, writer=TensorDictMaxValueWriter(rank_key="rank"))
    twin = TensorDictReplayBuffer(
        storage=LazyTensorStorage(10), writer=TensorDictMaxValueWriter(rank_key="rank")
    )
    generator = torch.Generator().manual_seed(0)
    kept: list[int] = []
    start = 0
    for n in (4, 4, 5, 3, 3, 2, 3, 1, 3, 5, 5, 3):
        batch = steps(range(start, start + n))
        batch["rank"] = torch.rand(n, generator=generator)
        index = rb.extend(batch.clone())
        assert torch.equal(index, twin.extend(batch.clone()))
        kept += [s for s, i in zip(range(start, start + n), index.tolist(), strict=True) if i >= 0]
        start += n
    storage.close()
    assert sorted(history_steps(path)) == kept


def test_a_row_set_behind_the_cursor_reaches_the_history_with_its_commit(tmp_path):
    """The ring commits the row (it reads back after close); the history must hold it."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    storage.set(torch.arange(4), steps(range(4)))
    storage.flush()
    storage.set(torch.tensor([1]), steps([4]))
    storage.close()
    ring = ZarrStorage(path=path, read_only=True)
    assert ring.get(torch.arange(4))["step"].tolist() == [0, 4, 2, 3]
    ring.close()
    assert history_steps(path) == [0, 1, 2, 3, 4]


def test_a_key_added_after_the_ring_wrapped_reads_as_zeros_in_older_history_rows(tmp_path):
    """Rows the ring left before a key existed read zeros for it, as in the ring."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(4, path, archive=True, compression=Compression(block_rows=2))
    )
    rb.extend(TensorDict({"step": torch.arange(0, 4)}, [4]))
    rb.extend(TensorDict({"step": torch.arange(4, 8)}, [4]))
    rb.extend(TensorDict({"step": torch.tensor([8]), "late": torch.tensor([8.0])}, [1]))
    rb.storage.close()
    reader = ZarrStorage(path=path, read_only=True, history=True)
    rows = reader.get(torch.arange(len(reader)))
    reader.close()
    assert rows["step"].tolist() == list(range(9))
    assert rows["late"].tolist() == [0.0] * 8 + [8.0]


def test_verify_reads_the_rows_only_the_history_names(tmp_path):
    """A damaged chunk of history rows is found by verify (the reader's error sends the
    user there)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    storage.set(torch.arange(8), steps(range(8)))
    storage.flush()
    storage.set(torch.arange(8), steps(range(8, 16)))  # the ring leaves slots 0 and 1
    storage.close()
    shard = chunk_file(path, "data/obs", 0, 0)
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(zarr_rb.ChunkCorruptedError, match="verify"):
        history_steps(path)
    report = zarr_rb.verify(path)
    assert not report.ok
    assert any(d.array == "data/obs" and d.rows[0] == 0 for d in report.damaged)


def _with_history(path, runs) -> None:
    raw = np.asarray(runs, dtype="<i8").reshape(-1, 3).tobytes()
    encoded = {"runs": len(runs), "data": base64.b64encode(zlib.compress(raw)).decode()}
    document = json.loads((path / "zarr.json").read_text())
    document["attributes"]["zarr_rb"]["commit"]["history"] = encoded
    (path / "zarr.json").write_text(json.dumps(document))


@pytest.fixture
def archived(tmp_path):
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    storage.set(torch.arange(8), steps(range(8)))
    storage.set(torch.arange(4), steps(range(8, 12)))
    storage.close()
    return path


def _read_history(path) -> None:
    reader = ZarrStorage(path=path, read_only=True, history=True)
    try:
        reader.get(torch.arange(len(reader)))
    finally:
        reader.close()


def _history_episodes(path) -> None:
    view = zarr_rb.open(path, history=True)
    try:
        view.episodes  # noqa: B018
    finally:
        view.close()


def _write_and_flush(path) -> None:
    storage = ZarrStorage(path=path)
    try:
        storage.set(torch.arange(4, 8), steps(range(12, 16)))
        storage.flush()
    except BaseException:
        simulate_crash(storage)  # nothing more is written
        raise
    storage.close()


@pytest.mark.parametrize(
    "runs",
    [[[0, 0, 8], [8, 10**6, 4]], [[0, 0, 2**46]]],
    ids=["rows past the arrays", "more rows than any archive"],
)
def test_a_corrupted_history_is_a_typed_error_for_readers(archived, runs):
    _with_history(archived, runs)
    with pytest.raises(StoreCorruptedError):
        _read_history(archived)
    with pytest.raises(StoreCorruptedError):
        _history_episodes(archived)


def test_a_corrupted_history_is_a_typed_error_for_a_writer(archived):
    """A history naming more rows than the arrays hold: no slot would ever be free."""
    _with_history(archived, [[0, 0, 10**7]])
    with pytest.raises(StoreCorruptedError):
        _write_and_flush(archived)


def test_dask_arrays_of_the_ring_and_of_the_history_are_not_taken_for_each_other(tmp_path):
    dask = pytest.importorskip("dask")
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    storage.set(torch.arange(8), steps(range(8)))
    storage.flush()
    storage.set(torch.arange(8), steps(range(8, 16)))
    storage.close()
    ring, history = zarr_rb.open(path), zarr_rb.open(path, history=True)
    try:
        first_of_ring = ring.to_dask()["step"][:4]
        first_of_history = history.to_dask()["step"][:4]
        got = dask.compute(first_of_ring, first_of_history)
        assert [a.tolist() for a in got] == [[8, 9, 10, 11], [0, 1, 2, 3]]
    finally:
        ring.close()
        history.close()


def test_rows_extended_before_a_torchrl_loads_stay_in_the_history(tmp_path):
    """``rb.loads`` of a dump made elsewhere moves the ring back: the rows extended before
    it stay in the history as extended (not the dump's rows at their places)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(12, path, archive=True, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    rb.extend(steps(range(12)))
    rb.dumps(tmp_path / "dump")
    rb.extend(steps(range(12, 18)))  # positions 4 and 5 wait in RAM
    rb.loads(tmp_path / "dump")
    rb.extend(steps(range(18, 21)))
    storage.close()
    history = history_steps(path)
    assert history[:12] == list(range(12))
    assert history[-3:] == [18, 19, 20]
    assert history == list(range(21))


def test_extends_that_fail_before_they_keep_their_rows_are_not_in_the_history(tmp_path):
    """Two extends fail before they keep their rows (no room for a block of RAM): their
    positions are not in the history (found by review: they were appended with the rows
    those positions held before, and the store could not be opened again)."""
    from unittest import mock

    from zarr_rb.core.write_cache import WriteBuffer

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(steps(range(7)))
    for start in (100, 200):
        no_room = mock.patch.object(WriteBuffer, "_new_block", side_effect=MemoryError)
        with no_room, pytest.raises(MemoryError):
            rb.extend(steps(range(start, start + 3)))
    rb.extend(steps(range(300, 302)))
    storage.close()
    steps_kept = history_steps(path)
    assert steps_kept[:7] == list(range(7))
    assert {300, 301} <= set(steps_kept)
    assert not {100, 101, 102, 200, 201, 202} & set(steps_kept)
    assert len(steps_kept) == len(set(steps_kept))


def test_an_extend_interrupted_between_two_keys_puts_no_row_into_the_history(tmp_path):
    """An extend over a row waiting in RAM, written there in place (not extended), is
    interrupted between two keys: the row gets its value back, and the history leaves the
    extend's position out (found by review: the row put back counted as kept, and the
    history took it with the value written in place)."""
    from unittest import mock

    from zarr_rb.core.write_cache import Block

    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=4)
    storage = ZarrStorage(8, path, archive=True, compression=compression, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(steps(range(4)))
    storage.flush()
    rb.extend(steps([4]))  # row 4 waits in RAM
    in_place = steps([55])
    in_place["index"] = torch.tensor([5])
    storage[torch.tensor([5])] = in_place  # row 5, in RAM, not extended
    put, calls = Block.put, []

    def interrupted(self: Block, *args, **kwargs) -> None:
        calls.append(1)
        if len(calls) == 2:  # after the first key
            raise KeyboardInterrupt

        put(self, *args, **kwargs)

    with mock.patch.object(Block, "put", interrupted), pytest.raises(KeyboardInterrupt):
        rb.extend(steps([105, 106]))  # rows 5 and 6
    assert storage.get(torch.tensor([5]))["step"].tolist() == [55]
    storage.close()
    assert history_steps(path) == [0, 1, 2, 3, 4]
