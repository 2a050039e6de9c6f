"""zarr_rb.load rebuilds an equal buffer: every constructor setting of TorchRL's buffers, every
buffer class (sync=False prioritized buffers included), and the same next samples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.checkpointers import (
    FlatStorageCheckpointer,
    NestedStorageCheckpointer,
)
from torchrl.data.replay_buffers.sample_units import Sequence, Transition
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, RandomSampler

import zarr_rb
from zarr_rb import PickleNotAllowedError, ZarrStorage

N = 48


def rows(n: int = N, start: int = 0) -> TensorDict:
    step = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": step.float().unsqueeze(-1),
            "td_error": (step % 7).float() + 0.5,
            ("next", "done"): (step % 6 == 5).unsqueeze(-1),
        },
        batch_size=[n],
    )


def _collate(batch: Any) -> Any:
    return batch


BUFFERS = {
    "tdprb_sync_false": lambda s: TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, eps=1e-3, storage=s, batch_size=6, sync=False, reduction="mean"
    ),
    # (float64 trees: TorchRL 0.14's own PrioritizedReplayBuffer fails on its first extend)
    "prb": lambda s: PrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, eps=1e-4, storage=s, batch_size=6
    ),
    "prb_sync_false": lambda s: PrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, storage=s, batch_size=6, sync=False
    ),
    "settings": lambda s: TensorDictReplayBuffer(
        storage=s,
        batch_size=6,
        pin_memory=False,
        sample_unit=Sequence(3, episode_boundary="stop", burn_in=1),
        priority_key="td_error",
        dim_extend=0,
    ),
    "prefetch": lambda s: TensorDictReplayBuffer(storage=s, batch_size=6, prefetch=2),
    "transition_consume": lambda s: TensorDictReplayBuffer(
        storage=s, batch_size=4, sample_unit=Transition(), consume_after_n_samples=3
    ),
    "flat_checkpointer": lambda s: TensorDictReplayBuffer(
        storage=s, batch_size=6, checkpointer=FlatStorageCheckpointer(reward_keys=("reward",))
    ),
}


def settings(rb: Any) -> dict[str, Any]:
    """What a user can observe of a buffer's construction."""
    from zarr_rb.state._buffer import buffer_settings

    config, objects = buffer_settings(rb)
    out = {"config": config, "objects": {k: type(v) for k, v in objects.items()}}
    out["sampler"] = type(rb.sampler).__name__
    out["writer"] = type(rb.writer).__name__
    prioritized = getattr(rb, "_prioritized_sampler", None) or rb.sampler
    if isinstance(prioritized, PrioritizedSampler):
        out["prioritized"] = (
            prioritized._alpha,
            prioritized._beta,
            prioritized._eps,
            prioritized.dtype,
            prioritized.reduction,
            prioritized._max_capacity,
        )
    out["checkpointer"] = type(rb.storage.checkpointer).__name__
    return out


def fill(rb: Any) -> None:
    if isinstance(rb, TensorDictReplayBuffer):
        rb.extend(rows())
    else:
        rb.extend(rows()["obs"])
    for seed in range(3):
        torch.manual_seed(seed)
        rb.sample()
    if isinstance(rb, (PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer)):
        rb.update_priority(torch.arange(N), torch.arange(N).float() % 5 + 0.1)


def next_samples(rb: Any) -> list[Any]:
    out = []
    for seed in range(4):
        torch.manual_seed(seed)
        np.random.seed(seed)  # PrioritizedSampler draws from NumPy too
        sample = rb.sample()
        out.append(sample["obs"] if isinstance(sample, TensorDict) else sample)
    return out


