"""The kinds of data a storage holds: tensors, TensorDicts (nested to any depth),
tensorclass instances and pytrees of tensors.

A store keeps flat ``{key: tensor}`` leaves; users hand a storage any of these kinds and
expect the same kind back. This module tells the kinds apart, flattens data into entries
(:func:`flatten`), builds data back from leaves read from a store (:func:`build`), and
applies the few operations a storage needs on any kind (stack a list, clone, index,
assign, move to a device).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensor_collection,
    is_tensorclass,
    lazy_stack,
)

from zarr_rb.errors import StoreCorruptedError, UnstackableError, UnsupportedDataError
from zarr_rb.format.names import Kind
from zarr_rb.format.schema import Schema
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.entries import Entry, PyValues, RaggedRows, decode
from zarr_rb.util.io import load_json
from zarr_rb.util.keys import Key


def kind_of(data: Any) -> Kind:
    if is_tensorclass(data):
        return "tensorclass"
    if is_tensor_collection(data):
        return "tensordict"
    if isinstance(data, torch.Tensor):
        return "tensor"
    if not pytree.tree_flatten(data)[1].is_leaf():
        return "pytree"
    raise UnsupportedDataError(
        f"expected a torch.Tensor, a TensorDict, a tensorclass instance or a pytree of "
        f"tensors (dicts, lists, tuples), got {type(data).__name__}",
    )


def device_of(data: Any) -> torch.device | None:
    """The device of data (``None`` for a collection without one)."""
    if kind_of(data) == "pytree":
        device = next(iter(_pytree_leaves(data).values())).device
    else:
        device = data.device
    return None if device is None else torch.device(device)


def _path_part(entry: Any) -> str:
    """One step of a pytree path as a key part: a dict key, a sequence index, an attribute."""
    if isinstance(entry, pytree.MappingKey):
        return str(entry.key)
    if isinstance(entry, pytree.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, pytree.GetAttrKey):
        return entry.name
    return str(entry)


def _pytree_leaves(data: Any) -> dict[Key, torch.Tensor]:
    leaves: dict[Key, torch.Tensor] = {}
    for path, value in pytree.tree_flatten_with_path(data)[0]:
        key = tuple(_path_part(entry) for entry in path)
        if not isinstance(value, torch.Tensor):
            raise UnsupportedDataError(
                f"pytree leaf {key!r} is a {type(value).__name__}; only tensor leaves can be "
                "stored",
            )
        if key in leaves:
            raise UnsupportedDataError(
                f"pytree leaves at {key!r} collide once their path is written as names "
                "(e.g. the keys 0 and '0' of one dict); rename one of them",
            )
        leaves[key] = value
    return leaves


def treespec_of(data: Any) -> str:
    """The structure of a pytree, as JSON."""
    try:
        return str(pytree.treespec_dumps(pytree.tree_flatten(data)[1]))
    except (TypeError, NotImplementedError) as err:
        raise UnsupportedDataError(f"cannot record the structure of this pytree ({err})") from None


@functools.lru_cache(maxsize=64)
def load_treespec(text: str) -> pytree.TreeSpec:
    """A recorded pytree structure (checked: stores are untrusted input)."""
    try:
        load_json(text.encode("utf-8"))  # bounded nesting before the recursive loader
        return pytree.treespec_loads(text)
    except (ValueError, TypeError, KeyError, RecursionError, NotImplementedError) as err:
        raise StoreCorruptedError(
            f"invalid zarr_rb metadata: the recorded pytree structure cannot be read "
            f"({type(err).__name__})",
        ) from None


def _as_tensordict(data: Any) -> TensorDictBase:
    if is_tensorclass(data):
        return compat.tensorclass_data(data)
    assert isinstance(data, TensorDictBase)
    return data


def flatten(data: Any) -> dict[Key, Entry]:
    """The entries of ``data`` keyed by tuple keys (``()`` for a bare tensor; the path of each
    leaf for a pytree, in the pytree's order): tensors, Python values (non-tensor entries)
    and, for lazy stacks of rows of different shapes, ragged rows."""
    kind = kind_of(data)
    if kind == "tensor":
        return {(): data}
    if kind == "pytree":
        return dict(_pytree_leaves(data))
    td = _as_tensordict(data)
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 and td.batch_dims == 1:
        return _flatten_rows(td)
    entries: dict[Key, Entry] = {}
    try:
        items = list(td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf))
    except RuntimeError as err:
        raise UnsupportedDataError(
            f"cannot read the entries of this {type(td).__name__} ({err}); rows of different "
            "shapes are stored from a lazy stack of rows (tensordict.lazy_stack of one "
            "TensorDict per row)",
        ) from None
    for key, value in items:
        path = key_tuple(key)
        if isinstance(value, (NonTensorData, NonTensorStack)):
            entries[path] = PyValues(_items(value, path))
        elif not isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise UnsupportedDataError(
                f"entry {path!r} is a {type(value).__name__}; only tensors and Python values "
                "(NonTensorData) can be stored",
            )
        else:
            entries[path] = value
    if not entries:
        raise UnsupportedDataError("cannot store a TensorDict without entries")
    return entries


def _items(value: NonTensorData | NonTensorStack, key: Key) -> list[object]:
    """The Python values of a non-tensor entry, one per element of its batch, in order."""
    if isinstance(value, NonTensorData) and not isinstance(value, NonTensorStack):
        return [value.data] * math.prod(value.batch_size)
    parts = value.tensordicts
    if value.batch_dims == 1 and all(type(part) is NonTensorData for part in parts):
        return [part.data for part in parts]  # as tolist(), without its per-element checks
    items: list[object] = value.tolist()
    for _ in range(value.batch_dims - 1):
        items = [item for row in items for item in row]  # type: ignore[attr-defined]
    return items


def _flatten_rows(stack: LazyStackedTensorDict) -> dict[Key, Entry]:
    """The entries of a lazy stack of rows: a key's rows are stacked when their shapes
    agree, kept as ragged rows when they differ."""
    rows = [flatten(row) for row in stack.tensordicts]
    if not rows:
        raise UnsupportedDataError("cannot store an empty lazy stack")
    keys = list(rows[0])
    entries: dict[Key, Entry] = {}
    for i, row in enumerate(rows):
        if row.keys() != rows[0].keys():
            missing = sorted(set(rows[0]).symmetric_difference(row))
            raise UnsupportedDataError(
                f"row {i} of the lazy stack has other keys than row 0 ({missing} differ); "
                "every row must hold the same keys",
            )
    for key in keys:
        parts = [row[key] for row in rows]
        if all(isinstance(part, PyValues) for part in parts):
            entries[key] = PyValues([item for part in parts for item in part.items])  # type: ignore[union-attr]
            continue
        if not all(isinstance(part, torch.Tensor) for part in parts):
            raise UnsupportedDataError(
                f"entry {key!r} holds tensors in some rows and other values in others",
            )
        tensors = [part for part in parts if isinstance(part, torch.Tensor)]
        if len({tuple(t.shape) for t in tensors}) == 1 and len({t.dtype for t in tensors}) == 1:
            entries[key] = torch.stack(tensors)
        else:
            entries[key] = RaggedRows(tensors)
    return entries


def tensors_of(data: Any) -> list[torch.Tensor]:
    """Every tensor ``data`` holds."""
    if kind_of(data) in ("tensor", "pytree"):
        return [t for t in pytree.tree_flatten(data)[0] if isinstance(t, torch.Tensor)]
    td = _as_tensordict(data)
    values = td.values(include_nested=True, leaves_only=True, is_leaf=_is_leaf)
    return [t for t in values if isinstance(t, torch.Tensor) and not is_tensor_collection(t)]


def nbytes_per_row(data: Any) -> int:
    """Bytes of one row (one index along dim 0) of the data ``data`` (not yet a store's: see
    ``Schema.row_nbytes`` for a store's), from shapes and dtypes only (nothing is read from
    lazy columns; rows of different lengths: their mean)."""
    total = 0
    for entry in flatten(data).values():
        if isinstance(entry, torch.Tensor):
            total += math.prod(entry.shape[1:]) * entry.dtype.itemsize
        elif isinstance(entry, RaggedRows):
            rows = entry.rows
            total += sum(row.numel() * row.dtype.itemsize for row in rows) // max(1, len(rows))
        else:
            total += 8
    return total


@functools.cache
def _is_leaf(cls: type) -> bool:
    """Leaves of a TensorDict: tensors and non-tensor entries."""
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


def tensorclass_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def remember_tensorclass(cls: type) -> str:
    name = tensorclass_name(cls)
    _SEEN_TENSORCLASSES[name] = cls
    return name


_SEEN_TENSORCLASSES: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()
"""Tensorclasses this process wrote, by name (also those defined inside a function, which
no import path reaches)."""


def resolve_tensorclass(name: str) -> type | None:
    """The tensorclass called ``name`` if this process wrote it or its module is already
    imported.

    Modules named in a store are never imported: opening a store must not run code.
    """
    seen = _SEEN_TENSORCLASSES.get(name)
    if seen is not None:
        return seen
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and is_tensorclass(obj) else None


def flip_list(data: list[Any]) -> Any:
    """A list of elements (``rb.extend([...])``) as one batch of them."""
    try:
        if all(is_tensor_collection(item) for item in data):
            try:
                return torch.stack(data)
            except RuntimeError:
                return lazy_stack(data)  # rows of different shapes
        for i, item in enumerate(data):
            for path, leaf in pytree.tree_flatten_with_path(item)[0]:
                if not isinstance(leaf, torch.Tensor):
                    raise UnsupportedDataError(
                        f"element {i} of the list holds a {type(leaf).__name__} at "
                        f"{pytree.keystr(path) or 'its root'}: the elements of a list are "
                        "stored as pytrees of tensors (wrap Python values of a TensorDict "
                        "in NonTensorData)",
                    )
        flat, specs = zip(*(pytree.tree_flatten(item) for item in data), strict=True)
        stacked = [torch.stack(items) for items in zip(*flat, strict=True)]
        return pytree.tree_unflatten(stacked, specs[0])
    except (RuntimeError, ValueError, TypeError) as err:
        raise UnstackableError(
            f"Stacking the elements of the list resulted in an error ({err}): ZarrStorage, "
            "like TorchRL's tensor storages, expects every element of the list to have the "
            "same structure and shapes. If the list is compact (each leaf already a batch), "
            "pass a tuple instead",
        ) from None


def clone(data: Any) -> Any:
    """A copy of data of any kind, bit for bit."""
    if kind_of(data) == "pytree":
        return pytree.tree_map(torch.clone, data)
    out = data.clone()
    # TensorDict.clone adds 0 to float tensors, which turns -0.0 into 0.0: copied again.
    for copy, source in zip(tensors_of(out), tensors_of(data), strict=True):
        if copy.is_floating_point():
            copy.copy_(source)
    return out


def select(data: Any, index: Any) -> Any:
    """``data[index]``, leaf by leaf for pytrees."""
    if kind_of(data) == "pytree":
        return pytree.tree_map(lambda leaf: leaf[index], data)
    return data[index]


def to_device(data: Any, device: torch.device) -> Any:
    if kind_of(data) == "pytree":
        return pytree.tree_map(lambda leaf: leaf.to(device), data)
    return data.to(device)


def assign(block: Any, index: Any, data: Any) -> None:
    """``block[index] = data``, leaf by leaf for pytrees."""
    if kind_of(block) != "pytree":
        block[index] = data
        return
    for target, value in zip(
        pytree.tree_flatten(block)[0], pytree.tree_flatten(data)[0], strict=True
    ):
        target[index] = value


def key_tuple(key: Any) -> Key:
    """A nested key (``"a"`` or ``("a", "b")``) as a tuple."""
    return (key,) if isinstance(key, str) else tuple(key)


def as_patch(patch: Mapping[Any, torch.Tensor], index: torch.Tensor) -> TensorDict:
    """``rb.update_if_present``'s patch (``{key: [n, ...]}``) as a TensorDict of ``n`` rows."""
    return TensorDict(
        {key_tuple(key): value for key, value in patch.items()}, batch_size=index.shape[:1]
    )


def build(
    leaves: Mapping[Key, torch.Tensor],
    *,
    schema: Schema,
    batch_shape: tuple[int, ...],
    device: torch.device | None,
) -> Any:
    """Assemble leaves (``[*batch_shape, ...]``) into the schema's data kind."""
    if schema.kind == "tensor":
        tensor = leaves[()]
        return tensor if device is None else tensor.to(device)
    if schema.kind == "pytree":
        assert schema.treespec is not None
        values = [leaves[leaf.key] for leaf in schema.leaves]
        if device is not None:
            values = [value.to(device) for value in values]
        return pytree.tree_unflatten(values, load_treespec(schema.treespec))
    others = [leaf for leaf in schema.leaves if leaf.value not in ("tensor", "lengths")]
    fixed = {leaf.key for leaf in schema.leaves if leaf.value == "tensor"}
    td: TensorDictBase
    if any(leaf.value == "ragged" for leaf in others):
        td = _row_stack(leaves, schema=schema, batch_shape=batch_shape, device=device)
    else:
        td = TensorDict(batch_size=(*batch_shape, *schema.item_batch_shape), device=device)
        for key, value in leaves.items():
            if key in fixed:
                td.set(key, value)
        n = math.prod(batch_shape)
        for leaf in others:
            stored = leaves[leaf.key]
            lengths = leaves.get(leaf.lengths_key) if leaf.ragged else None
            items = decode(
                leaf,
                stored.reshape(n, *stored.shape[len(batch_shape) :]),
                None if lengths is None else lengths.reshape(n),
            )
            td.set(leaf.key, _non_tensor_stack(items, batch_shape))
    if schema.kind == "tensorclass" and schema.tensorclass is not None:
        cls = resolve_tensorclass(schema.tensorclass)
        if cls is None:
            warnings.warn(
                f"tensorclass {schema.tensorclass} is not imported; returning a TensorDict. "
                "Import the module that defines it to get tensorclass instances back.",
                stacklevel=3,
            )
            return td
        return cls.from_tensordict(td)  # type: ignore[attr-defined]
    return td


def nest(items: list[Any], batch_shape: tuple[int, ...]) -> list[Any]:
    """Values in row order as nested lists of ``batch_shape``."""
    nested: list[Any] = items
    for size in reversed(batch_shape[1:]):
        nested = [nested[i : i + size] for i in range(0, len(nested), size)]
    return nested


def _non_tensor_stack(items: list[Any], batch_shape: tuple[int, ...]) -> NonTensorStack:
    """Python values (in row order) as a ``NonTensorStack`` of ``batch_shape``, as
    ``LazyTensorStorage`` returns its non-tensor entries."""
    stack: NonTensorStack = NonTensorStack.from_list(nest(items, batch_shape))
    return stack


def _row_stack(
    leaves: Mapping[Key, torch.Tensor],
    *,
    schema: Schema,
    batch_shape: tuple[int, ...],
    device: torch.device | None,
) -> TensorDictBase:
    """Rows holding entries of different lengths as a lazy stack of one TensorDict per row,
    as ``LazyStackStorage`` returns them."""
    n = math.prod(batch_shape)
    columns: list[tuple[Key, str, list[Any]]] = []
    for leaf in schema.leaves:
        if leaf.value == "lengths":
            continue
        values = leaves[leaf.key]
        values = values.reshape(n, *values.shape[len(batch_shape) :])
        if leaf.value == "tensor":
            columns.append((leaf.key, "tensor", list(values.unbind(0))))
            continue
        lengths = leaves.get(leaf.lengths_key) if leaf.ragged else None
        decoded = decode(leaf, values, None if lengths is None else lengths.reshape(n))
        columns.append((leaf.key, "tensor" if leaf.value == "ragged" else "value", decoded))
    rows = []
    for i in range(n):
        row = TensorDict(batch_size=(), device=device)
        for key, what, column in columns:
            if what == "tensor":
                row.set(key, column[i])
            else:
                row.set_non_tensor(key, column[i])
        rows.append(row)
    return _nest(rows, batch_shape)


def _nest(rows: list[TensorDictBase], batch_shape: tuple[int, ...]) -> TensorDictBase:
    if len(batch_shape) > 1:
        size = math.prod(batch_shape[1:])
        rows = [_nest(rows[i : i + size], batch_shape[1:]) for i in range(0, len(rows), size)]
    if not rows:
        return TensorDict(batch_size=batch_shape)
    stacked: TensorDictBase = lazy_stack(rows)
    return stacked
