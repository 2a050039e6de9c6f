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


def test_a_key_added_later_gets_zeros_in_runs_of_rows_across_a_block_boundary(tmp_path):
    """Rows on disk in a run that crosses a block's end (rows 3-4, blocks of 4) all get
    zeros in a key added later (found by review: the run was cut at the block's end and
    its rows past it never got theirs, so reading row 4 raised ChunkCorruptedError)."""
    layout = Compression(block_rows=4, chunk_rows=4)
    storage = ZarrStorage(6, tmp_path / "rb.zarr", compression=layout, ram_bytes=0)

    def rows(values):
        step = torch.tensor(values)
        return TensorDict({"step": step, "obs": step.float()[:, None]}, [len(values)])

    storage.set(torch.tensor([1, 3, 4]), rows([21, 23, 24]))
    storage.set(torch.tensor([0, 1]), rows([30, 31]))  # rows 3-4 on disk; len 5
    storage.set(torch.tensor([5]), rows([35]).set("added", torch.tensor([7])))
    assert storage.unreadable_rows().tolist() == [2]  # (never written)
    got = storage.get(torch.tensor([0, 1, 3, 4, 5]))
    assert got["step"].tolist() == [30, 31, 23, 24, 35]
    assert got["added"].tolist() == [0, 0, 0, 0, 7]
    storage.close()
