"""Where a component's state goes: a Zarr group of small arrays plus JSON attributes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy, to_numpy
from zarr_rb.engine import Engine


@dataclasses.dataclass
class _Tree:
    """What the nodes of one tree share (one save or one load)."""

    bytes_written: int = 0
    """Bytes written by every node of the tree."""
    pending: list[Any] = dataclasses.field(default_factory=list)
    """Array writes started and not waited for."""
    read_ahead: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Tensors read ahead by :meth:`StateNode.read_all`, by path."""


class StateNode:
    """A group inside a store's state slot, as seen by one component adapter.

    Arrays are written as soon as they are put (only the chunks that changed since the
    last save into this slot); attributes are collected and written once by the saver.
    """

    def __init__(
        self,
        engine: Engine,
        path: str,
        attrs: dict[str, Any],
        *,
        parent: StateNode | None = None,
    ) -> None:
        self.engine = engine
        self.path = path
        self.attrs = attrs
        self._tree = _Tree() if parent is None else parent.tree

    @property
    def tree(self) -> _Tree:
        """What this node shares with the others of its tree."""
        return self._tree

    @property
    def bytes_written(self) -> int:
        """Bytes written by every node of this node's tree."""
        return self._tree.bytes_written

    def child(self, name: str) -> StateNode:
        attrs = self.attrs.setdefault("children", {}).setdefault(name, {})
        return StateNode(self.engine, f"{self.path}/{name}", attrs, parent=self)

    def put_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Store a tensor (any shape, any supported dtype) under ``name``."""
        tensor = tensor.detach().cpu().contiguous()
        self.attrs.setdefault("tensors", {})[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
        }
        flat = to_numpy(tensor.reshape(-1)) if tensor.numel() else np.zeros(1, np.uint8)
        written, futures = self.engine.write_state_array(f"{self.path}/{name}", flat)
        self._tree.bytes_written += written
        self._tree.pending.extend(futures)

    def wait(self) -> None:
        """Wait for every array write started under this (root) node."""
        for future in self._tree.pending:
            future.result()
        self._tree.pending.clear()

    def read_all(self) -> None:
        """Read every tensor under this node now: a load reads one save whole, then checks
        that it was not replaced meanwhile, before anything is built from it."""
        for name in self.attrs.get("tensors", {}):
            self._tree.read_ahead[f"{self.path}/{name}"] = self._read_tensor(name)
        for name in self.attrs.get("children", {}):
            self.child(name).read_all()

    def get_tensor(self, name: str) -> torch.Tensor:
        read = self._tree.read_ahead.get(f"{self.path}/{name}")
        if read is not None:
            return read.clone()
        return self._read_tensor(name)

    def _read_tensor(self, name: str) -> torch.Tensor:
        spec = self.attrs.get("tensors", {}).get(name)
        if spec is None:
            raise KeyError(f"no tensor {name!r} in {self.path!r}")
        dtype = TORCH_DTYPES[spec["dtype"]]
        shape = tuple(int(n) for n in spec["shape"])
        if any(n < 0 for n in shape) or len(shape) > 32:
            raise ValueError(f"invalid shape {shape} for tensor {name!r} in {self.path!r}")
        size = math.prod(shape)
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        flat = self.engine.read_state_array(f"{self.path}/{name}", size=size)
        return from_numpy(flat, dtype).reshape(shape).clone()
