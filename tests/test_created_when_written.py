"""As TorchRL's storages, a ZarrStorage creates nothing on disk until its first write; a
store deleted under its writer is reported as gone, not as another writer's doing."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

from zarr_rb import ZarrStorage
from zarr_rb.errors import StoreNotFoundError


def batch(start: int, n: int) -> TensorDict:
    return TensorDict({"step": torch.arange(start, start + n), "obs": torch.ones(n, 3)}, [n])


def test_nothing_is_on_disk_before_the_first_write(tmp_path):
    path = tmp_path / "runs" / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
    assert not (tmp_path / "runs").exists()
    assert len(rb) == 0
    rb.extend(batch(0, 5))
    rb.storage.close()
    assert len(ZarrStorage(path=path)) == 5


def test_torchrl_scripts_scratch_dir_of_a_collected_temporary_directory():
    """TorchRL's TD3 and SAC scripts pass ``tempfile.TemporaryDirectory().name``: the
    directory is gone as soon as the object is collected, before the first write."""
    rbs = []
    for make in (LazyMemmapStorage, ZarrStorage):
        scratch = tempfile.TemporaryDirectory()
        storage = make(100, scratch_dir=scratch.name)
        scratch.cleanup()  # collected: the directory is removed
        rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
        rb.extend(batch(0, 10))
        rb.extend(batch(10, 10))
        rbs.append(rb)
    memmap, zarr = rbs
    assert len(zarr) == len(memmap) == 20
    assert torch.equal(zarr[:]["step"], memmap[:]["step"])
    zarr.storage.flush()
    zarr.storage.cleanup()
    shutil.rmtree(memmap.storage.scratch_dir, ignore_errors=True)


def test_a_store_deleted_under_its_writer_is_reported_gone(tmp_path):
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
    rb.extend(batch(0, 5))
    rb.storage.flush()
    shutil.rmtree(path)

    def write_and_commit() -> None:
        rb.extend(batch(5, 5))  # its rows are committed as they reach disk
        rb.storage.flush()

    with pytest.raises(StoreNotFoundError, match="deleted"):
        write_and_commit()


def test_opening_a_missing_store_without_a_capacity_says_it_is_missing(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no zarr_rb store"):
        ZarrStorage(path=tmp_path / "nope.zarr")
    assert not (tmp_path / "nope.zarr").exists()
