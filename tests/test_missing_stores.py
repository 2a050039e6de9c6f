"""A store deleted under its writer, or missing where a storage opens, is reported as gone
(not as another writer's doing, nor as a missing setting)."""

from __future__ import annotations

import shutil

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import ZarrStorage
from zarr_rb.errors import StoreNotFoundError


def batch(start: int, n: int) -> TensorDict:
    return TensorDict({"step": torch.arange(start, start + n), "obs": torch.ones(n, 3)}, [n])


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


def test_a_buffer_not_written_yet_snapshots_and_pickles(tmp_path):
    import pickle

    import zarr_rb

    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, tmp_path / "rb.zarr"))
    zarr_rb.save(rb, tmp_path / "snapshot.zarr")
    rb.dumps(tmp_path / "dump")
    assert len(ZarrStorage(path=tmp_path / "snapshot.zarr", read_only=True)) == 0
    pickle.dumps(rb.storage)  # another process can open it by its path now
    assert len(ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)) == 0
    rb.storage.close()
