"""Entries that are not one tensor of a fixed shape per row, and the leaves that store them.

Two kinds of entries reach a storage besides fixed-shape tensors:

* **Python values**, one per row (``NonTensorData`` / ``NonTensorStack`` entries and the
  non-tensor fields of tensorclasses): ``str``, ``bytes``, ``int``, ``float``, ``bool`` or
  ``None``, one type per key. Numbers are stored as int64 / float64 / bool arrays; strings
  (as UTF-8) and bytes as rows of uint8 of different lengths.
* **Ragged rows**: a tensor per row whose first dimension differs from row to row (token
  ids, point clouds), as ``LazyStackStorage`` keeps them.

Rows of different lengths are stored padded with zeros along their first dimension, with
their lengths in a companion leaf (:meth:`LeafSpec.lengths_key`); :mod:`zarr_rb.core.store`
reads each row up to its length only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.errors import SchemaMismatchError, StoreCorruptedError, UnsupportedDataError
from zarr_rb.format.schema import SCALAR_DTYPES, LeafSpec, Value
from zarr_rb.util.keys import Key

_PYTHON_TYPES: dict[type, Value] = {
    str: "str",
    bytes: "bytes",
    bool: "bool",
    int: "int",
    float: "float",
    type(None): "none",
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def as_written(key: Key) -> str | Key:
    """A key as a user writes it: ``"tokens"``, or ``("next", "obs")`` when nested."""
    return key[0] if len(key) == 1 else key


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedRows:
    """The rows of one entry, each a tensor, whose first dimensions differ."""

    rows: Sequence[torch.Tensor]

    def __len__(self) -> int:
        return len(self.rows)


@dataclasses.dataclass(frozen=True, slots=True)
class PyValues:
    """One Python value per row (rows in order, over every batch dimension)."""

    items: Sequence[object]

    def __len__(self) -> int:
        return len(self.items)


Entry = torch.Tensor | RaggedRows | PyValues
"""What one key of written data holds, for all the rows written."""


def value_kind(items: Sequence[object], key: Key) -> Value:
    """The one kind of Python value that ``items`` hold."""
    kinds = {_PYTHON_TYPES.get(type(item)) for item in items}
    if None in kinds:
        other = next(item for item in items if type(item) not in _PYTHON_TYPES)
        raise UnsupportedDataError(
            f"entry {key!r} holds a {type(other).__name__}: non-tensor entries may hold str, "
            "bytes, int, float, bool or None values only; store other objects as tensors, "
            "or encode them (e.g. as bytes) first",
        )
    if len(kinds) > 1:
        raise UnsupportedDataError(
            f"entry {key!r} holds values of several types ({sorted(k or '' for k in kinds)}): "
            "a key holds one type of value in every row",
        )
    kind = next(iter(kinds)) if kinds else "none"
    assert kind is not None
    return kind


def ragged_spec(key: Key, rows: Sequence[torch.Tensor], dtype: str) -> LeafSpec:
    """The spec of a leaf of ragged rows: rows must differ in their first dimension only."""
    shapes = {tuple(row.shape[1:]) for row in rows}
    if any(row.ndim == 0 for row in rows) or len(shapes) > 1:
        raise UnsupportedDataError(
            f"entry {key!r}: rows of shapes {sorted({tuple(r.shape) for r in rows})[:4]} "
            "cannot be stored together; rows may differ in their first dimension only",
        )
    return LeafSpec(key=key, dtype=dtype, shape=next(iter(shapes)), value="ragged")


def pad(rows: Sequence[torch.Tensor], tail: tuple[int, ...], dtype: torch.dtype) -> Any:
    """Rows stacked along a new first dimension, padded with zeros to the longest:
    ``(padded [n, width, *tail], lengths [n])``."""
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    width = int(lengths.max()) if len(rows) else 0
    padded = torch.zeros((len(rows), width, *tail), dtype=dtype)
    for i, row in enumerate(rows):
        padded[i, : row.shape[0]] = row
    return padded, lengths


def encode(leaf: LeafSpec, entry: Entry, *, where: str) -> dict[Key, torch.Tensor]:
    """The leaf tensors (``[n, ...]``) that store ``entry`` under ``leaf``: the leaf's own,
    and the lengths of a leaf of rows of different lengths."""
    key = leaf.key
    if leaf.value == "tensor":
        if not isinstance(entry, torch.Tensor):
            described = "rows of different lengths" if isinstance(entry, RaggedRows) else "values"
            raise SchemaMismatchError(
                f"{where}: entry {key!r} holds {described}, the store holds it as a tensor of "
                f"shape {leaf.shape} per row. Rows of different lengths must be declared "
                f"when the store is created: ZarrStorage(..., ragged=[{as_written(key)!r}])",
            )
        return {key: entry}
    if leaf.value == "ragged":
        if isinstance(entry, PyValues):
            raise SchemaMismatchError(
                f"{where}: entry {key!r} holds Python values, the store holds tensors there"
            )
        dtype = entry.dtype if isinstance(entry, torch.Tensor) else dtype_of(entry, key)
        if str(dtype).removeprefix("torch.") != leaf.dtype:
            raise SchemaMismatchError(
                f"{where}: entry {key!r} has dtype {dtype}, the store holds torch.{leaf.dtype}; "
                "cast it before writing",
            )
        if isinstance(entry, torch.Tensor):
            if entry.ndim < 2 or tuple(entry.shape[2:]) != leaf.shape:
                raise SchemaMismatchError(
                    f"{where}: entry {key!r} has shape {tuple(entry.shape)}, expected rows of "
                    f"shape (length, *{leaf.shape})",
                )
            lengths = torch.full((entry.shape[0],), entry.shape[1], dtype=torch.int64)
            return {key: entry, leaf.lengths_key: lengths}
        shapes = {tuple(row.shape[1:]) for row in entry.rows}
        if any(row.ndim == 0 for row in entry.rows) or shapes - {leaf.shape}:
            raise SchemaMismatchError(
                f"{where}: entry {key!r} has rows of shapes "
                f"{sorted({tuple(r.shape) for r in entry.rows})[:4]}, the store holds rows of "
                f"shape (length, *{leaf.shape})",
            )
        padded, lengths = pad(entry.rows, leaf.shape, entry.rows[0].dtype)
        return {key: padded, leaf.lengths_key: lengths}
    # One Python value per row.
    if not isinstance(entry, PyValues):
        raise SchemaMismatchError(
            f"{where}: entry {key!r} holds a tensor, the store holds {leaf.value} values there"
        )
    kind = value_kind(entry.items, key)
    if kind != leaf.value and entry.items:
        raise SchemaMismatchError(
            f"{where}: entry {key!r} holds {kind} values, the store holds {leaf.value} values "
            "there (a key holds one type of value in every row)",
        )
    n = len(entry.items)
    if leaf.value in ("str", "bytes"):
        encoded = [_encode_bytes(item, key, where) for item in entry.items]
        rows = [torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy()) for b in encoded]
        padded, lengths = pad(rows, (), torch.uint8)
        return {key: padded, leaf.lengths_key: lengths}
    if leaf.value == "none":
        return {key: torch.zeros(n, dtype=torch.uint8)}
    if leaf.value == "int":
        outside = [item for item in entry.items if not _INT64_MIN <= item <= _INT64_MAX]  # type: ignore[operator]
        if outside:
            raise UnsupportedDataError(
                f"{where}: entry {key!r} holds the int {outside[0]}, outside int64 "
                f"[{_INT64_MIN}, {_INT64_MAX}]; store it as a string or as bytes instead",
            )
    return {key: torch.tensor(list(entry.items), dtype=TORCH_DTYPES[leaf.dtype]).reshape(n)}


def dtype_of(entry: RaggedRows, key: Key) -> torch.dtype:
    dtypes = {row.dtype for row in entry.rows}
    if len(dtypes) > 1:
        raise UnsupportedDataError(
            f"entry {key!r}: its rows have dtypes {sorted(map(str, dtypes))}; cast them to "
            "one dtype before writing",
        )
    return next(iter(dtypes))


def _encode_bytes(item: object, key: Key, where: str) -> bytes:
    if isinstance(item, bytes):
        return item
    assert isinstance(item, str)
    try:
        return item.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UnsupportedDataError(
            f"{where}: entry {key!r} holds a string that is not valid Unicode text "
            f"({err.reason} at position {err.start}: "
            f"{item[max(0, err.start - 8) : err.end + 8]!r}); "
            "store it as bytes instead",
        ) from None


def spec_for(key: Key, entry: Entry, *, lead: int, ragged: bool, dtype_name: str) -> LeafSpec:
    """The spec of a new leaf from its first write (``lead`` batch dimensions; ``ragged``:
    store a tensor entry as rows of different lengths)."""
    if isinstance(entry, PyValues):
        value = value_kind(entry.items, key)
        return LeafSpec(key=key, dtype=SCALAR_DTYPES[value], shape=(), value=value)
    if isinstance(entry, RaggedRows):
        return ragged_spec(key, entry.rows, dtype_name)
    shape = tuple(entry.shape[lead:])
    if ragged and shape:
        return LeafSpec(key=key, dtype=dtype_name, shape=shape[1:], value="ragged")
    return LeafSpec(key=key, dtype=dtype_name, shape=shape)


def decode(leaf: LeafSpec, values: torch.Tensor, lengths: torch.Tensor | None) -> list[Any]:
    """Each row of a leaf that is not a fixed-shape tensor: a tensor of its length (ragged),
    or its Python value."""
    if leaf.value == "ragged":
        assert lengths is not None
        # Copies: a view would keep the whole block, padded to its longest row, alive.
        return [values[i, :n].clone() for i, n in enumerate(lengths.tolist())]
    if leaf.value in ("str", "bytes"):
        assert lengths is not None
        raw = values.numpy()
        encoded = [raw[i, :n].tobytes() for i, n in enumerate(lengths.tolist())]
        if leaf.value == "bytes":
            return encoded
        try:
            return [item.decode("utf-8") for item in encoded]
        except UnicodeDecodeError as err:
            raise StoreCorruptedError(
                f"key {leaf.key!r} holds bytes that are not UTF-8 text ({err.reason}); the "
                "store is damaged (zarr_rb writes valid UTF-8 only)",
            ) from None
    if leaf.value == "none":
        return [None] * values.shape[0]
    items: list[Any] = values.reshape(-1).tolist()
    return items


ENTRY_KINDS = {
    "ragged": "rows of different lengths",
    "str": "strings",
    "bytes": "bytes",
    "int": "Python ints",
    "float": "Python floats",
    "bool": "Python bools",
    "none": "None values",
}
"""What an entry that no tensor column holds holds, by its leaf's value kind, for messages."""
