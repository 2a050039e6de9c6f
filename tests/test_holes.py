"""No sampler ever draws a row that a repair (or a crash) withdrew, and sampling such a store
raises no error: every TorchRL sampler, on a writer and on a reader, fresh or loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import chunk_file
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
)

import zarr_rb
from zarr_rb import Compression, RowsNotCommittedError, ZarrStorage
from zarr_rb.testing import simulate_crash

ROWS = 96
LAYOUT = Compression(chunk_rows=2, block_rows=8, large_row_bytes=64)
HOLE = range(24, 32)  # one shard of the image leaf
LENGTHS = (7, 12, 5, 9, 14, 6, 11, 8, 10, 4, 10)  # trajectories, some across the hole


def transitions() -> TensorDict:
    traj = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[:ROWS]
    done = torch.zeros(ROWS, 1, dtype=torch.bool)
    done[torch.cumsum(torch.tensor(LENGTHS), 0)[:-1] - 1] = True
    step = torch.arange(ROWS)
    return TensorDict(
        {
            "step": step,
            "obs": step.float().view(-1, 1, 1).expand(-1, 4, 4).clone(),
            "traj": traj,
            ("next", "done"): done,
            ("next", "reward"): step.float().unsqueeze(-1),
        },
        batch_size=[ROWS],
    )


def withdraw_a_shard(path: Path) -> None:
    """Lose the image shard of rows 24-31 and repair: those rows become holes."""
    chunk_file(path, "data/obs", 3, 0, 0).unlink()
    zarr_rb.verify(path, repair=True)
    assert zarr_rb.verify(path).ok


@pytest.fixture
def holed_store(tmp_path: Path) -> Path:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(ROWS, path, compression=LAYOUT))
    rb.extend(transitions())
    rb.storage.close()
    withdraw_a_shard(path)
    return path


SAMPLERS: dict[str, Callable[[], Any]] = {
    "random": RandomSampler,
    "without_replacement": lambda: SamplerWithoutReplacement(drop_last=False),
    "slice_traj_key": lambda: SliceSampler(slice_len=4, traj_key="traj"),
    "slice_end_key": lambda: SliceSampler(slice_len=4, end_key=("next", "done")),
    "slice_not_strict": lambda: SliceSampler(slice_len=4, traj_key="traj", strict_length=False),
    "slice_without_replacement": lambda: SliceSamplerWithoutReplacement(
        slice_len=4, traj_key="traj"
    ),
    "prioritized": lambda: PrioritizedSampler(ROWS, alpha=0.7, beta=0.5),
    "prioritized_slice": lambda: PrioritizedSliceSampler(
        ROWS, alpha=0.7, beta=0.5, slice_len=4, traj_key="traj"
    ),
}


def draws(rb: ReplayBuffer, times: int) -> set[int]:
    rows: set[int] = set()
    for _ in range(times):
        sample = rb.sample()
        rows.update(sample["step"].tolist())  # the step is the row
    return rows


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "reader"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_no_sampler_draws_a_withdrawn_row(holed_store: Path, name: str, read_only: bool) -> None:
    storage = ZarrStorage(path=holed_store, read_only=read_only)
    assert len(storage) == ROWS  # the length stays: the rows are holes
    with pytest.raises(RowsNotCommittedError):
        storage.get(torch.tensor([HOLE[0]]))
    rb = TensorDictReplayBuffer(storage=storage, sampler=SAMPLERS[name](), batch_size=16)
    drawn = draws(rb, 60)
    assert not drawn & set(HOLE), f"{name} drew withdrawn rows {sorted(drawn & set(HOLE))}"
    assert len(drawn) > 40  # and it still draws from all the rest
    storage.close()


def test_a_rewritten_hole_is_drawn_again(holed_store: Path) -> None:
    storage = ZarrStorage(path=holed_store)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
    assert not draws(rb, 30) & set(HOLE)
    rows = transitions()[HOLE.start : HOLE.stop]
    rb[HOLE.start : HOLE.stop] = rows  # every key but "index" (TensorDictReplayBuffer's)
    assert not draws(rb, 30) & set(HOLE)  # not whole yet: still holes
    rb[HOLE.start : HOLE.stop] = rows.set("index", torch.arange(HOLE.start, HOLE.stop))
    assert draws(rb, 60) & set(HOLE)
    storage.close()


def test_prioritized_buffer_loaded_after_a_repair(tmp_path: Path) -> None:
    """A saved prioritized buffer whose rows were then lost: the loaded sampler gives them
    no weight (exactly zero), the others keep their saved priorities."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=1.0,
        beta=0.5,
        storage=ZarrStorage(ROWS, path, compression=LAYOUT),
        batch_size=16,
    )
    rb.extend(transitions())
    rb.update_priority(torch.arange(ROWS), torch.full((ROWS,), 2.0))
    zarr_rb.save(rb)
    rb.storage.close()
    withdraw_a_shard(path)
    loaded = zarr_rb.load(path)
    drawn = draws(loaded, 60)
    assert not drawn & set(HOLE)
    assert len(drawn) > 40
    leaves = torch.as_tensor(loaded.sampler._sum_tree[torch.arange(ROWS)])
    assert (leaves[list(HOLE)] == 0).all()
    assert (leaves[: HOLE.start] > 0).all()
    loaded.storage.close()


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "reader"])
@pytest.mark.parametrize("shards", [1, 7, 11], ids=["few", "most", "all_but_one"])
def test_random_draws_are_uniform_over_the_readable_rows(
    tmp_path: Path, shards: int, read_only: bool
) -> None:
    """Few holes are skipped by drawing again the picks that fell on them, many by listing
    the readable rows: both draw every readable row, each as often (within chance)."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(ROWS, path, compression=LAYOUT))
    rb.extend(transitions())
    rb.storage.close()
    for shard in range(shards):
        chunk_file(path, "data/obs", shard, 0, 0).unlink()
    zarr_rb.verify(path, repair=True)
    holes = set(range(8 * shards))
    storage = ZarrStorage(path=path, read_only=read_only)
    assert set(storage.unreadable_rows().tolist()) == holes
    rb = TensorDictReplayBuffer(storage=storage, batch_size=500)
    rb.set_rng(torch.Generator().manual_seed(3))
    counts = torch.zeros(ROWS, dtype=torch.int64)
    for _ in range(40):
        counts += torch.bincount(rb.sample()["step"], minlength=ROWS)
    assert not counts[sorted(holes)].any()
    readable = counts[8 * shards :].double()
    expected = 40 * 500 / readable.numel()
    chi2 = float(((readable - expected) ** 2 / expected).sum())
    assert chi2 < 3 * readable.numel(), (chi2, readable.tolist())  # mean df, sd sqrt(2 df)
    storage.close()


def test_two_dimensional_store(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    data = TensorDict(
        {"step": torch.arange(ROWS * 2).view(ROWS, 2), "obs": torch.zeros(ROWS, 2, 4, 4)},
        batch_size=[ROWS, 2],
    )
    storage = ZarrStorage(ROWS * 2, path, ndim=2, compression=LAYOUT)
    storage.set(slice(0, ROWS), data)
    storage.close()
    chunk_file(path, "data/obs", 3, 0, 0, 0).unlink()
    zarr_rb.verify(path, repair=True)
    for make in (RandomSampler, SamplerWithoutReplacement):
        storage = ZarrStorage(path=path)
        rb = TensorDictReplayBuffer(storage=storage, sampler=make(), batch_size=16)
        for _ in range(40):
            rows = (rb.sample()["step"] // 2).tolist()
            assert not set(rows) & set(HOLE)
        storage.close()


@pytest.mark.parametrize("block_rows", [2, 4])
def test_a_save_covering_rows_never_written_loads_them_as_holes(
    tmp_path: Path, block_rows: int
) -> None:
    """TorchRL's storage grows its length by the rows of each ``set``: the same rows set
    twice leave ``len`` past the rows written (LazyTensorStorage then reads whatever its
    memory held there). A save made then covers rows no commit declares: they load as
    holes, which raise ``RowsNotCommittedError`` and which samplers skip, as on the buffer
    saved (found by review: the load read them as zeros, or raised ChunkCorruptedError on
    their missing objects)."""

    def rows(values: list[int]) -> TensorDict:
        step = torch.tensor(values)
        return TensorDict({"step": step, "obs": step.float()[:, None]}, [len(values)])

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=block_rows))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    storage.set(torch.tensor([0, 1]), rows([10, 11]))
    storage.set(torch.tensor([0, 1]), rows([20, 21]))
    assert len(storage) == 4
    assert storage._store.unreadable_rows().tolist() == [2, 3]
    zarr_rb.save(rb)
    storage.close()
    loaded = zarr_rb.load(path)
    assert len(loaded) == 4
    with pytest.raises(RowsNotCommittedError):
        loaded.storage.get(torch.arange(4))
    assert loaded.storage.get(torch.tensor([0, 1]))["step"].tolist() == [20, 21]
    assert set(loaded.sample(64)["step"].tolist()) <= {20, 21}
    loaded.storage.close()
    # An in-RAM storage cannot leave them out: the load says which rows and what to do.
    with pytest.raises(RowsNotCommittedError, match=r"rows \[2, 3\].*never written"):
        zarr_rb.load(path, storage="memory")


def _rows(values: list[int]) -> TensorDict:
    step = torch.tensor(values)
    return TensorDict({"step": step, "obs": step.float()[:, None]}, [len(values)])


def _reopened_after_crash(storage: ZarrStorage, path: Path) -> tuple[int, list[int], dict]:
    """``storage``'s writer dies; the length of the store opened again, its holes, and the
    ``step`` of each other row."""
    simulate_crash(storage)
    with ZarrStorage(path=path) as reopened:
        holes = reopened.unreadable_rows().tolist()
        rows = [row for row in range(len(reopened)) if row not in holes]
        steps = reopened.get(torch.tensor(rows))["step"].tolist() if rows else []
        return len(reopened), holes, dict(zip(rows, steps, strict=True))


@pytest.mark.parametrize("block_rows", [2, 4, 64])
def test_rows_set_past_rows_never_written_are_committed(tmp_path: Path, block_rows: int) -> None:
    """TorchRL counts in ``len`` rows that ``storage.set`` never wrote (the same rows set
    twice). Nothing will write them, so commits declare them as holes rather than wait
    for them: rows set past them are committed by a flush, and survive a crash (found by
    review: commits stopped at the first such row, and a crash lost every row set after
    it)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=block_rows))
    storage.set(torch.tensor([0, 1]), _rows([10, 11]))
    storage.set(torch.tensor([0, 1]), _rows([20, 21]))
    storage.set(torch.tensor([4, 5]), _rows([40, 41]))
    assert len(storage) == 6
    assert storage.unreadable_rows().tolist() == [2, 3]
    storage.flush()
    length, holes, steps = _reopened_after_crash(storage, path)
    assert (length, holes, steps) == (6, [2, 3], {0: 20, 1: 21, 4: 40, 5: 41})


