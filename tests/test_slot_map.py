"""Blocks written over live in other slots of the arrays: every way in and out of a store
reads and writes them through the commit's slot map, and never pairs keys of two commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage

LAYOUT = Compression(block_rows=4)


def steps(start: int, stop: int) -> TensorDict:
    step = torch.arange(start, stop)
    return TensorDict(
        {"step": step, "obs": step.float()[:, None] * 10 + torch.arange(6), "done": step % 7 == 0},
        [stop - start],
    )


def whole(td: Any) -> bool:
    """Every key of every row a function of its step."""
    step = td["step"]
    obs = step.float()[:, None] * 10 + torch.arange(6)
    return torch.equal(td["obs"], obs) and torch.equal(td["done"], step % 7 == 0)


def test_a_shared_writer_keeps_the_slot_map_of_a_ring_written_over(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, path, compression=LAYOUT))
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    for buffer in (rb, twin):
        buffer.extend(steps(0, 16))
        buffer.extend(steps(16, 24))  # blocks 0 and 1 move to other slots
    rb.storage.close()
    shared = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    shared.extend(steps(100, 102))  # a commit of the shared protocol
    shared.storage.close()
    reader = ZarrStorage(path=path, read_only=True)
    got = reader.get(torch.arange(8))
    # Rows 0-7 as the writer left them: the ones it wrote over, not the evicted ones.
    assert got["step"].tolist() == list(range(16, 24))
    assert whole(got)
    reader.close()


def test_a_view_reads_every_key_of_its_rows_from_one_commit(tmp_path: Path) -> None:
    """The writer commits between the view's reads: the rows it returns are whole rows of
    one commit, never keys of two."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, path, compression=LAYOUT))
    rb.extend(steps(0, 16))
    rb.storage.flush()
    view = zarr_rb.open(path)
    store = view.storage._store
    original = store.read
    reads = []

    def read_then_let_the_writer_go_on(rows: Any, keys: Any, **kwargs: Any) -> Any:
        out = original(rows, keys, **kwargs)
        reads.append(list(keys))
        if len(reads) == 1:
            rb.extend(steps(16, 20))  # rows 0-3 written over, and committed
            rb.storage.flush()
        return out

    store.read = read_then_let_the_writer_go_on  # type: ignore[method-assign]
    for index in (torch.tensor([0, 1, 2, 3]), [2, 3], torch.arange(16) < 4):
        reads.clear()
        got = view[index]
        assert whole(got), (index, got["step"])
    rb.storage.close()


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    maps=st.lists(st.lists(st.integers(-1, 40), max_size=30), min_size=1, max_size=8),
    last=st.lists(st.integers(-1, 40), max_size=30),
)
def test_the_slots_older_commits_keep_are_those_the_last_does_not_name(maps, last):
    # (What decides how many commits a writer keeps: setdiff1d, without sorting every block.)
    from zarr_rb.core.solo_slots import _slots_besides

    arrays = [np.array(m, dtype=np.int64) for m in maps]
    expected = np.setdiff1d(np.concatenate(arrays), np.array(last, dtype=np.int64))
    assert _slots_besides(arrays, np.array(last, dtype=np.int64)).tolist() == expected.tolist()
