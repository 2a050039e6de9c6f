"""A column added by a later write: rows written without it read as zeros there, as in
TorchRL's storages, and are stored and committed like any other row."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

import zarr_rb
from zarr_rb import Compression, ZarrStorage


def fill(storage) -> TensorDictReplayBuffer:
    """TensorDictMaxValueWriter sets ``index`` on ``add`` but not on ``extend``."""
    rb = TensorDictReplayBuffer(
        storage=storage, writer=TensorDictMaxValueWriter(rank_key="r"), batch_size=4
    )
    rb.extend(TensorDict({"r": torch.arange(5.0), "x": torch.arange(5)}, [5]))
    rb.add(TensorDict({"r": torch.tensor(10.0), "x": torch.tensor(10)}, []))
    rb.extend(TensorDict({"r": torch.arange(20.0, 23.0), "x": torch.arange(20, 23)}, [3]))
    return rb


def test_rows_written_without_a_later_column_read_zeros_and_are_committed(tmp_path):
    expected = fill(LazyTensorStorage(20))[:]
    path = tmp_path / "rb.zarr"
    rb = fill(ZarrStorage(20, path))
    for key in ("index", "r", "x"):
        assert torch.equal(rb[:][key].materialize(), expected[key])
    rb.storage.close()
    reopened = ZarrStorage(path=path)
    assert len(reopened) == len(expected)
    for key in ("index", "r", "x"):
        assert torch.equal(reopened[:][key].materialize(), expected[key])
    reopened.close()


def test_a_save_whose_block_was_copied_on_write_loads_with_a_later_column_as_zeros(tmp_path):
    """Rows 0-1 saved; rows 2-7 extended (block 0 is copied on write, and committed: the save
    keeps its rows in the slot it names), then a write adds a column. ``zarr_rb.load`` of the
    save gives its rows with zeros there (their slot got none: every read of them failed
    with ChunkCorruptedError; found by the crash machine)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(12, path, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(TensorDict({"x": torch.arange(2)}, [2]))
    zarr_rb.save(rb)
    rb.extend(TensorDict({"x": torch.arange(2, 8)}, [6]))
    rb.extend(TensorDict({"x": torch.arange(8, 10), "y": torch.ones(2)}, [2]))
    storage.close()
    loaded = zarr_rb.load(path)
    try:
        got = loaded.storage.get(torch.arange(2))
        assert got["x"].tolist() == [0, 1]
        assert got["y"].tolist() == [0.0, 0.0]
    finally:
        loaded.storage.close()
