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
        key_tuple = (key,) if isinstance(key, str) else tuple(key)
        if not isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise UnsupportedDataError(
                f"entry {key_tuple!r} is a {type(value).__name__}; only tensor leaves can be "
                "stored (non-tensor data is not supported yet)",
            )
        leaves[key_tuple] = value
    if not leaves:
        raise UnsupportedDataError("cannot store a TensorDict without tensor leaves")
    return leaves


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
) -> dict[Key, torch.Tensor]:
    """Validate ``data`` against ``schema`` and return its leaves as ``[n, *row_shape]``.

    ``index_shape`` is the shape of the row index the data is written at (``()`` for a
    single row).
    """
    if kind_of(data) != schema.kind and {kind_of(data), schema.kind} != {
        "tensordict",
        "tensorclass",
    }:
        raise SchemaMismatchError(
            f"{where} holds {schema.kind} data, got a {type(data).__name__}",
        )
    leaves = flatten(data)
    expected = {leaf.key: leaf for leaf in schema.leaves}
    missing = sorted(set(expected) - set(leaves))
    extra = sorted(set(leaves) - set(expected))
    if missing or extra:
        raise SchemaMismatchError(
            f"{where}: the written data's keys differ from the stored keys "
            f"(missing: {missing}, unexpected: {extra}); every write must carry the same "
            "keys as the first one",
        )
    n = math.prod(index_shape)
    out: dict[Key, torch.Tensor] = {}
    for key, tensor in leaves.items():
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
    return out


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
    td = TensorDict(batch_size=(*batch_shape, *schema.item_batch_shape))
    for key, value in leaves.items():
        td.set(key, value)
    if device is not None:
        td = td.to(device)
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
