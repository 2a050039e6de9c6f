"""Lazy columns: tensors whose rows stay on disk until something uses them.

``storage[:]`` must behave like LazyMemmapStorage's memory-mapped view:
``storage[:]["done"]`` reads the done flags and nothing else, ``storage[:]["obs"][5]``
reads one row, and a write into it (``storage[:]["done"][5] = True``,
``storage[:].set_(key, value)``, ``td.update_(...)``) lands in the store.

A :class:`LazyColumn` is a tensor subclass (a wrapper subclass, see PyTorch's docs) that
carries a :class:`ColumnSource`, the rows of it it stands for, and the view operations
applied to them since (``col[3]``, ``col[:, 1]``, ``col.unbind(1)[0]``, ...), so that views
stay lazy and writable:

* a view on the rows (a slice or an integer on the first dimension) narrows the rows;
* any other view (on later dimensions, a reshape, an unbind) is recorded and replayed
  on the rows once read;
* a write (an in-place op, ``copy_``, ``index_put_``, an ``out=``) reads the rows the
  view covers, applies the op to them and writes them back; copies into whole rows and
  row-indexed assignments write without reading first;
* any other operation reads the rows and runs on a plain tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils._pytree import tree_map

from zarr_rb.torchrl import compat

ViewOp = tuple[Any, tuple[Any, ...], dict[str, Any], int | None]
"""A view operation: the aten op, its arguments after the tensor, its keyword arguments, and
for ops returning several views (unbind, split) which one."""

_aten = torch.ops.aten


class ColumnSource(Protocol):
    """Rows of one leaf: how many there are, and how to read and write them."""

    @property
    def length(self) -> int: ...

    @property
    def revision(self) -> int:
        """Changes whenever the rows may have changed (cached reads are then stale)."""
        ...

    def read(self, rows: np.ndarray) -> torch.Tensor:
        """Rows (any order, repeats allowed) as ``[len(rows), ...]``."""
        ...

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """``values[i]`` into row ``rows[i]`` (any order; the last of repeated rows wins)."""
        ...


@runtime_checkable
class ValuesSource(Protocol):
    """Rows of an entry of Python values (strings...), which no tensor holds."""

    def python_values(self, rows: np.ndarray) -> list[Any]:
        """The values of ``rows``, in order."""
        ...

    def refuse(self) -> Exception:
        """The error for reading the entry as a tensor."""
        ...


class _Reader:
    """A read-only source from a row reader (columns that nothing writes into)."""

    def __init__(self, length: int, reader: Callable[[np.ndarray], torch.Tensor]) -> None:
        self._length = length
        self._reader = reader

    @property
    def length(self) -> int:
        return self._length

    @property
    def revision(self) -> int:
        return 0

    def read(self, rows: np.ndarray) -> torch.Tensor:
        return self._reader(rows)

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        raise TypeError("this LazyColumn is a read-only view of rows on disk")


_ONE_ROW: tuple[ViewOp, ...] = ((_aten.select.int, (0, 0), {}, None),)
"""The tail of a view of one row of a column."""


class LazyColumn(torch.Tensor):
    """A column of rows read on demand (and written back) through a :class:`ColumnSource`."""

    _source: ColumnSource
    _rows: np.ndarray
    _tail: tuple[ViewOp, ...]
    _element: tuple[int, ...]
    _cache: tuple[int, torch.Tensor] | None

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        reader: Callable[[np.ndarray], torch.Tensor] | None = None,
        *,
        source: ColumnSource | None = None,
    ) -> LazyColumn:
        """A column of ``shape[0]`` rows of ``shape[1:]``, read by ``reader`` (read-only) or
        read and written through ``source``."""
        if source is None:
            if reader is None:
                raise TypeError("LazyColumn needs a reader or a source")
            source = _Reader(int(shape[0]), reader)
        return cls._make(source, np.arange(shape[0]), (), tuple(shape[1:]), dtype)

    @classmethod
    def _make(
        cls,
        source: ColumnSource,
        rows: np.ndarray,
        tail: tuple[ViewOp, ...],
        element: tuple[int, ...],
        dtype: torch.dtype,
    ) -> LazyColumn:
        meta = _replay(torch.empty((rows.size, *element), dtype=dtype, device="meta"), tail)
        self: LazyColumn = compat.make_wrapper_subclass(cls, meta, dtype)
        self._source = source
        self._rows = rows
        self._tail = tail
        self._element = element
        self._cache = None
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyColumn(shape={tuple(self.shape)}, dtype={self.dtype})"

    def materialize(self) -> torch.Tensor:
        """Read the rows (once per change of the source) and return them as a plain tensor."""
        revision = self._source.revision
        if self._cache is None or self._cache[0] != revision:
            value = _replay(self._source.read(self._rows), self._tail)
            self._cache = (revision, value)
        return self._cache[1]

    # Python-level conversions never reach __torch_dispatch__: route them to the data.
    def tolist(self) -> Any:
        source = self._source
        if isinstance(source, ValuesSource):  # a column of Python values: those values
            if not self._tail:
                return source.python_values(self._rows)
            if self._tail == _ONE_ROW:
                return source.python_values(self._rows)[0]
            raise source.refuse()
        return self.materialize().tolist()

    def __iter__(self) -> Any:
        if isinstance(self._source, ValuesSource) and not self._tail:
            return iter(self.tolist())
        return super().__iter__()  # type: ignore[no-untyped-call]

    def numpy(self, *, force: bool = False) -> np.ndarray:
        return self.materialize().numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.materialize().numpy()
        return array if dtype is None else array.astype(dtype)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickles (and torch.save) as the plain tensor it stands for.
        return self.materialize().__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        # A copy of the rows now, a plain tensor (as a pickled column comes back).
        copy = self.materialize().clone()
        memo[id(self)] = copy
        return copy

    # --- views -------------------------------------------------------------------------

    def _view(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._tail and not kwargs:
            if func is _aten.select.int and args[0] == 0:
                index = int(args[1])
                index += self._rows.size if index < 0 else 0
                if not 0 <= index < self._rows.size:
                    raise IndexError(
                        f"index {args[1]} is out of range for a column of {self._rows.size} rows"
                    )
                rows = self._rows[index : index + 1]
                return self._with(rows, ((_aten.select.int, (0, 0), {}, None),))
            if func is _aten.slice.Tensor and (not args or args[0] == 0):
                start, stop, step = (*args[1:4], None, None, None)[:3]
                return self._with(self._rows[slice(start, stop, step)], ())
        outputs = func(torch.empty(self.shape, dtype=self.dtype, device="meta"), *args, **kwargs)
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(
                self._with(self._rows, (*self._tail, (func, args, kwargs, i)))
                for i in range(len(outputs))
            )
        return self._with(self._rows, (*self._tail, (func, args, kwargs, None)))

    def _with(self, rows: np.ndarray, tail: tuple[ViewOp, ...]) -> LazyColumn:
        return self._make(self._source, rows, tail, self._element, self.dtype)

    # --- writes ------------------------------------------------------------------------

    def _write_whole_rows(self, value: torch.Tensor) -> None:
        """Write ``value`` (broadcast to this view's shape) into every row of the view."""
        rows = self._rows
        value = value.to(self.dtype).expand(self.shape)
        self._source.write(rows, value.reshape(rows.size, *self._element))

    def _covers_whole_rows(self) -> bool:
        return not self._tail or self._tail == _ONE_ROW

    def _write(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, leading: bool
    ) -> Any:
        """Run ``func``, which writes into this view, on its rows and write them back.

        ``leading``: the view is ``func``'s first argument (an in-place op), not an ``out=``.
        """
        if leading and not kwargs and self._covers_whole_rows():
            if func is _aten.copy_.default:
                self._write_whole_rows(_plain(args[1]))
                return self
            if func is _aten.fill_.Scalar or func is _aten.zero_.default:
                fill = 0 if func is _aten.zero_.default else args[1]
                self._write_whole_rows(torch.full((), fill, dtype=self.dtype))
                return self
            accumulate = len(args) > 3 and args[3]
            if (
                func is _aten.index_put_.default
                and not self._tail
                and not accumulate
                and _row_index(args[1])
            ):
                index = _as_rows(args[1][0])
                rows = self._rows[index.reshape(-1)]
                value = _plain(args[2]).to(self.dtype).expand((*index.shape, *self._element))
                self._source.write(rows, value.reshape(rows.size, *self._element))
                return self
        base = self._source.read(self._rows)
        target = _replay(base, self._tail)

        def swap(value: Any) -> Any:
            return target if value is self else _plain(value)

        result = func(*tree_map(swap, args), **tree_map(swap, kwargs))
        self._source.write(self._rows, base)
        return tree_map(lambda value: self if value is target else value, result)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # The column's own methods run on it as ``cls.method(column, ...)``: what a column
        # holds stays its own (no other code reads a column's rows, source or views).
        kwargs = kwargs or {}
        written = _written_column(func, args, kwargs)
        if written is not None:
            column, position, listed = written
            if listed and len(args[position]) > 1:
                return _write_each(func, args, kwargs, position)
            return cls._write(column, func, args, kwargs, leading=position == 0 and not listed)
        if args and isinstance(args[0], LazyColumn) and func.is_view:
            return cls._view(args[0], func, args[1:], kwargs)
        if func is _aten.index.Tensor and isinstance(args[0], LazyColumn) and _row_index(args[1]):
            rows = cls._rows_at(args[0], args[1][0])
            if rows is not None:
                return rows
        return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))

    def _rows_at(self, index: torch.Tensor) -> torch.Tensor | None:
        """``self[index]`` for an index of rows, read from the source (only those rows);
        ``None`` for a view with operations applied after its rows."""
        if self._tail:
            return None
        rows = _as_rows(index)
        flat = self._rows[rows.reshape(-1)]
        return self._source.read(flat).reshape(*rows.shape, *self._element)


