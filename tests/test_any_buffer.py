"""zarr_rb.save of buffers on TorchRL's own storages (LazyTensorStorage, LazyMemmapStorage,
ListStorage, LazyStackStorage, CompressedListStorage) with each sampler and writer: the
store loads as a buffer on ZarrStorage, or back into RAM, whose next seeded samples and
later writes are the original's."""

from __future__ import annotations

import pytest
import torch
from kinds import assert_same_rows, token_rows, values
from tensordict import LazyStackedTensorDict, TensorDict
from torchrl.data import (
    CompressedListStorage,
    LazyMemmapStorage,
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.samplers import ConsumingSampler

import zarr_rb
from zarr_rb import StoreExistsError, UnsupportedDataError, ZarrStorage
from zarr_rb.interop import buffers

STORAGES = {
    "LazyTensorStorage": lambda: LazyTensorStorage(40),
    "LazyMemmapStorage": lambda: LazyMemmapStorage(40),
    "ListStorage": lambda: ListStorage(40),
    "LazyStackStorage": lambda: LazyStackStorage(40),
    "CompressedListStorage": lambda: CompressedListStorage(40),
}


def batch(n: int, start: int, storage_name: str) -> TensorDict:
    """Rows with an episode id (four steps each), a reward and a string; token ids of each
    row's own length on LazyStackStorage. (LazyMemmapStorage keeps one string for all its
    rows, the first written: its rows carry none.)"""
    ragged = storage_name == "LazyStackStorage"
    step = torch.arange(start, start + n)
    if ragged:
        data = token_rows([1 + (s * 7) % 13 for s in step.tolist()], seed=start)
    else:
        data = TensorDict(
            {
                "obs": step[:, None].float().expand(n, 3).clone(),
                "prompt": values([f"s{s}" for s in step.tolist()]),
            },
            [n],
        )
        if storage_name == "LazyMemmapStorage":
            del data["prompt"]
    data.set("reward", step.float() / 7)
    data.set("episode", step // 4)
    return data


BUFFERS = {
    "random": lambda storage: TensorDictReplayBuffer(storage=storage, batch_size=6),
    "prioritized": lambda storage: TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=storage, batch_size=6
    ),
    "without-replacement": lambda storage: TensorDictReplayBuffer(
        storage=storage, sampler=SamplerWithoutReplacement(), batch_size=6
    ),
    "slice": lambda storage: TensorDictReplayBuffer(
        storage=storage, sampler=SliceSampler(slice_len=2, traj_key="episode"), batch_size=6
    ),
    "prioritized-sampler": lambda storage: TensorDictReplayBuffer(
        storage=storage, sampler=PrioritizedSampler(40, alpha=0.6, beta=0.4), batch_size=6
    ),
    "prioritized-slice": lambda storage: TensorDictReplayBuffer(
        storage=storage,
        sampler=PrioritizedSliceSampler(40, alpha=0.7, beta=0.5, slice_len=2, traj_key="episode"),
        batch_size=6,
    ),
    "slice-without-replacement": lambda storage: TensorDictReplayBuffer(
        storage=storage,
        sampler=SliceSamplerWithoutReplacement(slice_len=2, traj_key="episode"),
        batch_size=6,
    ),
    "plain-prioritized": lambda storage: PrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=storage, batch_size=6
    ),
    "consuming": lambda storage: TensorDictReplayBuffer(
        storage=storage, sampler=ConsumingSampler(max_sample_count=4), batch_size=6
    ),
    "max-value-writer": lambda storage: TensorDictReplayBuffer(
        storage=storage, writer=TensorDictMaxValueWriter(rank_key="reward"), batch_size=6
    ),
}


def filled(storage_name: str, buffer_name: str):
    rb = BUFFERS[buffer_name](STORAGES[storage_name]())
    for start, n in [(0, 16), (16, 1), (17, 30)]:  # past capacity: the ring wraps
        if n == 1:
            rb.add(batch(1, start, storage_name)[0])
        else:
            rb.extend(batch(n, start, storage_name))
    for _ in range(2):  # the sampler's state moves (priorities, the permutation)
        sample, info = rb.sample(return_info=True)
        if isinstance(rb, TensorDictPrioritizedReplayBuffer):
            rb.update_tensordict_priority(sample)
        elif isinstance(rb.sampler, PrioritizedSampler):
            rb.update_priority(info["index"], sample["reward"] + 1)
    return rb


def next_samples(rb, seed: int, n: int = 3) -> list:
    rb.set_rng(torch.Generator().manual_seed(seed))
    return [rb.sample(return_info=True) for _ in range(n)]


