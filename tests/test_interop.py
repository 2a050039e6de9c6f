"""The arrays are plain Zarr v3: other tools read them without zarr_rb."""

from __future__ import annotations

import numpy as np
import torch
import zarr
from tensordict import TensorDict

from zarr_rb import ZarrStorage


def fill(store_path) -> TensorDict:
    data = TensorDict(
        {
            "obs": torch.randint(0, 255, (12, 4, 8, 8), dtype=torch.uint8),
            "next": {"reward": torch.randn(12, 1), "done": torch.zeros(12, 1, dtype=torch.bool)},
            "action": torch.arange(12),
            "logits": torch.randn(12, 3).bfloat16(),
        },
        batch_size=[12],
    )
    storage = ZarrStorage(32, store_path)
    storage.set(torch.arange(12), data)
    storage.close()
    return data


def test_zarr_python_reads_arrays_with_right_dtypes_and_shapes(store_path):
    data = fill(store_path)
    group = zarr.open_group(store_path, mode="r")
    assert group.attrs["zarr_rb"]["commit"]["length"] == 12
    obs = group["data/obs"]
    assert obs.dtype == np.uint8
    assert obs.shape == (32, 4, 8, 8)
    np.testing.assert_array_equal(obs[:12], data["obs"].numpy())
    np.testing.assert_array_equal(group["data/next/reward"][:12], data["next", "reward"].numpy())
    assert group["data/next/done"].dtype == np.bool_
    # bfloat16 is stored as its uint16 bits; the real dtype is recorded on the array.
    logits = group["data/logits"]
    assert logits.dtype == np.uint16
    assert logits.attrs["zarr_rb"]["dtype"] == "bfloat16"
    restored = torch.from_numpy(logits[:12].view(np.int16)).view(torch.bfloat16)
    assert torch.equal(restored, data["logits"])


def test_tensordict_from_zarr_opens_the_data_group(store_path):
    data = fill(store_path)
    td = TensorDict.from_zarr(store_path / "data")
    # The arrays hold the full capacity; the committed length lives in the root attributes.
    length = zarr.open_group(store_path, mode="r").attrs["zarr_rb"]["commit"]["length"]
    assert td.batch_size[0] == 32
    assert torch.equal(td["obs"][:length], data["obs"])
    assert torch.equal(td["next", "reward"][:length], data["next", "reward"])


def _codecs(path, key: str) -> list[str]:
    import json

    meta = json.loads((path / "data" / key / "zarr.json").read_text())
    sharding = next(c for c in meta["codecs"] if c["name"] == "sharding_indexed")
    return [codec["name"] for codec in sharding["configuration"]["codecs"]]


def test_frames_the_codec_cannot_shrink_are_stored_raw(store_path):
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (64, 4, 84, 84), dtype=torch.uint8, generator=generator)
    flat = torch.arange(64, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 4, 84, 84).clone()
    storage = ZarrStorage(256, store_path)
    storage.set(torch.arange(64), TensorDict({"noise": noise, "flat": flat}, [64]))
    storage.set(
        torch.arange(64, 128), TensorDict({"noise": noise, "flat": flat, "more": noise}, [64])
    )
    storage.close()
    assert _codecs(store_path, "noise") == ["bytes", "crc32c"]
    assert _codecs(store_path, "more") == ["bytes", "crc32c"]  # a key added later too
    assert _codecs(store_path, "flat") == ["bytes", "zstd", "crc32c"]
    group = zarr.open_group(store_path, mode="r")  # zarr-python alone reads every kind back
    np.testing.assert_array_equal(group["data/noise"][:64], noise.numpy())
    np.testing.assert_array_equal(group["data/noise"][64:128], noise.numpy())
    np.testing.assert_array_equal(group["data/more"][64:128], noise.numpy())
    np.testing.assert_array_equal(group["data/flat"][:64], flat.numpy())
    reopened = ZarrStorage(path=store_path)
    assert torch.equal(reopened.get(torch.arange(128))["noise"], torch.cat([noise, noise]))
    reopened.close()
