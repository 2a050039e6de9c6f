"""Data written to a storage as the leaves of its store.

The first write of a store gives its schema (:func:`infer_schema`: keys, dtypes, shapes,
which entries are rows of different lengths or Python values); every write is checked
against it and turned into ``{key: [n, *row_shape]}`` leaves (:func:`leaves_for_write`),
with the specs of keys the store does not hold yet (new columns).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zarr_rb.errors import SchemaMismatchError, UnsupportedDataError
from zarr_rb.format.dtypes import stored_dtype
from zarr_rb.format.names import Kind, check_new_keys, parse_key
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.torchrl.columns import LazyColumn
from zarr_rb.torchrl.data_kinds import (
    flatten,
    key_tuple,
    kind_of,
    remember_tensorclass,
    treespec_of,
)
from zarr_rb.torchrl.entries import Entry, RaggedRows, as_written, dtype_of, encode, spec_for
from zarr_rb.util.keys import Key

Ragged = bool | frozenset[Key]
"""Which tensor entries a new store keeps as rows of different lengths besides those whose
rows differ in the first write: all of them (``True``), those keys, or none."""


def ragged_keys(value: bool | str | Sequence[str | tuple[str, ...]]) -> Ragged:
    """ZarrStorage's ``ragged=`` as :data:`Ragged`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return frozenset({(value,)})
    return frozenset(key_tuple(key) for key in value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _specs(
    key: Key,
    entry: Entry,
    *,
    kind: Kind,
    lead: int,
    ragged: Ragged,
    batch_dims: int,
    item_batch: tuple[int, ...],
) -> list[LeafSpec]:
    """The specs of a new leaf (and of its lengths leaf) from its first write."""
    key = parse_key(key, kind=kind)
    if isinstance(entry, torch.Tensor):
        dtype = dtype_name(entry.dtype)
    elif isinstance(entry, RaggedRows):
        dtype = dtype_name(dtype_of(entry, key))
    else:
        dtype = "uint8"
    stored_dtype(dtype)
    wanted = ragged if isinstance(ragged, bool) else key in ragged
    wanted = wanted and kind in ("tensordict", "tensorclass")  # tensors, pytrees: fixed rows
    leaf = spec_for(key, entry, lead=lead, ragged=wanted, dtype_name=dtype)
    if leaf.value != "tensor" and item_batch:
        raise UnsupportedDataError(
            f"entry {key!r}: Python values and rows of different lengths need data whose batch "
            f"dimensions are the storage's ({item_batch} more here)",
        )
    if leaf.ragged and batch_dims != 1:
        raise UnsupportedDataError(
            f"entry {key!r}: strings, bytes and rows of different lengths are stored in "
            "1-dimensional storages (ndim=1) only",
        )
    return [leaf.lengths_leaf(), leaf] if leaf.ragged else [leaf]


def infer_schema(
    data: Any, *, batched: bool, ndim: int, max_size: int, ragged: Ragged = False
) -> Schema:
    """The schema of a store from the first data written to it.

    Args:
        data: the first write.
        batched: whether ``data`` carries a leading row dimension (``extend``) or is a
            single element (``add``).
        ndim: the storage's number of batch dimensions.
        max_size: the storage's capacity in elements.
        ragged: tensor entries to keep as rows of different lengths (besides those whose
            rows differ in ``data``).
    """
    kind = kind_of(data)
    lead = ndim if batched else ndim - 1
    leaves_of_data = flatten(data)
    if kind != "tensor":  # a bare tensor's one array has the format's own name
        check_new_keys(leaves_of_data)
    if kind in ("tensor", "pytree"):
        first = next(iter(leaves_of_data.values()))
        assert isinstance(first, torch.Tensor)
        data_batch = tuple(first.shape[:lead])
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
    leaves = [
        spec
        for key, entry in leaves_of_data.items()
        for spec in _specs(
            key,
            entry,
            kind=kind,
            lead=lead,
            ragged=ragged,
            batch_dims=ndim,
            item_batch=item_batch,
        )
    ]
    return Schema(
        kind=kind,
        batch_shape=(rows, *trailing),
        # A pytree's leaves keep its own order (rebuilding it needs that order).
        leaves=tuple(leaves if kind == "pytree" else sorted(leaves, key=lambda leaf: leaf.key)),
        tensorclass=remember_tensorclass(type(data)) if kind == "tensorclass" else None,
        item_batch_shape=tuple(item_batch),
        treespec=treespec_of(data) if kind == "pytree" else None,
    )


def leaves_for_write(
    data: Any,
    *,
    schema: Schema,
    index_shape: tuple[int, ...],
    where: str,
    ragged: Ragged = False,
) -> tuple[dict[Key, torch.Tensor], list[LeafSpec]]:
    """Validate ``data`` against ``schema`` and return its leaves as ``[n, *row_shape]``.

    ``index_shape`` is the shape of the row index the data is written at (``()`` for a
    single row). Keys the store does not hold yet are new columns: their specs are
    returned too (their leaves are among the returned ones). Keys of the store that
    ``data`` lacks keep their values in the rows written.
    """
    _check_kind(data, schema, where)
    lead = len(index_shape) + len(schema.batch_shape) - 1
    entries = flatten(data)
    new = _new_specs(entries, schema=schema, lead=lead, where=where, ragged=ragged)
    expected = {leaf.key: leaf for leaf in (*schema.leaves, *new)}
    n = math.prod(index_shape)
    trailing = schema.batch_shape[1:]
    out: dict[Key, torch.Tensor] = {}
    for key, entry in entries.items():
        leaf = expected[key]
        if leaf.value == "tensor" and isinstance(entry, torch.Tensor):
            out[key] = _fixed_rows(entry, leaf, index_shape, trailing, where)
            continue
        if isinstance(entry, torch.Tensor):
            # A tensor written to a leaf of rows of different lengths: all rows of its length.
            entry = _plain(entry).reshape(n, *entry.shape[len(index_shape) :])
        count = len(entry) if not isinstance(entry, torch.Tensor) else entry.shape[0]
        if count != n * math.prod(trailing):
            raise SchemaMismatchError(
                f"{where}: entry {key!r} holds {count} rows, expected {n} (index shape "
                f"{index_shape})",
            )
        for part, value in encode(leaf, entry, where=where).items():
            out[part] = value.detach().to("cpu").reshape(n, *trailing, *value.shape[1:])
    return out, new


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, LazyColumn):
        return tensor.materialize()  # read before any of the rows written changes
    return tensor