def same_index(a, b) -> bool:
    """Sample indices: a tensor, or a tuple of them (slice samplers)."""
    if isinstance(b, tuple):
        return len(a) == len(b) and all(same_index(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def rows_of(storage, index):
    rows = storage.get(index)  # CompressedListStorage returns a list of rows
    return torch.stack(rows).contiguous() if isinstance(rows, list) else rows


# What TorchRL writes into the rows a list storage holds when it samples them (the sample
# info, in the sample's shapes): zarr_rb.save leaves those out when rows disagree.
WRITTEN_BY_SAMPLING = ["index", ("next", "done"), ("next", "truncated"), ("next", "terminated")]


def comparable(sample, storage_name: str = ""):
    """A sample's rows, dense where their shapes agree (TorchRL's list storages sample lazy
    stacks even of rows of one shape), without the weights (compared closely, below)."""
    sample = sample.exclude("priority_weight")
    if storage_name == "LazyStackStorage":
        sample = sample.exclude(*WRITTEN_BY_SAMPLING, "next")  # "next": then left empty
    if isinstance(sample, LazyStackedTensorDict):
        try:
            return sample.contiguous()
        except RuntimeError:  # rows of different lengths stay a lazy stack
            pass
    return sample


@pytest.mark.parametrize("buffer_name", sorted(BUFFERS))
@pytest.mark.parametrize("storage_name", sorted(STORAGES))
def test_a_saved_buffer_loads_with_the_same_rows_and_next_samples(
    tmp_path, storage_name, buffer_name
):
    if buffer_name == "max-value-writer" and storage_name != "LazyTensorStorage":
        pytest.skip("TorchRL's TensorDictMaxValueWriter needs a TensorStorage")
    if "slice" in buffer_name and storage_name in ("ListStorage", "CompressedListStorage"):
        pytest.skip("TorchRL's SliceSampler cannot read trajectories out of a list storage")
    if buffer_name == "prioritized-slice" and storage_name == "LazyStackStorage":
        pytest.skip("TorchRL's PrioritizedSliceSampler needs a TensorStorage's _total_shape")
    rb = filled(storage_name, buffer_name)
    path = tmp_path / "saved.zarr"
    assert zarr_rb.save(rb, path, progress=False) == path
    assert type(rb.storage).__name__ == storage_name  # the buffer itself is left as it was
    on_disk = zarr_rb.load(path)
    in_ram = zarr_rb.load(path, storage="memory", progress=False)
    assert isinstance(on_disk.storage, ZarrStorage)
    expected_memory = LazyStackStorage if storage_name == "LazyStackStorage" else LazyTensorStorage
    assert type(in_ram.storage) is expected_memory
    assert len(on_disk) == len(in_ram) == len(rb) == 40
    every = torch.arange(40)
    original = rows_of(rb.storage, every)
    assert_same_rows(
        comparable(on_disk.storage.get(every), storage_name),
        comparable(original, storage_name),
    )
    drawn = [next_samples(loaded, 3) for loaded in (on_disk, in_ram)]
    expected = next_samples(rb, 3)  # after: the sampler's state moves as it draws
    for samples in drawn:
        for (ours, info), (theirs, their_info) in zip(samples, expected, strict=True):
            assert same_index(info["index"], their_info["index"])
            assert_same_rows(comparable(ours, storage_name), comparable(theirs, storage_name))
            if "priority_weight" in their_info:
                weights = torch.as_tensor(info["priority_weight"])
                torch.testing.assert_close(weights, torch.as_tensor(their_info["priority_weight"]))
    # The writer goes on where the original's would.
    more = batch(5, 100, storage_name)
    for buffer in (rb, on_disk, in_ram):
        buffer.extend(more.clone())
    original = rows_of(rb.storage, every)
    for loaded in (on_disk, in_ram):
        assert_same_rows(
            comparable(loaded.storage.get(every), storage_name),
            comparable(original, storage_name),
        )


def test_rows_are_streamed_in_blocks(tmp_path, monkeypatch):
    blocks = []
    copy = buffers.copy_rows

    def counted(source, target, **kwargs):
        real_set = target.set

        def set_block(where, block, **kw):
            blocks.append(len(block))
            return real_set(where, block, **kw)

        target.set = set_block
        return copy(source, target, **kwargs)

    monkeypatch.setattr(buffers, "copy_rows", counted)
    monkeypatch.setattr("zarr_rb.torchrl.state_dict.COPY_BLOCK_BYTES", 200)
    rb = filled("LazyTensorStorage", "random")
    zarr_rb.save(rb, tmp_path / "blocks.zarr", progress=False)
    assert len(blocks) > 3
    assert sum(blocks) == 40
    loaded = zarr_rb.load(tmp_path / "blocks.zarr")
    every = torch.arange(40)
    assert_same_rows(loaded.storage.get(every), rb.storage.get(every))


def test_saving_onto_an_existing_path_is_refused_and_leaves_it_alone(tmp_path):
    rb = filled("ListStorage", "random")
    path = tmp_path / "taken.zarr"
    zarr_rb.save(rb, path, progress=False)
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(StoreExistsError):
        zarr_rb.save(rb, path, progress=False)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before


def test_a_buffer_on_torchrl_storage_needs_a_path(tmp_path):
    with pytest.raises(ValueError, match="path"):
        zarr_rb.save(filled("LazyTensorStorage", "random"))


def test_a_list_buffer_of_objects_that_cannot_be_stored_leaves_no_store(tmp_path):
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"obs": torch.ones(2), "info": object()} for _ in range(3)])
    path = tmp_path / "objects.zarr"
    with pytest.raises(UnsupportedDataError, match="info"):
        zarr_rb.save(rb, path, progress=False)
    assert not path.exists()


def test_load_into_memory_refuses_an_unknown_storage_name(tmp_path):
    rb = filled("LazyTensorStorage", "random")
    zarr_rb.save(rb, tmp_path / "s.zarr", progress=False)
    with pytest.raises(ValueError, match="storage='zarr' or storage='memory'"):
        zarr_rb.load(tmp_path / "s.zarr", storage="disk")


@pytest.mark.parametrize("storage_name", ["ListStorage", "CompressedListStorage"])
def test_list_storages_whose_first_rows_share_a_length_save_as_ragged(
    tmp_path, monkeypatch, storage_name
):
    monkeypatch.setattr("zarr_rb.torchrl.state_dict.COPY_BLOCK_BYTES", 64)  # a block per row
    rb = ReplayBuffer(storage=STORAGES[storage_name](), batch_size=2)
    rows = token_rows([5, 5, 5, 5, 7, 9])
    for row in rows.unbind(0):
        rb.add(row)
    loaded = zarr_rb.load(zarr_rb.save(rb, tmp_path / "rows.zarr", progress=False))
    assert_same_rows(loaded.storage.get(torch.arange(6)), rows)
