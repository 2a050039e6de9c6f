"""The writes of a :class:`~zarr_rb.ZarrStorage`: TorchRL's ``set`` with every index
form, the first write that makes the store's arrays, patches of some keys
(``rb.update_if_present``, writes into lazy views) and ``rb.empty()``.

Every write is validated whole before it touches the length, the cursor or the store: a
refused write leaves the storage as it was (and its writer, see
:mod:`zarr_rb.torchrl.guards`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.metadata import capacity_of
from zarr_rb.errors import NotSupportedError, UnknownKeyError, UnsupportedDataError
from zarr_rb.format.index_key import INDEX_KEY, POSITION_MARK
from zarr_rb.format.schema import Schema
from zarr_rb.torchrl import compat, data_kinds, index_forms, sharing
from zarr_rb.torchrl.entries import ENTRY_KINDS
from zarr_rb.torchrl.leaves import infer_schema, leaves_for_write, new_leaves
from zarr_rb.torchrl.samples import OneCommitSamples
from zarr_rb.torchrl.store_backed import io_boundary
from zarr_rb.util.keys import Key


class StorageWrites(OneCommitSamples):
    """Writes of a storage into its store (see the module's docstring)."""

    @io_boundary
    def _init(self, data: Any) -> None:
        """Create the store's arrays from one element (TorchRL's checkpointers call this)."""
        self._initialize(data, batched=False)

    def _initialize(self, data: Any, *, batched: bool) -> None:
        self._create(self._schema_for(data, batched=batched))

    def _schema_for(self, data: Any, *, batched: bool) -> Schema:
        """The schema a first write of ``data`` gives the store."""
        if self.device == "auto":  # as LazyTensorStorage: the data's (None for a TensorDict
            self.device = data_kinds.device_of(data)  # without a device)
        return infer_schema(
            data, batched=batched, ndim=self.ndim, max_size=self.max_size, ragged=self._ragged
        )

    def _create(self, schema: Schema, *, samples: dict[Key, torch.Tensor] | None = None) -> None:
        """Create the store's arrays (the first write; ``samples``: the leaves it writes)."""
        self._store.initialize(schema, samples=samples)
        self.initialized = True
        # As TorchRL's storages: max_size rounded up to whole rows (ndim > 1).
        self.max_size = capacity_of(self._store.meta)

    @io_boundary
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        with self._store.commits.set_aside():  # (a write reads the store as it is now)
            self._set_now(cursor, data, set_cursor=set_cursor)

    def _set_now(self, cursor: Any, data: Any, *, set_cursor: bool) -> None:
        store = self._store
        store.check_writable()
        if isinstance(data, list):
            data = data_kinds.flip_list(data)
        if store.is_shared and set_cursor and not isinstance(cursor, tuple):
            self._append_shared(cursor, data)
            compat.bump_revision(self)
            return
        # Validate everything before touching the length or the cursor: a rejected
        # write leaves the storage as it was (and its writer, see guards.guard_writer).
        rows, leaves = self._rows_to_write(cursor, data)
        store.before_write(rows)
        self.__dict__["writes_begun"] += 1
        schema = store.schema
        assert schema is not None
        next_cursor = None
        if set_cursor:
            compat.set_last_cursor(self, cursor)
            compat.grow_length(self, data, cursor)
            last_row = compat.last_cursor_index(self)
            if last_row is not None:
                next_cursor = (last_row + 1) % schema.rows
        try:
            store.write(rows, leaves, cursor=next_cursor)
        finally:
            # Also when it failed: its rows are kept (a flush writes them again), and a
            # read made before it must not be served again.
            compat.bump_revision(self)

    def _append_shared(self, cursor: Any, data: Any) -> None:
        """An extend of a shared store: the rows go where this writer's blocks have room
        (see :func:`~zarr_rb.torchrl.sharing.append`)."""
        if self.ndim != 1:
            raise NotSupportedError(
                f"{self._where}: shared writers place rows by blocks of a 1-D storage; "
                f"this one has ndim={self.ndim}: flatten the batch (data.reshape(-1)) and "
                "use ndim=1",
            )
        rows, leaves = self._rows_to_write(cursor, data)
        self.__dict__["writes_begun"] += 1
        self._thread_state.placed = sharing.append(
            self._store,
            cursor,
            rows,
            leaves,
            where=self._where,
            index_is_position=self.index_is_position(),
        )

    def _rows_to_write(self, cursor: Any, data: Any) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """The sorted unique rows ``cursor`` writes, and the leaves ``data`` puts there."""
        store = self._store
        where = self._where
        first: Schema | None = None
        if not self.initialized:
            first = self._schema_for(data, batched=not compat.is_int(cursor))
            if isinstance(cursor, tuple):
                self._create(first)
        schema = store.schema or first
        assert schema is not None
        if isinstance(cursor, tuple):
            rows, leaves = self._patch_elements(cursor, data, schema)
            _refuse_marks(leaves, where)
            return rows, leaves
        index, index_shape = index_forms.write_rows(cursor, schema.rows, where=where)
        all_leaves, new = leaves_for_write(
            data, schema=schema, index_shape=index_shape, where=where, ragged=self._ragged
        )
        _refuse_marks(all_leaves, where)
        if first is not None:  # the rows passed: the store's arrays are made only now
            self._create(first, samples=all_leaves)
        if new:
            store.add_leaves(new, samples=all_leaves)
        rows, last = index_forms.unique_last(index)
        if rows.size == index.size and (rows == index).all():
            return rows, all_leaves  # already sorted and unique: no gather, no copy
        position = torch.from_numpy(last)
        return rows, {key: value[position] for key, value in all_leaves.items()}

    def _patch_elements(
        self, cursor: tuple[Any, ...], data: Any, schema: Schema
    ) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """Rows touched by a multi-dimensional index, read and patched with ``data``."""
        where = self._where
        head, rest = cursor[0], cursor[1:]
        rows, position = index_forms.read_rows(head, schema.rows, where=where)
        kind = data_kinds.kind_of(data)
        lead = 0 if kind in ("tensor", "pytree") else data.ndim - len(schema.item_batch_shape)
        new = new_leaves(data, schema=schema, lead=lead, where=where, ragged=self._ragged)
        block = self._read(rows, schema, unused_as_zeros=True)
        if new and not (
            isinstance(block, TensorDictBase) and all(leaf.value == "tensor" for leaf in new)
        ):
            self._store.add_leaves(new)  # (rare: such keys are made before the check)
            assert self._store.schema is not None
            schema = self._store.schema
            block = self._read(rows, schema, unused_as_zeros=True)
            new = []
        grown = schema.with_leaves(new)
        for leaf in new:  # new keys: zeros in the rows read, as once they are made
            shape = (rows.size, *schema.batch_shape[1:], *leaf.shape)
            block.set(leaf.key, torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype]))
        data_kinds.assign(block, (position, *rest), data)
        leaves, _ = leaves_for_write(block, schema=grown, index_shape=(rows.size,), where=where)
        if new:  # the patch passed: only now are its new keys made
            self._store.add_leaves(new)
        return rows, leaves

    @io_boundary
    def write_leaves(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Write ``values[key][i]`` into row ``rows[i]`` of some leaves (see
        :meth:`_write_leaves_now`)."""
        with self._store.commits.set_aside():  # (a write reads the store as it is now)
            self._write_leaves_now(rows, values)

    def _write_leaves_now(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Write ``values[key][i]`` into row ``rows[i]`` of some leaves, together (any order;
        the last of repeated rows wins): what writes into the lazy columns of ``storage[:]``
        and ``rb.update_if_present`` do.

        As with TorchRL's storages, whose views alias their memory, such writes leave the
        storage's mutation revision to the buffer method that made them (``rb.set_``,
        ``rb.update_``...), which moves it once.
        """
        self._store.check_writable()
        where = self._where
        schema = self._store.schema
        kinds = {} if schema is None else {leaf.key: leaf.value for leaf in schema.leaves}
        for key in values:
            if key not in kinds:
                held = ", ".join(repr(k if len(k) > 1 else k[0]) for k in kinds) or "no key"
                raise UnknownKeyError(
                    f"{where}: no entry {key if len(key) > 1 else key[0]!r} to patch (it "
                    f"holds {held}); a patch of some keys (rb.update_if_present, a write into "
                    "storage[:]) changes entries the rows have, as TorchRL's storages do: "
                    "extend with rows that have the new entry to add it",
                )
            if kinds[key] != "tensor":
                what = ENTRY_KINDS.get(kinds[key], f"{kinds[key]} values")
                raise NotSupportedError(
                    f"{where}: entry {key!r} holds {what}, which a patch of some keys "
                    "(rb.update_if_present, a write into storage[:]) cannot change; write "
                    "whole rows (rb.extend, storage[index] = rows) instead",
                )
        _refuse_marks(values, where)
        rows = index_forms.check_rows(
            rows.astype(np.int64), self._store.rows, where=where, what="write index"
        )
        unique, last = index_forms.unique_last(rows)
        if unique.size != rows.size or (unique != rows).any():
            picked = torch.from_numpy(last)
            values = {key: value[picked] for key, value in values.items()}
        self._store.write(unique, {key: value.detach().to("cpu") for key, value in values.items()})
        # The revision stays (see above), but a gather kept from before must not be served.
        self._gathers.clear()

    @io_boundary
    def _empty(self) -> None:
        self._store.empty()
        compat.bump_revision(self)

    @io_boundary
    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
        """Patch some keys of some elements (``rb.update_if_present``): those keys only are
        written, after TorchRL validated the whole patch."""
        if index.ndim > 1:
            self.set(tuple(index.unbind(-1)), data_kinds.as_patch(patch, index), set_cursor=False)
            return
        self.write_leaves(
            index.cpu().numpy(),
            {data_kinds.key_tuple(key): value for key, value in patch.items()},
        )


def _refuse_marks(values: dict[Key, torch.Tensor], where: str) -> None:
    """Refuse an ``"index"`` entry holding the value that stands for a row's position in a
    store of several writers (see :mod:`zarr_rb.format.index_key`): it would read back as the
    position."""
    value = values.get(INDEX_KEY)
    if value is not None and value.dtype == torch.int64 and bool((value == POSITION_MARK).any()):
        raise UnsupportedDataError(
            f"{where}: entry 'index' holds {POSITION_MARK} (-2**62), the value that stands "
            "for a row's position in stores of several writers, so it would read back as "
            "the position; store that value under another key",
        )
