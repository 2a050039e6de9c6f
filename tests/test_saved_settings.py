"""zarr_rb.load rebuilds an equal buffer: every constructor setting of TorchRL's buffers, every
buffer class (sync=False prioritized buffers included), and the same next samples."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchrl
from sample_runner import python_c
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
from zarr_rb.errors import TorchRLVersionError, UnsupportedDataError

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
    """The documented flow: the loaded buffer shares the saved one's store."""
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
    done = python_c(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


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


# --- every constructor argument of every class zarr_rb saves ---------------------------------

# Non-default values for every constructor argument that takes a JSON value, per class that
# zarr_rb saves (several cases where TorchRL makes arguments exclusive: num_slices and
# slice_len, end_key and end_keys, fragmented and span or compile). Arguments zarr_rb leaves
# out are named in zarr_rb.state._arguments.EXCLUDED, with the reason.
_KEYS = {
    "truncated_key": ("next", "trunc"),
    "init_key": "init",
    "strict_length": False,
    "use_gpu": "cpu",
}
_PRIORITY = {
    "max_capacity": N,
    "alpha": 0.6,
    "beta": 0.4,
    "eps": 1e-3,
    "reduction": "mean",
    "max_priority_within_buffer": True,
}
_ENDS = {"num_slices": 2, "end_keys": [("next", "done"), ("next", "trunc")], "compile": True}
_BUFFER = {"batch_size": 6, "dim_extend": 0, "sample_unit": Transition()}
_PREFETCH = {"batch_size": 6, "prefetch": 2, "sample_unit": Sequence(3, "stop", burn_in=1)}
_PIN = {"batch_size": 6, "pin_memory": True}
CASES: dict[str, list[dict[str, Any]]] = {
    "RandomSampler": [{}],
    "ConsumingSampler": [{"max_sample_count": 3}],
    "SamplerWithoutReplacement": [{"drop_last": True, "shuffle": False}],
    "SliceSampler": [
        {
            "slice_len": 4,
            "traj_key": "frag_episode",
            "step_key": "frag_t",
            "fragmented": True,
            "cache_values": True,
            "pad_output": True,
            **_KEYS,
        },
        {**_ENDS, "span": (1, 2)},
        {"slice_len": 4, "end_key": ("next", "trunc")},
    ],
    "SliceSamplerWithoutReplacement": [
        {"slice_len": 4, "traj_key": "episode", "drop_last": True, "shuffle": False, **_KEYS},
        _ENDS,
        {"slice_len": 4, "end_key": ("next", "trunc")},
    ],
    "PrioritizedSampler": [
        {**_PRIORITY, "device": "cpu"},
        {"max_capacity": N, "alpha": 0.6, "beta": 0.4, "dtype": torch.float64},
    ],
    "PrioritizedSliceSampler": [
        {
            **_PRIORITY,
            "slice_len": 4,
            "traj_key": "episode",
            "cache_values": True,
            "span": (0, 1),
            **{k: v for k, v in _KEYS.items() if k != "use_gpu"},
        },
        {"max_capacity": N, "alpha": 0.6, "beta": 0.4, **_ENDS},
        {
            "max_capacity": N,
            "alpha": 0.6,
            "beta": 0.4,
            "slice_len": 4,
            "end_key": ("next", "trunc"),
        },
        {"max_capacity": N, "alpha": 0.6, "beta": 0.4, "slice_len": 4, "dtype": torch.float64},
    ],
    "PromptGroupSampler": [
        {
            "num_groups": 2,
            "group_key": "prompt",
            "strategy": "recency",
            "reward_key": "r",
            "cache_groups": False,
        },
        {"samples_per_group": 4, "group_key": "prompt", "strategy": "reward", "reward_key": "r"},
    ],
    "StalenessAwareSampler": [{"max_staleness": 3, "version_key": "version"}],
    "StreamingSliceSampler": [
        {"slice_len": 4, "traj_key": "episode", "cache_values": True, "pad_output": True, **_KEYS},
        {"slice_len": 4, "end_keys": [("next", "done"), ("next", "trunc")], "span": (1, 2)},
        {"slice_len": 4, "end_key": ("next", "trunc"), "compile": True},
    ],
    "ImmutableDatasetWriter": [{"compilable": True}],
    "RoundRobinWriter": [{"compilable": True, "track_generations": True}],
    "TensorDictRoundRobinWriter": [{"compilable": True, "track_generations": True}],
    "TensorDictMaxValueWriter": [{"rank_key": "score", "reduction": "max", "compilable": True}],
    "ReplayBuffer": [
        {**_BUFFER, "consume_after_n_samples": 3, "shared": True},
        _PREFETCH,
        _PIN,
    ],
    "TensorDictReplayBuffer": [
        {**_BUFFER, "priority_key": "prio", "consume_after_n_samples": 3, "shared": True},
        _PREFETCH,
        _PIN,
    ],
    "PrioritizedReplayBuffer": [
        {"alpha": 0.6, "beta": 0.4, "sync": False, **_BUFFER},
        {"alpha": 0.6, "beta": 0.4, **_PREFETCH},
        {"alpha": 0.6, "beta": 0.4, **_PIN},
    ],
    "HERReplayBuffer": [
        {
            "her_ratio": 0.5,
            "strategy": "final",
            "goal_key": "goal",
            "achieved_goal_key": "achieved",
            "reward_key": "her_r",
            "end_key": ("next", "trunc"),
            "priority_key": "prio",
            "consume_after_n_samples": 3,
            "shared": True,
            **_BUFFER,
        },
        {"strategy": "episode", **_PREFETCH},
        {"strategy": "random", **_PIN},
    ],
    "TensorDictPrioritizedReplayBuffer": [
        {
            "alpha": 0.6,
            "beta": 0.4,
            "priority_key": "prio",
            "sync": False,
            "shared": True,
            "batch_size": 6,
        },
        {"alpha": 0.6, "beta": 0.4, **_BUFFER},
        {"alpha": 0.6, "beta": 0.4, **_PREFETCH},
        {"alpha": 0.6, "beta": 0.4, **_PIN},
    ],
}
CASE_IDS = [(name, i) for name, cases in CASES.items() for i in range(len(cases))]
REFUSED_VALUES = {
    "StalenessAwareSampler": {
        "staleness_weight_fn": "a function of its own is code, which a save refuses by name "
        "(tests/test_every_component.py); TorchRL's default is saved as None",
    },
}
"""Arguments saved at their default only: any other value is refused at the save."""


def _supported() -> dict[str, type]:
    from zarr_rb.state._buffer import BUFFER_CLASSES
    from zarr_rb.state._components import ADAPTERS

    return {**{name: a.cls for name, a in ADAPTERS.items()}, **BUFFER_CLASSES}


def _signature(cls: type) -> dict[str, inspect.Parameter]:
    """What ``cls(...)`` takes: its ``__init__``'s parameters, and those of the parents its
    ``**kwargs`` go to."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__[:-1]:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        for p in parameters:
            # Ray adds _ray_trace_ctx to classes it makes actors of (once test_ray ran).
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and not p.name.startswith("_ray_"):
                out.setdefault(p.name, p)
        if all(p.kind is not p.VAR_KEYWORD for p in parameters):
            break
    return out


def test_every_constructor_argument_is_saved_or_excluded_with_a_reason() -> None:
    """Fails when the installed TorchRL adds an argument to a class zarr_rb saves: add a
    non-default value for it to CASES (then the round trip below checks it is saved), or
    exclude it by name in zarr_rb.state._arguments.EXCLUDED, saying why."""
    from zarr_rb.state._arguments import EXCLUDED

    supported = _supported()
    assert set(CASES) == set(supported), "every class zarr_rb saves has cases here"
    signatures = {name: _signature(cls) for name, cls in supported.items()}
    problems = []
    for name, signature in signatures.items():
        excluded = EXCLUDED.get(name, {})
        covered = {arg for case in CASES[name] for arg in case} | set(REFUSED_VALUES.get(name, {}))
        problems += [
            f"{name}({a}): excluded without a reason" for a, r in excluded.items() if not r
        ]
        problems += [
            f"{name}({a}): neither saved here with a non-default value nor excluded"
            for a in signature
            if a not in covered and a not in excluded
        ]
        for case in CASES[name]:
            problems += [
                f"{name}({a}={v!r}): the default, or no argument of TorchRL {torchrl.__version__}"
                for a, v in case.items()
                if a not in signature or (a not in excluded and v == signature[a].default)
            ]
    for name, excluded in EXCLUDED.items():
        problems += [
            f"{name}({a}): excluded, but no class excluding it takes it"
            for a in excluded
            if not any(
                a in signatures[n] for n, e in EXCLUDED.items() if e.get(a) and n in signatures
            )
        ]
    assert not problems, "\n".join(problems)


def episodes(case: dict[str, Any]) -> TensorDict:
    """Rows of 8-step episodes with the keys ``case`` names (each key costs a few hundred
    files); ``frag_*`` are six episodes whose steps interleave (for ``fragmented=True``)."""
    step = torch.arange(N)
    t = step % 8
    rows = TensorDict(
        {
            "obs": step.float().unsqueeze(-1),
            "episode": step // 8,
            "frag_episode": step % 6,
            "frag_t": step // 6,
            ("next", "done"): (t == 7).unsqueeze(-1),
            ("next", "trunc"): (step % 12 == 11).unsqueeze(-1),
            "init": (t == 0).unsqueeze(-1),
            "score": (step * 7 % 11).float(),
            "prompt": step % 6,
            "r": (step % 5).float(),
            "td_error": (step % 7).float() + 0.5,
            "prio": (step % 3).float() + 0.5,
            "version": torch.zeros(N, dtype=torch.long),  # policy versions, all current
            "her_r": torch.zeros(N, 1),
            "goal": torch.stack([step.float(), -step.float()], 1),
            "achieved": torch.stack([step.float() / 2, step.float()], 1),
        },
        batch_size=[N],
    )
    keys = set(rows.keys())
    named = [v for v in case.values() if isinstance(v, str) and v in keys]
    return rows.select("obs", "episode", ("next", "done"), ("next", "trunc"), *named)


def her_reward(td: TensorDict) -> torch.Tensor:
    """A ``HERReplayBuffer``'s reward for the goals of :func:`episodes`."""
    goal = td.get("goal", default=None)
    if goal is None:
        return torch.zeros(td.shape[0], 1)
    return -(goal - td["achieved"]).norm(dim=-1, keepdim=True)


def host(name: str, case: dict[str, Any], storage: ZarrStorage) -> Any:
    """A buffer on ``storage`` built with ``case``: the buffer itself, or a buffer around
    the sampler or writer."""
    cls = _supported()[name]
    if name == "HERReplayBuffer":
        return cls(her_reward, storage=storage, **case)
    if issubclass(cls, ReplayBuffer):
        return cls(storage=storage, **case)
    component = cls(**case)
    if name == "RoundRobinWriter":
        return ReplayBuffer(storage=storage, writer=component, batch_size=8)
    if name.endswith("Writer"):
        return TensorDictReplayBuffer(storage=storage, writer=component, batch_size=8)
    return TensorDictReplayBuffer(storage=storage, sampler=component, batch_size=8)


# Attributes TorchRL recomputes before it uses them (at each sample, or from the rows), or
# sets to its default: not saved.
RECOMPUTED = {
    "_remaining_batches",  # at each sample (it bounds how far prefetch draws ahead)
    "_storage_len_buffer",  # at each sample
    "_fragmented_index",  # from the rows, at the first sample
    "_group_index",  # from the rows, at the first sample
    "_row_rewards",
    "_index_len",
    "_cache_storage_id",
    "_rng",  # None when no generator was set (the class attribute, or set to None)
    "_keys_validated",  # HERReplayBuffer: its keys, checked at the first sample
    "_last_cache_key",  # HERReplayBuffer: its episode ends, found again from the rows
    "_episode_ends_cache",
}


def _plain(value: Any) -> Any:
    """``value`` as plain data (one-element tensors as numbers), or ``None`` if it is not
    plain (a tensor, a function, an object)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        ok = all(p is not None or v is None for p, v in zip(items, value, strict=True))
        return tuple(items) if ok else None
    if isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return None


def attributes(obj: Any) -> dict[str, Any]:
    """The plain attributes of an object (its settings and scalar state), read as TorchRL
    reads them (through its properties)."""
    values = {k: getattr(obj, k) for k in vars(obj) if k not in RECOMPUTED}
    return {k: _plain(v) for k, v in values.items() if v is None or _plain(v) is not None}


def _limits(name: str, case: dict[str, Any]) -> tuple[bool, bool]:
    """Whether rows can be written, and samples compared, with ``case`` here: TorchRL
    0.14's float64 priority trees refuse the float32 default priority of every write;
    an immutable dataset's writer refuses every write; pinning memory needs CUDA;
    prefetched batches are drawn ahead, in other threads."""
    rows = case.get("dtype") != torch.float64 and name != "ImmutableDatasetWriter"
    samples = rows and not case.get("prefetch")
    return rows, samples and (not case.get("pin_memory") or torch.cuda.is_available())


def components(rb: Any) -> dict[str, Any]:
    out = {"buffer": rb, "sampler": rb.sampler, "writer": rb.writer}
    if getattr(rb, "_prioritized_sampler", None) is not None:
        out["prioritized_sampler"] = rb._prioritized_sampler
    return out


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=True`` samplers compile with dynamo's eager backend: the same code path,
    without the half minute inductor takes here."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


@pytest.mark.usefixtures("eager_compile")
@pytest.mark.parametrize(("name", "index"), CASE_IDS, ids=[f"{n}-{i}" for n, i in CASE_IDS])
def test_every_argument_comes_back(tmp_path: Path, name: str, index: int) -> None:
    """Each case, saved and loaded: the saved arguments are the class's (all but the
    excluded ones), every plain attribute of the buffer and its components is the same, and
    the next seeded samples are the same."""
    from zarr_rb.state._arguments import EXCLUDED

    case = CASES[name][index]
    path = tmp_path / "rb.zarr"
    rb = host(name, case, ZarrStorage(N, path))
    rows, samples = _limits(name, case)
    if rows:
        rb.extend(episodes(case))
        if samples:
            for seed in range(2):
                torch.manual_seed(seed)
                rb.sample()
        if isinstance(rb.sampler, PrioritizedSampler):
            rb.update_priority(torch.arange(N), torch.arange(N).float() % 5 + 0.1)
    zarr_rb.save(rb)
    expected = {role: attributes(obj) for role, obj in components(rb).items()}
    expected_samples = next_samples(rb) if samples else None
    rb.storage.close()

    state = saved_state(path)
    role = "buffer" if issubclass(_supported()[name], ReplayBuffer) else None
    role = role or ("writer" if name.endswith("Writer") else "sampler")
    config = state["buffer"]["arguments"] if role == "buffer" else state["children"][role]["config"]
    assert set(config) == set(_signature(_supported()[name])) - set(EXCLUDED.get(name, {}))

    loaded = zarr_rb.load(path, reward_fn=her_reward)
    assert type(loaded) is type(rb)
    for role, obj in components(loaded).items():
        assert attributes(obj) == expected[role], role
    if expected_samples is not None:
        for got, want in zip(next_samples(loaded), expected_samples, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    loaded.storage.close()


def saved_state(path: Path) -> dict[str, Any]:
    """The buffer state record of the store's last save, as saved (JSON)."""
    import json

    root = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    group = path / "state" / str(root["saved"]["slot"]) / "zarr.json"
    state: dict[str, Any] = json.loads(group.read_text())["attributes"]["zarr_rb_state"]
    return state


