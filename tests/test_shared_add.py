"""``rb.add`` on a store of several writers returns the position its row got, as ``extend``
does (TorchRL's writers return their own cursor, which other writers moved past), so that
priorities and ``update_priority`` go to that row."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

from zarr_rb import Compression, ZarrStorage


def row(step: int) -> TensorDict:
    return TensorDict({"obs": torch.full((3,), step), "step": torch.tensor(step)}, [])


def test_add_by_shared_writers_returns_where_each_row_went(tmp_path):
    path = tmp_path / "shared.zarr"
    first = ZarrStorage(16, path, shared=True, compression=Compression(block_rows=4))
    a = TensorDictReplayBuffer(storage=first)
    a.extend(torch.stack([row(i) for i in range(3)]))
    b = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    model = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    model.extend(torch.stack([row(i) for i in range(3)]))
    for step in range(3, 40):
        rb = (a, b, b, a)[step % 4]
        got = rb.add(row(step))
        expected = model.add(row(step))
        assert int(got) == int(expected), step
        assert int(rb.storage[int(got)]["step"]) == step  # the row is where it says
    for rb in (a, b):
        rb.storage.close()


def test_priorities_of_rows_added_by_shared_writers_go_to_those_rows(tmp_path):
    path = tmp_path / "shared.zarr"
    first = ZarrStorage(16, path, shared=True, compression=Compression(block_rows=4))
    a = ReplayBuffer(storage=first, sampler=PrioritizedSampler(16, alpha=1.0, beta=1.0))
    a.extend(torch.stack([row(i) for i in range(3)]))
    b = ReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    b.extend(torch.stack([row(i) for i in range(3, 6)]))  # positions 3-5, by another writer
    index = a.add(row(6))  # position 6, though a's own cursor is at 3
    assert int(index) == 6
    a.update_priority(torch.tensor([int(index)]), torch.tensor([100.0]))
    sample = a.sample(64)
    assert (sample["step"] == 6).float().mean() > 0.5  # the row given the priority
    for rb in (a, b):
        rb.storage.close()
