"""Shared writers that save at the same time: each save loads as its writer made it.

A save writes the buffer's state (sampler, writer, generator) into a group of its own,
then publishes the record that names it. Two writers that pick the same group write over
each other's state: the tests let one writer's save run entirely between the moment the
other picked its group and the moment it writes there.
"""

from __future__ import annotations

import os
import textwrap

import torch
from sample_runner import python_c
from test_s3 import batch
from torchrl.data import TensorDictPrioritizedReplayBuffer

import zarr_rb
import zarr_rb.api
from zarr_rb import ZarrStorage

CAPACITY = 64


def priorities(path: str, version: str) -> list[float]:
    loaded = zarr_rb.load(path, version=version, read_only=True, progress=False)
    try:
        tree = loaded.sampler._sum_tree
        return [tree[i] for i in range(len(loaded))]
    finally:
        loaded.storage.close()


def test_shared_writers_saving_at_once_each_keep_their_own_state(tmp_path, monkeypatch):
    path = str(tmp_path / "rb.zarr")
    storage = ZarrStorage(CAPACITY, path, shared=True)
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
    rb.extend(batch(0, 20))
    save_buffer = zarr_rb.api.save_buffer

    def another_save_first(*args, **kwargs):
        """Another writer saves, start to end, after this one picked its state group."""
        monkeypatch.setattr(zarr_rb.api, "save_buffer", save_buffer)
        other = f"""
            import torch
            import zarr_rb
            from torchrl.data import TensorDictPrioritizedReplayBuffer
            from zarr_rb import ZarrStorage
            from test_s3 import batch
            storage = ZarrStorage(path={path!r}, shared=True)
            rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
            rb.extend(batch(500, 10))
            rb.update_priority(torch.arange(len(rb)), torch.full((len(rb),), 7.0))
            zarr_rb.save(rb, tag="other", progress=False)
            storage.close()
            """
        child = python_c(textwrap.dedent(other), cwd=os.path.dirname(__file__))
        assert child.returncode == 0, child.stderr[-3000:]
        return save_buffer(*args, **kwargs)

    monkeypatch.setattr(zarr_rb.api, "save_buffer", another_save_first)
    rb.update_priority(torch.arange(20), torch.full((20,), 3.0))
    zarr_rb.save(rb, tag="mine", progress=False)
    storage.close()
    assert priorities(path, "other") == [7.0] * 30
    assert priorities(path, "mine")[:20] == [3.0] * 20


def test_a_shared_writers_saves_leave_only_the_state_groups_records_name(tmp_path):
    """Each save of a shared writer writes a group of its own; the ones no record names
    any longer (its earlier untagged saves) are deleted as the next one is published."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(CAPACITY, str(path), shared=True)
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
    for turn in range(5):
        rb.extend(batch(turn * 10, 10))
        zarr_rb.save(rb, progress=False)
    zarr_rb.save(rb, tag="kept", progress=False)
    rb.extend(batch(100, 10))
    zarr_rb.save(rb, progress=False)
    storage.close()
    groups = sorted(p.name for p in (path / "state").iterdir() if p.is_dir())
    assert len(groups) == 2, groups  # the last save's and the kept version's
    for version, length in ((None, 60), ("kept", 50)):
        loaded = zarr_rb.load(str(path), version=version, read_only=True, progress=False)
        assert len(loaded) == length
        loaded.storage.close()


def test_a_writer_that_saves_reads_the_rows_other_writers_committed_before(tmp_path):
    """A save publishes through the record as it is now, other writers' rows included:
    the rows the writer reads next are those (no read cached before is served again)."""
    path = str(tmp_path / "rb.zarr")
    mine = ZarrStorage(CAPACITY, path, shared=True)
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=mine)
    rb.extend(batch(0, CAPACITY))
    everything = torch.arange(CAPACITY)
    assert mine.get(everything)["action"].tolist() == [t % 5 for t in range(CAPACITY)]
    other = ZarrStorage(path=path, shared=True)
    TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=other).extend(batch(101, 10))
    zarr_rb.save(rb, progress=False)
    expected = [t % 5 for t in [*range(101, 111), *range(10, CAPACITY)]]
    assert mine.get(everything)["action"].tolist() == expected
    other.close()
    mine.close()
