"""Regressions found in review of the RAM tier of frames (``zarr_rb/core/frames.py``)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.arrays import StoreArrays


def _episode(n: int, stack: int, side: int, dtype: torch.dtype, start: int = 0) -> TensorDict:
    frames = torch.stack(
        [
            ((torch.arange(side * side) + t * 7) % 251).view(side, side)
            for t in range(start, start + n + stack)
        ]
    ).to(dtype)
    obs = torch.stack([frames[t : t + stack] for t in range(n)])
    nxt = torch.stack([frames[t + 1 : t + 1 + stack] for t in range(n)])
    return TensorDict({"obs": obs, "next": {"obs": nxt}}, batch_size=[n])


@pytest.mark.parametrize(("stack", "side", "dtype"), [(3, 30, torch.uint8), (3, 45, torch.float32)])
def test_frames_not_on_8_byte_boundaries(
    tmp_path: Path, stack: int, side: int, dtype: torch.dtype
) -> None:
    """A frame of 900 bytes (``[3, 30, 30]`` uint8): two frames line up as 8-byte words,
    the second frame of a row does not start on an 8-byte boundary. One-row extends compared
    words with bytes and raised (``The size of tensor a (225) must match ... (1800)``)."""
    storage = ZarrStorage(16, tmp_path / "rb.zarr")  # ram_bytes="auto"
    twin = LazyTensorStorage(16)
    rb, rb_twin = (TensorDictReplayBuffer(storage=s, batch_size=2) for s in (storage, twin))
    for t in range(3):
        data = _episode(1, stack, side, dtype, start=t)
        rb.extend(data)
        rb_twin.extend(data)
    # A write whose tensors start at an odd byte (a view into a larger buffer).
    data = _episode(4, stack, side, dtype, start=3)
    flat = torch.zeros(data["obs"].numel() * data["obs"].element_size() + 3, dtype=torch.uint8)
    flat[3:] = data["obs"].reshape(-1).view(torch.uint8)
    data["obs"] = (
        flat[3:].view(dtype).view(data["obs"].shape) if dtype == torch.uint8 else data["obs"]
    )
    rb.extend(data)
    rb_twin.extend(data)
    everything = torch.arange(len(twin))
    assert_identical(
        storage.get(everything).exclude("index"), twin.get(everything).exclude("index")
    )
    tier = storage._store.ram.frames
    assert tier is not None
    tier.check()
    assert bool(tier.resident[: len(twin)].all())
    storage.close()


def test_admission_record_stays_bounded(tmp_path: Path) -> None:
    """A tier that never needs to evict kept one entry per write for ever (1-row writes: a
    leak of an array and a tuple per ``rb.add``)."""
    storage = ZarrStorage(8, tmp_path / "rb.zarr", ram_bytes=2**22)
    for t in range(200):
        storage.set(torch.tensor([t % 8]), _episode(1, 4, 16, torch.uint8, start=t))
    tier = storage._store.ram.frames
    assert tier is not None
    tier.check()
    assert len(tier._admitted) <= 2 * 64 + 1, len(tier._admitted)
    storage.close()


def test_a_full_tier_does_not_read_rows_to_drop_them(tmp_path: Path) -> None:
    """With a budget given, a shared writer's tier is filled again after other writers'
    changes; once full, each fill read a chunk of up to 1,024 rows from the store, decoded
    them, and dropped them (the chunk did not fit), at every read after every refresh."""
    path = tmp_path / "rb.zarr"
    rows = 1500
    learner = ZarrStorage(rows, path, shared=True, ram_bytes=200 * 256 + rows * 32 + 4096)
    TensorDictReplayBuffer(storage=learner, batch_size=8).extend(_episode(1200, 4, 16, torch.uint8))
    collector = ZarrStorage(path=path, mode="r+", shared=True, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=collector, batch_size=8)
    read = StoreArrays.read
    counted = [0]

    def counting(self, requests, lengths=None):  # type: ignore[no-untyped-def]
        counted[0] += int(np.size(requests.get(("obs",), ())))
        return read(self, requests, lengths)

    with mock.patch.object(StoreArrays, "read", counting):
        for i in range(3):
            rb.extend(_episode(5, 4, 16, torch.uint8, start=2000 + 10 * i))
            learner.refresh()
            counted[0] = 0
            learner.get(torch.tensor([0]))
            assert counted[0] <= 64, counted[0]
    learner._store.ram.frames.check()
    collector.close()
    learner.close()


@pytest.mark.parametrize("blank_heads", [1.0, 0.2])
def test_frames_alike_at_their_start_are_compared_whole(tmp_path: Path, blank_heads: float) -> None:
    """Frames are compared by their first bytes before their whole bytes: frames that start
    alike (a blank top of the screen) and differ further on stay distinct, whether most
    rows start alike (``1.0``) or a few (``0.2``)."""
    g = torch.Generator().manual_seed(3)
    rows, stack, side = 96, 4, 24
    obs = torch.randint(0, 255, (rows, stack, side, side), dtype=torch.uint8, generator=g)
    nxt = torch.cat([obs[1:], obs[-1:]])  # an episode: next[k] is obs[k + 1] ...
    nxt[::7, :, -1, -1] ^= 1  # ... but for its last byte, now and then
    obs[1::5, :-1, -1, -1] ^= 1  # stacks that do not continue the row before, by one byte
    blank = torch.rand(rows, generator=g) < blank_heads
    obs[blank, :, :6] = 0  # the first 144 bytes of each frame alike
    nxt[blank, :, :6] = 0
    data = TensorDict({"obs": obs, "next": {"obs": nxt}}, batch_size=[rows])
    storage = ZarrStorage(rows, tmp_path / "rb.zarr")  # ram_bytes="auto"
    twin = LazyTensorStorage(rows)
    for s in (storage, twin):
        rb = TensorDictReplayBuffer(storage=s, batch_size=2)
        for start in range(0, rows, 32):
            rb.extend(data[start : start + 32])
    storage._store.ram.frames.check()
    assert int(storage._store.ram.frames.resident.sum()) == rows
    every = torch.arange(rows)
    assert_identical(storage.get(every).exclude("index"), twin.get(every).exclude("index"))


def test_an_error_of_the_tier_is_raised_once_the_rows_are_written(tmp_path: Path) -> None:
    """The frames go into the tier while TensorStore encodes the rows for the disk: an error
    there is raised once the extend's rows are written and committed (they are then read
    from the store), and the buffer goes on."""
    from zarr_rb.core.frames import FrameTier

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(64, path, compression=Compression(block_rows=16))  # RAM tier on
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    first = _episode(32, 4, 24, torch.uint8)
    rb.extend(first[:16])
    with (
        mock.patch.object(FrameTier, "put", side_effect=MemoryError("no room")),
        pytest.raises(MemoryError, match="no room"),
    ):
        rb.extend(first[16:])  # a whole block, written within the call
    assert len(storage) == 32
    assert_identical(storage.get(torch.arange(32)).exclude("index"), first)
    rb.extend(_episode(8, 4, 24, torch.uint8, start=40))
    storage.close()
    with ZarrStorage(path=path) as reopened:  # committed before the error was raised
        assert len(reopened) == 40
        assert_identical(reopened.get(torch.arange(32)).exclude("index"), first)


def test_rows_whose_frames_failed_to_go_into_the_tier_are_not_read_as_their_old_frames(
    tmp_path: Path,
) -> None:
    """An extend over resident rows whose frames fail to go into the tier (found by review):
    the rows are written and committed, so the tier must not serve their old frames; with
    the write failing too, its error is raised, noting the tier's."""
    from conftest import fail_at_row_write

    from zarr_rb.errors import StoreWriteError

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(32, path, compression=Compression(block_rows=16))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_episode(32, 4, 24, torch.uint8))  # every row resident
    new = _episode(16, 4, 24, torch.uint8, start=100)
    plan = "zarr_rb.core.frames.plan_frames"
    with mock.patch(plan, side_effect=MemoryError("no room")), pytest.raises(MemoryError):
        rb.extend(new)  # rows 0-15 again
    live = storage.get(torch.arange(32)).exclude("index")
    assert_identical(live[:16], new)
    newer = _episode(16, 4, 24, torch.uint8, start=200)
    with (
        mock.patch(plan, side_effect=MemoryError("no room")),
        fail_at_row_write(1, 100),
        pytest.raises(StoreWriteError) as raised,
    ):
        rb.extend(newer)  # rows 16-31
    assert any("frames into RAM failed too" in note for note in raised.value.__notes__)
    storage.flush()
    live = storage.get(torch.arange(32)).exclude("index")
    assert_identical(live[16:], newer)
    storage.close()
    with ZarrStorage(path=path) as reopened:
        assert_identical(reopened.get(torch.arange(32)).exclude("index"), live)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool])
def test_frames_of_one_byte_values_every_other_byte(tmp_path: Path, dtype: torch.dtype) -> None:
    """Frames of 1-byte values whose last dimension is strided (found by review): numpy
    cannot read them as 8-byte words without a copy, and the extend raised."""
    storage = ZarrStorage(32, tmp_path / "rb.zarr", compression=Compression(block_rows=16))
    twin = LazyTensorStorage(32)
    rb, rb_twin = (TensorDictReplayBuffer(storage=s, batch_size=2) for s in (storage, twin))
    for start in (0, 100):
        data = _episode(16, 4, 24, torch.uint8, start=start).apply(lambda t: (t % 2).to(dtype))
        wide = data.apply(lambda t: torch.repeat_interleave(t, 2, dim=-1)[..., ::2])
        assert not wide["obs"].is_contiguous()
        rb.extend(wide)
        rb_twin.extend(data)
    everything = torch.arange(32)
    assert_identical(
        storage.get(everything).exclude("index"), twin.get(everything).exclude("index")
    )
    storage.close()
