"""A write into the rows of ``rb[:]`` is seen by the next read of the same rows, even when
that very read was made (and kept) just before."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage


def steps(versions: list[int], envs: int) -> TensorDict:
    v = torch.tensor(versions)[None, :] * envs + torch.arange(envs)[:, None]
    return TensorDict({"step": v, "next": {"reward": v[..., None] * 0.5}}, v.shape)


def test_a_gather_after_a_write_through_the_view_reads_the_new_rows(tmp_path):
    compression = Compression(block_rows=2)
    zarr = ZarrStorage(60, tmp_path / "rb.zarr", ndim=2, compression=compression)
    results = []
    for storage in (zarr, LazyTensorStorage(60, ndim=2)):
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(steps([1, 2], 3))
        rb.storage.get(torch.arange(2))  # a gather the storage may keep
        rb[:, torch.tensor([0])] = steps([3], 3)  # TorchRL writes through rb[:]
        results.append(rb.storage.get(torch.arange(2)))
    for key in ("step", ("next", "reward")):
        assert torch.equal(results[0][key], results[1][key])
    assert results[0]["step"][0].tolist() == [9, 10, 11]
    zarr.close()
