"""One small adapter per TorchRL sampler and writer: its constructor settings as JSON,
its state as arrays, and how to rebuild it.

Adapters are looked up by exact class: a subclass may add state its parent's adapter
would silently drop, so an unknown class is an error that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torchrl.data.replay_buffers import samplers as S  # noqa: N812
from torchrl.data.replay_buffers import writers as W  # noqa: N812

from zarr_rb import _compat as compat
from zarr_rb.errors import UnsupportedDataError
from zarr_rb.state._node import StateNode

Config = dict[str, Any]


def key_to_json(key: Any) -> Any:
    if key is None or isinstance(key, str):
        return key
    return list(key)


def key_from_json(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How to save, rebuild and restore one component class."""

    cls: type
    config: Callable[[Any], Config]
    build: Callable[[Config], Any]
    save: Callable[[Any, StateNode], None]
    load: Callable[[Any, StateNode], None]

    @property
    def name(self) -> str:
        return self.cls.__name__


def _nothing(obj: Any, node: StateNode) -> None:
    return None


# --- samplers --------------------------------------------------------------------------------


def _without_replacement_config(obj: Any) -> Config:
    return {"drop_last": bool(obj.drop_last), "shuffle": bool(obj.shuffle)}


def _without_replacement_save(obj: Any, node: StateNode) -> None:
    node.attrs["len_storage"] = int(obj.len_storage)
    node.attrs["ran_out"] = bool(compat.get(obj, "_ran_out"))
    node.attrs["has_sample_list"] = compat.get(obj, "_sample_list") is not None
    if compat.get(obj, "_sample_list") is not None:
        node.put_tensor("sample_list", compat.get(obj, "_sample_list"))


def _without_replacement_load(obj: Any, node: StateNode) -> None:
    obj.len_storage = int(node.attrs["len_storage"])
    compat.put(obj, "_ran_out", bool(node.attrs["ran_out"]))
    compat.put(
        obj,
        "_sample_list",
        node.get_tensor("sample_list") if node.attrs["has_sample_list"] else None,
    )


_SLICE_FIELDS = (
    "num_slices",
    "slice_len",
    "cache_values",
    "strict_length",
)
_SLICE_KEYS = ("end_key", "traj_key", "truncated_key", "init_key")


def _slice_config(obj: Any) -> Config:
    config: Config = {name: getattr(obj, name) for name in _SLICE_FIELDS}
    config.update({name: key_to_json(getattr(obj, name, None)) for name in _SLICE_KEYS})
    config["span"] = list(obj.span)
    if getattr(obj, "end_keys", None) is not None:
        config["end_keys"] = [key_to_json(k) for k in obj.end_keys]
    return config


def _slice_kwargs(config: Config) -> dict[str, Any]:
    kwargs = {name: config[name] for name in _SLICE_FIELDS}
    kwargs.update({name: key_from_json(config[name]) for name in _SLICE_KEYS})
    if config.get("end_keys") is not None:
        kwargs["end_keys"] = [key_from_json(k) for k in config["end_keys"]]
        kwargs["end_key"] = None
    return kwargs


def _slice_save(obj: Any, node: StateNode) -> None:
    node.attrs["fetch_traj"] = bool(compat.get(obj, "_fetch_traj"))
    node.attrs["traj_key_auto"] = bool(getattr(obj, "_traj_key_auto", False))
    cache = node.child("cache")
    entries = {}
    for name, value in compat.get(obj, "_cache").items():
        parts = value if isinstance(value, (tuple, list)) else (value,)
        if not all(isinstance(p, torch.Tensor) for p in parts):
            continue  # derived values TorchRL recomputes from the storage
        entries[name] = {"tuple": isinstance(value, (tuple, list)), "n": len(parts)}
        for i, part in enumerate(parts):
            cache.put_tensor(f"{_safe(name)}-{i}", part)
    cache.attrs["entries"] = entries


def _slice_load(obj: Any, node: StateNode) -> None:
    compat.put(obj, "_fetch_traj", bool(node.attrs["fetch_traj"]))
    compat.put(obj, "_traj_key_auto", bool(node.attrs["traj_key_auto"]))
    cache = node.child("cache")
    compat.put(obj, "_cache", {})
    for name, spec in cache.attrs.get("entries", {}).items():
        parts = [cache.get_tensor(f"{_safe(name)}-{i}") for i in range(spec["n"])]
        compat.get(obj, "_cache")[name] = tuple(parts) if spec["tuple"] else parts[0]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _prioritized_config(obj: Any) -> Config:
    return {
        "max_capacity": int(compat.get(obj, "_max_capacity")),
        "alpha": float(compat.get(obj, "_alpha")),
        "beta": float(compat.get(obj, "_beta")),
        "eps": float(compat.get(obj, "_eps")),
        "dtype": str(obj.dtype).removeprefix("torch."),
        "reduction": obj.reduction,
        "max_priority_within_buffer": bool(compat.get(obj, "_max_priority_within_buffer")),
    }


_PRIORITIZED_FIELDS = (
    "max_capacity",
    "alpha",
    "beta",
    "eps",
    "dtype",
    "reduction",
    "max_priority_within_buffer",
)


