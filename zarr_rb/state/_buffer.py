"""The replay buffer itself: its class and constructor settings, how to rebuild it around
its components, and its generator.

Every setting a TorchRL 0.14 buffer takes in its constructor is kept: as JSON when it is a
value (batch size, ``pin_memory``, ``prefetch``, ``sync``, a ``Sequence`` sample unit,
TorchRL's checkpointers...), as a code object (:mod:`zarr_rb.state._objects`) when it is
code (a custom ``collate_fn``).
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data import (
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers import checkpointers as _checkpointers
from torchrl.data.replay_buffers import sample_units as _units

from zarr_rb import _compat as compat
from zarr_rb.errors import UnsupportedDataError
from zarr_rb.state._components import key_from_json, key_to_json
from zarr_rb.state._node import StateNode

BUFFER_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ReplayBuffer,
        TensorDictReplayBuffer,
        PrioritizedReplayBuffer,
        TensorDictPrioritizedReplayBuffer,
    )
}
_PRIORITIZED = (PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer)
_SEQUENCE_FIELDS = ("length", "episode_boundary", "burn_in", "bootstrap", "dilation")
_TED_CHECKPOINTERS = {
    cls.__name__: (cls, hooks)
    for cls, hooks in (
        (_checkpointers.FlatStorageCheckpointer, 1),
        (_checkpointers.NestedStorageCheckpointer, 1),
        (_checkpointers.H5StorageCheckpointer, 2),
    )
}


def buffer_settings(rb: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings of ``rb`` as JSON, and its non-default code objects (``None``: default).

    Raises:
        UnsupportedDataError: ``rb`` is not one of the buffer classes zarr_rb rebuilds.
    """
    cls = type(rb)
    if BUFFER_CLASSES.get(cls.__name__) is not cls:
        supported = ", ".join(sorted(BUFFER_CLASSES))
        raise UnsupportedDataError(
            f"cannot save a {cls.__module__}.{cls.__qualname__}; zarr_rb saves {supported}",
        )
    prefetch = compat.get(rb, "_prefetch_cap")
    config: dict[str, Any] = {
        "class": cls.__name__,
        "batch_size": compat.get(rb, "_batch_size"),
        "dim_extend": compat.get(rb, "_dim_extend"),
        "pin_memory": bool(compat.get(rb, "_pin_memory")),
        "prefetch": int(prefetch) if prefetch else None,
        "consume_after_n_samples": compat.get(rb, "_consume_after_n_samples"),
    }
    if isinstance(rb, TensorDictReplayBuffer):
        config["priority_key"] = key_to_json(rb.priority_key)
    if isinstance(rb, _PRIORITIZED):
        config["sync"] = bool(compat.get(rb, "_sync"))
        config["prioritized_sampler_write_count"] = int(
            compat.get(rb, "_prioritized_sampler_write_count")
        )
    unit = compat.get(rb, "_sample_unit")
    config["sample_unit"], custom_unit = _sample_unit_config(unit)
    checkpointer = rb.storage.checkpointer
    config["checkpointer"], custom_checkpointer = _checkpointer_config(checkpointer)
    collate = compat.get(rb, "_collate_fn")
    default_collate = compat.default_collate(
        rb.storage, _is_tensordict=compat.get(rb, "_is_tensordict")
    )
    objects = {
        "collate_fn": None if compat.same_function(collate, default_collate) else collate,
        "sample_unit": unit if custom_unit else None,
        "checkpointer": checkpointer if custom_checkpointer else None,
    }
    return config, objects


def _sample_unit_config(unit: Any) -> tuple[Any, bool]:
    """JSON for a sample unit, and whether it is custom code (saved as a code object)."""
    if unit is None:
        return None, False
    if type(unit) is _units.Transition:
        return {"class": "Transition"}, False
    if type(unit) is _units.Sequence:
        config = {name: getattr(unit, name) for name in _SEQUENCE_FIELDS}
        config["done_key"] = key_to_json(unit.done_key)
        return {"class": "Sequence", "config": config}, False
    return {"class": "custom"}, True


def _sample_unit(config: Any, custom: Any) -> Any:
    if config is None:
        return None
    if config["class"] == "custom":
        return custom
    if config["class"] == "Transition":
        return _units.Transition()
    if config["class"] != "Sequence":
        raise ValueError(f"unknown sample unit {config['class']!r}")
    settings = config["config"]
    return _units.Sequence(
        **{name: settings[name] for name in _SEQUENCE_FIELDS},
        done_key=key_from_json(settings["done_key"]),
    )