def _fixed_rows(
    tensor: torch.Tensor,
    leaf: LeafSpec,
    index_shape: tuple[int, ...],
    trailing: tuple[int, ...],
    where: str,
) -> torch.Tensor:
    key = leaf.key
    row_shape = (*trailing, *leaf.shape)
    if dtype_name(tensor.dtype) != leaf.dtype:
        raise SchemaMismatchError(
            f"{where}: entry {key!r} has dtype {tensor.dtype}, the store holds "
            f"torch.{leaf.dtype}; cast it before writing",
        )
    shape = tuple(tensor.shape)
    if shape != (*index_shape, *row_shape):
        expected = (*index_shape, *row_shape)
        lead = len(index_shape) + len(trailing)
        if shape[:lead] != (*index_shape, *trailing):
            raise SchemaMismatchError(
                f"{where}: entry {key!r} has shape {shape}, expected {expected} (index shape "
                f"{index_shape} + stored shape {row_shape})",
            )
        # The rows' own shape differs from the one the key's first write stored.
        got, held, name = list(shape[lead:]), list(leaf.shape), as_written(key)
        message = (
            f"{where}: shape mismatch: rows of {name!r} have shape {got}, the store holds rows "
            f"of shape {held}, set by the first write of that key (entry {key!r} has shape "
            f"{shape}, expected {expected}). Either write rows of shape {held} (the same "
            "frame stack, image size, ... as before), or write these to a new store"
        )
        if len(got) == len(held) and got[1:] == held[1:]:
            message += (
                f"; if rows of {name!r} are sequences whose length varies from row to row, "
                f"create the store with ZarrStorage(..., ragged=[{name!r}])"
            )
        raise SchemaMismatchError(message)
    return _plain(tensor).detach().to("cpu").reshape(math.prod(index_shape), *row_shape)


def new_leaves(
    data: Any, *, schema: Schema, lead: int, where: str, ragged: Ragged = False
) -> list[LeafSpec]:
    """Specs of the keys of ``data`` that the store does not hold (new columns), whose first
    ``lead`` dimensions are batch dimensions."""
    _check_kind(data, schema, where)
    return _new_specs(flatten(data), schema=schema, lead=lead, where=where, ragged=ragged)


def _new_specs(
    entries: Mapping[Key, Entry], *, schema: Schema, lead: int, where: str, ragged: Ragged
) -> list[LeafSpec]:
    held = {leaf.key for leaf in schema.leaves}
    if schema.kind == "pytree" and entries.keys() != held:
        raise SchemaMismatchError(
            f"{where}: the pytree written has leaves {sorted(entries)}, the store holds "
            f"{sorted(held)}; every write must have the structure of the first one",
        )
    check_new_keys([key for key in entries if key not in held], held=held, where=where)
    new = []
    for key, entry in entries.items():
        if key in held:
            continue
        if isinstance(entry, torch.Tensor) and entry.ndim < lead:
            raise SchemaMismatchError(
                f"{where}: new entry {key!r} has shape {tuple(entry.shape)}, expected at "
                f"least {lead} batch dimensions",
            )
        new.extend(
            _specs(
                key,
                entry,
                kind="tensordict",
                lead=lead,
                ragged=ragged,
                batch_dims=len(schema.batch_shape),
                item_batch=schema.item_batch_shape,
            )
        )
    return new


def _check_kind(data: Any, schema: Schema, where: str) -> None:
    if kind_of(data) != schema.kind and {kind_of(data), schema.kind} != {
        "tensordict",
        "tensorclass",
    }:
        raise SchemaMismatchError(
            f"{where} holds {schema.kind} data, got a {type(data).__name__}",
        )
