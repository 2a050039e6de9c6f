"""The parts of a buffer that are code, not data: transforms, a custom ``collate_fn``, a
custom sample unit or checkpointer, a ``HERReplayBuffer``'s reward function.

They are pickled into uint8 arrays and unpickled only when the caller opts in with
``allow_pickle=True`` (unpickling runs code stored in the buffer), or handed in rebuilt by
the caller. Transforms also keep their ``state_dict()`` as plain tensors plus JSON, so that a
transform built the same way receives the saved state without any unpickling.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from zarr_rb.errors import StoreCorruptedError, ZarrRBError
from zarr_rb.state._node import StateNode

CODE_OBJECTS = ("collate_fn", "sample_unit", "checkpointer", "reward_fn")
"""Buffer settings that are code when they are not TorchRL's defaults (a
``HERReplayBuffer``'s ``reward_fn`` always is)."""


class PickleNotAllowedError(ZarrRBError, PermissionError):
    """Restoring the saved buffer needs unpickling, which the caller did not allow."""


def _pickle_into(node: StateNode, name: str, obj: Any) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    node.put_tensor(name, torch.frombuffer(bytearray(blob), dtype=torch.uint8))


_MOVED = {
    "zarr_rb._checkpointer": "zarr_rb.torchrl.checkpointer",
    "zarr_rb.storage": "zarr_rb.torchrl.storage",
}
"""Modules of zarr_rb's own classes that saves of earlier versions name, and where those
classes are now."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(_MOVED.get(module, module), name)


def _unpickle(node: StateNode, name: str) -> Any:
    data = node.get_tensor(name).numpy().tobytes()
    return _Unpickler(io.BytesIO(data)).load()  # the caller opted in


def _class_name(obj: Any) -> str:
    """What an object is, for messages: its own name (classes, functions) or its class's."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def save_code_objects(objects: dict[str, Any], node: StateNode) -> None:
    """Pickle the non-default code objects of a buffer (``None`` values are defaults)."""
    saved, unpicklable = {}, {}
    for name, obj in objects.items():
        if obj is None:
            continue
        try:
            _pickle_into(node, name, obj)
        except (pickle.PicklingError, AttributeError, TypeError):
            # A lambda or a closure: the load is given it again (its name says which).
            unpicklable[name] = _class_name(obj)
        else:
            saved[name] = _class_name(obj)
    node.attrs["saved"] = saved
    node.attrs["unpicklable"] = unpicklable


def load_code_objects(
    node: StateNode, *, given: dict[str, Any], allow_pickle: bool
) -> dict[str, Any]:
    """The code objects to rebuild the buffer with: the caller's (``given``), else the saved
    ones unpickled (with ``allow_pickle``); ``None`` for TorchRL's defaults."""
    saved: dict[str, str] = node.attrs.get("saved", {})
    unpicklable: dict[str, str] = node.attrs.get("unpicklable", {})
    out: dict[str, Any] = dict.fromkeys(CODE_OBJECTS)
    missing = []
    for name in CODE_OBJECTS:
        if given.get(name) is not None:
            out[name] = given[name]
        elif name in unpicklable:
            raise PickleNotAllowedError(
                f"the saved buffer was built with a {name} that could not be pickled when it "
                f"was saved ({unpicklable[name]}: a lambda or a closure); pass {name}=... "
                "to zarr_rb.load",
            )
        elif name in saved:
            if not allow_pickle:
                missing.append(f"{name} ({saved[name]})")
                continue
            out[name] = _unpickle(node, name)
    if missing:
        raise PickleNotAllowedError(
            f"the saved buffer has a custom {', '.join(missing)} that can only be rebuilt by "
            "unpickling, which runs code stored in the buffer. Pass allow_pickle=True if you "
            f"trust the store, or pass {', '.join(m.split()[0] + '=...' for m in missing)} "
            "to zarr_rb.load",
        )
    return out


def save_transforms(transform: Any, node: StateNode) -> None:
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
    node.attrs["classes"] = [_class_name(t) for t in _transforms_of(transform)]
    _pickle_into(node, "pickle", transform)


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
        transform = _unpickle(node, "pickle")
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
