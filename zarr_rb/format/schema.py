"""What a store holds: its :class:`Schema` (the data kind, the batch shape, the leaves) and
each leaf's :class:`LeafSpec` (key, dtype, element shape, and what one row of it holds), as
the record keeps them and parsed back from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from zarr_rb.errors import StoreCorruptedError, UnsupportedDataError
from zarr_rb.format._parse import _expect, _parse_int_list
from zarr_rb.format.dtypes import STORED_DTYPES, stored_dtype
from zarr_rb.format.names import KINDS, LENGTHS_GROUP, Kind, array_path, parse_key

_MAX_TREESPEC_CHARS = 2**20
_MAX_LEAVES = 10_000

Value = Literal["tensor", "ragged", "str", "bytes", "int", "float", "bool", "none", "lengths"]
"""What a leaf holds per row: a tensor of a fixed shape; a tensor whose first dimension differs
from row to row (``"ragged"``); one Python value of a type (``"str"``, ``"bytes"``, ``"int"``,
``"float"``, ``"bool"``, ``"none"``: ``NonTensorData`` entries); or the row lengths of a ragged
leaf (``"lengths"``, internal)."""
VALUES: tuple[Value, ...] = (
    "tensor",
    "ragged",
    "str",
    "bytes",
    "int",
    "float",
    "bool",
    "none",
    "lengths",
)
RAGGED_VALUES = ("ragged", "str", "bytes")
"""Leaves kept as rows of different lengths: values padded along their first element
dimension (an array that grows wider as longer rows come), and a lengths leaf."""
RAGGED_NOMINAL_LENGTH = 256
"""The row length of ragged leaves assumed where a row's size must be guessed (block sizes)."""
SCALAR_DTYPES = {"str": "uint8", "bytes": "uint8", "int": "int64", "float": "float64"}
SCALAR_DTYPES.update({"bool": "bool", "none": "uint8"})
"""The dtype each kind of non-tensor value is stored as (strings as their UTF-8 bytes)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeafSpec:
    """One array of the store: its key, its torch dtype, the shape of one element and what
    one row of it holds (:data:`Value`).

    ``shape`` excludes the storage's batch dimensions (``ndim`` of them) and, for ragged
    leaves, the dimension whose length varies from row to row (the first of the element).
    """

    key: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    value: Value = "tensor"

    @property
    def ragged(self) -> bool:
        return self.value in RAGGED_VALUES

    @property
    def lengths_key(self) -> tuple[str, ...]:
        """The key of this ragged leaf's lengths leaf (no data key starts with ``""``)."""
        return ("", *self.key)

    def lengths_leaf(self) -> LeafSpec:
        return LeafSpec(key=self.lengths_key, dtype="int64", shape=(), value="lengths")

    @property
    def stored_dtype(self) -> str:
        return stored_dtype(self.dtype)

    @property
    def path(self) -> str:
        if self.value == "lengths":
            return "/".join((LENGTHS_GROUP, *self.key[1:]))
        return array_path(self.key)

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.stored_dtype).itemsize)

    @property
    def element_nbytes(self) -> int:
        """Bytes of one element (of a ragged leaf: of a nominal row, for sizing blocks)."""
        nominal = RAGGED_NOMINAL_LENGTH if self.ragged else 1
        return self.itemsize * math.prod(self.shape) * nominal

    def to_json(self) -> dict[str, Any]:
        out = {"key": list(self.key), "dtype": self.dtype, "shape": list(self.shape)}
        if self.value != "tensor":
            out["value"] = self.value
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class FrameLeaf:
    """A leaf stored as frames, each once per block (``docs/design/frames-on-disk.md``):
    its key, its ``("next", ...)`` twin stored with it (or ``None``), and the frames of
    each of its stacks (1: the leaf is kept by element)."""

    key: tuple[str, ...]
    next_key: tuple[str, ...] | None
    stack: int

    @property
    def keys(self) -> tuple[tuple[str, ...], ...]:
        return (self.key,) if self.next_key is None else (self.key, self.next_key)

    def to_json(self) -> dict[str, Any]:
        twin = None if self.next_key is None else list(self.next_key)
        return {"key": list(self.key), "next": twin, "stack": self.stack}


