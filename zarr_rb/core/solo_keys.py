"""Keys added to a store of one writer that holds rows: their arrays are created, and
zeros go into every cell of theirs that a reader of a record could read (rows on disk, in
their slots and in their committed ones, a kept save's, an archive's), before the store
takes the keys; rows waiting in RAM get zeros there. Part of
:class:`~zarr_rb.core.solo.SoloCommits` (see :mod:`zarr_rb.core.solo`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.solo_saves import SoloSaves
from zarr_rb.errors import StoreWriteError
from zarr_rb.format.names import FORMAT_NON_TENSOR
from zarr_rb.format.schema import LeafSpec, leaves_by_key
from zarr_rb.util.keys import Key


class SoloKeys(SoloSaves):
    """Keys added to the store (see the module's docstring)."""

    def add_leaves(
        self, leaves: Sequence[LeafSpec], samples: Mapping[Key, torch.Tensor] | None
    ) -> None:
        with contextlib.suppress(StoreWriteError):
            # (A block write in flight that failed waits in RAM again, zeros of the new
            # keys included, for the next flush: the write adding the keys goes on.)
            self.settle()
        store = self.store
        schema = store.schema
        assert schema is not None
        assert store.write_cache is not None
        assert store.ledger is not None
        block_rows = store.meta.block_rows or 1
        physical_shape = (store.physical_rows, *schema.batch_shape[1:])
        on_disk = store.ledger.held()  # (rows with cells of some keys written, too)
        if on_disk.any():
            # The record says this writer holds its slots before it writes zeros there, and
            # names the keys only after (a reader of it would meet cells holding nothing).
            self._first_own_slot()
        with store.writing("creating the arrays of new keys", kept=False):
            store.arrays.create(leaves, physical_shape, block_rows, samples=samples)
        grown = schema.with_leaves(leaves)
        # The zeros go to disk before the store takes the new keys: if their write fails,
        # the store is without them, as the error says (the call stored nothing and is made
        # again), not holding keys whose cells on disk were never written (unreadable).
        store.leaves = leaves_by_key(grown.leaves)  # (the new arrays open by their leaves)
        try:
            self._zeros_in_new_keys(leaves, on_disk)
        except BaseException:
            store.leaves = leaves_by_key(schema.leaves)
            store.arrays.forget(leaf.key for leaf in leaves)
            raise
        # A store of format 1 that takes leaves format 1 cannot read becomes format 2, so
        # that an older zarr_rb refuses it (FormatVersionError) instead of misreading it.
        fmt = store.meta.format
        if any(leaf.value != "tensor" for leaf in leaves):
            fmt = max(fmt, FORMAT_NON_TENSOR)
        self.meta = dataclasses.replace(self.meta, schema=grown, format=fmt)
        for leaf in leaves:
            store.write_cache.add_key(
                leaf.key, store.element_shape(leaf), TORCH_DTYPES[leaf.dtype], ragged=leaf.ragged
            )
        store.ram.choose()
        store.ledger.add_keys((leaf.key for leaf in leaves), zeroed=on_disk)

    def _zeros_in_new_keys(self, leaves: Sequence[LeafSpec], on_disk: np.ndarray) -> None:
        """Zeros on disk for every row that holds data there (intact here, published to
        readers, or kept by a save), so that those rows stay whole with the new keys; rows
        waiting in RAM get zeros there too (add_key)."""
        store = self.store
        block_rows = store.meta.block_rows or 1
        committed = self._committed_slots()
        with store.writing("writing zeros into new keys", kept=False):
            futures = []
            row_sets = []
            for start, stop in _runs(on_disk, block_rows):
                # In the block's slot, and in its committed one (when the writer moved it
                # since): readers of the last commit read it there.
                positions = np.arange(start, stop)
                rows = np.union1d(self.physical(positions), committed.physical(positions))
                row_sets.append(rows)
            history = store.committed.history
            if history is not None:  # an archive's rows read as zeros in the new keys too
                row_sets.append(np.unique(history.physical(np.arange(history.end))))
            # So do a kept save's, in its slots (a block copied on write since is elsewhere
            # now): zarr_rb.load serves them with the keys added since.
            covered = np.concatenate(row_sets) if row_sets else np.zeros(0, np.int64)
            for saved in self.meta.pinned():
                commit = saved.commit(store.elements_per_row(store.schema))
                rows = self._slots_of(commit).physical(np.arange(commit.length))
                rows = np.setdiff1d(rows, covered)
                if rows.size:
                    row_sets.append(rows)
                    covered = np.union1d(covered, rows)
            for rows in row_sets:
                for leaf in leaves:
                    if leaf.ragged:
                        continue  # its rows are empty (their lengths are zeros): nothing to read
                    zeros = np.zeros((rows.size, *store.element_shape(leaf)), leaf.stored_dtype)
                    futures.append(store.arrays.get(leaf.key).write_rows(rows, zeros))
            for future in futures:
                future.result()


def _runs(mask: np.ndarray, step: int) -> Iterator[tuple[int, int]]:
    """The ``True`` runs of ``mask`` as ``(start, stop)``, cut at multiples of ``step``."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        first = start
        while first < stop:  # (a run need not start at a multiple of step)
            end = min(stop, (first // step + 1) * step)
            yield first, end
            first = end
