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
from zarr_rb._io import observe_io


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
