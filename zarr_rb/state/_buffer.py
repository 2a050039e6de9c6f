"""The replay buffer itself: its class and settings, its generator and its transforms.

Transforms are kept twice: their ``state_dict()`` as plain tensors plus JSON (restored
without unpickling), and the transform objects pickled into a uint8 array that is only
unpickled when the caller opts in with ``allow_pickle=True``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torchrl.data import (
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

from zarr_rb.errors import StoreCorruptedError, UnsupportedDataError, ZarrRBError
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


class PickleNotAllowedError(ZarrRBError, PermissionError):
    """Restoring the saved transforms needs unpickling, which the caller did not allow."""


def buffer_config(rb: Any) -> dict[str, Any]:
    cls = type(rb)
    if BUFFER_CLASSES.get(cls.__name__) is not cls:
        supported = ", ".join(sorted(BUFFER_CLASSES))
        raise UnsupportedDataError(
            f"cannot save a {cls.__module__}.{cls.__qualname__}; zarr_rb saves {supported}",
        )
    config: dict[str, Any] = {
        "class": cls.__name__,
        "batch_size": rb._batch_size,
        "dim_extend": rb._dim_extend,
    }
    if isinstance(rb, TensorDictReplayBuffer):
        config["priority_key"] = key_to_json(rb.priority_key)
    return config


def build_buffer(
    config: dict[str, Any],
    *,
    storage: Any,
    sampler: Any,
    writer: Any,
    transform: Any,
) -> Any:
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
    }
    if issubclass(cls, TensorDictReplayBuffer):
        kwargs["priority_key"] = key_from_json(config["priority_key"])
    if issubclass(cls, _PRIORITIZED):
        # These classes build their own PrioritizedSampler; its state is loaded after.
        kwargs.update(
            alpha=sampler._alpha,
            beta=sampler._beta,
            eps=sampler._eps,
            reduction=sampler.reduction,
        )
        rb = cls(**kwargs)
        if type(rb._writer) is not type(writer):
            rb._writer = writer
            writer.register_storage(storage)
        return rb
    return cls(sampler=sampler, writer=writer, **kwargs)


def save_generator(rb: Any, node: StateNode) -> None:
    generator = rb._rng
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


def save_transforms(rb: Any, node: StateNode) -> None:
    transform = rb._transform
    n = len(transform) if transform is not None else 0
    node.attrs["count"] = n
    if not n:
        return
    state = transform.state_dict()
    names: list[str] = []
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            node.put_tensor(f"t{len(names)}", tensor)
            names.append(name)
    node.attrs["state_keys"] = names
    node.attrs["classes"] = [
        f"{type(t).__module__}.{type(t).__qualname__}" for t in _transforms_of(transform)
    ]
    blob = pickle.dumps(transform, protocol=pickle.HIGHEST_PROTOCOL)
    node.put_tensor("pickle", torch.frombuffer(bytearray(blob), dtype=torch.uint8))


def _transforms_of(transform: Any) -> list[Any]:
    return list(getattr(transform, "transforms", [transform]))


def load_transforms(node: StateNode, *, transform: Any, allow_pickle: bool) -> Any:
    """The transform to hand to the rebuilt buffer.

    Args:
        transform: a freshly built transform to receive the saved state (no unpickling).
        allow_pickle: unpickle the saved transform objects (runs code from the store).
    """
    if not node.attrs.get("count"):
        return transform
    if transform is None:
        if not allow_pickle:
            classes = ", ".join(node.attrs.get("classes", []))
            raise PickleNotAllowedError(
                f"the saved buffer has transforms ({classes}) that can only be rebuilt by "
                "unpickling them, which runs code stored in the buffer. Pass "
                "allow_pickle=True if you trust the store, or pass transform=... (built "
                "the same way) to restore only their state, without unpickling.",
            )
        blob = node.get_tensor("pickle").numpy().tobytes()
        transform = pickle.loads(blob)  # the caller opted in above
        from torchrl.envs.transforms import Transform

        if not isinstance(transform, Transform):
            raise StoreCorruptedError(
                f"the transforms blob in {node.path!r} unpickled to a "
                f"{type(transform).__name__}, not a torchrl Transform",
            )
    state = {name: node.get_tensor(f"t{i}") for i, name in enumerate(node.attrs["state_keys"])}
    if state:
        transform.load_state_dict(state, strict=False)
    return transform
