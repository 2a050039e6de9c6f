"""The reads of a :class:`~zarr_rb.ZarrStorage`: TorchRL's ``get`` with every index form,
lazy views of every row (``storage[:]``, the full view TorchRL's checkpointers read),
entries of Python values, the random draws of ``RandomSampler`` and the batches of a
PyTorch ``DataLoader``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from torch.utils._pytree import tree_map

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.reader import follows_writer
from zarr_rb.errors import NotSupportedError
from zarr_rb.format.commit import Commit
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.torchrl import compat, data_kinds, index_forms, sharing
from zarr_rb.torchrl.column_sources import LeafSource, RowsOnlySource, ViewCommit
from zarr_rb.torchrl.columns import LazyColumn
from zarr_rb.torchrl.dataloader import check_open
from zarr_rb.torchrl.entries import ENTRY_KINDS, decode
from zarr_rb.torchrl.guards import random_readable_indices
from zarr_rb.torchrl.store_backed import io_boundary
from zarr_rb.torchrl.writes import StorageWrites
from zarr_rb.util.fork import refuse_if_forked
from zarr_rb.util.keys import Key


class StorageReads(StorageWrites):
    """Reads of a storage from its store (see the module's docstring)."""

    @property
    def _storage(self) -> Any:
        """What TorchRL's checkpointers and hooks read and write: :meth:`full_view`."""
        return self.full_view() if "_store" in self.__dict__ else None

    @_storage.setter
    def _storage(self, value: Any) -> None:
        if value is not None:
            raise TypeError("ZarrStorage keeps its data on disk; it cannot adopt a tensor")

    def full_view(self) -> Any:
        """The full capacity as lazy, writable columns (``None`` before the first write);
        unused capacity reads as zeros."""
        schema = self._store.schema
        return None if schema is None else self._lazy_view(schema.rows, unused_as_zeros=True)

    @io_boundary
    def get(self, index: Any) -> Any:
        refuse_if_forked(self._where)  # TensorStore would abort the process
        if not self.initialized and self._store.is_shared:
            self._pick_up_other_writers()
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        schema = self._store.schema
        assert schema is not None
        if self.read_only and index_forms.takes_a_view(index):
            self.follow_writer()  # (a view reads one commit: the newest when it is taken)
        length = compat.length_along_dim0(self)
        if index_forms.is_key(index):
            # storage.get("done") or storage.get(("next", "done")): that column, lazily.
            key = data_kinds.key_tuple(index)
            if any(leaf.key == key and leaf.value != "tensor" for leaf in schema.leaves):
                return self._entry(key)
            return data_kinds.select(self.get(slice(None)), index)
        head, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if isinstance(index, tuple) and not index:
            head = slice(None)
        gathered = False  # (rows read now, not a lazy view: a sample ends there)
        try:
            if isinstance(head, slice) and head.indices(length) == (0, length, 1):
                # Every row: a lazy, writable view (further indices narrow it, lazily too).
                out = self._lazy_view(length)
                if rest:
                    out = data_kinds.select(out, (slice(None), *rest))
            elif not rest and not isinstance(head, slice) and not compat.is_int(head):
                gathered = True
                if self._store.is_shared and isinstance(head, torch.Tensor):
                    out = sharing.gather_redrawing(
                        head,
                        lambda i: self._gather(
                            index_forms.as_index_tensor(i), schema, compat.length_along_dim0(self)
                        ),
                        self._rand_given_ndim,
                        draw=getattr(self._thread_state, "draw", None),
                        refresh=self.draw_again,
                    )
                else:
                    out = self._gather(index_forms.as_index_tensor(head), schema, length)
            else:
                gathered = True
                rows, position = index_forms.read_rows(head, length, where=self._where)
                block = self._read(rows, schema)
                whole = isinstance(position, slice) and not rest
                out = block if whole else data_kinds.select(block, (position, *rest))
        finally:
            if gathered:
                self.gathered()
        device = self.device
        if self._build_device is None and isinstance(device, torch.device):
            out = data_kinds.to_device(out, device)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """``[self[i] for i in indices]`` in one read of the store: how a PyTorch
        ``DataLoader`` fetches a batch (``DataLoader(rb.storage, batch_size=256,
        num_workers=2, collate_fn=torch.stack)``; see :mod:`zarr_rb.torchrl.dataloader`)."""
        check_open(self)
        refuse_if_forked(self._where)  # before len(), which may read the record
        if self.ndim != 1:
            raise NotSupportedError(
                f"store {self.url!r} has ndim={self.ndim}: its len counts elements while "
                "storage[i] is a whole time step, so it is not a flat dataset; "
                "zarr_rb.open(path).dataset() has one item per [time, env] element"
            )
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self.read_only and index.size and index.max() >= len(self):
            self.refresh()  # a persistent worker: the writer committed rows since it opened
        # An array index (not a tensor) reads these very rows, one gather, even from a
        # shared store, where a sampler's tensor index may be redrawn if its rows were
        # evicted.
        batch = self.get(index)
        if isinstance(batch, (torch.Tensor, TensorDictBase)):
            return list(batch.unbind(0))
        return [tree_map(lambda leaf, k=k: leaf[k], batch) for k in range(index.size)]

    def _gather(self, index: torch.Tensor, schema: Schema, length: int) -> Any:
        """Rows at a row index (a sampler's output), in the order asked, repeats included
        (the last gather is kept for the next reader of the same rows, see
        :mod:`zarr_rb.torchrl.gather_cache`)."""
        held = self._store.commits.held()  # (a sample's: the rows of the commit it holds)
        generation = None if held is None else held.generation
        revision = (compat.revision(self), self._store.version, generation)
        # A sampler's own read of the rows it drew (SliceSampler reads their flags) is kept
        # for the buffer's gather of the same rows, which follows; no other read is kept,
        # as its caller may change what it was handed in ways no version counter shows.
        drawing = bool(getattr(self._thread_state, "drawing", False))
        shaped = None if drawing else self._gathers.take(index, revision)
        if shaped is None:
            rows = index_forms.check_rows(index.reshape(-1).numpy(), length, where=self._where)
            leaves = self._store.read(rows, (leaf.key for leaf in schema.leaves))
            shaped = {key: v.reshape(*index.shape, *v.shape[1:]) for key, v in leaves.items()}
            if drawing and all(leaf.value == "tensor" for leaf in schema.leaves):
                self._gathers.keep(index, revision, shaped)
            else:
                # (Python values, which a caller may replace unseen, or one TensorDict per
                # row, too many tensors to watch for changes cheaply: not kept.)
                self._gathers.clear()
        return data_kinds.build(
            shaped,
            schema=schema,
            batch_shape=(*index.shape, *schema.batch_shape[1:]),
            device=self._build_device,
        )

    def _lazy_view(self, length: int, *, unused_as_zeros: bool = False) -> Any:
        """Every leaf as a writable :class:`LazyColumn` over rows ``[0, length)``; entries no
        tensor column holds (strings, rows of different lengths) as columns that say, when
        read, how to read them."""
        schema = self._store.schema
        assert schema is not None
        columns, leaves = self.lazy_columns(length, unused_as_zeros=unused_as_zeros)
        return data_kinds.build(
            columns,
            schema=dataclasses.replace(schema, leaves=tuple(leaves)),
            batch_shape=(length, *schema.batch_shape[1:]),
            device=self._build_device,
        )

    def lazy_columns(
        self, length: int, *, unused_as_zeros: bool = False
    ) -> tuple[dict[Key, LazyColumn], list[LeafSpec]]:
        """Every leaf as a :class:`LazyColumn` over rows ``[0, length)``, and the leaves the
        columns stand for (an entry no tensor column holds stands as ``uint8``)."""
        store = self._store
        schema = store.schema
        assert schema is not None
        columns: dict[Key, LazyColumn] = {}
        leaves = []
        # A reader's columns read the rows of one commit (a save's never change).
        view = ViewCommit(store) if follows_writer(store) else None
        for leaf in schema.leaves:
            if leaf.value == "lengths":
                continue
            if leaf.value == "tensor":
                source: Any = LeafSource(
                    self._store,
                    leaf.key,
                    length,
                    unused_as_zeros=unused_as_zeros,
                    holes_as_zeros=lambda: self.reads_holes_as_zeros,
                    write=self.write_leaves,
                    view=view,
                )
                columns[leaf.key] = LazyColumn(
                    (length, *self._store.element_shape(leaf)),
                    TORCH_DTYPES[leaf.dtype],
                    source=source,
                )
                leaves.append(leaf)
                continue
            what = ENTRY_KINDS.get(leaf.value, f"{leaf.value} values")
            values = None
            if leaf.value != "ragged":
                under = None if view is None else view.commit
                values = functools.partial(self.entry_values, under=under)
            source = RowsOnlySource(self._store, leaf.key, length, what, values=values)
            shape = (length, *schema.batch_shape[1:])
            columns[leaf.key] = LazyColumn(shape, torch.uint8, source=source)
            leaves.append(LeafSpec(key=leaf.key, dtype="uint8", shape=()))
        return columns, leaves

    def _entry(self, key: Key) -> Any:
        """``storage.get(key)`` of an entry no tensor column holds: every row of it, as a
        list of tensors (rows of different lengths), or the values as ``LazyTensorStorage``
        returns them."""
        rows = compat.length_along_dim0(self)
        items = self.entry_values(key, np.arange(rows))
        if self._store.leaf(key).value == "ragged":
            return items
        schema = self._store.schema
        assert schema is not None
        shape = (rows, *schema.batch_shape[1:])
        stack = NonTensorStack.from_list(items) if items else NonTensorStack(batch_size=shape)
        # As TensorStorage.get(key) returns them: what a TensorDict's [key] gives.
        return TensorDict({key: stack}, batch_size=shape)[key]

    @io_boundary
    def entry_values(self, key: Key, rows: np.ndarray, *, under: Commit | None = None) -> list[Any]:
        """The rows of an entry no tensor column holds: its Python values (a list of them
        per row with ``ndim=2``), or its tensors of different lengths (``under``: as that
        commit has them, a reader's view's)."""
        leaf = self._store.leaf(key)
        keys = [leaf.key, *([leaf.lengths_key] if leaf.ragged else [])]
        read = self._store.read(rows, keys, under=under)
        items = decode(leaf, read[leaf.key], read.get(leaf.lengths_key))
        schema = self._store.schema
        assert schema is not None
        return data_kinds.nest(items, (rows.size, *schema.batch_shape[1:]))

    @io_boundary
    def _rand_given_ndim(self, batch_size: int) -> Any:
        """Random element indices (RandomSampler), drawn among the rows that can be read:
        rows withdrawn by a crash or by ``verify --repair`` are never drawn."""
        if not self.unreadable_rows().size:
            index = super()._rand_given_ndim(batch_size)
        else:
            index = random_readable_indices(self, batch_size)
        if self._store.is_shared:
            self._thread_state.draw = index  # drawn again if evicted before it is read
        return index
