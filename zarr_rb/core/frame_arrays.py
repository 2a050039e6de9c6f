"""The leaves of a store kept as frames, each once per block (``Compression(frames=True)``,
``docs/design/frames-on-disk.md``): their cells and frame ids arrays, created, opened, and
reached by :class:`~zarr_rb.core.arrays.StoreArrays` for the writes, reads and slots of
those leaves. Rows here are rows of the arrays (physical).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zarr_rb.core.dtypes import to_numpy
from zarr_rb.core.frame_cells import (
    ID_DTYPE,
    FrameCells,
    cell_layouts,
    cells_per_row,
    ids_tail,
)
from zarr_rb.core.frame_plans import FrameKeys, frame_leaves, stored_frame_keys
from zarr_rb.engine import RowArray
from zarr_rb.engine.layout import dimension_names
from zarr_rb.errors import NotSupportedError, StoreCorruptedError
from zarr_rb.format.names import ATTRS_KEY, frame_ids_path
from zarr_rb.format.schema import Schema, leaves_by_key
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.array_writes import ArraysOwner


def with_frames(store: ArraysOwner, schema: Schema) -> Schema:
    """``schema`` with the leaves a store of ``Compression(frames=True)`` stores as frames,
    fixed now (:attr:`Schema.frames`).

    Raises:
        NotSupportedError: a store whose objects are created once (on S3), where frames on
            disk are not built yet.
    """
    if store.lifetime.creates_once:
        raise NotSupportedError(
            f"store {store.url!r}: Compression(frames=True) is not supported on object stores "
            "yet; pass Compression(frames=False) (the default), or a local path"
        )
    frames = frame_leaves(schema.leaves, schema.batch_shape, store.compression.large_row_bytes)
    return dataclasses.replace(schema, frames=frames)


class FrameArrays:
    """The cells and ids arrays of a store's frames leaves, opened once each."""

    def __init__(self, store: ArraysOwner) -> None:
        self.store = store
        self._cells: dict[Key, FrameCells] = {}
        """By the key of each frames leaf, and of its twin."""

    def specs(self, schema: Schema | None = None) -> list[FrameKeys]:
        schema = schema if schema is not None else self.store.schema
        return [] if schema is None else stored_frame_keys(schema)

    def keys(self) -> frozenset[Key]:
        """Every key stored as frames (none before the schema is set)."""
        schema = self.store.schema
        return frozenset() if schema is None else schema.frame_keys

    def create(
        self,
        schema: Schema,
        rows: int,
        block_rows: int,
        *,
        replace: bool = True,
        samples: Mapping[Key, torch.Tensor] | None = None,
    ) -> None:
        """Create the cells and ids arrays of ``schema``'s frames leaves (``rows`` rows). A
        leaf whose first rows the codec does not shrink has raw cells."""
        store = self.store
        engine = store.engine
        for spec in self.specs(schema):
            cells_layout, ids_layout = cell_layouts(spec, rows, block_rows)
            compression = store.compression
            sample = None if samples is None else samples.get(spec.key)
            if sample is not None and not compression.shrinks(to_numpy(sample)):
                compression = dataclasses.replace(compression, codec="none")
            leaf = leaves_by_key(schema.leaves)[spec.key]
            attributes = {
                ATTRS_KEY: {
                    "dtype": leaf.dtype,
                    "batch_dims": 1,
                    "frames": {"cells": cells_per_row(spec), "stack": spec.stack},
                }
            }
            names = dimension_names(spec.key, 1, len(cells_layout.shape))
            for path, layout, dtype in [
                (leaf.path, cells_layout, leaf.stored_dtype),
                *((frame_ids_path(key), ids_layout, str(ID_DTYPE)) for key in spec.keys),
            ]:
                engine.create_group(path.rpartition("/")[0])
                engine.create_array(
                    path,
                    layout=dataclasses.replace(layout, dimension_names=names)
                    if path == leaf.path
                    else layout,
                    dtype=dtype,
                    compression=compression if path == leaf.path else store.compression,
                    attributes=attributes,
                    replace=replace,
                )

    def cells(self, key: Key) -> FrameCells:
        """The frames of the leaf of ``key`` (or of its twin), opened at first use.

        Raises:
            StoreCorruptedError: an array does not match the schema.
        """
        found = self._cells.get(key)
        if found is not None:
            return found
        spec = next(spec for spec in self.specs() if key in spec.keys)
        block_rows = self.store.meta.block_rows or 1
        cells = self._open(self.store.leaf(spec.key).path, (cells_per_row(spec), *spec.frame_shape))
        ids = {k: self._open(frame_ids_path(k), ids_tail(spec)) for k in spec.keys}
        opened = FrameCells(spec, cells, ids, block_rows)
        for k in spec.keys:
            self._cells[k] = opened
        return opened

    def _open(self, path: str, tail: tuple[int, ...]) -> RowArray:
        store = self.store
        try:
            array = store.engine.open_array(path, read_only=store.read_only)
        except ValueError as err:
            raise StoreCorruptedError(
                f"store {store.url!r}: cannot open array {path!r} ({err})"
            ) from None
        if array.shape[1:] != tail or array.shape[0] < store.physical_rows:
            raise StoreCorruptedError(
                f"store {store.url!r}: array {path!r} has shape {array.shape}, expected "
                f"({store.physical_rows}, {', '.join(map(str, tail))}) (at least as many rows)"
            )
        return array

    def arrays(self) -> list[RowArray]:
        """Every cells and ids array (for the operations on slots)."""
        out: list[RowArray] = []
        for spec in self.specs():
            cells = self.cells(spec.key)
            out.append(cells.cells)
            out.extend(cells.ids[key] for key in spec.keys)
        return out

    def forget(self) -> None:
        self._cells.clear()

    # --- writes and reads ------------------------------------------------------------------

    def start_write(
        self,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        *,
        behind: bool,
        positions: np.ndarray | None,
    ) -> list[tuple[RowArray, Any, list[str]]]:
        """Start writing the frames leaves among ``values`` to rows ``rows`` of the arrays;
        ``positions``: the buffer's positions of those rows, if known (their frames may be
        in the RAM tier)."""
        started = []
        done: set[int] = set()
        for key in values:
            cells = self.cells(key)
            if id(cells) in done:
                continue
            done.add(id(cells))
            given = {k: values[k] for k in cells.spec.keys if k in values}
            known = None if positions is None else self.store.ram.known_frames(key, positions)
            started.extend(cells.start_write(rows, given, behind=behind, known=known))
        return started

    def read(self, key: Key, rows: np.ndarray) -> torch.Tensor:
        """Rows ``rows`` of the arrays (any order) of the leaf of ``key``."""
        return self.cells(key).read(rows, [key])[key]

    def room(
        self,
        slots: np.ndarray,
        blocks: np.ndarray,
        writes: Sequence[tuple[np.ndarray, Mapping[Key, torch.Tensor]]],
        block_rows: int,
    ) -> np.ndarray:
        """For each of ``blocks`` (in ``slots``), whether ``writes`` (positions and values)
        surely find the cells of their frames leaves past the slot's mark: each write takes
        at most a row of cells per row it gives a frames leaf of."""
        fits = np.ones(slots.size, dtype=bool)
        for spec in self.specs():
            given = [rows for rows, values in writes if values.keys() & set(spec.keys)]
            if not given:
                continue
            rows = np.concatenate(given) // block_rows  # (a row given twice counts twice)
            counts = np.bincount(rows, minlength=int(blocks.max()) + 1)[blocks]
            cells = self.cells(spec.key)
            fits &= [cells.room(int(s), int(n)) for s, n in zip(slots, counts, strict=True)]
        return fits

    def copies(
        self, requests: Mapping[Key, np.ndarray], read: Mapping[Key, torch.Tensor]
    ) -> list[tuple[np.ndarray, dict[Key, torch.Tensor]]]:
        """The writes that copy the rows ``requests`` asks of each frames key (positions,
        sorted; ``read``: their values) into a block's new slot, by value: a row's frames
        leaves in one write, so that each row takes one row of cells at most."""
        out = []
        for spec in self.specs():
            asked = {key: requests[key] for key in spec.keys if key in requests}
            if not asked:
                continue
            every = np.unique(np.concatenate(list(asked.values())))
            has = {key: np.isin(every, rows) for key, rows in asked.items()}
            patterns: dict[tuple[Key, ...], list[int]] = {}
            for i in range(every.size):
                keys = tuple(key for key in asked if has[key][i])
                patterns.setdefault(keys, []).append(i)
            for keys, picked in patterns.items():
                rows = every[np.asarray(picked)]
                values = {}
                for key in keys:
                    at = np.searchsorted(requests[key], rows)
                    values[key] = read[key][torch.from_numpy(at)]
                out.append((rows, values))
        return out

    def take_slots(self, slots: Sequence[int]) -> None:
        """Slots the ring took for blocks: their regions start afresh."""
        for spec in self.specs():
            self.cells(spec.key).take_slots(slots)
