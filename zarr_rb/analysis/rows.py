"""The committed rows of a store, read-only: what :class:`~zarr_rb.analysis.view.View`
shows and what the analysis tools (dask, xarray, datasets) read.

A :class:`StoredRows` takes no lock and writes nothing; it sees the rows of the last commit
it read (holes, rows a crash or a repair withdrew, are reported and never read) and moves
to a newer commit only on :meth:`StoredRows.refresh`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from tensordict import TensorDict

from zarr_rb.analysis._keys import TENSOR_KEY, KeyLike, public_key, shown
from zarr_rb.core.dtypes import TORCH_DTYPES, numpy_dtype, to_numpy
from zarr_rb.errors import UnknownKeyError
from zarr_rb.format.commit import mask_to_ranges
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.locations import StoreURL
from zarr_rb.torchrl import compat, data_kinds, index_forms
from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.keys import Key

_KINDS = {"tensor": "tensor", "ragged": "ragged"}
_Self = TypeVar("_Self", bound="StoredRows")


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    """One key of a store: the dtype and shape of one element (``None`` along the dimension
    whose length varies from row to row), and what it holds: ``"tensor"``, ``"ragged"``
    (rows of different lengths) or ``"values"`` (strings and other Python values)."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]
    kind: str

    def __repr__(self) -> str:
        shape = ", ".join("*" if n is None else str(n) for n in self.shape)
        kind = "" if self.kind == "tensor" else f", {self.kind}"
        return f"Column({str(self.dtype).removeprefix('torch.')}[{shape}]{kind})"


def open_rows(
    path: StoreURL, *, storage_options: Mapping[str, Any] | None = None, history: bool = False
) -> StoredRows:
    """The committed rows of the store at ``path``, read-only (see
    :func:`zarr_rb.analysis.view.open`, which gives them with their episodes)."""
    storage = ZarrStorage(
        path=path, read_only=True, storage_options=storage_options, history=history
    )
    return StoredRows(storage)


