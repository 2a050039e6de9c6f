"""The automatic frames setting (``Compression(frames=None)``, the default): which leaves a
store keeps as frames, decided at its first write from their shapes and first rows, and
recorded (``docs/design/frames-on-disk.md``, step 3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.errors import SchemaMismatchError

SMALL = Compression(block_rows=8, large_row_bytes=256)
"""The defaults but for small blocks, and 256 bytes a large row (a 4x12x10 stack is 480)."""


def setting(frames: bool | None) -> Compression:
    return dataclasses.replace(SMALL, frames=frames)


def record(path: Path) -> dict:
    out: dict = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    return out


def stored_frames(path: Path) -> list[dict]:
    schema = record(path)["schema"]
    return list(schema.get("frames", [])) if schema else []


def run_of_stacks(n: int, *, twin: bool = True, seed: int = 0) -> TensorDict:
    """Transitions of a run of distinct 12x10 frames, 4 to a stack, each row's next one
    frame on."""
    frames = torch.randint(0, 256, (n + 4, 12, 10), dtype=torch.uint8, generator=gen(seed))
    stacks = torch.stack([frames[t : t + 4] for t in range(n + 1)])
    data = {"obs": stacks[:-1], "reward": torch.arange(n, dtype=torch.float32)}
    if twin:
        data["next"] = {"obs": stacks[1:]}
    return TensorDict(data, batch_size=[n])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def written_and_read(path: Path, data: TensorDict, **kwargs) -> ZarrStorage:
    storage = ZarrStorage(len(data) + 8, path, **kwargs)
    storage.set(torch.arange(len(data)), data)
    assert_identical(storage.get(torch.arange(len(data))).exclude("index"), data)
    return storage


def test_stacks_with_their_next_are_stored_as_frames_and_the_record_says_so(tmp_path):
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(40, path, compression=SMALL)
    assert Compression().frames is None
    zarr_rb.save(TensorDictReplayBuffer(storage=storage))  # an empty store: nothing decided
    # (Left out, not null: an older zarr_rb, whose parser takes true or false, reads false.)
    assert "frames" not in record(path)["compression"]
    data = run_of_stacks(20)
    storage.set(torch.arange(20), data)
    storage.flush()
    assert stored_frames(path) == [{"key": ["obs"], "next": ["next", "obs"], "stack": 4}]
    assert record(path)["compression"]["frames"] is True
    assert storage.compression.frames is True
    storage.close()
    for frames in (None, True):  # None matches what the first write decided
        with ZarrStorage(path=path, compression=setting(frames)) as again:
            assert_identical(again.get(torch.arange(20)).exclude("index"), data)
    with pytest.raises(SchemaMismatchError, match="compression=None to reopen"):
        ZarrStorage(path=path, compression=setting(False))


@pytest.mark.parametrize(
    "case",
    ["rgb images without a twin", "stacks of noise without a twin", "noise with a twin"],
)
def test_large_leaves_whose_first_rows_share_no_frame_stay_stacks(tmp_path, case):
    n = 12
    noise = torch.randint(0, 256, (n + 1, 4, 12, 10), dtype=torch.uint8, generator=gen(1))
    if case == "rgb images without a twin":
        data = TensorDict({"image": noise[:n, :3]}, [n])
    elif case == "stacks of noise without a twin":
        data = TensorDict({"obs": noise[:n]}, [n])
    else:  # a next that no row's own obs repeats
        other = torch.randint(0, 256, (n, 4, 12, 10), dtype=torch.uint8, generator=gen(2))
        data = TensorDict({"obs": noise[:n], "next": {"obs": other}}, [n])
    path = tmp_path / "rb.zarr"
    written_and_read(path, data, compression=SMALL).close()
    assert stored_frames(path) == []
    assert record(path)["compression"]["frames"] is False
    assert record(path)["format"] < 4  # readable as before frames on disk


def test_a_leaf_with_a_twin_one_row_ahead_is_stored_as_frames_without_stacks(tmp_path):
    states = torch.randn(17, 100)  # 400 bytes a row: a large leaf, no stack
    data = TensorDict({"state": states[:-1], "next": {"state": states[1:]}}, [16])
    path = tmp_path / "rb.zarr"
    written_and_read(path, data, compression=SMALL).close()
    assert stored_frames(path) == [{"key": ["state"], "next": ["next", "state"], "stack": 1}]


def test_a_first_write_of_one_row_decides_from_the_shape(tmp_path):
    path = tmp_path / "rb.zarr"
    data = run_of_stacks(9)
    storage = ZarrStorage(16, path, compression=SMALL)
    storage.set(torch.arange(1), data[:1])
    storage.set(torch.arange(1, 9), data[1:])
    assert_identical(storage.get(torch.arange(9)).exclude("index"), data)
    storage.close()
    assert [leaf["key"] for leaf in stored_frames(path)] == [["obs"]]


def test_frames_false_keeps_stacks_and_true_takes_leaves_that_share_nothing(tmp_path):
    noise = TensorDict(
        {"obs": torch.randint(0, 256, (12, 4, 12, 10), dtype=torch.uint8, generator=gen(3))},
        [12],
    )
    written_and_read(tmp_path / "off.zarr", run_of_stacks(12), compression=setting(False)).close()
    assert stored_frames(tmp_path / "off.zarr") == []
    assert record(tmp_path / "off.zarr")["compression"]["frames"] is False
    written_and_read(tmp_path / "on.zarr", noise, compression=setting(True)).close()
    assert [leaf["key"] for leaf in stored_frames(tmp_path / "on.zarr")] == [["obs"]]


def test_an_empty_store_takes_the_setting_it_is_reopened_with(tmp_path):
    path = tmp_path / "rb.zarr"
    with ZarrStorage(16, path, compression=SMALL) as empty:
        zarr_rb.save(TensorDictReplayBuffer(storage=empty))
    assert "frames" not in record(path)["compression"]
    with ZarrStorage(path=path, compression=setting(False)) as storage:
        storage.set(torch.arange(8), run_of_stacks(8))
    assert stored_frames(path) == []
    assert record(path)["compression"]["frames"] is False


def test_shared_writers_take_the_first_writers_choice(tmp_path):
    path = tmp_path / "rb.zarr"
    data = run_of_stacks(24)
    first, second = (
        TensorDictReplayBuffer(storage=ZarrStorage(32, path, compression=SMALL, shared=True))
        for _ in range(2)
    )
    # The second writer's first write is of one row (shape alone: frames); the first's,
    # of rows of noise (no frame shared: stacks). The first to publish its schema wins.
    noise = TensorDict(
        {
            "obs": torch.randint(0, 256, (8, 4, 12, 10), dtype=torch.uint8, generator=gen(4)),
            "reward": torch.zeros(8),
            "next": {
                "obs": torch.randint(0, 256, (8, 4, 12, 10), dtype=torch.uint8, generator=gen(5))
            },
        },
        [8],
    )
    first.extend(noise)
    second.extend(data[:1])
    second.extend(data[1:])
    for rb in (first, second):
        rb.storage.close()
    assert stored_frames(path) == []
    with ZarrStorage(path=path, mode="r") as reader:
        assert len(reader) == 32
        rows = reader.get(torch.arange(32)).exclude("index")
    assert sorted(rows["reward"].tolist()) == sorted([0.0] * 8 + data["reward"].tolist())
    assert zarr_rb.verify(path).ok


def test_a_shared_writer_takes_the_recorded_choice_or_says_its_own_differs(tmp_path):
    path = tmp_path / "rb.zarr"
    data = run_of_stacks(24)
    first, joining, stacks = (
        TensorDictReplayBuffer(storage=ZarrStorage(32, path, compression=c, shared=True))
        for c in (SMALL, SMALL, setting(False))
    )
    first.extend(data[:12])  # decides: frames
    joining.extend(data[12:])
    assert joining.storage.compression.frames is True  # as recorded, not its None
    # (The record it took from the first writer's says so too: not the null it opened with.)
    assert joining.storage._store.meta.compression["frames"] is True
    with pytest.raises(SchemaMismatchError, match=r"frames=True.*frames=False"):
        stacks.extend(data[:4])
    for rb in (first, joining, stacks):
        rb.storage.close()
    with ZarrStorage(path=path, mode="r") as reader:
        assert len(reader) == 24
        assert reader.compression.frames is True


def test_a_record_from_before_the_setting_reads_as_its_schema_stores(tmp_path):
    path = tmp_path / "rb.zarr"
    data = run_of_stacks(12)
    written_and_read(path, data, compression=setting(False)).close()
    document = json.loads((path / "zarr.json").read_text())
    del document["attributes"]["zarr_rb"]["compression"]["frames"]  # as written before it
    (path / "zarr.json").write_text(json.dumps(document))
    with ZarrStorage(path=path) as storage:
        assert storage.compression.frames is False
        assert_identical(storage.get(torch.arange(12)).exclude("index"), data)
    with pytest.raises(SchemaMismatchError, match="compression=None to reopen"):
        ZarrStorage(path=path, compression=setting(True))
