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


def test_a_patch_of_a_key_the_store_lacks_is_refused_before_anything_is_written(tmp_path):
    """``write_leaves`` (behind the lazy columns of ``storage[:]`` and ``update_if_present``)
    changes entries the rows have, as TorchRL's storages do: a key the store lacks is an
    ``UnknownKeyError`` naming it, and the store stays as it was."""
    import numpy as np
    import pytest

    from zarr_rb.errors import UnknownKeyError

    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, tmp_path / "rb.zarr"))
    rb.extend(steps([1, 2, 3], 1)[0])
    with pytest.raises(UnknownKeyError, match=r"'done'.*'step'"):
        rb.storage.write_leaves(
            np.array([0]), {("done",): torch.ones(1, dtype=torch.bool), ("step",): torch.zeros(1)}
        )
    rb.storage.close()
    with ZarrStorage(path=tmp_path / "rb.zarr", read_only=True) as reopened:
        assert reopened[:]["step"].tolist() == [1, 2, 3]
        assert "done" not in list(reopened[:].keys())