def _checkpointer_config(checkpointer: Any) -> tuple[Any, bool]:
    """JSON for a storage checkpointer (``None``: zarr_rb's own), and whether it is custom
    code (saved as a code object)."""
    from zarr_rb._checkpointer import ZarrStorageCheckpointer

    hooks = (compat.get(checkpointer, "_save_hooks"), compat.get(checkpointer, "_load_hooks"))
    if type(checkpointer) is ZarrStorageCheckpointer and not any(hooks):
        return None, False
    known = _TED_CHECKPOINTERS.get(type(checkpointer).__name__)
    if known is None or type(checkpointer) is not known[0] or len(hooks[0]) != known[1]:
        return {"class": "custom"}, True
    ted = hooks[0][0]
    config: dict[str, Any] = {
        "done_keys": sorted(key_to_json(k) for k in ted.done_keys),
        "reward_keys": sorted(key_to_json(k) for k in ted.reward_keys),
    }
    if isinstance(checkpointer, _checkpointers.H5StorageCheckpointer):
        config.update(checkpoint_file=checkpointer.checkpoint_file, h5_kwargs=checkpointer.kwargs)
    return {"class": type(checkpointer).__name__, "config": config}, False


def _checkpointer(config: Any, custom: Any) -> Any:
    if config is None:
        return None
    if config["class"] == "custom":
        return custom
    cls = _TED_CHECKPOINTERS[config["class"]][0]
    settings = dict(config["config"])
    for name in ("done_keys", "reward_keys"):
        settings[name] = [key_from_json(k) for k in settings[name]]
    return cls(**settings)


def build_buffer(
    config: dict[str, Any],
    *,
    storage: Any,
    sampler: Any,
    writer: Any,
    prioritized_sampler: Any,
    transform: Any,
    objects: dict[str, Any],
) -> Any:
    """The buffer of ``config`` around its rebuilt components (their state is loaded
    after)."""
    cls = BUFFER_CLASSES.get(config.get("class", ""))
    if cls is None:
        raise UnsupportedDataError(
            f"the saved buffer is a {config.get('class')!r}, which zarr_rb cannot rebuild",
        )
    kwargs: dict[str, Any] = {
        "storage": storage,
        "batch_size": config["batch_size"],
        "transform": transform,
        "dim_extend": config["dim_extend"],
        "pin_memory": config.get("pin_memory", False),
        "prefetch": config.get("prefetch"),
        "collate_fn": objects.get("collate_fn"),
        "sample_unit": _sample_unit(config.get("sample_unit"), objects.get("sample_unit")),
    }
    if issubclass(cls, TensorDictReplayBuffer):
        kwargs["priority_key"] = key_from_json(config["priority_key"])
    if issubclass(cls, _PRIORITIZED):
        # These classes build their own PrioritizedSampler from these settings; the saved
        # one (with the same settings and its state) takes its place below.
        prioritized = sampler if prioritized_sampler is None else prioritized_sampler
        kwargs.update(
            alpha=compat.get(prioritized, "_alpha"),
            beta=compat.get(prioritized, "_beta"),
            eps=compat.get(prioritized, "_eps"),
            sync=config.get("sync", True),
        )
        if cls is TensorDictPrioritizedReplayBuffer:
            kwargs["reduction"] = prioritized.reduction
        else:
            kwargs["dtype"] = prioritized.dtype
        rb = cls(**kwargs)
        if config.get("sync", True):
            compat.put(rb, "_sampler", sampler)
        else:
            compat.put(rb, "_sampler", sampler)
            compat.put(rb, "_prioritized_sampler", prioritized_sampler)
            compat.put(
                rb, "_prioritized_sampler_write_count", config["prioritized_sampler_write_count"]
            )
        compat.put(rb, "_writer", writer)
        writer.register_storage(storage)
    else:
        consume = config.get("consume_after_n_samples")
        if consume is not None:
            kwargs["consume_after_n_samples"] = consume
        rb = cls(sampler=sampler, writer=writer, **kwargs)
    checkpointer = _checkpointer(config.get("checkpointer"), objects.get("checkpointer"))
    if checkpointer is not None:
        storage.checkpointer = checkpointer
    return rb


def save_generator(rb: Any, node: StateNode) -> None:
    generator = compat.get(rb, "_rng")
    node.attrs["present"] = generator is not None
    if generator is not None:
        node.attrs["device"] = str(generator.device)
        node.put_tensor("state", generator.get_state())


def load_generator(node: StateNode) -> torch.Generator | None:
    if not node.attrs.get("present"):
        return None
    generator = torch.Generator(device=node.attrs["device"])
    generator.set_state(node.get_tensor("state"))
    return generator