class StoredRows:
    """The committed rows of a store, or some of its keys (read-only)."""

    def __init__(self, storage: ZarrStorage, *, keys: Iterable[Key] | None = None) -> None:
        self.storage = storage
        """The read-only :class:`~zarr_rb.ZarrStorage` underneath (for TorchRL samplers)."""
        self._keys = None if keys is None else tuple(keys)

    # --- what the store holds --------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.storage.storage_options

    @property
    def _schema(self) -> Schema | None:
        return self.storage.schema

    def leaves(self) -> list[LeafSpec]:
        """The leaves shown (lengths of ragged leaves are part of those)."""
        schema = self._schema
        if schema is None:
            return []
        leaves = [leaf for leaf in schema.leaves if leaf.value != "lengths"]
        if self._keys is not None:
            leaves = [leaf for leaf in leaves if leaf.key in self._keys]
        return leaves

    def __len__(self) -> int:
        """Elements (rows, times environments for ``ndim=2``) of the last commit read."""
        return len(self.storage) if self.storage.initialized else 0

    @property
    def rows(self) -> int:
        """Rows along the first (time) dimension."""
        return compat.length_along_dim0(self.storage) if self.storage.initialized else 0

    @property
    def shape(self) -> torch.Size:
        """``[rows]``, or ``[time, n_envs]`` for ``ndim=2``."""
        schema = self._schema
        return torch.Size((self.rows, *(() if schema is None else schema.batch_shape[1:])))

    @property
    def ndim(self) -> int:
        return int(self.storage.ndim)

    @property
    def capacity(self) -> int:
        """Rows along the first dimension the store holds at most (its ring)."""
        schema = self._schema
        return self.storage.max_size if schema is None else schema.rows

    @property
    def cursor(self) -> int:
        """The row the next write goes to (the oldest row, once the ring is full)."""
        return self.storage.cursor

    def keys(self) -> list[KeyLike]:
        """The keys, nested ones as tuples (as ``TensorDict.keys(True, True)``)."""
        return [public_key(leaf.key) for leaf in self.leaves()]

    @property
    def schema(self) -> dict[KeyLike, Column]:
        """Each key's element dtype, shape and kind."""
        out = {}
        for leaf in self.leaves():
            shape: tuple[int | None, ...] = leaf.shape
            if leaf.ragged:
                shape = (None, *leaf.shape)
            kind = _KINDS.get(leaf.value, "values")
            dtype = TORCH_DTYPES[leaf.dtype] if kind != "values" else torch.uint8
            out[public_key(leaf.key)] = Column(dtype=dtype, shape=shape, kind=kind)
        return out

    @property
    def valid(self) -> np.ndarray:
        """Which rows (along time) may be read: ``False`` for holes."""
        mask = np.ones(self.rows, dtype=bool)
        mask[self.storage.store.unreadable_rows()] = False
        return mask

    @property
    def holes(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` inside the length that cannot be read: withdrawn by
        a crash or a repair, and not written since."""
        return list(mask_to_ranges(~self.valid))

    def refresh(self: _Self) -> _Self:
        """Move to the writer's latest commit (rows, keys and holes)."""
        self.storage.refresh()
        return self

    def close(self) -> None:
        self.storage.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        keys = ", ".join(f"{shown(k)}: {c!r}" for k, c in self.schema.items())
        holes = f", holes={self.holes}" if self.holes else ""
        name = type(self).__name__
        return f"{name}({self.url!r}, shape={list(self.shape)}{holes}, keys={{{keys}}})"

    # --- rows --------------------------------------------------------------------------

    def select(self, *keys: KeyLike) -> StoredRows:
        """The rows of some keys only: nothing else is read through them."""
        return StoredRows(self.storage, keys=[self.key_of(k) for k in keys])

    def key_of(self, key: KeyLike) -> Key:
        """``key`` as a tuple, one of the keys shown (raises :class:`UnknownKeyError`)."""
        key = data_kinds.key_tuple(key)
        if not any(leaf.key == key for leaf in self.leaves()):
            held = ", ".join(shown(k) for k in self.keys()) or "no key"
            raise UnknownKeyError(f"{self.url!r} has no key {shown(key)}: it holds {held}")
        return key

    def _lazy(self) -> TensorDict:
        storage = self.storage
        columns, _ = storage.lazy_columns(self.rows)
        wanted = {leaf.key for leaf in self.leaves()}
        return TensorDict(
            {k or (TENSOR_KEY,): c for k, c in columns.items() if k in wanted},
            batch_size=self.shape,
        )

    def __getitem__(self, index: Any) -> Any:
        """A key: its column (lazy: ``view["obs"][17]`` reads one row). Rows (an int, a
        slice, an index tensor or a mask): a TensorDict of them; ints and slices stay lazy,
        index tensors and masks read the rows of this view's keys, together."""
        if index_forms.is_key(index):
            key = self.key_of(index)
            return self._lazy()[key or (TENSOR_KEY,)]
        if self.ndim == 1 and isinstance(index, (torch.Tensor, np.ndarray, list)):
            # Every key read together, from one commit (key by key, each could come from
            # another commit of a writer at work).
            try:
                picked = np.arange(self.rows)[np.asarray(index)]
            except IndexError:
                return self._lazy()[index]  # which says what is out of range
            if picked.ndim == 1:
                return self.read_rows(picked)
        return self._lazy()[index]

    def read_rows(self, rows: np.ndarray, envs: np.ndarray | None = None) -> TensorDict:
        """Rows (along time; with ``envs``, the elements ``(rows[i], envs[i])`` of an
        ``ndim=2`` store) of this view's keys, read together (never torn)."""
        schema = self._schema
        assert schema is not None
        leaves = [
            leaf
            for chosen in self.leaves()
            for leaf in ((chosen, chosen.lengths_leaf()) if chosen.ragged else (chosen,))
        ]
        values = self.storage.store.read(rows, [leaf.key for leaf in leaves])
        batch_shape = (rows.size, *schema.batch_shape[1:])
        if schema.kind == "tensor":
            out = TensorDict({TENSOR_KEY: values[()]}, batch_size=batch_shape)
        else:
            sub = dataclasses.replace(
                schema, kind="tensordict", leaves=tuple(leaves), tensorclass=None, treespec=None
            )
            out = data_kinds.build(values, schema=sub, batch_shape=batch_shape, device=None)
        if envs is not None:
            out = out[torch.arange(rows.size), torch.from_numpy(envs)]
        return out

    def numpy(self, key: KeyLike, rows: Any = None) -> np.ndarray:
        """The rows of one key as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``); holes
        read as zeros (see :attr:`valid`).

        ``rows`` picks rows as a NumPy index of the first dimension does: an integer gives
        one element (no row dimension), a slice, a list, an array of row numbers or a
        boolean mask give rows in that order and shape.
        """
        leaf = self.leaf(self.key_of(key))
        picked = np.arange(self.rows)[slice(None) if rows is None else rows]
        store = self.storage.store
        values = store.read(picked.reshape(-1), [leaf.key], unreadable_as_zeros=True)[leaf.key]
        out = to_numpy(values).view(numpy_dtype(leaf.dtype))
        return out.reshape((*picked.shape, *out.shape[1:]))

    def leaf(self, key: Key) -> LeafSpec:
        """The leaf of a key shown (``key`` as :meth:`key_of` gives it)."""
        return next(leaf for leaf in self.leaves() if leaf.key == key)
