"""TorchRL's index forms for storages: which rows an index addresses, in which order.

``get`` and ``set`` take ints, slices, lists, 1-D and 2-D index tensors and boolean masks
(and tuples of them for ``ndim > 1`` storages); these helpers turn them into row numbers,
with TorchRL's semantics (negative indices wrap, the last of repeated rows written wins).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zarr_rb.errors import RowIndexError
from zarr_rb.format.messages import preview_rows
from zarr_rb.torchrl import compat


def is_key(index: Any) -> bool:
    """Whether ``index`` is a (nested) key of the data rather than a row index."""
    if isinstance(index, str):
        return True
    return isinstance(index, tuple) and bool(index) and all(isinstance(i, str) for i in index)


def takes_a_view(index: Any) -> bool:
    """Whether ``storage.get(index)`` gives a lazy view of every row: a key (``"obs"``), all
    rows (``slice(None)``, ``()``), or all rows then more indices (``(slice(None), ...)``)."""
    if is_key(index) or (isinstance(index, tuple) and not index):
        return True
    head = index[0] if isinstance(index, tuple) else index
    return isinstance(head, slice) and head == slice(None)


def as_index_tensor(index: Any) -> torch.Tensor:
    """An integer index tensor (a boolean mask becomes the indices it selects)."""
    tensor = torch.as_tensor(index)
    if tensor.dtype == torch.bool:
        return tensor.nonzero().squeeze(-1)
    if tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"expected an integer or boolean index, got dtype {tensor.dtype}")
    return tensor.to(torch.int64).cpu()


def check_rows(rows: np.ndarray, length: int, *, where: str, what: str = "index") -> np.ndarray:
    """Rows with negative indices wrapped; raises for any outside ``[0, length)``."""
    rows = np.where(rows < 0, rows + length, rows)
    if rows.size and (rows.min() < 0 or rows.max() >= length):
        raise RowIndexError(
            f"{where}: {what} out of range for {length} rows: "
            f"{preview_rows(rows[(rows < 0) | (rows >= length)])}",
        )
    return rows


def write_rows(cursor: Any, rows: int, *, where: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Rows addressed by a write cursor (relative to capacity, as in TorchRL's storages),
    and the shape of the index."""
    if isinstance(cursor, slice):
        index = np.arange(*cursor.indices(rows))
        return index, (index.size,)
    if compat.is_int(cursor):
        index = np.array([int(cursor)])
        shape: tuple[int, ...] = ()
    else:
        tensor = as_index_tensor(cursor)
        index, shape = tensor.reshape(-1).numpy(), tuple(tensor.shape)
    return check_rows(index, rows, where=where, what="write index").astype(np.int64), shape


def read_rows(head: Any, length: int, *, where: str) -> tuple[np.ndarray, Any]:
    """Sorted unique rows addressed by ``head`` and how to pick them from a block of them."""
    if isinstance(head, slice):
        start, stop, step = head.indices(length)
        if step < 0:
            raise ValueError("negative slice steps are not supported (as in torch)")
        rows = np.arange(start, stop, step, dtype=np.int64)
        return rows, slice(0, rows.size)
    if compat.is_int(head):
        row = int(head) + (length if int(head) < 0 else 0)
        if not 0 <= row < length:
            raise RowIndexError(f"{where}: index {int(head)} is out of range for {length} rows")
        return np.array([row], dtype=np.int64), 0
    tensor = as_index_tensor(head)
    flat = check_rows(tensor.reshape(-1).numpy(), length, where=where)
    rows, inverse = np.unique(flat, return_inverse=True)
    return rows, torch.from_numpy(inverse.reshape(tensor.shape))


def unique_last(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique rows, and for each the position of its last occurrence (last write wins)."""
    reversed_rows = index[::-1]
    rows, first_in_reversed = np.unique(reversed_rows, return_index=True)
    return rows, (index.size - 1 - first_in_reversed).astype(np.int64)
