"""zarr_rb.save / zarr_rb.load, rb.dumps / rb.loads: exact resume, cost, snapshots, safety."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_identical, chunk_files
from tensordict import TensorDict
from torchrl.data import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
)
from torchrl.envs.transforms import Compose, ObservationNorm

import zarr_rb
from zarr_rb import (
    Compression,
    NoSavedBufferError,
    PickleNotAllowedError,
    StoreCorruptedError,
    UnsupportedDataError,
    ZarrStorage,
)
from zarr_rb.engine import RowArray

CAPACITY = 96
BATCH = 16
COMPRESSION = Compression(block_rows=16, large_row_bytes=64)


def transitions(n: int, step: int) -> TensorDict:
    """``n`` transitions of 4-step episodes; every value encodes the step it was made at."""
    g = torch.Generator().manual_seed(step)
    start = step * 1000
    ids = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": torch.randint(0, 255, (n, 2, 6, 6), generator=g, dtype=torch.uint8),
            "episode": ids // 4,
            "td_error": torch.rand(n, generator=g),
            "next": {
                "done": (ids % 4 == 3).unsqueeze(-1),
                "reward": torch.randn(n, 1, generator=g),
            },
        },
        batch_size=[n],
    )


def make_buffer(case: str, storage: ZarrStorage, generator: torch.Generator):
    kwargs = {"storage": storage, "batch_size": 8, "generator": generator}
    if case == "random":
        return ReplayBuffer(sampler=RandomSampler(), writer=RoundRobinWriter(), **kwargs)
    if case == "without_replacement":
        return TensorDictReplayBuffer(sampler=SamplerWithoutReplacement(), **kwargs)
    if case == "slice":
        return TensorDictReplayBuffer(
            sampler=SliceSampler(slice_len=4, traj_key="episode", strict_length=False),
            **kwargs,
        )
    if case == "slice_without_replacement":
        return TensorDictReplayBuffer(
            sampler=SliceSamplerWithoutReplacement(slice_len=4, end_key=("next", "done")),
            **kwargs,
        )
    if case == "prioritized":
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, **kwargs)
    if case == "prioritized_slice":
        return TensorDictReplayBuffer(
            sampler=PrioritizedSliceSampler(
                CAPACITY, 0.7, 0.5, slice_len=4, traj_key="episode", strict_length=False
            ),
            **kwargs,
        )
    if case == "max_value":
        return TensorDictReplayBuffer(
            sampler=RandomSampler(), writer=TensorDictMaxValueWriter(rank_key="td_error"), **kwargs
        )
    if case == "round_robin_td":
        return TensorDictReplayBuffer(
            sampler=RandomSampler(), writer=TensorDictRoundRobinWriter(), **kwargs
        )
    raise AssertionError(case)


CASES = [
    "random",
    "without_replacement",
    "slice",
    "slice_without_replacement",
    "prioritized",
    "prioritized_slice",
    "max_value",
    "round_robin_td",
]


def train_step(rb, step: int):
    """One step: extend, sample, update priorities. Returns what was drawn."""
    data = transitions(BATCH if step % 3 else BATCH + 5, step)
    if isinstance(rb, TensorDictReplayBuffer):
        rb.extend(data)
    else:
        rb.extend(data["obs"])
    np.random.seed(step)  # PrioritizedSampler draws from NumPy as well as from the generator
    sample, info = rb.sample(return_info=True)
    index = info["index"]
    if isinstance(rb.sampler, PrioritizedSampler):
        flat = index if isinstance(index, torch.Tensor) else index[0]
        rb.update_priority(
            flat, torch.rand(flat.shape, generator=torch.Generator().manual_seed(step)) + 0.1
        )
    return index, sample


def run(rb, steps: range):
    return [train_step(rb, step) for step in steps]


@pytest.mark.filterwarnings("ignore:Calling update_priority:UserWarning")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("where", ["snapshot", "in_place"])
def test_resume_draws_identical_indices_and_data(tmp_path, case, where):
    """Run A trains K steps and saves at step k; run B loads the save and continues.

    From step k on, A and B draw identical indices and identical data.
    """
    k, total = 7, 14  # the ring (96 rows) wraps around before the end

    def trained_until_k(path: Path):
        rb = make_buffer(
            case,
            ZarrStorage(CAPACITY, path, compression=COMPRESSION),
            torch.Generator().manual_seed(0),
        )
        run(rb, range(k))
        return rb

    rb_a = trained_until_k(tmp_path / "a.zarr")
    saved_at = zarr_rb.save(rb_a, tmp_path / "b.zarr" if where == "snapshot" else None)
    expected = run(rb_a, range(k, total))
    if where == "in_place":
        # Run A's later steps rewrote its store; save in place from an identical twin run.
        rb_a.storage.close()
        twin = trained_until_k(tmp_path / "twin.zarr")
        saved_at = zarr_rb.save(twin)
        twin.storage.close()
    rb_b = zarr_rb.load(saved_at)
    assert type(rb_b) is type(rb_a)
    assert type(rb_b.sampler) is type(rb_a.sampler)
    assert type(rb_b.writer) is type(rb_a.writer)
    actual = run(rb_b, range(k, total))
    for (index_a, data_a), (index_b, data_b) in zip(expected, actual, strict=True):
        assert_identical(
            torch.stack(list(index_b)) if isinstance(index_b, tuple) else index_b,
            torch.stack(list(index_a)) if isinstance(index_a, tuple) else index_a,
        )
        assert_identical(data_b, data_a)


def data_file_inodes(store: Path) -> dict[str, int]:
    return {
        str(p.relative_to(store)): p.stat().st_ino
        for p in (store / "data").rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("rows", [320, 1280])
def test_save_in_place_rewrites_no_row_already_on_disk(tmp_path, rows):
    """Saving writes the rows held in RAM and the state: nothing that grows with the data."""
    storage = ZarrStorage(4096, tmp_path / "rb.zarr", compression=COMPRESSION)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=8)
    for step in range(rows // 20):
        rb.extend(transitions(20, step))  # 20-row extends: the last block stays in RAM
    rb.update_priority(torch.arange(5), torch.ones(5))
    storage.flush()
    rb.extend(transitions(4, 999))
    before = data_file_inodes(storage.path)
    zarr_rb.save(rb)
    after = data_file_inodes(storage.path)
    replaced = {name for name in before if after.get(name) != before[name]}
    added = set(after) - set(before)
    # Only the files of the one block still in RAM (one shard per large leaf, one chunk
    # per small leaf) change, however many rows the store holds.
    assert len(replaced | added) <= len(storage.schema.leaves)
    assert all("/c." in name or name.startswith("data/") for name in replaced | added)


def state_chunk_inodes(store: Path, slot: int) -> dict[str, int]:
    root = store / "state" / str(slot) / "sampler"
    return {str(p.relative_to(root)): p.stat().st_ino for p in root.rglob("c.*") if p.is_file()}


def test_second_save_writes_only_changed_priority_chunks(tmp_path):
    capacity = 2**20  # four 1 MiB chunks of float32 priorities per tree
    storage = ZarrStorage(capacity, tmp_path / "rb.zarr")
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=8)
    rb.extend(transitions(64, 0))
    zarr_rb.save(rb)  # slot 0
    zarr_rb.save(rb)  # slot 1
    before = state_chunk_inodes(storage.path, 0)
    rb.update_priority(torch.tensor([3]), torch.tensor([5.0]))
    zarr_rb.save(rb)  # slot 0 again: only the chunk holding index 3 differs, per tree
    after = state_chunk_inodes(storage.path, 0)
    changed = {name for name in before if after[name] != before[name]}
    assert changed == {"sum_tree/c.0", "min_tree/c.0"}
    # The min tree's untouched chunks (all +inf) stay as they are on disk.
    assert {"min_tree/c.1", "min_tree/c.2", "min_tree/c.3"} <= set(before)


def test_load_and_loads_read_no_data_chunk(tmp_path, monkeypatch):
    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr", compression=COMPRESSION)
    rb = make_buffer("prioritized", storage, torch.Generator().manual_seed(0))
    run(rb, range(5))
    zarr_rb.save(rb)
    rb.dumps(storage.path)
    storage.close()

    read_rows = RowArray.read_rows

    def no_data_reads(self, rows):
        if self.path.startswith("data/"):
            raise AssertionError(f"read rows of {self.path} while loading")
        return read_rows(self, rows)

    monkeypatch.setattr(RowArray, "read_rows", no_data_reads)
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    assert len(loaded) == sum(BATCH if step % 3 else BATCH + 5 for step in range(5))
    loaded.storage.close()  # one writer per store
    again = make_buffer(
        "prioritized", ZarrStorage(CAPACITY, tmp_path / "rb.zarr"), torch.Generator()
    )
    again.loads(tmp_path / "rb.zarr")
    assert len(again) == len(loaded)


def test_snapshot_is_independent_of_later_training(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "a.zarr", compression=COMPRESSION)
    rb = make_buffer("prioritized", storage, torch.Generator().manual_seed(0))
    run(rb, range(4))
    snapshot = zarr_rb.save(rb, tmp_path / "snap.zarr")
    # Same filesystem: chunk files are shared by hard links, not copied.
    shards = chunk_files(snapshot, "data/obs")
    assert shards
    assert all(p.stat().st_nlink >= 2 for p in shards)
    frozen = zarr_rb.load(snapshot)
    before = frozen.storage[:].clone()
    priorities = frozen.sampler._sum_tree[torch.arange(CAPACITY)]
    frozen.storage.close()

    run(rb, range(4, 12))  # wraps around: every row of the original is rewritten
    zarr_rb.save(rb)
    assert not torch.equal(rb.storage[:]["obs"][:10], before["obs"][:10])

    reopened = zarr_rb.load(snapshot)
    assert_identical(reopened.storage[:], before)
    assert torch.equal(reopened.sampler._sum_tree[torch.arange(CAPACITY)], priorities)


def test_max_value_writer_keeps_indices_above_2_pow_24(tmp_path):
    big = 2**24 + 64
    storage = ZarrStorage(big, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(
        storage=storage, writer=TensorDictMaxValueWriter(rank_key="td_error"), batch_size=4
    )
    rb.extend(transitions(8, 0))
    heap = [(0.5, 2**24 + 3), (0.75, 2**24 + 61), (0.9, 7)]
    rb.writer._current_top_values = list(heap)
    zarr_rb.save(rb)
    storage.close()
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    assert loaded.writer._current_top_values == heap
    # float32 cannot tell these apart: the reason the heap is not stored as TorchRL does
    assert torch.tensor(2**24 + 3, dtype=torch.float32) == torch.tensor(2**24 + 4.0)


def test_rb_dumps_into_own_path_copies_nothing(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr", compression=COMPRESSION)
    rb = make_buffer("round_robin_td", storage, torch.Generator().manual_seed(0))
    run(rb, range(3))
    rb.dumps(storage.path)
    assert not (storage.path / "storage" / "data").exists()
    assert (storage.path / "storage" / "zarr_rb_storage.json").is_file()


def test_loading_the_state_the_buffer_is_at_moves_nothing_back(tmp_path):
    """A load of a save made at the state the live buffer is at again (after ``rb.loads``
    of a dump of that state) changes nothing: a dump of that state still loads after it,
    although the store's block map differs from the save's past the rows they hold (a
    block written since moved to another slot)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(20, path, compression=zarr_rb.Compression(block_rows=2))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(TensorDict({"step": torch.arange(2)}, [2]))
    rb.dumps(path)
    zarr_rb.save(rb)
    rb.extend(TensorDict({"step": torch.tensor([2])}, [1]))  # into a block the save keeps
    rb.loads(path)
    beside = zarr_rb.load(path)
    assert beside.storage[:]["step"].tolist() == [0, 1]
    beside.storage.close()
    rb.loads(path)  # refused before: "the rows its last save covered were written over"
    assert rb.storage[:]["step"].tolist() == [0, 1]


