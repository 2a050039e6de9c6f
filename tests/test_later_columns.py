"""A column added by a later write: rows written without it read as zeros there, as in
TorchRL's storages, and are stored and committed like any other row."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

from zarr_rb import ZarrStorage


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