def test_a_write_into_trailing_holes_after_a_load_keeps_the_length(tmp_path: Path) -> None:
    """A save whose length covers rows never written loads them as holes; writing one of
    them, then a crash, reopens with the buffer's length, the rest still holes (found by
    review: commits after a load counted from the record before it, and dropped the
    trailing holes from the length)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    storage.set(torch.tensor([0, 1]), _rows([10, 11]))
    storage.set(torch.tensor([0, 1]), _rows([20, 21]))
    zarr_rb.save(rb)
    storage.close()
    loaded = zarr_rb.load(path)
    assert len(loaded) == 4
    loaded.storage.set(2, _rows([32])[0])
    assert len(loaded) == 5  # (TorchRL counts each row set)
    assert loaded.storage.unreadable_rows().tolist() == [3, 4]
    loaded.storage.flush()
    length, holes, steps = _reopened_after_crash(loaded.storage, path)
    assert (length, holes, steps) == (5, [3, 4], {0: 20, 1: 21, 2: 32})


def test_rows_written_after_loading_a_cursor_past_the_length_are_committed(
    tmp_path: Path,
) -> None:
    """A row set past the length leaves the store's cursor past it; a save keeps that
    cursor and a load restores it. Rows written after the load are committed by the next
    save (found by the holes state machine: no commit was made after such a load, and a
    crash lost the rows the next save covered)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(12, path, compression=Compression(block_rows=2, chunk_rows=2))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    storage.set(torch.tensor([2]), _rows([1]))  # len 1: row 0 never written, row 2 past it
    zarr_rb.save(rb)
    simulate_crash(storage)
    rb = zarr_rb.load(path)
    assert (len(rb), rb.storage.cursor) == (1, 3)
    rb.storage.set(torch.tensor([0]), _rows([2]))
    zarr_rb.save(rb)
    simulate_crash(rb.storage)
    rb = zarr_rb.load(path)
    assert len(rb) == 2
    assert rb.storage.unreadable_rows().tolist() == [1]
    assert rb.storage.get(torch.tensor([0]))["step"].tolist() == [2]
    rb.storage.close()


