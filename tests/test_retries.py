"""A write that failed waits to be written again at the next flush; rows written since over
the same cells are newer, and the retry must not land over them."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.util.io import observe_io


def steps(values: torch.Tensor) -> TensorDict:
    return TensorDict({"step": values, "obs": values.float()[:, None] * 2}, [values.numel()])


def test_a_failed_write_is_not_replayed_over_newer_rows(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(8, path, compression=Compression(block_rows=4)))
    rb.extend(steps(torch.arange(8)))
    rb.storage.flush()

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        rb.storage.set(torch.tensor([2]), steps(torch.tensor([500])))  # kept to retry
    rb.extend(steps(torch.arange(100, 108)))  # every row again, row 2 included
    assert rb.storage.get(torch.tensor([2]))["step"].item() == 102
    rb.storage.close()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(torch.arange(8))["step"].tolist() == list(range(100, 108))
    reader.close()


def test_a_failed_write_is_read_back_as_kept_not_from_the_last_read(tmp_path: Path) -> None:
    """A write that failed is kept (and written by the next flush): the writer's reads of
    its rows give the new values, never those of a read made before it (the storage keeps
    its last read for a sampler that reads the same rows twice)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4))
    TensorDictReplayBuffer(storage=storage).extend(steps(torch.arange(8)))
    storage.flush()
    rows = torch.arange(8)
    assert storage.get(rows)["step"].tolist() == list(range(8))  # kept as the last read

    def broken_disk(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.EIO, "Input/output error")

    with observe_io(broken_disk), pytest.raises(StoreWriteError):
        storage.set(torch.tensor([2]), steps(torch.tensor([500])))
    expected = [0, 1, 500, 3, 4, 5, 6, 7]
    assert storage.get(rows)["step"].tolist() == expected
    storage.flush()  # writes the kept row
    assert storage.get(rows)["step"].tolist() == expected
    storage.close()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(rows)["step"].tolist() == expected
    reader.close()


def test_rows_after_a_failed_write_wait_for_it_rather_than_leave_a_hole(tmp_path: Path) -> None:
    """A block whose write failed waits in RAM; rows written past it are not committed
    without it (a reader, or the store reopened after a crash, would find a hole), and the
    flush that writes it again publishes them all."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(96, path, compression=Compression(block_rows=8))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(steps(torch.arange(8)))

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        rb.extend(steps(torch.arange(8, 16)))  # kept in RAM to retry
    storage.set(torch.arange(16, 24), steps(torch.arange(16, 24)))  # a whole block, written
    reader = ZarrStorage(path=path, read_only=True)
    assert reader._store.unreadable_rows().size == 0
    assert reader.get(torch.arange(len(reader)))["step"].tolist() == list(range(len(reader)))
    storage.flush()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(torch.arange(len(reader)))["step"].tolist() == list(range(24))
    storage.close()
