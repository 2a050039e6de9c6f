"""One small adapter per TorchRL sampler and writer: its constructor arguments as JSON
(those of the installed TorchRL's signature, see :mod:`zarr_rb.state._arguments`), its state
as arrays, and how to rebuild it.

Adapters are looked up by exact class: a subclass may add state its parent's adapter
would silently drop, so an unknown class is an error that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchrl.data.replay_buffers import samplers as S  # noqa: N812
from torchrl.data.replay_buffers import writers as W  # noqa: N812

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.errors import UnsupportedDataError
from zarr_rb.state._arguments import (
    Argument,
    constructor_kwargs,
    missing_class,
    private,
    read_arguments,
)
from zarr_rb.state._node import StateNode
from zarr_rb.torchrl import compat

Config = dict[str, Any]


def key_to_json(key: Any) -> Any:
    if key is None or isinstance(key, str):
        return key
    return list(key)


def key_from_json(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How to save, rebuild and restore one component class.

    Its settings are its constructor arguments (see :mod:`zarr_rb.state._arguments`);
    ``arguments`` says how to read back and pass again those it does not keep under their
    own name.
    """

    cls: type
    save: Callable[[Any, StateNode], None]
    load: Callable[[Any, StateNode], None]
    arguments: Mapping[str, Argument] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cls.__name__

    def config(self, obj: Any) -> Config:
        """The constructor arguments ``obj`` was built with, as JSON."""
        return read_arguments(obj, self.arguments)

    def build(self, config: Config, *, saved_version: str | None) -> Any:
        """A new component built with the saved constructor arguments ``config``."""
        if saved_version is None:  # older adapters kept a few settings that are no arguments
            config = {k: v for k, v in config.items() if k not in _NOT_ARGUMENTS.get(self.name, ())}
        return self.cls(
            **constructor_kwargs(self.cls, config, self.arguments, saved_version=saved_version)
        )


_NOT_ARGUMENTS = {"SliceSamplerWithoutReplacement": ("cache_values",)}
"""Settings that stores saved before their TorchRL version was recorded hold, though the
constructor does not take them."""


def _nothing(obj: Any, node: StateNode) -> None:
    return None


# --- samplers --------------------------------------------------------------------------------


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
    # As TorchRL keeps them, tensors (its loads copies into them in place).
    if value is not None:
        value = torch.tensor(value, dtype=obj.dtype)
    if where is not None:
        where = torch.tensor(where)
    compat.put(obj, "_max_priority", (value, where))


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


_SLICE = {
    # TorchRL keeps whether it uses a GPU, and the device apart.
    "use_gpu": Argument(
        read=lambda obj: str(compat.get(obj, "_gpu_device")) if obj.use_gpu else False
    ),
}
_PRIORITIZED = {
    **{name: private(f"_{name}") for name in ("max_capacity", "alpha", "beta", "eps")},
    "max_priority_within_buffer": private("_max_priority_within_buffer"),
    "dtype": Argument(
        read=lambda obj: str(obj.dtype).removeprefix("torch."),
        decode=lambda value: TORCH_DTYPES[value],
    ),
    "device": private("_device"),
}


def _staleness_weight_fn(obj: Any) -> Any:
    """``None`` for TorchRL's default weight; another function is code, which a save does
    not hold (the save is refused, naming the argument)."""
    weight = compat.get(obj, "_weight_fn")
    return None if weight is compat.default_staleness_weight else weight


_STALENESS = {
    "max_staleness": private("_max_staleness"),
    "version_key": private("_version_key"),
    "staleness_weight_fn": Argument(read=_staleness_weight_fn),
}
_WRITER = {
    "compilable": private("_compilable"),
    "track_generations": private("_track_generations"),
    "rank_key": private("_rank_key"),
    "reduction": private("_reduction"),
}


def _adapters(module: Any, *specs: tuple[Any, ...]) -> list[Adapter]:
    """Adapters of the classes ``module`` of the installed TorchRL has (a store that names
    another is refused when it is loaded, naming the class and both TorchRL versions)."""
    adapters = []
    for name, save, load, *arguments in specs:
        cls = getattr(module, name, None)
        if cls is not None:
            adapters.append(Adapter(cls, save, load, *arguments))
    return adapters


ADAPTERS: dict[str, Adapter] = {
    adapter.name: adapter
    for adapter in (
        *_adapters(
            S,
            ("RandomSampler", _nothing, _nothing),
            ("ConsumingSampler", _state_dict_save, _state_dict_load),
            ("SamplerWithoutReplacement", _without_replacement_save, _without_replacement_load),
            ("SliceSampler", _slice_save, _slice_load, _SLICE),
            (
                "SliceSamplerWithoutReplacement",
                _both(_slice_save, _without_replacement_save),
                _both(_slice_load, _without_replacement_load),
                _SLICE,
            ),
            ("PrioritizedSampler", _prioritized_save, _prioritized_load, _PRIORITIZED),
            (
                "PrioritizedSliceSampler",
                _both(_slice_save, _prioritized_save),
                _both(_slice_load, _prioritized_load),
                {**_SLICE, **_PRIORITIZED},
            ),
            ("PromptGroupSampler", _state_dict_save, _state_dict_load),
            ("StalenessAwareSampler", _state_dict_save, _state_dict_load, _STALENESS),
            (
                "StreamingSliceSampler",
                _both(_slice_save, _state_dict_save),
                _both(_slice_load, _state_dict_load),
                _SLICE,
            ),
        ),
        *_adapters(
            W,
            ("RoundRobinWriter", _round_robin_save, _round_robin_load, _WRITER),
            ("TensorDictRoundRobinWriter", _round_robin_save, _round_robin_load, _WRITER),
            ("TensorDictMaxValueWriter", _max_value_save, _max_value_load, _WRITER),
            ("ImmutableDatasetWriter", _nothing, _nothing, _WRITER),
        ),
    )
}


REFUSED: dict[str, str] = {
    "Sampler": "it is the base class of TorchRL's samplers, which no buffer holds itself",
    "Writer": "it is the base class of TorchRL's writers, which no buffer holds itself",
    "SamplerEnsemble": "it samples the buffers of a ReplayBufferEnsemble, which is saved "
    "buffer by buffer (zarr_rb.save each of them)",
    "WriterEnsemble": "it writes the buffers of a ReplayBufferEnsemble, which is saved "
    "buffer by buffer (zarr_rb.save each of them)",
}
"""TorchRL samplers and writers that zarr_rb does not save, and why (in the error)."""


def adapter_for(obj: Any, *, role: str) -> Adapter:
    adapter = ADAPTERS.get(type(obj).__name__)
    if adapter is None or type(obj) is not adapter.cls:
        where = f"{type(obj).__module__}.{type(obj).__qualname__}"
        reason = REFUSED.get(type(obj).__name__)
        if reason is not None:
            raise UnsupportedDataError(f"cannot save the buffer's {role}, a {where}: {reason}")
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedDataError(
            f"cannot save the buffer's {role}: {where} has no zarr_rb state adapter "
            f"(supported: {supported})",
        )
    return adapter


def adapter_named(name: str, *, role: str, saved_version: str | None) -> Adapter:
    adapter = ADAPTERS.get(name)
    if adapter is not None:
        return adapter
    if not any(isinstance(getattr(m, name, None), type) for m in (S, W)):
        raise missing_class(name, role=role, saved_version=saved_version)
    raise UnsupportedDataError(
        f"the saved {role} is a {name!r}, which this version of zarr_rb cannot rebuild",
    )
