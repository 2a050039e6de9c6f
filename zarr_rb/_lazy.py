"""Lazy columns: tensors whose rows stay on disk until something uses them.

``storage[:]`` must behave like LazyMemmapStorage's memory-mapped view:
``storage[:]["done"]`` reads the done flags and nothing else, and
``storage[:]["obs"][5]`` reads one row. A :class:`LazyColumn` is a tensor
subclass (``torch.Tensor._make_wrapper_subclass``) that carries only shape,
dtype and a reader. Row selections on its first dimension read just those rows;
any other operation reads the whole column once and runs on the real tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

RowReader = Callable[[np.ndarray], torch.Tensor]
"""Reads rows (positions in the column, any order, repeats allowed): ``[len(rows), ...]``."""


class LazyColumn(torch.Tensor):
    """A column of ``length`` rows read on demand through ``reader``."""

    _reader: RowReader
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, reader: RowReader) -> LazyColumn:
        self: LazyColumn = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=torch.device("cpu")
        )
        self._reader = reader
        self._value = None
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyColumn(shape={tuple(self.shape)}, dtype={self.dtype})"

    def materialize(self) -> torch.Tensor:
        """Read the whole column (once) and return it as a regular tensor."""
        if self._value is None:
            self._value = self._reader(np.arange(self.shape[0]))
        return self._value

    # Python-level conversions never reach __torch_dispatch__: route them to the data.
    def tolist(self) -> Any:
        return self.materialize().tolist()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        return self.materialize().numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.materialize().numpy()
        return array if dtype is None else array.astype(dtype)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickles (and torch.save) as the plain tensor it stands for.
        return self.materialize().__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def _read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self._value is not None:
            return self._value[rows]
        flat = rows.reshape(-1).to(torch.int64)
        flat = torch.where(flat < 0, flat + self.shape[0], flat)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(
                f"index out of range for a column of {self.shape[0]} rows: {rows.tolist()}"
            )
        return self._reader(flat.numpy()).reshape(*rows.shape, *self.shape[1:])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        for argument, value in zip(func._schema.arguments, args, strict=False):
            alias = argument.alias_info
            if isinstance(value, LazyColumn) and alias is not None and alias.is_write:
                raise TypeError(
                    f"{func} would write into a LazyColumn, a read-only view of rows on disk; "
                    "write through the storage instead (storage.set(index, data))",
                )
        if args and isinstance(args[0], LazyColumn) and args[0]._value is None and not kwargs:
            column: LazyColumn = args[0]
            if func is aten.select.int and args[1] == 0:
                return column._read_rows(torch.tensor([args[2]]))[0]
            if func is aten.slice.Tensor and (len(args) < 2 or args[1] == 0):
                start, stop, step = (*args[2:5], None, None, None)[:3]
                rows = torch.arange(column.shape[0])[slice(start, stop, step)]
                return column._read_rows(rows)
            if func is aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None:
                index = args[1][0]
                if index.dtype == torch.bool:
                    index = index.nonzero().squeeze(-1)
                return column._read_rows(index)

        def unwrap(value: Any) -> Any:
            return value.materialize() if isinstance(value, LazyColumn) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
