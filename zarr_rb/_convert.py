"""Data kinds <-> flat leaf dictionaries.

A storage keeps ``{key: tensor}`` leaves; users hand it tensors, TensorDicts
(nested to any depth) or tensorclass instances and expect the same kind back.
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
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensor_collection,
    is_tensorclass,
)

from zarr_rb._format import Kind, LeafSpec, Schema, parse_key, stored_dtype
from zarr_rb._io import load_json
from zarr_rb._lazy import LazyColumn
from zarr_rb.errors import (
    SchemaMismatchError,
    StoreCorruptedError,
    UnstackableError,
    UnsupportedDataError,
)

Key = tuple[str, ...]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    device = next(iter(flatten(data).values())).device if kind_of(data) == "pytree" else data.device
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
        td: TensorDictBase = data._tensordict
        return td
    assert isinstance(data, TensorDictBase)
    return data


def flatten(data: Any) -> dict[Key, torch.Tensor]:
    """The leaves of ``data`` keyed by tuple keys (``()`` for a bare tensor; the path of each
    leaf for a pytree, in the pytree's order)."""
    kind = kind_of(data)
    if kind == "tensor":
        return {(): data}
    if kind == "pytree":
        return _pytree_leaves(data)
    leaves: dict[Key, torch.Tensor] = {}
    # Non-tensor entries (strings, NonTensorData) are leaves too: listed, so that they are
    # refused rather than silently left out.
    entries = _as_tensordict(data).items(include_nested=True, leaves_only=True, is_leaf=_is_leaf)
    for key, value in entries:
        path = key_tuple(key)
        if not isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise UnsupportedDataError(
                f"entry {path!r} is a {type(value).__name__}; only tensor leaves can be "
                "stored (non-tensor data is not supported yet)",
            )
        leaves[path] = value
    if not leaves:
        raise UnsupportedDataError("cannot store a TensorDict without tensor leaves")
    return leaves


def row_nbytes(data: Any) -> int:
    """Bytes of one row (one index along dim 0) of ``data``, from shapes and dtypes only
    (nothing is read from lazy columns)."""
    leaves = flatten(data).values()
    return sum(math.prod(leaf.shape[1:]) * leaf.dtype.itemsize for leaf in leaves)


def _is_leaf(cls: type) -> bool:
    """Leaves of a TensorDict: tensors and non-tensor entries."""
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


def tensorclass_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _remember_tensorclass(cls: type) -> str:
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


def infer_schema(data: Any, *, batched: bool, ndim: int, max_size: int) -> Schema:
    """The schema of a store from the first data written to it.

    Args:
        data: the first write.
        batched: whether ``data`` carries a leading row dimension (``extend``) or is a
            single element (``add``).
        ndim: the storage's number of batch dimensions.
        max_size: the storage's capacity in elements.
    """
    kind = kind_of(data)
    lead = ndim if batched else ndim - 1
    leaves_of_data = flatten(data)
    if kind in ("tensor", "pytree"):
        data_batch = tuple(next(iter(leaves_of_data.values())).shape[:lead])
    else:
        data_batch = tuple(data.shape)
    if len(data_batch) < lead:
        raise UnsupportedDataError(
            f"expected data with at least {lead} batch dimensions for ndim={ndim}, got batch "
            f"shape {data_batch}",
        )
    trailing = data_batch[1:lead] if batched else data_batch[:lead]
    rows = -(-max_size // max(1, math.prod(trailing)))
    item_batch = data_batch[lead:] if kind not in ("tensor", "pytree") else ()
    leaves = []
    for key, tensor in leaves_of_data.items():
        dtype = dtype_name(tensor.dtype)
        stored_dtype(dtype)
        leaves.append(
            LeafSpec(key=parse_key(key, kind=kind), dtype=dtype, shape=tuple(tensor.shape[lead:]))
        )
    return Schema(
        kind=kind,
        batch_shape=(rows, *trailing),
        # A pytree's leaves keep its own order (rebuilding it needs that order).
        leaves=tuple(leaves if kind == "pytree" else sorted(leaves, key=lambda leaf: leaf.key)),
        tensorclass=_remember_tensorclass(type(data)) if kind == "tensorclass" else None,
        item_batch_shape=tuple(item_batch),
        treespec=treespec_of(data) if kind == "pytree" else None,
    )


def leaves_for_write(
    data: Any, *, schema: Schema, index_shape: tuple[int, ...], where: str
) -> tuple[dict[Key, torch.Tensor], list[LeafSpec]]:
    """Validate ``data`` against ``schema`` and return its leaves as ``[n, *row_shape]``.

    ``index_shape`` is the shape of the row index the data is written at (``()`` for a
    single row). Keys the store does not hold yet are new columns: their specs are
    returned too (their leaves are among the returned ones). Keys of the store that
    ``data`` lacks keep their values in the rows written.
    """
    _check_kind(data, schema, where)
    lead = len(index_shape) + len(schema.batch_shape) - 1
    new = new_leaves(data, schema=schema, lead=lead, where=where)
    expected = {leaf.key: leaf for leaf in (*schema.leaves, *new)}
    n = math.prod(index_shape)
    out: dict[Key, torch.Tensor] = {}
    for key, tensor in flatten(data).items():
        leaf = expected[key]
        row_shape = (*schema.batch_shape[1:], *leaf.shape)
        if dtype_name(tensor.dtype) != leaf.dtype:
            raise SchemaMismatchError(
                f"{where}: entry {key!r} has dtype {tensor.dtype}, the store holds "
                f"torch.{leaf.dtype}; cast it before writing",
            )
        shape = tuple(tensor.shape)
        if shape != (*index_shape, *row_shape):
            raise SchemaMismatchError(
                f"{where}: entry {key!r} has shape {shape}, expected "
                f"{(*index_shape, *row_shape)} (index shape {index_shape} + stored shape "
                f"{row_shape})",
            )
        if isinstance(tensor, LazyColumn):
            tensor = tensor.materialize()  # read before any of the rows written changes
        out[key] = tensor.detach().to("cpu").reshape(n, *row_shape)
    return out, new


def new_leaves(data: Any, *, schema: Schema, lead: int, where: str) -> list[LeafSpec]:
    """Specs of the keys of ``data`` that the store does not hold (new columns), whose first
    ``lead`` dimensions are batch dimensions."""
    _check_kind(data, schema, where)
    held = {leaf.key for leaf in schema.leaves}
    leaves = flatten(data)
    if schema.kind == "pytree" and leaves.keys() != held:
        raise SchemaMismatchError(
            f"{where}: the pytree written has leaves {sorted(leaves)}, the store holds "
            f"{sorted(held)}; every write must have the structure of the first one",
        )
    new = []
    for key, tensor in leaves.items():
        if key in held:
            continue
        dtype = dtype_name(tensor.dtype)
        stored_dtype(dtype)
        if tensor.ndim < lead:
            raise SchemaMismatchError(
                f"{where}: new entry {key!r} has shape {tuple(tensor.shape)}, expected at "
                f"least {lead} batch dimensions",
            )
        new.append(LeafSpec(key=parse_key(key), dtype=dtype, shape=tuple(tensor.shape[lead:])))
    return new


def _check_kind(data: Any, schema: Schema, where: str) -> None:
    if kind_of(data) != schema.kind and {kind_of(data), schema.kind} != {
        "tensordict",
        "tensorclass",
    }:
        raise SchemaMismatchError(
            f"{where} holds {schema.kind} data, got a {type(data).__name__}",
        )


def flip_list(data: list[Any]) -> Any:
    """A list of elements (``rb.extend([...])``) as one batch of them."""
    try:
        if all(is_tensor_collection(item) for item in data):
            return torch.stack(data)
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
    """A copy of data of any kind."""
    if kind_of(data) == "pytree":
        return pytree.tree_map(torch.clone, data)
    return data.clone()


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
    td = TensorDict(batch_size=(*batch_shape, *schema.item_batch_shape), device=device)
    for key, value in leaves.items():
        td.set(key, value)
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