def test_a_write_of_some_keys_into_rows_never_written_reads_zeros_in_the_others(
    tmp_path: Path,
) -> None:
    """As LazyTensorStorage's fresh memory: rows TorchRL counts that no call wrote get
    zeros in the keys a write leaves out, also once a commit declared them holes (found by
    review: after a flush, such a write left the row a hole)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=4))
    storage.set(torch.tensor([0, 1]), _rows([10, 11]))
    storage.set(torch.tensor([0, 1]), _rows([20, 21]))  # len 4: rows 2-3 never written
    storage.flush()
    storage[torch.tensor([2])] = TensorDict({"step": torch.tensor([32])}, [1])
    row = storage.get(torch.tensor([2]))
    assert (row["step"].tolist(), row["obs"].tolist()) == ([32], [[0.0]])
    assert storage.unreadable_rows().tolist() == [3]
    storage.flush()
    length, holes, steps = _reopened_after_crash(storage, path)
    assert (length, holes, steps) == (4, [3], {0: 20, 1: 21, 2: 32})


def test_rows_not_written_since_an_empty_are_holes(tmp_path: Path) -> None:
    """After ``empty()``, rows TorchRL counts that no call wrote since are holes, as in a
    store reopened after the empty (found by review: they read the values on disk from
    before the empty, where LazyTensorStorage reads the last ones it held)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(list(range(8))))
    storage.flush()
    rb.extend(_rows([100]))  # row 0 waits in RAM
    rb.empty()
    storage.set(torch.tensor([5, 5]), _rows([205, 205]))  # len 2: rows 0-1 not written
    assert len(storage) == 2
    assert storage.unreadable_rows().tolist() == [0, 1]
    with pytest.raises(RowsNotCommittedError):
        storage.get(torch.tensor([0]))
    rb.extend(_rows([300, 301]))  # the writer's cursor is 0: rows 0-1
    assert storage.get(torch.arange(2))["step"].tolist() == [300, 301]
    storage.flush()
    length, holes, steps = _reopened_after_crash(storage, path)
    assert (length, holes, steps) == (4, [2, 3], {0: 300, 1: 301})