# --- the TorchRL release a buffer was saved with ----------------------------------------------


def _saved_store(path: Path) -> None:
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(N, path), sampler=PrioritizedSampler(N, 0.7, 0.5), batch_size=4
    )
    rb.extend(rows())
    zarr_rb.save(rb)
    rb.storage.close()


def _edit_saved_state(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the saved state record (JSON) of the store's last save."""
    import json

    root = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    group = path / "state" / str(root["saved"]["slot"]) / "zarr.json"
    document = json.loads(group.read_text())
    edit(document["attributes"]["zarr_rb_state"])
    group.write_text(json.dumps(document))


def test_a_save_records_the_torchrl_and_zarr_rb_versions(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    _saved_store(path)
    assert saved_state(path)["versions"] == {
        "torchrl": torchrl.__version__,
        "zarr_rb": zarr_rb.__version__,
    }


def _newer(state: dict[str, Any]) -> None:
    state["versions"]["torchrl"] = "99.0"


@pytest.mark.parametrize(
    ("edit", "component", "argument"),
    [
        (
            lambda s: s["children"]["sampler"]["config"].update(future_setting=1),
            "PrioritizedSampler",
            "future_setting",
        ),
        (
            lambda s: s["buffer"]["arguments"].update(future_setting=True),
            "TensorDictReplayBuffer",
            "future_setting",
        ),
        (
            lambda s: s["children"]["sampler"].update({"class": "FutureSampler"}),
            "FutureSampler",
            None,
        ),
        (lambda s: s["children"]["writer"].update({"class": "FutureWriter"}), "FutureWriter", None),
        (lambda s: s["buffer"].update({"class": "FutureReplayBuffer"}), "FutureReplayBuffer", None),
    ],
    ids=["sampler-argument", "buffer-argument", "sampler-class", "writer-class", "buffer-class"],
)
def test_a_newer_torchrl_s_argument_or_class_is_a_typed_error_naming_both_versions(
    tmp_path: Path, edit: Any, component: str, argument: str | None
) -> None:
    path = tmp_path / "rb.zarr"
    _saved_store(path)
    _edit_saved_state(path, lambda s: (_newer(s), edit(s)))
    with pytest.raises(TorchRLVersionError) as caught:
        zarr_rb.load(path)
    err = caught.value
    assert (err.component, err.argument) == (component, argument)
    assert (err.saved_version, err.installed_version) == ("99.0", torchrl.__version__)
    for word in (component, argument or component, "99.0", torchrl.__version__):
        assert word in str(err)


def test_an_argument_that_cannot_be_read_back_fails_the_save_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TorchRL release that adds an argument its class does not keep under its name: the
    save refuses, naming it, instead of dropping the setting."""
    from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement

    init = SamplerWithoutReplacement.__init__

    def newer(
        self: Any, drop_last: bool = False, shuffle: bool = True, future_setting: int = 0
    ) -> None:
        init(self, drop_last=drop_last, shuffle=shuffle)

    monkeypatch.setattr(SamplerWithoutReplacement, "__init__", newer)
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(N, path), sampler=SamplerWithoutReplacement(), batch_size=4
    )
    rb.extend(rows())
    with pytest.raises(UnsupportedDataError, match=r"SamplerWithoutReplacement.*'future_setting'"):
        zarr_rb.save(rb)
    rb.storage.close()
    with pytest.raises(zarr_rb.NoSavedBufferError):
        zarr_rb.load(path)
