"""Where a component's state goes: a Zarr group of small arrays plus JSON attributes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy, to_numpy
from zarr_rb.engine import Engine


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
        self._root: StateNode = self if parent is None else parent._root
        self.bytes_written = 0
        """Bytes written by this node and its children (counted on the root node)."""
        self._pending: list[Any] = []
        self._read: dict[str, torch.Tensor] = {}
        """Tensors read ahead by :meth:`read_all` (kept on the root node), by path."""

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
        self._root.bytes_written += written
        self._root._pending.extend(futures)

    def wait(self) -> None:
        """Wait for every array write started under this (root) node."""
        for future in self._root._pending:
            future.result()
        self._root._pending.clear()

    def read_all(self) -> None:
        """Read every tensor under this node now: a load reads one save whole, then checks
        that it was not replaced meanwhile, before anything is built from it."""
        for name in self.attrs.get("tensors", {}):
            self._root._read[f"{self.path}/{name}"] = self._read_tensor(name)
        for name in self.attrs.get("children", {}):
            self.child(name).read_all()

    def get_tensor(self, name: str) -> torch.Tensor:
        read = self._root._read.get(f"{self.path}/{name}")
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