def test_a_version_keeps_its_rows_where_the_buffer_has_holes_no_call_wrote(
    tmp_path: Path,
) -> None:
    """A version saved before an ``empty()`` keeps its rows, though the buffer's commits
    declare holes at them since (rows counted, not written): those are not damage the
    version shares (found by review: loading the version read them as holes, and a save
    of it lost them for good)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    storage.set(torch.tensor([0]), _rows([7]))
    zarr_rb.save(rb, tag="v1")
    rb.empty()
    storage.set(torch.tensor([2]), _rows([9]))  # len 1: row 0 not written since the empty
    storage.flush()
    assert storage.unreadable_rows().tolist() == [0]
    for read_only in (True, False):
        if not read_only:
            storage.close()  # (a writer loads a version of a buffer open nowhere else)
        loaded = zarr_rb.load(path, version="v1", read_only=read_only)
        assert loaded.storage.unreadable_rows().tolist() == []
        assert loaded.storage.get(torch.tensor([0]))["step"].tolist() == [7]
        loaded.storage.close()


def test_a_write_of_some_keys_into_a_committed_unwritten_row_after_a_reopen(
    tmp_path: Path,
) -> None:
    """A store reopened after a crash knows which of its holes no call wrote (the record
    says so): a write of some keys there gets zeros in the others, as in the writer that
    declared them (found by review: after the reopen, the row stayed a hole and the write
    was lost)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path)
    storage.set(torch.arange(2), _rows([1, 2]))
    storage.set(torch.tensor([3]), _rows([4]))  # len 3: row 2 never written
    storage.flush()
    simulate_crash(storage)
    storage = ZarrStorage(path=path)
    assert storage.unreadable_rows().tolist() == [2]
    storage.set(torch.tensor([2]), TensorDict({"step": torch.tensor([3])}, [1]))
    storage.flush()
    assert storage.unreadable_rows().tolist() == [3]
    row = storage.get(torch.tensor([2]))
    assert (row["step"].tolist(), row["obs"].tolist()) == ([3], [[0.0]])
    length, holes, steps = _reopened_after_crash(storage, path)
    assert (length, holes, steps) == (4, [3], {0: 1, 1: 2, 2: 3})


def test_a_record_keeps_which_holes_no_call_wrote() -> None:
    """``Commit.unwritten`` goes through the record whole; it lies inside the holes (a
    record that says otherwise is refused), and one made for holes replaced since keeps
    only what lies inside them. A record of an older version has none: every hole counts
    as lost."""
    from zarr_rb.errors import StoreCorruptedError
    from zarr_rb.format.commit import Commit, parse_commit

    commit = Commit(generation=3, length=10, cursor=10, holes=((2, 5), (7, 9)), unwritten=((3, 5),))
    assert parse_commit(commit.to_json(), rows=16) == commit
    assert (
        commit.unwritten_at(np.arange(12)).tolist()
        == [False] * 3 + [True] * 2 + [False] * 5 + [True] * 2
    )
    older = commit.to_json()
    del older["unwritten"]
    assert parse_commit(older, rows=16).unwritten == ()
    replaced = Commit(length=10, holes=((4, 6),), unwritten=((3, 5),)).to_json()
    assert replaced["unwritten"] == [[4, 5]]
    with pytest.raises(StoreCorruptedError, match="unwritten"):
        parse_commit({**commit.to_json(), "unwritten": [[1, 3]]}, rows=16)