def _prioritized_kwargs(config: Config) -> dict[str, Any]:
    kwargs = {name: config[name] for name in _PRIORITIZED_FIELDS}
    kwargs["dtype"] = getattr(torch, config["dtype"])
    return kwargs


def _prioritized_save(obj: Any, node: StateNode) -> None:
    # The segment trees answer vectorised reads: one call per tree, no Python loop.
    index = torch.arange(compat.get(obj, "_max_capacity"))
    node.put_tensor("sum_tree", torch.as_tensor(compat.get(obj, "_sum_tree")[index]))
    node.put_tensor("min_tree", torch.as_tensor(compat.get(obj, "_min_tree")[index]))
    value, where = compat.get(obj, "_max_priority")
    node.attrs["max_priority"] = None if value is None else float(value)
    node.attrs["max_priority_index"] = None if where is None else _index_to_json(where)


def _index_to_json(where: Any) -> Any:
    if isinstance(where, torch.Tensor):
        return where.tolist()
    return int(where)


def _tree_leaves(obj: Any, node: StateNode, name: str) -> torch.Tensor:
    """Saved leaves of a segment tree, checked: TorchRL's trees are C++ and take a wrong
    shape or dtype without a word (or crash)."""
    values = node.get_tensor(name)
    capacity = compat.get(obj, "_max_capacity")
    if values.shape != (capacity,) or values.dtype != obj.dtype:
        raise ValueError(
            f"{name}: saved leaves of shape {tuple(values.shape)} and dtype {values.dtype}, "
            f"expected ({capacity},) and {obj.dtype}"
        )
    return values


def _prioritized_load(obj: Any, node: StateNode) -> None:
    index = torch.arange(compat.get(obj, "_max_capacity"))
    compat.get(obj, "_sum_tree")[index] = _tree_leaves(obj, node, "sum_tree")
    compat.get(obj, "_min_tree")[index] = _tree_leaves(obj, node, "min_tree")
    value, where = node.attrs["max_priority"], node.attrs["max_priority_index"]
    if isinstance(where, list):
        where = torch.tensor(where)
    compat.put(obj, "_max_priority", (value, where))


def _prompt_group_config(obj: Any) -> Config:
    """TorchRL's GRPO sampler: groups of rows sharing a prompt (its group index is a cache,
    rebuilt from the rows; the recency clock is its state)."""
    return {
        "num_groups": obj.num_groups,
        "samples_per_group": obj.samples_per_group,
        "group_key": key_to_json(obj.group_key),
        "strategy": obj.strategy,
        "reward_key": key_to_json(obj.reward_key),
        "cache_groups": bool(obj.cache_groups),
    }


def _prompt_group_build(config: Config) -> Any:
    return S.PromptGroupSampler(
        num_groups=config["num_groups"],
        samples_per_group=config["samples_per_group"],
        group_key=key_from_json(config["group_key"]),
        strategy=config["strategy"],
        reward_key=key_from_json(config["reward_key"]),
        cache_groups=config["cache_groups"],
    )


def _both(*fns: Callable[[Any, StateNode], None]) -> Callable[[Any, StateNode], None]:
    def run(obj: Any, node: StateNode) -> None:
        for fn in fns:
            fn(obj, node)

    return run


def _state_dict_save(obj: Any, node: StateNode) -> None:
    """A component's public ``state_dict()``: tensors as arrays, the rest as JSON."""
    values: dict[str, Any] = {}
    for name, value in obj.state_dict().items():
        if isinstance(value, torch.Tensor):
            node.put_tensor(name, value)
            values[name] = {"tensor": True}
        elif value is None or isinstance(value, (bool, int, float)):
            values[name] = {"value": value}
        else:
            raise UnsupportedDataError(
                f"cannot save {type(obj).__name__} state entry {name!r} of type "
                f"{type(value).__name__}",
            )
    node.attrs["state"] = values


def _state_dict_load(obj: Any, node: StateNode) -> None:
    state = {
        name: node.get_tensor(name) if entry.get("tensor") else entry["value"]
        for name, entry in node.attrs["state"].items()
    }
    obj.load_state_dict(state)


# --- writers ---------------------------------------------------------------------------------


def _round_robin_save(obj: Any, node: StateNode) -> None:
    node.attrs["cursor"] = int(compat.get(obj, "_cursor"))
    node.attrs["write_count"] = int(compat.get(obj, "_write_count"))
    generation = compat.get(obj, "_generation") if compat.get(obj, "_track_generations") else None
    node.attrs["has_generation"] = generation is not None
    if generation is not None:
        node.put_tensor("generation", generation)


def _round_robin_load(obj: Any, node: StateNode) -> None:
    compat.put(obj, "_cursor", int(node.attrs["cursor"]))
    compat.put(obj, "_write_count", int(node.attrs["write_count"]))
    if node.attrs.get("has_generation"):
        compat.put(obj, "_generation", node.get_tensor("generation"))
        compat.get(obj, "_align_generation_device")()