def _plain(value: Any) -> Any:
    return value.materialize() if isinstance(value, LazyColumn) else value


def _written_column(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[LazyColumn, int, bool] | None:
    """The LazyColumn ``func`` writes into, its position among the arguments, and whether
    it is in a list there (the ``_foreach_*_`` ops TensorDict uses for ``update_``,
    ``copy_``...)."""
    for position, argument in enumerate(compat.op_schema(func).arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        if isinstance(value, LazyColumn):
            return value, position, False
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, LazyColumn):
                    return item, position, True
    return None


def _write_each(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], position: int) -> Any:
    """Run a ``_foreach_*_`` op that writes into LazyColumns one element at a time: each
    LazyColumn takes its own write, the plain tensors theirs."""
    targets = args[position]
    n = len(targets)
    if func is compat.FOREACH_COPY:
        for target, source in zip(targets, args[1], strict=True):
            target.copy_(_plain(source))  # a LazyColumn writes it through
        return None
    for i in range(n):

        def pick(value: Any, i: int = i) -> Any:
            if isinstance(value, (list, tuple)) and len(value) == n:
                return [value[i]]
            return value

        func(*(pick(value) for value in args), **{k: pick(v) for k, v in kwargs.items()})
    return None


def _row_index(indices: Any) -> bool:
    """Whether ``indices`` (of an ``index``/``index_put_``) picks rows only."""
    return (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and isinstance(indices[0], torch.Tensor)
        and not isinstance(indices[0], LazyColumn)
        and (indices[0].dtype == torch.bool or not indices[0].is_floating_point())
    )


def _as_rows(index: torch.Tensor) -> np.ndarray:
    if index.dtype == torch.bool:
        index = index.nonzero().squeeze(-1)
    return index.cpu().numpy().astype(np.int64)


def _replay(tensor: torch.Tensor, tail: tuple[ViewOp, ...]) -> torch.Tensor:
    for func, args, kwargs, which in tail:
        out = func(tensor, *args, **kwargs)
        tensor = out if which is None else out[which]
    return tensor