@pytest.mark.parametrize("name", list(BUFFERS))
def test_load_rebuilds_an_equal_buffer(tmp_path: Path, name: str) -> None:
    path = tmp_path / "rb.zarr"
    rb = BUFFERS[name](ZarrStorage(N, path))
    fill(rb)
    zarr_rb.save(rb)
    expected_settings = settings(rb)
    expected = next_samples(rb)
    rb.storage.close()

    loaded = zarr_rb.load(path)
    assert type(loaded) is type(rb)
    assert settings(loaded) == expected_settings
    if name != "prefetch":  # prefetched batches are drawn ahead, in other threads
        for got, want in zip(next_samples(loaded), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    loaded.storage.close()


def test_custom_collate_fn_is_code_loaded_only_on_request(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(N, path), batch_size=4, collate_fn=_collate)
    rb.extend(rows())
    zarr_rb.save(rb)
    rb.storage.close()
    with pytest.raises(PickleNotAllowedError, match=r"collate_fn \(.*_collate\).*collate_fn="):
        zarr_rb.load(path)
    for loaded in (
        zarr_rb.load(path, allow_pickle=True),
        zarr_rb.load(path, collate_fn=_collate),
    ):
        assert loaded._collate_fn is _collate
        loaded.storage.close()


def test_nested_checkpointer_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(N, path)
    rb = TensorDictReplayBuffer(storage=storage, checkpointer=NestedStorageCheckpointer())
    rb.extend(rows())
    zarr_rb.save(rb)
    storage.close()
    loaded = zarr_rb.load(path)
    assert type(loaded.storage.checkpointer) is NestedStorageCheckpointer
    loaded.storage.close()


def saved_then_extended(path: Path, *, extends: int) -> TensorDictReplayBuffer:
    """A writer that saved after N rows, then went on for ``extends`` times N more."""
    writer = TensorDictReplayBuffer(storage=ZarrStorage(4 * N, path), batch_size=8)
    writer.extend(rows())
    zarr_rb.save(writer)
    for i in range(extends):
        writer.extend(rows(start=(i + 1) * N))
    writer.storage.flush()
    return writer


def test_read_only_load_stays_at_its_save_until_refresh(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    writer = TensorDictReplayBuffer(storage=ZarrStorage(4 * N, path), batch_size=8)
    writer.extend(rows())
    zarr_rb.save(writer)
    reader = zarr_rb.load(path, read_only=True)
    writer.extend(rows(start=N))
    writer.extend(rows(start=2 * N))
    writer.storage.flush()
    for _ in range(5):
        sample = reader.sample()
        assert len(reader) == N
        assert int(sample["obs"].max()) < N
    assert reader.storage.cursor == N
    reader.storage.refresh()
    assert len(reader) == 3 * N
    reader.storage.close()
    writer.storage.close()


def test_export_writes_the_saved_length_and_cursor(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    writer = saved_then_extended(path, extends=1)  # the rows after the save: not exported
    zarr_rb.export_torchrl(path, tmp_path / "dump", progress=False)
    from torchrl.data import LazyMemmapStorage

    torchrl = TensorDictReplayBuffer(storage=LazyMemmapStorage(4 * N), batch_size=8)
    torchrl.loads(tmp_path / "dump")
    assert len(torchrl) == N
    assert torchrl.writer._cursor == N
    torch.testing.assert_close(torchrl.storage[:]["obs"], rows()["obs"])
    writer.storage.close()


def test_save_then_load_in_the_same_process(tmp_path: Path) -> None:
    """The README's flow: the loaded buffer shares the saved one's store."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=ZarrStorage(N, path), batch_size=8
    )
    rb.extend(rows())
    zarr_rb.save(rb)
    expected = next_samples(rb)
    rb = zarr_rb.load(path)
    for got, want in zip(next_samples(rb), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rb.extend(rows(8, start=N))
    assert len(rb) == N
    rb.storage.close()


def test_a_failing_constructor_releases_the_store(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "rb.zarr"
    ZarrStorage(N, path).close()
    with pytest.raises(RuntimeError, match="device"):
        ZarrStorage(N, path, device="no-such-device")  # refused before the store opens

    def failing_init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("TensorStorage.__init__ failed")

    from torchrl.data.replay_buffers.storages import TensorStorage

    monkeypatch.setattr(TensorStorage, "__init__", failing_init)
    with pytest.raises(RuntimeError, match=r"TensorStorage\.__init__ failed"):
        ZarrStorage(N, path)
    monkeypatch.undo()
    # The writer lock is free again: another process takes the store.
    code = f"from zarr_rb import ZarrStorage; ZarrStorage({N}, {str(path)!r}).close()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_random_sampler_buffer_round_trip_of_non_tensordict_class(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = ReplayBuffer(storage=ZarrStorage(N, path), sampler=RandomSampler(), batch_size=5)
    rb.extend(torch.arange(N).float())
    zarr_rb.save(rb)
    rb.storage.close()
    loaded = zarr_rb.load(path)
    assert type(loaded) is ReplayBuffer
    assert len(loaded) == N
    loaded.storage.close()
