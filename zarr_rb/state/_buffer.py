"""The replay buffer itself: its class and constructor arguments, how to rebuild it around
its components, and its generator.

Every argument the installed TorchRL's buffer classes take is kept (see
:mod:`zarr_rb.state._arguments`): as JSON when it is a value (batch size, ``pin_memory``,
``prefetch``, ``sync``, ``shared``, a ``Sequence`` sample unit...), apart when it is a
component, a generator or code (a custom ``collate_fn``, :mod:`zarr_rb.state._objects`).
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
from torchrl.data.replay_buffers import her as _her
from torchrl.data.replay_buffers import replay_buffers as _buffers
from torchrl.data.replay_buffers import sample_units as _units

from zarr_rb.errors import UnsupportedDataError
from zarr_rb.state._arguments import (
    Argument,
    constructor_arguments,
    constructor_kwargs,
    missing_class,
    private,
    read_arguments,
)
from zarr_rb.state._components import key_from_json, key_to_json
from zarr_rb.state._node import StateNode
from zarr_rb.torchrl import compat

_HER: Any = getattr(_her, "HERReplayBuffer", None)
"""Hindsight relabelling at sample time (TorchRL 0.14): its ``reward_fn`` is code, saved
apart (``objects/``), the rest are values."""
BUFFER_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ReplayBuffer,
        TensorDictReplayBuffer,
        PrioritizedReplayBuffer,
        TensorDictPrioritizedReplayBuffer,
        *([_HER] if _HER is not None else []),
    )
}
REFUSED: dict[str, str] = {
    "ReplayBufferEnsemble": "it holds several buffers: save each with zarr_rb.save (each in a "
    "store of its own) and build the ensemble again around the loaded ones",
    "RayReplayBuffer": "its buffer lives in a Ray actor: save that buffer in the actor, or "
    "share the store itself between Ray workers (zarr_rb.ray)",
    "RemoteTensorDictReplayBuffer": "it is a handle on a buffer of another process "
    "(torch.distributed.rpc): save that buffer in the process that holds it",
    "OfflineToOnlineReplayBuffer": "it pairs a dataset with an online buffer: save the online "
    "buffer (rb.online_buffer) with zarr_rb.save, and build the pair again around the "
    "loaded one and the dataset",
}
"""TorchRL buffer classes that zarr_rb does not save, and why (in the error)."""
_PRIORITIZED = (PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer)
_TED_CHECKPOINTERS = {
    cls.__name__: (cls, hooks)
    for cls, hooks in (
        (_checkpointers.FlatStorageCheckpointer, 1),
        (_checkpointers.NestedStorageCheckpointer, 1),
        (_checkpointers.H5StorageCheckpointer, 2),
    )
}


_ARGUMENTS = {
    "batch_size": private("_batch_size"),
    "dim_extend": private("_dim_extend"),
    "pin_memory": Argument(read=lambda rb: bool(compat.get(rb, "_pin_memory"))),
    "prefetch": Argument(read=lambda rb: int(compat.get(rb, "_prefetch_cap")) or None),
    "consume_after_n_samples": private("_consume_after_n_samples"),
    "sync": Argument(read=lambda rb: bool(compat.get(rb, "_sync"))),
    "sample_unit": Argument(
        read=lambda rb: _sample_unit_config(compat.get(rb, "_sample_unit"))[0],
        decode=lambda value: value,  # rebuilt with the custom one, if any (build_buffer)
    ),
}
"""How the buffer arguments TorchRL keeps privately, or transforms, are read back."""

_LEGACY_SETTINGS = ("class", "checkpointer", "prioritized_sampler_write_count")
"""Keys of the settings of stores saved before the arguments were kept apart that are no
constructor arguments."""


def check_buffer_class(rb: Any) -> None:
    """Raise :class:`UnsupportedDataError` if ``rb`` is not of a buffer class zarr_rb
    rebuilds (with the reason, for those refused by name); before anything else is read."""
    cls = type(rb)
    if BUFFER_CLASSES.get(cls.__name__) is not cls:
        where = f"{cls.__module__}.{cls.__qualname__}"
        reason = REFUSED.get(cls.__name__)
        if reason is not None:
            raise UnsupportedDataError(f"cannot save a {where}: {reason}")
        supported = ", ".join(sorted(BUFFER_CLASSES))
        raise UnsupportedDataError(f"cannot save a {where}; zarr_rb saves {supported}")


def buffer_settings(rb: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings of ``rb`` as JSON, and its non-default code objects (``None``: default).

    Raises:
        UnsupportedDataError: ``rb`` is not one of the buffer classes zarr_rb rebuilds, or
            an argument of it cannot be saved.
    """
    cls = type(rb)
    check_buffer_class(rb)
    config: dict[str, Any] = {"class": cls.__name__, "arguments": read_arguments(rb, _ARGUMENTS)}
    if isinstance(rb, _PRIORITIZED):
        config["prioritized_sampler_write_count"] = int(
            compat.get(rb, "_prioritized_sampler_write_count")
        )
    unit = compat.get(rb, "_sample_unit")
    custom_unit = _sample_unit_config(unit)[1]
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
        "reward_fn": rb.reward_fn if _HER is not None and isinstance(rb, _HER) else None,
    }
    return config, objects


