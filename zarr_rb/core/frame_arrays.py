"""The leaves of a store kept as frames, each once per block (``Compression(frames=True)``,
``docs/design/frames-on-disk.md``): their cells and frame ids arrays, created, opened, and
reached by :class:`~zarr_rb.core.arrays.StoreArrays` for the writes, reads and slots of
those leaves. Rows here are rows of the arrays (physical).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zarr_rb.core.array_writes import least_rows
from zarr_rb.core.dtypes import to_numpy
from zarr_rb.core.frame_cells import (
    ID_DTYPE,
    FrameCells,
    cell_layouts,
    cells_per_row,
    ids_tail,
)
from zarr_rb.core.frame_plans import FrameKeys, KnownFrames, frame_leaves, stored_frame_keys
from zarr_rb.engine import RowArray
from zarr_rb.engine.layout import dimension_names
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format.names import ATTRS_KEY, frame_ids_path
from zarr_rb.format.schema import Schema, leaves_by_key
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.core.array_writes import ArraysOwner, FramedWrite


def _merged(
    writes: Sequence[FramedWrite], keys: Sequence[Key]
) -> list[tuple[np.ndarray, dict[Key, torch.Tensor]]]:
    """``writes`` (of the keys of one leaf and its twin) as one write per set of keys given:
    each row once, with the last value written of each of its keys."""
    every = np.unique(np.concatenate([at for at, _, _ in writes]))
    owner = np.full((len(keys), every.size), -1)
    where = np.zeros((len(keys), every.size), dtype=np.int64)
    for i, (at, _, given) in enumerate(writes):
        at_every = np.searchsorted(every, at)
        for k, key in enumerate(keys):
            if key in given:
                owner[k, at_every] = i
                where[k, at_every] = np.arange(at.size)
    has = owner >= 0
    out = []
    for pattern in np.unique(has, axis=1).T:
        picked = np.flatnonzero((has == pattern[:, None]).all(0))
        values: dict[Key, torch.Tensor] = {}
        for k in np.flatnonzero(pattern).tolist():
            key = keys[k]
            parts = []
            for i in np.unique(owner[k, picked]).tolist():
                mask = owner[k, picked] == i
                source = torch.from_numpy(where[k, picked[mask]])
                parts.append((np.flatnonzero(mask), writes[i][2][key][source]))
            first = parts[0][1]
            value = torch.empty((picked.size, *first.shape[1:]), dtype=first.dtype)
            for positions, part in parts:
                value[torch.from_numpy(positions)] = part.to(first.dtype)
            values[key] = value
        out.append((every[picked], values))
    return out


def with_frames(
    store: ArraysOwner, schema: Schema, samples: Mapping[Key, torch.Tensor] | None
) -> Schema:
    """``schema`` with the leaves ``store`` stores as frames, fixed now
    (:attr:`Schema.frames`), by its setting ``Compression.frames`` and the rows of its first
    write (``samples``, see :func:`~zarr_rb.core.frame_plans.frame_leaves`)."""
    compression = store.compression
    frames = frame_leaves(
        schema.leaves,
        schema.batch_shape,
        compression.large_row_bytes,
        compression.frames,
        samples,
    )
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

    def paths(self, schema: Schema) -> list[str]:
        """The paths of the cells and ids arrays of ``schema``'s frames leaves, in the order
        :meth:`create` makes them."""
        leaves = leaves_by_key(schema.leaves)
        return [
            path
            for spec in self.specs(schema)
            for path in (leaves[spec.key].path, *(frame_ids_path(key) for key in spec.keys))
        ]

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
        if array.shape[1:] != tail or array.shape[0] < least_rows(store):
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

    def start_writes(
        self, writes: Sequence[FramedWrite], *, behind: bool
    ) -> list[tuple[RowArray, Any, list[str]]]:
        """Start the writes of the frames leaves of one call: rows of the arrays, the
        buffer's positions of them if known (their frames may be in the RAM tier), values
        (a row given twice, of one key and of the other, say, is written once)."""
        started = []
        for cells, at, given, known in self._by_leaf(writes):
            started.extend(cells.start_write(at, given, behind=behind, known=known))
        return started

    def create_writes(
        self, writes: Sequence[FramedWrite]
    ) -> list[tuple[RowArray, list[tuple[np.ndarray, np.ndarray]]]]:
        """The writes of the frames leaves of one call when objects are created once (as
        :meth:`start_writes`, not started): each array and its rows and values. The
        objects of the slots written are made of these writes alone (every row of a slot
        that holds data is among them), so each slot's cells are taken from the first."""
        every = [at for at, _, _ in writes]
        if not every:
            return []
        slots = np.unique(np.concatenate(every) // (self.store.meta.block_rows or 1))
        self.take_slots(slots.tolist())
        by_array: dict[str, tuple[RowArray, list[tuple[np.ndarray, np.ndarray]]]] = {}
        for cells, at, given, known in self._by_leaf(writes):
            for array, rows, values in cells.row_writes(at, given, known=known):
                by_array.setdefault(array.path, (array, []))[1].append((rows, values))
        return list(by_array.values())

    def _by_leaf(
        self, writes: Sequence[FramedWrite]
    ) -> Iterator[tuple[FrameCells, np.ndarray, Mapping[Key, torch.Tensor], KnownFrames | None]]:
        """Each write of each frames leaf: its cells, rows, values, and the frames the RAM
        tier holds for them (when their positions are known). Writes that give a row of a
        leaf more than once are made as one, the last value of each key winning: a row
        then takes one row of cells in its block, which the block's region has room for
        (written in two, it would take two)."""
        for spec in self.specs():
            mine = [
                (at, positions, {k: values[k] for k in spec.keys if k in values})
                for at, positions, values in writes
                if values.keys() & set(spec.keys)
            ]
            if not mine:
                continue
            cells = self.cells(spec.key)
            ram = self.store.ram
            rows = np.concatenate([at for at, _, _ in mine])
            if np.unique(rows).size == rows.size:
                for at, positions, given in mine:
                    known = None if positions is None else ram.known_frames(spec.key, positions)
                    if known is None or len(given) < len(spec.keys) or not known.known.all():
                        ram.keep_lent_frames()  # (frames compared: by value)
                    yield cells, at, given, known
            else:
                ram.keep_lent_frames()
                for at, given in _merged(mine, spec.keys):
                    yield cells, at, given, None

    def read(self, requests: Mapping[Key, np.ndarray]) -> dict[Key, torch.Tensor]:
        """The rows ``requests[key]`` of the arrays (any order) of each frames key. The keys
        of a leaf and its twin that ask the same rows (a sample asks both) are read
        together: their ids, then the cells they name, once."""
        out: dict[Key, torch.Tensor] = {}
        for spec in self.specs():
            asked = [key for key in spec.keys if key in requests]
            while asked:
                rows = requests[asked[0]]
                alike = [key for key in asked if np.array_equal(requests[key], rows)]
                out.update(self.cells(spec.key).read(rows, alike))
                asked = [key for key in asked if key not in alike]
        return out

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
