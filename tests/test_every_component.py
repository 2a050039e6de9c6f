"""Every sampler, writer and buffer class the installed TorchRL exports from ``torchrl.data``
and ``torchrl.data.replay_buffers`` is either saved by ``zarr_rb.save`` (a buffer built with
it loads with the same rows and the same next seeded samples) or refused by name, with a
typed error that says why. A class a TorchRL release adds fails here until it is one or the
other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchrl.data
import torchrl.data.replay_buffers
from conftest import assert_identical
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers import samplers as S  # noqa: N812
from torchrl.data.replay_buffers import writers as W  # noqa: N812
from torchrl.data.replay_buffers.her import HERReplayBuffer
from torchrl.data.replay_buffers.offline_to_online import OfflineToOnlineReplayBuffer

import zarr_rb
from zarr_rb import UnsupportedDataError, ZarrStorage
from zarr_rb.state import PickleNotAllowedError
from zarr_rb.state._buffer import BUFFER_CLASSES, buffer_settings
from zarr_rb.state._buffer import REFUSED as REFUSED_BUFFERS
from zarr_rb.state._components import ADAPTERS, REFUSED, adapter_for

ROWS = 64


def exported() -> dict[str, type]:
    """The sampler, writer and buffer classes TorchRL exports, by name."""
    names = set(torchrl.data.__all__) | set(torchrl.data.replay_buffers.__all__)
    out = {}
    for name in sorted(names):
        cls = getattr(torchrl.data, name, None) or getattr(torchrl.data.replay_buffers, name)
        if isinstance(cls, type) and (
            issubclass(cls, (S.Sampler, W.Writer, ReplayBuffer))
            or cls is OfflineToOnlineReplayBuffer
        ):
            out[name] = cls
    return out


def reward(td: TensorDict) -> torch.Tensor:
    """A goal-conditioned reward (a module-level function: it pickles)."""
    return -(td["desired_goal"] - td["achieved_goal"]).norm(dim=-1, keepdim=True)


def rows(start: int, n: int) -> TensorDict:
    """Episodes of eight steps, with everything the samplers and buffers below read."""
    step = torch.arange(start, start + n)
    done = (step % 8 == 7)[:, None]
    return TensorDict(
        {
            "obs": step[:, None].float().expand(n, 3).clone(),
            "episode": step // 8,
            "step_count": step % 8,
            "policy_version": step // 16,
            "desired_goal": torch.stack([step.float(), -step.float()], 1),
            "achieved_goal": torch.stack([step.float() / 2, step.float()], 1),
            "priority": step.float(),
            "next": {"done": done, "truncated": torch.zeros_like(done), "reward": step[:, None]},
        },
        [n],
    )


def slices(**kwargs: Any) -> dict[str, Any]:
    return {"traj_key": "episode", "slice_len": 4, **kwargs}


SAMPLERS: dict[str, Callable[[], Any]] = {
    "RandomSampler": S.RandomSampler,
    "ConsumingSampler": S.ConsumingSampler,
    "SamplerWithoutReplacement": S.SamplerWithoutReplacement,
    "SliceSampler": lambda: S.SliceSampler(**slices()),
    "SliceSamplerWithoutReplacement": lambda: S.SliceSamplerWithoutReplacement(**slices()),
    "PrioritizedSampler": lambda: S.PrioritizedSampler(ROWS, alpha=0.7, beta=0.5),
    "PrioritizedSliceSampler": lambda: S.PrioritizedSliceSampler(
        ROWS, alpha=0.7, beta=0.5, **slices()
    ),
    "PromptGroupSampler": lambda: S.PromptGroupSampler(group_key="episode", num_groups=2),
    "StalenessAwareSampler": lambda: S.StalenessAwareSampler(max_staleness=4),
    "StreamingSliceSampler": lambda: S.StreamingSliceSampler(**slices()),
}
WRITERS: dict[str, Callable[[], Any]] = {
    "RoundRobinWriter": W.RoundRobinWriter,
    "TensorDictRoundRobinWriter": W.TensorDictRoundRobinWriter,
    "TensorDictMaxValueWriter": lambda: W.TensorDictMaxValueWriter(rank_key="priority"),
    "ImmutableDatasetWriter": W.ImmutableDatasetWriter,
}


def build(name: str, storage: Any) -> Any:
    """A buffer on ``storage`` that holds the class ``name`` (a buffer class, or a sampler
    or writer of a TensorDictReplayBuffer)."""
    if name in SAMPLERS:
        return TensorDictReplayBuffer(storage=storage, sampler=SAMPLERS[name](), batch_size=8)
    if name in WRITERS:
        return TensorDictReplayBuffer(storage=storage, writer=WRITERS[name](), batch_size=8)
    cls = BUFFER_CLASSES[name]
    if name == "HERReplayBuffer":
        return cls(reward, storage=storage, batch_size=8, her_ratio=0.5, strategy="future")
    if "Prioritized" in name:
        return cls(alpha=0.7, beta=0.5, storage=storage, batch_size=8)
    return cls(storage=storage, batch_size=8)


def fill(rb: Any, name: str) -> None:
    if name == "ImmutableDatasetWriter":
        rb.storage.set(torch.arange(ROWS - 8), rows(0, ROWS - 8))  # a dataset, written once
        return
    for start in range(0, ROWS + 16, 24):  # the ring comes around
        rb.extend(rows(start, 24))
    if name == "StalenessAwareSampler":  # rows of policy versions 0-4, 1-5 versions old
        for _ in range(5):
            rb.sampler.increment_consumer_version()
    rb.set_rng(torch.Generator().manual_seed(0))
    for _ in range(2):  # the sampler's state moves (a permutation, queued slices, ...)
        rb.sample()


def next_samples(rb: Any, seed: int) -> list[Any]:
    """Three samples, with their info (indices, weights), from seeded generators: the
    buffer's (samplers draw from it) and torch's (HER relabels with it)."""
    rb.set_rng(torch.Generator().manual_seed(seed))
    out = []
    for i in range(3):
        torch.manual_seed(seed + i)
        out.append(rb.sample(return_info=True))
    return out


SUPPORTED = sorted({*ADAPTERS, *BUFFER_CLASSES} & set(exported()))


def _saved_settings(obj: Any, *, component: bool) -> Any:
    """What zarr_rb.save reads first of a sampler or writer, or of a buffer."""
    return adapter_for(obj, role="sampler") if component else buffer_settings(obj)


def test_every_exported_class_is_saved_or_refused_by_name() -> None:
    for name, cls in exported().items():
        if name in ADAPTERS or name in BUFFER_CLASSES:
            assert name in SAMPLERS or name in WRITERS or name in BUFFER_CLASSES, name
            continue
        # The refusal goes by the class's name, before any attribute is read (some of
        # these classes are abstract, or need a Ray cluster to be built).
        instance = type(name, (), {"__module__": cls.__module__})()
        reason = REFUSED.get(name) or REFUSED_BUFFERS.get(name)
        assert reason is not None, f"TorchRL's {name} is neither saved nor refused by name"
        component = issubclass(cls, (S.Sampler, W.Writer))
        with pytest.raises(UnsupportedDataError) as caught:
            _saved_settings(instance, component=component)
        assert name in str(caught.value)
        assert reason in str(caught.value)


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_buffer_with_each_class_loads_with_the_same_rows_and_next_samples(
    name: str, tmp_path: Path
) -> None:
    path = tmp_path / "rb.zarr"
    rb = build(name, ZarrStorage(ROWS, path))
    fill(rb, name)
    zarr_rb.save(rb)
    loaded = zarr_rb.load(path, reward_fn=reward)
    try:
        assert type(loaded) is type(rb)
        assert type(loaded.sampler) is type(rb.sampler)
        assert type(loaded.writer) is type(rb.writer)
        assert len(loaded) == len(rb)
        assert_identical(loaded[:], rb[:])
        for (ours, info), (theirs, their_info) in zip(
            next_samples(loaded, 7), next_samples(rb, 7), strict=True
        ):
            assert_identical(ours, theirs)
            assert str(info) == str(their_info)  # indices, priority weights
    finally:
        loaded.storage.close()
        rb.storage.close()


def test_a_her_buffer_needs_its_reward_function_or_leave_to_unpickle(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = build("HERReplayBuffer", ZarrStorage(ROWS, path))
    fill(rb, "HERReplayBuffer")
    zarr_rb.save(rb)
    rb.storage.close()
    with pytest.raises(PickleNotAllowedError, match="reward_fn"):
        zarr_rb.load(path)
    loaded = zarr_rb.load(path, allow_pickle=True)
    assert loaded.reward_fn is reward
    loaded.storage.close()


def test_a_staleness_weight_of_its_own_is_refused_by_name(tmp_path: Path) -> None:
    sampler = S.StalenessAwareSampler(staleness_weight_fn=lambda staleness: 1 / (1 + staleness))
    rb = TensorDictReplayBuffer(storage=ZarrStorage(ROWS, tmp_path / "rb.zarr"), sampler=sampler)
    rb.extend(rows(0, 8))
    with pytest.raises(UnsupportedDataError, match=r"StalenessAwareSampler.*staleness_weight_fn"):
        zarr_rb.save(rb)
    rb.storage.close()


def test_a_her_buffer_with_a_lambda_saves_and_loads_with_its_function_given(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(ROWS, path)
    rb = HERReplayBuffer(lambda td: -td["achieved_goal"][..., :1], storage=storage, batch_size=8)
    fill(rb, "HERReplayBuffer")
    zarr_rb.save(rb)  # was a PicklingError: a lambda cannot be pickled
    storage.close()
    with pytest.raises(PickleNotAllowedError, match=r"could not be pickled.*reward_fn=\.\.\."):
        zarr_rb.load(path, allow_pickle=True)
    loaded = zarr_rb.load(path, reward_fn=reward)
    assert loaded.reward_fn is reward
    loaded.storage.close()


@pytest.mark.parametrize("refused", ["ReplayBufferEnsemble", "OfflineToOnlineReplayBuffer"])
def test_zarr_rb_save_of_a_buffer_refused_by_name_says_why(refused: str) -> None:
    cls = exported()[refused]
    instance = cls.__new__(cls)  # the class is checked before any attribute is read
    with pytest.raises(UnsupportedDataError, match=REFUSED_BUFFERS[refused][:40]):
        zarr_rb.save(instance)


def test_a_staleness_sampler_with_its_default_settings_loads(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(ROWS, path), sampler=S.StalenessAwareSampler(), batch_size=4
    )
    rb.extend(rows(0, 8))
    zarr_rb.save(rb)  # max_staleness=-1 ("no limit") was saved, then refused at the load
    rb.storage.close()
    loaded = zarr_rb.load(path)
    assert loaded.sampler.max_staleness == -1
    loaded.storage.close()


def test_a_setting_a_load_would_refuse_is_refused_at_the_save(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    sampler = S.StalenessAwareSampler(max_staleness=2**40)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(ROWS, path), sampler=sampler, batch_size=4)
    rb.extend(rows(0, 8))
    with pytest.raises(UnsupportedDataError, match="sampler setting 1099511627776"):
        zarr_rb.save(rb)
    rb.storage.close()
