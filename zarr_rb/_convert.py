"""Data kinds <-> flat leaf dictionaries.

A storage keeps ``{key: tensor}`` leaves; users hand it tensors, TensorDicts
(nested to any depth) or tensorclass instances and expect the same kind back.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass

from zarr_rb._format import Kind, LeafSpec, Schema, parse_key, stored_dtype
from zarr_rb.errors import SchemaMismatchError, UnsupportedDataError

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
    raise UnsupportedDataError(
        f"expected a torch.Tensor, a TensorDict or a tensorclass instance, got "
        f"{type(data).__name__}",
    )


def device_of(data: Any) -> torch.device | None:
    """The device of a tensor or tensor collection (``None`` for a collection without one)."""
    device = data.device
    return None if device is None else torch.device(device)


def _as_tensordict(data: Any) -> TensorDictBase:
    if is_tensorclass(data):
        td: TensorDictBase = data._tensordict
        return td
    assert isinstance(data, TensorDictBase)
    return data


def flatten(data: Any) -> dict[Key, torch.Tensor]:
    """The leaves of ``data`` keyed by tuple keys (``()`` for a bare tensor)."""
    if kind_of(data) == "tensor":
        return {(): data}
    leaves: dict[Key, torch.Tensor] = {}
    for key, value in _as_tensordict(data).items(include_nested=True, leaves_only=True):
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
    if isinstance(data, torch.Tensor):
        leaves = [data]
    else:
        td = data._tensordict if is_tensorclass(data) else data
        leaves = list(td.values(include_nested=True, leaves_only=True))
    return sum(math.prod(leaf.shape[1:]) * leaf.dtype.itemsize for leaf in leaves)


def tensorclass_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_tensorclass(name: str) -> type | None:
    """The tensorclass called ``name`` if its module is already imported.

    Modules named in a store are never imported: opening a store must not run code.
    """
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
    data_batch = tuple(data.shape) if kind != "tensor" else tuple(data.shape[:lead])
    if len(data_batch) < lead:
        raise UnsupportedDataError(
            f"expected data with at least {lead} batch dimensions for ndim={ndim}, got batch "
            f"shape {data_batch}",
        )
    trailing = data_batch[1:lead] if batched else data_batch[:lead]
    rows = -(-max_size // max(1, math.prod(trailing)))
    item_batch = data_batch[lead:] if kind != "tensor" else ()
    leaves = []
    for key, tensor in flatten(data).items():
        dtype = dtype_name(tensor.dtype)
        stored_dtype(dtype)
        leaves.append(
            LeafSpec(key=parse_key(key, kind=kind), dtype=dtype, shape=tuple(tensor.shape[lead:]))
        )
    return Schema(
        kind=kind,
        batch_shape=(rows, *trailing),
        leaves=tuple(sorted(leaves, key=lambda leaf: leaf.key)),
        tensorclass=tensorclass_name(type(data)) if kind == "tensorclass" else None,
        item_batch_shape=tuple(item_batch),
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
        out[key] = tensor.detach().to("cpu").reshape(n, *row_shape)
    return out, new


def new_leaves(data: Any, *, schema: Schema, lead: int, where: str) -> list[LeafSpec]:
    """Specs of the keys of ``data`` that the store does not hold (new columns), whose first
    ``lead`` dimensions are batch dimensions."""
    _check_kind(data, schema, where)
    held = {leaf.key for leaf in schema.leaves}
    new = []
    for key, tensor in flatten(data).items():
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
        return cls._from_tensordict(td)  # type: ignore[attr-defined]
    return td