def test_rb_dumps_elsewhere_writes_a_valid_store(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr", compression=COMPRESSION)
    rb = make_buffer("round_robin_td", storage, torch.Generator().manual_seed(0))
    run(rb, range(3))
    rb.dumps(tmp_path / "dump")
    rb.dumps(tmp_path / "dump")  # dumping again replaces the previous dump
    copy = ZarrStorage(path=tmp_path / "dump" / "storage", read_only=True)
    assert len(copy) == len(storage)
    assert_identical(copy[:], storage[:])


def test_load_without_saved_buffer(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr")
    storage.set(torch.arange(3), transitions(3, 0))
    storage.close()
    with pytest.raises(NoSavedBufferError, match="no saved buffer"):
        zarr_rb.load(tmp_path / "rb.zarr")


def test_unsupported_component_is_named_and_nothing_is_written(tmp_path):
    class MySampler(RandomSampler):
        pass

    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(storage=storage, sampler=MySampler(), batch_size=4)
    rb.extend(transitions(4, 0))
    with pytest.raises(UnsupportedDataError, match="MySampler"):
        zarr_rb.save(rb)
    assert not (storage.path / "state").exists()


def normalized_buffer(storage: ZarrStorage) -> TensorDictReplayBuffer:
    transform = Compose(
        ObservationNorm(loc=torch.tensor(0.0), scale=torch.tensor(1.0), in_keys=["reward"])
    )
    return TensorDictReplayBuffer(storage=storage, batch_size=4, transform=transform)


def fill_with_transform(path: Path) -> TensorDictReplayBuffer:
    rb = normalized_buffer(ZarrStorage(CAPACITY, path))
    rb.extend(
        TensorDict({"reward": torch.arange(8.0).unsqueeze(-1)}, batch_size=[8]),
    )
    rb.transform[0].loc.fill_(3.0)
    rb.transform[0].scale.fill_(2.0)
    zarr_rb.save(rb)
    rb.storage.close()
    return rb


def test_transforms_state_restored_without_unpickling(tmp_path):
    fill_with_transform(tmp_path / "rb.zarr")
    fresh = Compose(
        ObservationNorm(loc=torch.tensor(0.0), scale=torch.tensor(1.0), in_keys=["reward"])
    )
    rb = zarr_rb.load(tmp_path / "rb.zarr", transform=fresh)
    assert rb.transform[0].loc.item() == 3.0
    assert rb.transform[0].scale.item() == 2.0
    sample = rb[torch.arange(8)]
    assert torch.equal(sample["reward"], torch.arange(8.0).unsqueeze(-1) * 2.0 + 3.0)


def test_transforms_need_explicit_opt_in(tmp_path):
    fill_with_transform(tmp_path / "rb.zarr")
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        zarr_rb.load(tmp_path / "rb.zarr")
    rb = zarr_rb.load(tmp_path / "rb.zarr", allow_pickle=True)
    assert isinstance(rb.transform[0], ObservationNorm)
    assert rb.transform[0].loc.item() == 3.0


class _Planted:
    """A pickle payload that creates a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_planted_pickle_never_runs_without_opt_in(tmp_path):
    path = tmp_path / "rb.zarr"
    fill_with_transform(path)
    marker = tmp_path / "pwned"
    blob = np.frombuffer(pickle.dumps(_Planted(marker)), dtype=np.uint8)
    location = ZarrStorage(path=path, read_only=True)._store.engine
    slot = location.read_root_metadata()["attributes"]["zarr_rb"]["saved"]["slot"]
    group = f"state/{slot}/transforms"
    attrs = location.read_group_attributes(f"state/{slot}")
    attrs["zarr_rb_state"]["children"]["transforms"]["tensors"]["pickle"]["shape"] = [blob.size]
    location.write_group_attributes(f"state/{slot}", attrs)
    _, writes = location.write_state_array(f"{group}/pickle", blob)
    for write in writes:
        write.result()

    with pytest.raises(PickleNotAllowedError):
        zarr_rb.load(path)
    fresh = Compose(
        ObservationNorm(loc=torch.tensor(0.0), scale=torch.tensor(1.0), in_keys=["reward"])
    )
    zarr_rb.load(path, transform=fresh).storage.close()
    assert not marker.exists()
    # The payload is real: with the opt-in it does run (and is then not a transform).
    with pytest.raises(StoreCorruptedError, match="not a torchrl Transform"):
        zarr_rb.load(path, allow_pickle=True)
    assert marker.exists()
    os.unlink(marker)


def test_round_robin_generations_survive_save_and_load(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(
        storage=storage, writer=TensorDictRoundRobinWriter(track_generations=True), batch_size=4
    )
    for step in range(8):  # wraps: some slots are written twice
        rb.extend(transitions(BATCH, step))
    generation = rb.writer._generation.clone()
    zarr_rb.save(rb)
    storage.close()
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    assert loaded.writer._track_generations
    assert torch.equal(loaded.writer._generation, generation)
    assert loaded.writer._write_count == 8 * BATCH


def test_ndim2_buffer_saves_and_loads(tmp_path):
    storage = ZarrStorage(64, tmp_path / "rb.zarr", ndim=2)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    data = transitions(24, 0).reshape(6, 4)
    rb.extend(data)
    expected = rb.storage[:].clone()
    zarr_rb.save(rb)
    rb.storage.close()
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    assert loaded.storage.ndim == 2
    assert len(loaded) == 24
    assert_identical(loaded.storage[:], expected)


def test_snapshot_leaves_out_interrupted_write_temporaries(tmp_path):
    storage = ZarrStorage(CAPACITY, tmp_path / "a.zarr", compression=COMPRESSION)
    rb = make_buffer("round_robin_td", storage, torch.Generator().manual_seed(0))
    run(rb, range(2))
    shard = chunk_files(storage.path, "data/obs")[0]
    shard.with_name(shard.name + ".__lock").write_bytes(b"partial")
    (storage.path / ".zarr.json.abc.tmp").write_text("{")
    snapshot = zarr_rb.save(rb, tmp_path / "snap.zarr")
    leftovers = [p for p in snapshot.rglob("*") if p.name.endswith((".__lock", ".tmp"))]
    assert leftovers == []
    assert len(zarr_rb.load(snapshot)) == len(rb)


def test_an_extend_around_the_ring_into_the_block_an_earlier_one_ended_in(tmp_path):
    """Row 3 waits in RAM (block 0) from an extend of one row; the next extend writes rows
    4-7 (block 1) and ends in block 0 again (row 0). Block 0 holds a row older than rows
    4-7, so it is written with them: a commit must never declare rows 4-7 while row 3,
    extended before them, waits (found by review: after a crash the store held rows 4-7
    new and row 3 old, cursor 3)."""
    from torchrl.data import TensorDictReplayBuffer

    from zarr_rb import Compression
    from zarr_rb.testing import simulate_crash

    def rows(v):
        return TensorDict(
            {"step": v, "obs": (v[:, None] * torch.ones(300)).to(torch.uint8)}, [v.numel()]
        )

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(rows(torch.arange(11)))  # rows 0-7, then 0-2: cursor 3
    rb.storage.flush()
    rb.extend(rows(torch.tensor([11])))  # row 3, in RAM
    rb.extend(rows(torch.arange(12, 17)))  # rows 4-7 and row 0
    simulate_crash(rb.storage)
    with ZarrStorage(path=path) as reopened:
        steps = reopened.get(torch.arange(len(reopened)))["step"].tolist()
        cursor = int(TensorDictReplayBuffer(storage=reopened)._writer._cursor)
    assert (steps, cursor) == ([16, 9, 10, 11, 12, 13, 14, 15], 1)