def buffer_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """The saved constructor arguments of a buffer's settings (older stores kept them among
    the other settings)."""
    if "arguments" in config:
        arguments: dict[str, Any] = config["arguments"]
        return arguments
    cls = BUFFER_CLASSES.get(config.get("class", ""))
    known = constructor_arguments(cls) if cls is not None else ()
    return {k: v for k, v in config.items() if k not in _LEGACY_SETTINGS and k in known}


def _sample_unit_config(unit: Any) -> tuple[Any, bool]:
    """JSON for a sample unit, and whether it is custom code (saved as a code object)."""
    if unit is None:
        return None, False
    if type(unit) is _units.Transition:
        return {"class": "Transition"}, False
    if type(unit) is _units.Sequence:
        return {"class": "Sequence", "config": read_arguments(unit, {})}, False
    return {"class": "custom"}, True


def _sample_unit(config: Any, custom: Any, *, saved_version: str | None) -> Any:
    if config is None:
        return None
    if config["class"] == "custom":
        return custom
    if config["class"] == "Transition":
        return _units.Transition()
    if config["class"] != "Sequence":
        raise ValueError(f"unknown sample unit {config['class']!r}")
    return _units.Sequence(
        **constructor_kwargs(_units.Sequence, config["config"], {}, saved_version=saved_version)
    )


def _checkpointer_config(checkpointer: Any) -> tuple[Any, bool]:
    """JSON for a storage checkpointer (``None``: zarr_rb's own), and whether it is custom
    code (saved as a code object)."""
    from zarr_rb.torchrl.checkpointer import ZarrStorageCheckpointer

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
    saved_version: str | None,
) -> Any:
    """The buffer of ``config`` around its rebuilt components (their state is loaded
    after)."""
    name = config.get("class", "")
    cls = BUFFER_CLASSES.get(name)
    if cls is None:
        if isinstance(name, str) and not hasattr(_buffers, name):
            raise missing_class(name, role="buffer", saved_version=saved_version)
        raise UnsupportedDataError(
            f"the saved buffer is a {name!r}, which zarr_rb cannot rebuild",
        )
    kwargs = constructor_kwargs(
        cls, buffer_arguments(config), _ARGUMENTS, saved_version=saved_version
    )
    kwargs.update(
        storage=storage,
        transform=transform,
        collate_fn=objects.get("collate_fn"),
        sample_unit=_sample_unit(
            kwargs.get("sample_unit"), objects.get("sample_unit"), saved_version=saved_version
        ),
    )
    if issubclass(cls, _PRIORITIZED):
        # These classes build their own PrioritizedSampler from these settings; the saved
        # one (with the same settings and its state) takes its place below.
        prioritized = sampler if prioritized_sampler is None else prioritized_sampler
        kwargs.update(
            alpha=compat.get(prioritized, "_alpha"),
            beta=compat.get(prioritized, "_beta"),
            eps=compat.get(prioritized, "_eps"),
        )
        if cls is TensorDictPrioritizedReplayBuffer:
            kwargs["reduction"] = prioritized.reduction
        else:
            kwargs["dtype"] = prioritized.dtype
        rb = cls(**kwargs)
        compat.put(rb, "_sampler", sampler)
        if not kwargs.get("sync", True):
            compat.put(rb, "_prioritized_sampler", prioritized_sampler)
            compat.put(
                rb, "_prioritized_sampler_write_count", config["prioritized_sampler_write_count"]
            )
        compat.put(rb, "_writer", writer)
        writer.register_storage(storage)
    else:
        if cls is _HER:
            kwargs["reward_fn"] = objects["reward_fn"]
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