@dataclasses.dataclass(frozen=True, slots=True)
class Schema:
    """What the store holds: the data kind, its batch shape and its leaves."""

    kind: Kind
    batch_shape: tuple[int, ...]
    """Capacity along each of the ``ndim`` batch dimensions, e.g. ``(rows, n_envs)``."""
    leaves: tuple[LeafSpec, ...]
    tensorclass: str | None = None
    """``"module:qualname"`` of the tensorclass for ``kind == "tensorclass"``."""
    item_batch_shape: tuple[int, ...] = ()
    """Batch dimensions of one stored TensorDict beyond the storage's own ``ndim``."""
    treespec: str | None = None
    """For ``kind == "pytree"``: the structure (``torch.utils._pytree.treespec_dumps``); the
    leaves are in its order."""
    frames: tuple[FrameLeaf, ...] = ()
    """Leaves stored as frames (``Compression(frames=True)``), fixed when the schema is set:
    a leaf added later is never one."""

    @property
    def frame_keys(self) -> frozenset[tuple[str, ...]]:
        """Every key stored as frames (twins included)."""
        return frozenset(key for leaf in self.frames for key in leaf.keys)

    @property
    def rows(self) -> int:
        return self.batch_shape[0]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (all leaves, all trailing batch dimensions)."""
        return self.elements_per_row * sum(leaf.element_nbytes for leaf in self.leaves)

    @property
    def elements_per_row(self) -> int:
        """Elements of one row (``n_envs`` with ``ndim=2``; TorchRL counts elements)."""
        return math.prod(self.batch_shape[1:])

    def with_leaves(self, leaves: Sequence[LeafSpec]) -> Schema:
        """This schema with ``leaves`` added (new keys), leaves kept in key order."""
        grown = tuple(sorted((*self.leaves, *leaves), key=lambda leaf: leaf.key))
        return dataclasses.replace(self, leaves=grown)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "batch_shape": list(self.batch_shape),
            "tensorclass": self.tensorclass,
            "item_batch_shape": list(self.item_batch_shape),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "treespec": self.treespec,
        }
        if self.frames:
            out["frames"] = [leaf.to_json() for leaf in self.frames]
        return out


# --- parsing (untrusted JSON -> typed records) -------------------------------------------


def _parse_leaf(value: object, kind: Kind) -> LeafSpec:
    _expect(isinstance(value, Mapping), "a leaf object", value)
    assert isinstance(value, Mapping)
    key_raw = value.get("key")
    _expect(
        isinstance(key_raw, list) and all(isinstance(k, str) for k in key_raw), "a key", key_raw
    )
    assert isinstance(key_raw, list)
    dtype = value.get("dtype")
    _expect(
        isinstance(dtype, str) and dtype in STORED_DTYPES,
        f"a dtype among {sorted(STORED_DTYPES)}",
        dtype,
    )
    assert isinstance(dtype, str)
    shape = _parse_int_list(value.get("shape"), "leaf shape")
    _expect(math.prod(shape) <= 2**40, "a leaf shape of bounded size", shape)
    held = value.get("value", "tensor")
    _expect(held in VALUES, f"a leaf value among {VALUES}", held)
    assert held in VALUES
    expected_dtype = "int64" if held == "lengths" else SCALAR_DTYPES.get(held, dtype)
    _expect(dtype == expected_dtype, f"dtype {expected_dtype} for {held} leaves", dtype)
    _expect(held in ("tensor", "ragged") or not shape, "no element shape for values", shape)
    try:
        if held == "lengths":
            _expect(bool(key_raw) and key_raw[0] == "", "a lengths key starting with ''", key_raw)
            key = ("", *parse_key(key_raw[1:], kind=kind))
        else:
            key = parse_key(key_raw, kind=kind)
    except UnsupportedDataError as err:
        raise StoreCorruptedError(f"invalid zarr_rb metadata: {err}") from None
    return LeafSpec(key=key, dtype=dtype, shape=shape, value=held)


def parse_schema(value: object, *, ndim: int) -> Schema | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'schema' to be an object or null", value)
    assert isinstance(value, Mapping)
    kind = value.get("kind")
    _expect(kind in KINDS, f"a kind among {KINDS}", kind)
    assert kind in KINDS
    batch_shape = _parse_int_list(value.get("batch_shape"), "batch_shape", lo=1)
    _expect(len(batch_shape) == ndim, f"batch_shape of length ndim={ndim}", batch_shape)
    leaves_raw = value.get("leaves")
    _expect(
        isinstance(leaves_raw, list) and 0 < len(leaves_raw) <= _MAX_LEAVES,
        "a non-empty list of leaves",
        leaves_raw,
    )
    assert isinstance(leaves_raw, list)
    leaves = tuple(_parse_leaf(leaf, kind) for leaf in leaves_raw)
    keys = [leaf.key for leaf in leaves]
    _expect(len(set(keys)) == len(keys), "unique leaf keys", keys)
    _expect(kind != "tensor" or len(leaves) == 1, "exactly one leaf for a tensor", keys)
    tensorclass = value.get("tensorclass")
    _expect(tensorclass is None or isinstance(tensorclass, str), "a tensorclass name", tensorclass)
    assert tensorclass is None or isinstance(tensorclass, str)
    treespec = value.get("treespec")
    _expect(
        (treespec is None) == (kind != "pytree")
        and (
            treespec is None or (isinstance(treespec, str) and len(treespec) <= _MAX_TREESPEC_CHARS)
        ),
        "a treespec string for pytree data (and only for it)",
        str(treespec)[:80],
    )
    assert treespec is None or isinstance(treespec, str)
    item_batch_shape = _parse_int_list(value.get("item_batch_shape", []), "item_batch_shape")
    for leaf in leaves:
        _expect(
            leaf.value == "tensor" or not item_batch_shape,
            "no item batch dimensions beside values or ragged leaves",
            item_batch_shape,
        )
        _expect(
            leaf.value != "tensor" or leaf.shape[: len(item_batch_shape)] == item_batch_shape,
            f"leaf {leaf.key!r} shape to start with item_batch_shape {item_batch_shape}",
            leaf.shape,
        )
    ragged = sorted(leaf.key for leaf in leaves if leaf.ragged)
    lengths = sorted(leaf.key[1:] for leaf in leaves if leaf.value == "lengths")
    _expect(ragged == lengths, "one lengths leaf for each ragged leaf", lengths)
    _expect(not ragged or len(batch_shape) == 1, "ragged leaves in a 1-D storage only", ragged)
    return Schema(
        kind=kind,
        batch_shape=batch_shape,
        leaves=leaves,
        tensorclass=tensorclass,
        item_batch_shape=item_batch_shape,
        treespec=treespec,
        frames=_parse_frames(value.get("frames", []), leaves_by_key(leaves)),
    )


def _parse_frames(
    value: object, leaves: Mapping[tuple[str, ...], LeafSpec]
) -> tuple[FrameLeaf, ...]:
    _expect(isinstance(value, list) and len(value) <= _MAX_LEAVES, "a list of frames", value)
    assert isinstance(value, list)
    out = []
    taken: set[tuple[str, ...]] = set()
    for entry in value:
        _expect(isinstance(entry, Mapping), "a frames leaf object", entry)
        assert isinstance(entry, Mapping)
        key, twin = (_parse_leaf_key(entry.get(name), leaves) for name in ("key", "next"))
        _expect(key is not None, "the key of a frames leaf", entry)
        assert key is not None
        leaf = leaves[key]
        stack = _parse_int_list([entry.get("stack")], "frames stack", lo=1)[0]
        _expect(
            leaf.value == "tensor"
            and (stack == 1 or (len(leaf.shape) >= 3 and leaf.shape[0] == stack)),
            f"a tensor leaf of {stack}-frame stacks",
            entry,
        )
        _expect(
            twin is None or (leaves[twin].shape, leaves[twin].dtype) == (leaf.shape, leaf.dtype),
            "a next twin of the same shape and dtype",
            entry,
        )
        keys = {key} if twin is None else {key, twin}
        _expect(
            not keys & taken and len(keys) == (1 if twin is None else 2),
            "frames leaves once",
            entry,
        )
        taken |= keys
        out.append(FrameLeaf(key=key, next_key=twin, stack=stack))
    return tuple(out)


def _parse_leaf_key(
    value: object, leaves: Mapping[tuple[str, ...], LeafSpec]
) -> tuple[str, ...] | None:
    if value is None:
        return None
    _expect(
        isinstance(value, list) and tuple(value) in leaves, "the key of a leaf of the schema", value
    )
    assert isinstance(value, list)
    return tuple(value)


def leaves_by_key(leaves: Iterable[LeafSpec]) -> dict[tuple[str, ...], LeafSpec]:
    return {leaf.key: leaf for leaf in leaves}


def with_lengths(
    leaves: Mapping[tuple[str, ...], LeafSpec], keys: Iterable[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """``keys`` and the lengths leaves of the ragged ones among them."""
    keys = list(keys)
    lengths = [leaves[key].lengths_key for key in keys if leaves[key].ragged]
    return keys + [key for key in dict.fromkeys(lengths) if key not in keys]


def plain_then_ragged(
    leaves: Mapping[tuple[str, ...], LeafSpec], keys: Sequence[tuple[str, ...]]
) -> list[list[tuple[str, ...]]]:
    """Keys in the order they are read: ragged leaves after the lengths they need."""
    plain = [key for key in keys if not leaves[key].ragged]
    ragged = [key for key in keys if leaves[key].ragged]
    return [group for group in (plain, ragged) if group]
