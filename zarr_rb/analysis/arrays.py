"""A store's keys as dask arrays and as an xarray ``Dataset`` (optional: the ``analysis``
extra, ``pip install -e '.[analysis]'`` in a checkout of zarr_rb), lazy, one dask chunk per
block of rows (a shard, or a plain chunk for small keys), so that each task reads whole
objects of the store once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from zarr_rb.analysis._keys import KeyLike, dotted, public_key
from zarr_rb.analysis.rows import StoredRows
from zarr_rb.core.dtypes import numpy_dtype
from zarr_rb.engine.layout import dimension_names
from zarr_rb.torchrl.data_kinds import key_tuple
from zarr_rb.util.keys import Key
from zarr_rb.util.optional import require

if TYPE_CHECKING:
    import xarray


class _Rows:
    """One key's committed rows as dask reads them (``shape``, ``dtype``, ``[slices]``)."""

    def __init__(self, view: StoredRows, key: Key, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self._view = view
        self._key = key
        self.shape = shape
        self.dtype = dtype
        self.ndim = len(shape)

    def __getitem__(self, selection: Any) -> np.ndarray:
        """``rows[selection]`` as NumPy gives it. Dask passes the slices of a chunk or, once
        it fuses an indexing into the read, integers among them."""
        parts = selection if isinstance(selection, tuple) else (selection,)
        first = parts[0] if parts else Ellipsis
        if isinstance(first, slice):
            return self._view.numpy(self._key, first)[(slice(None), *parts[1:])]
        if isinstance(first, (int, np.integer)) and not isinstance(first, (bool, np.bool_)):
            # The row read stays in one index with the rest (as a 0-d array), because NumPy
            # places the dimensions of integer and array indices by where they stand.
            row = self._view.numpy(self._key, first)[np.newaxis]
            return np.asarray(row[(np.array(0), *parts[1:])])
        return np.asarray(self._view.numpy(self._key)[selection])  # other forms: every row


def to_dask(view: StoredRows) -> dict[KeyLike, Any]:
    """Each tensor key of ``view`` as a dask array of its committed rows."""
    da = require("dask.array", extra="analysis", what="View.to_dask()")
    schema = view.storage.schema
    if schema is None:
        return {}
    block = view.storage.store.meta.block_rows or max(1, view.rows)
    out: dict[KeyLike, Any] = {}
    for leaf in view.leaves():
        if leaf.value != "tensor":
            continue  # strings and rows of different lengths are no arrays
        shape = (*view.shape, *leaf.shape)
        rows = _Rows(view, leaf.key, shape, numpy_dtype(leaf.dtype))
        chunks = (block, *shape[1:])
        store = view.storage.store
        what = "history" if store.history else "ring"  # one store: two sets of rows
        name = (
            f"zarr_rb-{view.url}-{what}-{store.committed.generation}-{'/'.join(leaf.key)}-"
            f"{store.version}"
        )
        meta = np.empty((0,) * len(shape), dtype=rows.dtype)
        out[public_key(leaf.key)] = da.from_array(
            rows, chunks=chunks, name=name, lock=False, asarray=False, meta=meta
        )
    return out


def to_xarray(view: StoredRows) -> xarray.Dataset:
    """The tensor keys of ``view`` as an ``xarray.Dataset`` on dask, with the dimension
    names the store's arrays carry (``row``, or ``time`` and ``env``; ``<key>_<i>`` for
    element dimensions) and a ``valid`` variable along the first one."""
    xr = require("xarray", extra="analysis", what="View.to_xarray()")
    arrays = to_dask(view)
    names = {}
    for key, array in arrays.items():
        tuple_key = key_tuple(key)
        names[dotted(tuple_key)] = (dimension_names(tuple_key, view.ndim, array.ndim), array)
    first = dimension_names((), view.ndim, view.ndim)[0]
    names["valid"] = ((first,), view.valid)
    dataset: xarray.Dataset = xr.Dataset(names, attrs={"zarr_rb_url": view.url})
    return dataset
