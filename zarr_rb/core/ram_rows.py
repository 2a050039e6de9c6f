"""The rows a writer serves from RAM, and its reads: rows waiting in its write buffer, its
copies of small leaves and its RAM tier of frames come before the disk.

A writer keeps its rows not yet on disk by block (:class:`~zarr_rb.core.write_cache.WriteBuffer`),
copies of its small leaves (:class:`~zarr_rb.core.mirror.Mirror`) and, within ``ram_bytes``,
the frames of its large leaves, each once (:class:`~zarr_rb.core.frames.FrameTier`);
:class:`RamRows` reads through them, and from the arrays the rest, and keeps them up to
date as it writes and as other writers' commits change rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from zarr_rb.core.arrays import StoreArrays
from zarr_rb.core.calls import Calls, serialized
from zarr_rb.core.disk_reads import place, rows_as_of
from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.core.frame_plans import KnownFrames, frame_keys
from zarr_rb.core.frames import FrameTier
from zarr_rb.core.mirror import Mirror, put_rows, zeros
from zarr_rb.core.ram_fill import FillStore, TierFill
from zarr_rb.core.store_facts import StoreFacts
from zarr_rb.errors import RowsNotCommittedError
from zarr_rb.format.commit import Commit
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.schema import LeafSpec, plain_then_ragged, with_lengths
from zarr_rb.util.keys import Key


class RamOwner(StoreFacts, FillStore, Protocol):
    """What the RAM rows use of their store (:class:`~zarr_rb.core.store.Store`)."""

    @property
    def length_rows(self) -> int: ...
    @property
    def rows_reached(self) -> int: ...

    @property
    def arrays(self) -> StoreArrays: ...
    @property
    def calls(self) -> Calls: ...


class RamRows:
    """A writer's rows in RAM: what it mirrors, how far it wrote, and its reads."""

    def __init__(self, store: RamOwner, *, large_row_bytes: int, read_only: bool) -> None:
        self.store = store
        self.mirror = Mirror(rows=0, large_row_bytes=large_row_bytes, read_only=read_only)
        """The small leaves this writer keeps in RAM, and their copies."""
        self.frames: FrameTier | None = None
        """The frames of the large leaves this writer keeps in RAM (with ``ram_bytes``)."""
        self._large_row_bytes = large_row_bytes
        self._read_only = read_only
        self.calls = store.calls
        """The store's calls: a new budget waits for the call under way (whose rows may be
        lent to the tier it replaces)."""
        self.fill = TierFill(self, store.calls)
        """When the tier reads the rows already in the store."""
        self.rows_written = 0
        """One past the highest row this process wrote (or staged)."""

    # --- the mirror ------------------------------------------------------------------------

    @serialized
    def keep_in_ram(self, nbytes: int, *, fill: bool = False, behind: bool = False) -> None:
        """Let the writer keep the rows it writes in RAM, frames too, in at most ``nbytes``
        there (the small leaves take at least :data:`~zarr_rb.core.mirror.MIRROR_LIMIT_BYTES`);
        the largest budget asked by the storages sharing this store holds.

        Rows already in the store are read into RAM too (newest first, while they fit):
        with ``fill``, at the first read; with ``behind``, from the first read on, on a
        thread of the store (see :class:`~zarr_rb.core.ram_fill.TierFill`).
        """
        self.fill.ask(at_first_read=fill, behind=behind)
        if nbytes <= self.mirror.ram_bytes:
            return  # the budget chosen stands
        self.mirror.ram_bytes = int(nbytes)
        if self.store.schema is not None:
            self.choose()

    @property
    def ram_bytes(self) -> int:
        """The RAM budget of this writer (see :meth:`keep_in_ram`)."""
        return self.mirror.ram_bytes

    def choose(self) -> None:
        """Choose the leaves to keep in RAM (a new schema, a new budget)."""
        schema = self.store.schema
        assert schema is not None
        self.mirror.choose(schema.leaves, schema.batch_shape, self.store.rows_reached)
        specs = frame_keys(schema.leaves, schema.batch_shape, self._large_row_bytes)
        small = min(self.mirror.limit, self.mirror.row_bytes * schema.rows)
        budget = self.mirror.ram_bytes - small
        tier = None
        if specs and budget > 0 and not self._read_only:
            tier = FrameTier(specs, rows=schema.rows, budget=budget)  # (may fail: none changed)
            tier = tier if tier.capacity else None
        self.frames = tier
        if tier is not None:
            self.fill.again()
        if self.store.write_cache is not None:
            # (Rows whose frames the tier before held for it are copied in first.)
            self.store.write_cache.lend_frames(self.frames)

    @property
    def mirrored(self) -> bool:
        """Whether this writer keeps leaves in RAM (which other writers' rows change)."""
        return self.mirror.held or (self.frames is not None and bool(self.frames.resident.any()))

    def update(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, frames: bool = True
    ) -> None:
        """Rows (unique) this writer wrote or placed: into the copies of mirrored leaves,
        and into the tier of frames unless ``frames`` is false (then :meth:`update_frames`
        follows)."""
        first = self.store.rows_reached == 0
        if rows.size and int(rows.max()) >= self.rows_written:
            self.rows_written = int(rows.max()) + 1
            if self.mirror.keys:
                self.mirror.fit(self.store.rows_reached)
        if first:
            # A new store: mirrors start with its first rows (none to read back later).
            for key in self.mirror.missing():
                self.mirror.copy_of(key, self.reach(), self._load)
        self.mirror.put(rows, values, self.rows_written)
        if frames:
            self.update_frames(rows, values)

    def update_frames(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> None:
        """The frames of rows :meth:`update` took without them."""
        if self.frames is not None:
            self.frames.put(rows, values)

    def keep_lent_frames(self) -> None:
        """The writes under way are about to be read by value (their frames compared, or
        kept for a retry): the frames their blocks left in the tier are copied in first
        (:meth:`~zarr_rb.core.write_cache.WriteBuffer.keep_unkept`)."""
        if self.store.write_cache is not None:
            self.store.write_cache.keep_unkept()

    def known_frames(self, key: Key, positions: np.ndarray) -> KnownFrames | None:
        """The frames of the leaf of ``key`` (and its twin) at ``positions`` as the tier
        holds them, if it keeps that leaf."""
        tier = self.frames
        return None if tier is None or key not in tier.keys else tier.known(key, positions)

    def clear(self) -> None:
        """Forget every row kept in RAM (``empty``, a save loaded): read again when needed."""
        self.mirror.clear()
        if self.frames is not None:
            self.frames.clear()
            self.fill.again()

    def forget(self, rows: np.ndarray) -> None:
        """Rows (unique) a failed call may have put into RAM's copies, or not: they hold
        what the write buffer and the store hold, read again when needed."""
        if self.frames is not None:
            self.frames.release(rows[rows < self.frames.rows])
            self.fill.again(rows_changed=True)
        for key in self.mirror.held_keys():
            inside = np.unique(rows[rows < self.mirror[key].shape[0]])
            if inside.size:
                self.mirror.put(inside, {key: self._as_written(key, inside)}, reached=0)

    def changed(self, rows: np.ndarray) -> None:
        """Rows (a mask) that other writers changed: read their mirrored leaves again."""
        if self.frames is not None:
            self.frames.release(np.flatnonzero(rows[: self.frames.rows]))
            self.fill.again(rows_changed=True)
        if not self.mirror.held:
            return
        ledger = self.store.ledger
        assert ledger is not None
        picked = np.flatnonzero(ledger.fit(rows) & ledger.published)
        if picked.size > self.store.rows // 4:
            self.mirror.clear()  # read whole again when next needed
            return
        if picked.size:
            values = self.store.arrays.read(dict.fromkeys(self.mirror.held_keys(), picked))
            self.update(picked, values)

    def reach(self) -> int:
        """Rows a new copy of a mirrored leaf covers: those this writer may have reached."""
        assert self.store.ledger is not None
        return max(self.store.rows_reached, self.store.ledger.extent)

    def _load(self, key: Key, covered: int) -> torch.Tensor:
        """A new copy of a leaf, ``covered`` rows long, as this writer has them."""
        return self._as_written(key, np.arange(covered))

    def _as_written(self, key: Key, rows: np.ndarray) -> torch.Tensor:
        """The cells of ``key`` of ``rows`` (unique) as this writer has them, zeros where
        none can be read."""
        store = self.store
        assert store.write_cache is not None
        assert store.ledger is not None
        leaf = store.leaf(key)
        out = zeros((rows.size, *store.element_shape(leaf)), TORCH_DTYPES[leaf.dtype])
        # Only cells known to be on disk: others were never written, or were lost to a
        # crash or a failed write, and are not readable until they are rewritten. Rows
        # held in the write buffer come from there: a block being written to a new slot
        # is not there yet.
        staged, served = store.write_cache.staged_rows(rows)
        on_disk = np.flatnonzero(store.ledger.readable(rows, key) & ~staged)
        put_rows(out, on_disk, store.arrays.read({key: rows[on_disk]})[key])
        for block, positions in served:
            offsets = rows[positions] - block.index * store.write_cache.block_rows
            out[torch.from_numpy(positions)] = block.values[key][torch.from_numpy(offsets)]
        for positions, values in store.write_cache.patches.cells(rows, key):
            out[torch.from_numpy(positions)] = values
        return out

    # --- the write buffer ------------------------------------------------------------------

    def staged_mask(self, rows: int) -> np.ndarray:
        """The rows waiting in RAM, as a mask over the first ``rows`` rows."""
        mask = np.zeros(rows, dtype=bool)
        cache = self.store.write_cache
        assert cache is not None
        for block in cache.held():
            start = block.index * cache.block_rows
            if start < rows:
                stop = min(start + block.length, rows)
                mask[start:stop] |= block.dirty[: stop - start]
        return mask

    def unreadable_rows(self, rows: int) -> np.ndarray:
        """Which of the first ``rows`` rows this writer cannot read: neither whole on disk
        nor held in RAM (whole, or cell by cell: on disk, or kept from a failed write of
        some keys)."""
        ledger, cache = self.store.ledger, self.store.write_cache
        assert ledger is not None
        assert cache is not None
        if rows <= ledger.extent and ledger.intact[:rows].all():
            return np.empty(0, dtype=np.int64)  # every sample asks: one pass, no copy
        unreadable = ~(ledger.first(ledger.intact, rows) | self.staged_mask(rows))
        if unreadable.any():
            lost = np.flatnonzero(unreadable)
            whole = np.ones(lost.size, dtype=bool)
            for key in self.store.leaves:
                whole &= ledger.readable(lost, key) | cache.patches.mask(lost, key)
            unreadable[lost[whole]] = False
        return np.flatnonzero(unreadable)

    # --- reads -----------------------------------------------------------------------------

    def read(
        self,
        rows: np.ndarray,
        keys: list[Key],
        *,
        unwritten_as_zeros: bool,
        unreadable_as_zeros: bool,
        under: Commit | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Rows as this writer has them: on disk, in its write buffer, in its mirror (see
        :meth:`Store.read <zarr_rb.core.store.Store.read>`); ``under``: as that commit has
        them, a commit the store moved past (a shared writer's sample) read from disk."""
        store = self.store
        if under is not None and under.generation != store.committed.generation:
            return self._read_under(under, rows, keys, unreadable_as_zeros=unreadable_as_zeros)
        self.fill.before_read()
        cache, ledger = store.write_cache, store.ledger
        assert cache is not None
        assert ledger is not None
        hit, served = cache.staged_rows(rows)
        wanted = with_lengths(store.leaves, keys)
        # Cells of failed writes of some keys, kept for a retry: the newest values there.
        patches = {key: cache.patches.cells(rows, key) for key in wanted} if cache.patches else {}
        nothing = np.zeros(rows.size, dtype=bool)
        patched = {}
        for key, found in patches.items():
            patched[key] = nothing.copy()
            for positions, _ in found:
                patched[key][positions] = True
        on_disk: dict[Key, np.ndarray] = {}
        for key in wanted:
            readable = ledger.readable(rows, key) | hit | patched.get(key, nothing)
            if not readable.all() and not unreadable_as_zeros:
                lost = ~readable
                if unwritten_as_zeros:
                    lost &= rows < store.length_rows  # past the length: unused capacity
                if lost.any():
                    raise RowsNotCommittedError(
                        f"store {store.url!r}: rows {preview_rows(rows[lost])} "
                        f"hold no intact data for key {key!r}: nothing was written there yet, "
                        "or a write to them was interrupted (a crash or a failed write) and "
                        "they have not been rewritten since",
                    )
            on_disk[key] = readable & ~hit & ~patched.get(key, nothing)
        out: dict[Key, torch.Tensor] = {}
        index = torch.from_numpy(rows)
        tier = self.frames
        in_tier = np.zeros(rows.size, dtype=bool) if tier is None else tier.resident_rows(rows)
        # Rows waiting in the write buffer (or being written) come from the tier only where
        # they lent it their frames: the values of the others are those in their block.
        lent = np.zeros(rows.size, dtype=bool)
        for block, positions in served:
            lent[positions] = block.in_tier[rows[positions] - block.index * cache.block_rows]
        # Plain leaves first: they include the lengths that ragged leaves are read by.
        for group in plain_then_ragged(store.leaves, wanted):
            mirrored = [key for key in group if key in self.mirror.keys]
            if mirrored:
                reach = self.reach()
                out.update(
                    {key: self.mirror.gather(key, index, reach, self._load) for key in mirrored}
                )
            # Rows of the RAM tier: those resident and readable (on disk, or lent by the
            # write buffer).
            tiered = {}
            for key in group:
                if tier is not None and key in tier.keys:
                    resident = in_tier & (on_disk[key] | lent)
                    if resident.all():
                        out[key] = tier.gather(key, rows)
                    elif resident.any():
                        tiered[key] = resident
                        on_disk[key] = on_disk[key] & ~resident
            requests = {
                key: rows[on_disk[key]] for key in group if key not in mirrored and key not in out
            }
            lengths = {
                key: out[store.leaf(key).lengths_key][torch.from_numpy(on_disk[key])].numpy()
                for key in requests
                if store.leaf(key).ragged
            }
            parts = store.arrays.read(requests, lengths)
            everything = (
                not hit.any() and not tiered and all(on_disk[key].all() for key in requests)
            )
            for key, part in parts.items():
                if everything:
                    out[key] = part
                    continue
                leaf = store.leaf(key)
                width = _widest(leaf, out) if leaf.ragged else 0
                tensor = torch.zeros(
                    (rows.size, *store.element_shape(leaf, width)), dtype=part.dtype
                )
                place(tensor, torch.from_numpy(np.flatnonzero(on_disk[key])), part)
                for block, positions in served:
                    if key in tiered:
                        positions = positions[~tiered[key][positions]]
                    offsets = rows[positions] - block.index * cache.block_rows
                    staged = block.values[key][torch.from_numpy(offsets)]
                    place(tensor, torch.from_numpy(positions), staged)
                if key in tiered and tier is not None:
                    picked = np.flatnonzero(tiered[key])
                    gathered = tier.gather(key, rows[picked])
                    place(tensor, torch.from_numpy(picked), gathered)
                out[key] = tensor
            for key in group:
                if patches.get(key):
                    tensor = out[key].clone()
                    for positions, values in patches[key]:
                        place(tensor, torch.from_numpy(positions), values)
                    out[key] = tensor
        return {key: out[key] for key in keys}

    def _read_under(
        self, commit: Commit, rows: np.ndarray, keys: list[Key], *, unreadable_as_zeros: bool
    ) -> dict[Key, torch.Tensor]:
        """Rows as ``commit`` has them, from disk (see :meth:`read`)."""
        store = self.store
        found = rows_as_of(
            store.arrays,
            commit,
            rows,
            with_lengths(store.leaves, keys),
            unreadable_as_zeros=unreadable_as_zeros,
            where=f"store {store.url!r}",
        )
        return {key: found[key] for key in keys}


def _widest(leaf: LeafSpec, out: Mapping[Key, torch.Tensor]) -> int:
    """The longest of the rows read of a ragged leaf (its lengths are in ``out``)."""
    sizes = out[leaf.lengths_key]
    return int(sizes.max()) if sizes.numel() else 0
