"""The arrays are plain Zarr v3: other tools read them without zarr_rb."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path

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


def rows_with_zarr_python(store_path, key: str) -> np.ndarray:
    """Rows ``[0, len)`` of a leaf as ``docs/reading-without-zarr_rb.md`` tells a reader with
    zarr-python alone to find them: through the commit's slot map, when there is one."""
    group = zarr.open_group(store_path, mode="r")
    commit = group.attrs["zarr_rb"]["commit"]
    positions = np.arange(commit["length"])
    rows = positions
    if "slots" in commit:  # blocks written over since live in other slots
        block_rows, runs = commit["slots"]["block_rows"], commit["slots"]["runs"]
        slot = np.zeros(sum(count for _, _, count in runs), dtype=np.int64)
        for first, where, count in runs:
            slot[first : first + count] = np.arange(where, where + count)
        rows = slot[positions // block_rows] * block_rows + positions % block_rows
    if "runs" in commit:  # a store of several writers: runs of positions, row by row
        if "pieces" in commit["runs"]:  # a large map: pieces of it, objects of their own
            data = b"".join(
                zlib.decompress((Path(store_path) / "maps" / name).read_bytes())
                for _, name, _ in commit["runs"]["pieces"]
            )
        else:
            data = zlib.decompress(base64.b64decode(commit["runs"]["data"]))
        runs = np.frombuffer(data, "<i8").reshape(-1, 3)
        run = np.searchsorted(runs[:, 0], positions, side="right") - 1
        rows = runs[run, 1] + positions - runs[run, 0]  # [first position, its row, rows]
    values = group[f"data/{key}"].oindex[rows]
    if key == "index":  # what stands for a row's position
        marked = values == -(2**62)
        each = positions.reshape(-1, *[1] * (values.ndim - 1))
        values[marked] = np.broadcast_to(each, values.shape)[marked]
    return values


def test_zarr_python_reads_a_ring_written_over_through_its_slot_map(store_path):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from zarr_rb import Compression

    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(32, store_path, compression=Compression(block_rows=8))
    )
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(32))
    for buffer in (rb, twin):
        for start in range(0, 75, 15):  # the ring turns over twice, in steps across blocks
            steps = torch.arange(start, start + 15)
            buffer.extend(TensorDict({"step": steps, "obs": steps[:, None] * 2.0}, [15]))
        buffer[torch.tensor([3, 17])] = TensorDict(
            {"step": torch.tensor([-3, -17]), "obs": torch.tensor([[-6.0], [-34.0]])}, [2]
        )
    rb.storage.close()
    record = zarr.open_group(store_path, mode="r").attrs["zarr_rb"]
    assert record["format"] == 3
    assert "slots" in record["commit"]  # the blocks did move
    np.testing.assert_array_equal(rows_with_zarr_python(store_path, "step"), twin[:]["step"])
    np.testing.assert_array_equal(rows_with_zarr_python(store_path, "obs"), twin[:]["obs"])


def test_zarr_python_reads_a_ring_of_several_writers_through_its_runs(store_path):
    from torchrl.data import LazyTensorStorage

    from zarr_rb import Compression

    compression = Compression(block_rows=8)
    writers = [ZarrStorage(32, store_path, shared=True, compression=compression)]
    writers.append(ZarrStorage(path=store_path, mode="r+", shared=True))
    twin = LazyTensorStorage(32)
    cursor = 0
    for start in range(0, 75, 5):  # writers take turns, the ring turns over twice
        steps = torch.arange(start, start + 5)
        data = TensorDict({"step": steps, "obs": steps[:, None] * 2.0}, [5])
        positions = (cursor + torch.arange(5)) % 32
        # "index" as TorchRL's TensorDict writers set it: the positions given to the write
        writers[start % 2].set(torch.arange(5), data.set("index", torch.arange(5)))
        twin.set(positions, data.clone().set("index", positions))
        cursor = (cursor + 5) % 32
    for writer in writers:
        writer.close()
    record = zarr.open_group(store_path, mode="r").attrs["zarr_rb"]
    assert record["format"] == 3
    assert "runs" in record["commit"]
    everything = torch.arange(32)
    want = twin.get(everything)
    np.testing.assert_array_equal(rows_with_zarr_python(store_path, "step"), want["step"])
    np.testing.assert_array_equal(rows_with_zarr_python(store_path, "obs"), want["obs"])
    np.testing.assert_array_equal(rows_with_zarr_python(store_path, "index"), want["index"])


def test_zarr_python_rebuilds_frames_stored_once_as_the_docs_say(tmp_path):
    # docs/reading-without-zarr_rb.md, "Frames stored once", after a ring written over.
    from zarr_rb import Compression

    path = tmp_path / "rb.zarr"
    run = torch.randint(0, 256, (70, 6, 5), dtype=torch.uint8)
    stacks = torch.stack([run[t : t + 4] for t in range(66)])
    data = TensorDict({"observation": stacks[:-1], ("next", "observation"): stacks[1:]}, [65])
    compression = Compression(frames=True, block_rows=8, large_row_bytes=64)
    storage = ZarrStorage(32, path, compression=compression)
    storage.set(torch.arange(32), data[:32])
    storage.set(torch.arange(20), data[32:52])  # written over: blocks in other slots
    storage.close()
    expected = torch.cat([data[32:52], data[20:32]])
    group = zarr.open_group(path, mode="r")
    commit = group.attrs["zarr_rb"]["commit"]
    block_rows = group.attrs["zarr_rb"]["block_rows"]
    positions = np.arange(commit["length"])
    slot = np.zeros(sum(count for _, _, count in commit["slots"]["runs"]), dtype=np.int64)
    for first, where, count in commit["slots"]["runs"]:
        slot[first : first + count] = np.arange(where, where + count)
    rows = slot[positions // block_rows] * block_rows + positions % block_rows
    for key in ("observation", "next/observation"):
        cells = group["data/observation"]
        per_row = cells.shape[1]
        ids = group[f"frame_ids/{key}"].oindex[rows]
        at = (rows - rows % block_rows)[:, None] * per_row + ids
        wanted, where = np.unique(at // per_row, return_inverse=True)
        stacks_read = cells.oindex[wanted][where.reshape(at.shape), at % per_row]
        want = expected["observation" if key == "observation" else ("next", "observation")]
        np.testing.assert_array_equal(stacks_read, want.numpy())
