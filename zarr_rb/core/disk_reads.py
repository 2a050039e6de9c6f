"""Reads of rows from a store's data arrays: every key's reads in flight together, ragged
rows read up to their lengths, and the ``"index"`` entries written as a mark given their
positions. What is read is trusted no further than it is checked: a record that maps rows
past an array, or lengths wider than it, is a :class:`StoreCorruptedError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy
from zarr_rb.core.store_facts import StoreFacts
from zarr_rb.engine import RowArray
from zarr_rb.engine.damage import damage_error
from zarr_rb.engine.rows import reaches
from zarr_rb.errors import RowsNotCommittedError, StoreCorruptedError
from zarr_rb.format.commit import Commit
from zarr_rb.format.index_key import INDEX_KEY, put_positions
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.schema import LeafSpec
from zarr_rb.util.keys import Key


class RowsOwner(StoreFacts, Protocol):
    """What a read uses of its store (:class:`~zarr_rb.core.store.Store`)."""

    def physical(self, positions: np.ndarray) -> np.ndarray: ...


class FrameReads(Protocol):
    def keys(self) -> frozenset[Key]: ...
    def read(self, requests: Mapping[Key, np.ndarray]) -> dict[Key, torch.Tensor]: ...


class Arrays(Protocol):
    """The arrays a read goes to (:class:`~zarr_rb.core.arrays.StoreArrays`)."""

    @property
    def store(self) -> RowsOwner: ...
    def get(self, key: Key) -> RowArray: ...
    @property
    def frames(self) -> FrameReads: ...


def read_rows(
    arrays: Arrays,
    requests: Mapping[Key, np.ndarray],
    lengths: Mapping[Key, np.ndarray] | None = None,
    *,
    physical: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """Read the rows at positions ``requests[key]`` of each key; the reads of all keys run
    together. ``physical``: where positions are in the arrays (a commit's map, when a
    reader reads one it no longer shows); the store's own map by default.

    Ragged leaves need the lengths of the rows asked (``lengths[key]``): each row is read
    up to its length only, and rows come back padded with zeros to the longest.

    Raises:
        StoreCorruptedError: the record maps a row past its array, or a ragged row is
            longer than its array is wide.
        ChunkCorruptedError: a chunk of the rows asked cannot be read back intact.
    """
    store = arrays.store
    physical = physical or store.physical
    futures: dict[Key, list[tuple[np.ndarray, int | None, Any]]] = {}
    framed = arrays.frames.keys()
    for key, positions in requests.items():
        if not positions.size or key in framed:
            continue
        array = arrays.get(key)
        rows = physical(positions)
        if not reaches(array, int(rows.max())):
            raise StoreCorruptedError(
                f"store {store.url!r}: its commit record maps rows to row "
                f"{int(rows.max())} of array {'/'.join(key)!r}, which has "
                f"{array.shape[0]}: the record or the array's metadata is damaged. "
                "Restore the store from a copy, or run zarr_rb.verify(path)",
            )
        if not array.ragged:
            futures[key] = [(np.arange(rows.size), None, array.read_rows(rows))]
            continue
        assert lengths is not None
        sizes = _checked_lengths(store.url, key, lengths[key], array)
        # Rows grouped by how many chunks they span: each read touches only chunks that
        # were written with those rows (a missing chunk is an error, not zeros).
        spans = -(-sizes // array.chunk_length)
        futures[key] = [
            (picked, width, array.read_rows(rows[picked], width))
            for span in np.unique(spans[spans > 0]).tolist()
            for picked, width in [(np.flatnonzero(spans == span), span * array.chunk_length)]
        ]
    # (The plain keys' reads are under way meanwhile.)
    out = arrays.frames.read(
        {key: physical(rows) for key, rows in requests.items() if key in framed}
    )
    for key, rows in requests.items():
        leaf = store.leaf(key)
        dtype = TORCH_DTYPES[leaf.dtype]
        if key in framed:
            continue
        if not leaf.ragged:
            parts = futures.get(key)
            if parts is None:
                out[key] = torch.empty((0, *store.element_shape(leaf)), dtype=dtype)
                continue
            try:
                values = parts[0][2].result()
            except ValueError as err:
                raise damage_error(arrays.get(key), physical(rows), err) from None
            if key == INDEX_KEY:
                values = put_positions(values, rows)
            out[key] = from_numpy(values, dtype)
            continue
        assert lengths is not None
        sizes = lengths[key]
        widest = int(sizes.max()) if sizes.size else 0
        padded_rows = np.zeros((rows.size, *store.element_shape(leaf, widest)), leaf.stored_dtype)
        for picked, width, future in futures.get(key, []):
            try:
                part = future.result()
            except ValueError as err:
                raise damage_error(arrays.get(key), physical(rows[picked]), err, width) from None
            span = min(widest, part.shape[1])
            padded_rows[picked, :span] = part[:, :span]
        if widest:
            padded_rows[np.arange(widest) >= sizes[:, None]] = 0  # what lies past each length
        out[key] = from_numpy(padded_rows, dtype)
    return {key: out[key] for key in requests}


def read_rows_all(
    arrays: Arrays,
    requests: Mapping[Key, np.ndarray],
    *,
    physical: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[Key, torch.Tensor]:
    """:func:`read_rows` of leaves and of the lengths of their ragged ones (the rows of a
    ragged leaf's lengths must be asked with it)."""
    leaf: Callable[[Key], LeafSpec] = arrays.store.leaf
    plain = {key: rows for key, rows in requests.items() if not leaf(key).ragged}
    out = read_rows(arrays, plain, physical=physical)
    ragged = {key: rows for key, rows in requests.items() if leaf(key).ragged}
    if ragged:
        lengths = {key: out[leaf(key).lengths_key].numpy() for key in ragged}
        out.update(read_rows(arrays, ragged, lengths, physical=physical))
    return out


def _checked_lengths(url: str, key: Key, sizes: np.ndarray, array: RowArray) -> np.ndarray:
    """Row lengths of a ragged leaf, checked against its array (stores are untrusted)."""
    if sizes.size and (int(sizes.max()) > array.width or int(sizes.min()) < 0):
        array.refresh()  # the writer made it wider since this store opened it
    if sizes.size and (int(sizes.max()) > array.width or int(sizes.min()) < 0):
        raise StoreCorruptedError(
            f"store {url!r}: key {key!r} has rows of length "
            f"{int(sizes.min())}..{int(sizes.max())}, its array holds rows of at most "
            f"{array.width}",
        )
    return sizes.astype(np.int64)


def place(tensor: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``tensor[where] = values``; ragged rows (narrower or wider than ``tensor``) up to the
    width they share (beyond their lengths, rows are padding)."""
    if values.ndim > 1 and values.shape[1] != tensor.shape[1]:
        span = min(values.shape[1], tensor.shape[1])
        tensor[where, :span] = values[:, :span]
    else:
        tensor[where] = values


def padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Ragged rows padded with zeros to ``width`` along their length."""
    if tensor.shape[1] == width:
        return tensor
    out = tensor.new_zeros((tensor.shape[0], width, *tensor.shape[2:]))
    out[:, : tensor.shape[1]] = tensor
    return out


class ReadsAll(Protocol):
    """What :func:`rows_as_of` reads with (:class:`~zarr_rb.core.arrays.StoreArrays`)."""

    def read_all(
        self,
        requests: Mapping[Key, np.ndarray],
        *,
        physical: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> dict[Key, torch.Tensor]: ...


def rows_as_of(
    arrays: ReadsAll,
    commit: Commit,
    rows: np.ndarray,
    keys: list[Key],
    *,
    unreadable_as_zeros: bool,
    where: str,
) -> dict[Key, torch.Tensor]:
    """Positions ``rows`` as ``commit`` has them, read from the arrays through its own map:
    a shared writer's sample, whose store moved past the commit it drew from. The caller
    checks the read against the record after it (see ``SharingRecord.read_checked``)."""
    readable = commit.readable(rows)
    if not readable.all() and not unreadable_as_zeros:
        raise RowsNotCommittedError(
            f"{where}: rows {preview_rows(rows[~readable])} are not readable in commit "
            f"{commit.generation} (length {commit.length}, holes {list(commit.holes)})",
        )
    out = arrays.read_all(dict.fromkeys(keys, rows[readable]), physical=commit.physical)
    if not readable.all():
        out = {key: spread_rows(value, readable) for key, value in out.items()}
    return out


def spread_rows(values: torch.Tensor, where: np.ndarray) -> torch.Tensor:
    """``values`` at the ``True`` positions of ``where``, zeros elsewhere."""
    out = values.new_zeros((where.size, *values.shape[1:]))
    out[torch.from_numpy(np.flatnonzero(where))] = values
    return out