def _max_value_save(obj: Any, node: StateNode) -> None:
    node.attrs["cursor"] = int(compat.get(obj, "_cursor"))
    node.attrs["write_count"] = int(compat.get(obj, "_write_count"))
    heap = compat.get(obj, "_current_top_values")
    # TorchRL dumps the heap as one float32 tensor, which corrupts indices above 2**24;
    # ranks and indices are kept apart here, indices as int64.
    node.put_tensor("ranks", torch.tensor([float(r) for r, _ in heap], dtype=torch.float64))
    node.put_tensor("indices", torch.tensor([int(i) for _, i in heap], dtype=torch.int64))


def _max_value_load(obj: Any, node: StateNode) -> None:
    compat.put(obj, "_cursor", int(node.attrs["cursor"]))
    compat.put(obj, "_write_count", int(node.attrs.get("write_count", 0)))
    ranks = node.get_tensor("ranks").tolist()
    indices = node.get_tensor("indices").tolist()
    # The saved list is already a valid heap: it is restored in the same order.
    compat.put(obj, "_current_top_values", list(zip(ranks, indices, strict=True)))


def _max_value_config(obj: Any) -> Config:
    return {
        "rank_key": key_to_json(compat.get(obj, "_rank_key")),
        "reduction": compat.get(obj, "_reduction"),
    }


ADAPTERS: dict[str, Adapter] = {
    adapter.name: adapter
    for adapter in (
        Adapter(S.RandomSampler, lambda o: {}, lambda c: S.RandomSampler(), _nothing, _nothing),
        Adapter(
            S.ConsumingSampler,
            lambda o: {"max_sample_count": int(o.max_sample_count)},
            lambda c: S.ConsumingSampler(max_sample_count=c["max_sample_count"]),
            _state_dict_save,
            _state_dict_load,
        ),
        Adapter(
            S.SamplerWithoutReplacement,
            _without_replacement_config,
            lambda c: S.SamplerWithoutReplacement(**c),
            _without_replacement_save,
            _without_replacement_load,
        ),
        Adapter(
            S.SliceSampler,
            _slice_config,
            lambda c: S.SliceSampler(**_slice_kwargs(c), span=tuple(c["span"])),
            _slice_save,
            _slice_load,
        ),
        Adapter(
            S.SliceSamplerWithoutReplacement,
            lambda o: {**_slice_config(o), **_without_replacement_config(o)},
            lambda c: S.SliceSamplerWithoutReplacement(
                **{k: v for k, v in _slice_kwargs(c).items() if k != "cache_values"},
                drop_last=c["drop_last"],
                shuffle=c["shuffle"],
            ),
            _both(_slice_save, _without_replacement_save),
            _both(_slice_load, _without_replacement_load),
        ),
        Adapter(
            S.PrioritizedSampler,
            _prioritized_config,
            lambda c: S.PrioritizedSampler(**_prioritized_kwargs(c)),
            _prioritized_save,
            _prioritized_load,
        ),
        Adapter(
            S.PrioritizedSliceSampler,
            lambda o: {**_slice_config(o), **_prioritized_config(o)},
            lambda c: S.PrioritizedSliceSampler(
                **_prioritized_kwargs(c),
                **_slice_kwargs(c),
                span=tuple(c["span"]),
            ),
            _both(_slice_save, _prioritized_save),
            _both(_slice_load, _prioritized_load),
        ),
        Adapter(
            S.PromptGroupSampler,
            _prompt_group_config,
            _prompt_group_build,
            _state_dict_save,
            _state_dict_load,
        ),
        Adapter(
            W.RoundRobinWriter,
            lambda o: {"track_generations": bool(o._track_generations)},
            lambda c: W.RoundRobinWriter(track_generations=bool(c.get("track_generations", False))),
            _round_robin_save,
            _round_robin_load,
        ),
        Adapter(
            W.TensorDictRoundRobinWriter,
            lambda o: {"track_generations": bool(o._track_generations)},
            lambda c: W.TensorDictRoundRobinWriter(
                track_generations=bool(c.get("track_generations", False))
            ),
            _round_robin_save,
            _round_robin_load,
        ),
        Adapter(
            W.TensorDictMaxValueWriter,
            _max_value_config,
            lambda c: W.TensorDictMaxValueWriter(
                rank_key=key_from_json(c["rank_key"]), reduction=c["reduction"]
            ),
            _max_value_save,
            _max_value_load,
        ),
    )
}


def adapter_for(obj: Any, *, role: str) -> Adapter:
    adapter = ADAPTERS.get(type(obj).__name__)
    if adapter is None or type(obj) is not adapter.cls:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedDataError(
            f"cannot save the buffer's {role}: {type(obj).__module__}.{type(obj).__qualname__} "
            f"has no zarr_rb state adapter (supported: {supported})",
        )
    return adapter


def adapter_named(name: str, *, role: str) -> Adapter:
    adapter = ADAPTERS.get(name)
    if adapter is None:
        raise UnsupportedDataError(
            f"the saved {role} is a {name!r}, which this version of zarr_rb cannot rebuild",
        )
    return adapter
