"""Saves and versions of a store of one writer (and of every reader): a save's rows are
kept by the slots its record names, a reader or a writer goes back to them, and the state
groups no record names are deleted. Part of :class:`~zarr_rb.core.solo.SoloCommits` (see
:mod:`zarr_rb.core.solo`)."""

from __future__ import annotations

import abc
import dataclasses
import itertools

import numpy as np

from zarr_rb.core.solo_staging import SoloStaging
from zarr_rb.format.commit import Commit
from zarr_rb.format.names import STATE_GROUP
from zarr_rb.format.record import Saved
from zarr_rb.format.ring import SlotMap


class SoloSaves(SoloStaging):
    """The saves and versions of :class:`~zarr_rb.core.solo.SoloCommits`."""

    @abc.abstractmethod
    def publish(self, commit: Commit, *, saved: Saved | None = None, rows: bool = True) -> None:
        """Publish a record of ``commit`` (see :meth:`SoloCommits.publish`)."""

    def use_save(self, saved: Saved, commit: Commit) -> None:
        store = self.store
        ledger = store.ledger
        assert ledger is not None
        readable = commit.readable_mask(commit.length)
        # Rows withdrawn since the save (a repair found them damaged) in blocks still in the
        # slots the save has: the damage is the save's too. (Not the holes no call wrote,
        # as after an empty: the save's rows there are whole.)
        kept, head = self._slots_of(commit), self._committed_slots()
        for start, stop in store.committed.holes:
            lost = np.arange(start, min(stop, commit.length))
            lost = lost[~store.committed.unwritten_at(lost)]
            blocks = lost // kept.block_rows
            shared = kept.slots[blocks] == head.slots[blocks]
            readable[lost[shared]] = False
        if store.read_only:
            store.pinned = saved
            self.use_map(commit)
            ledger.published_as(readable)
            # The save's length and cursor too, until a refresh (a reader copying a save
            # longer than the buffer is now reads all of it).
            self.length = commit.length * store.elements_per_row(store.schema)
            self.cursor = commit.cursor
            store.version += 1
            return
        store.check_writable()
        store.discard()
        self.positions = SlotMap(
            kept.slots.copy(),
            block_rows=kept.block_rows,
            capacity=max(kept.capacity, self.block_map.capacity),
        )
        ledger.rebase(readable)
        # The rows committed since the save are dropped: the epoch moves (unless they are
        # the save's rows, as when a save is loaded right after it was made: the same
        # positions read the same rows, whatever the maps say of blocks past them).
        committed = store.committed
        self._rewrote_published = not (
            commit.length == committed.length and commit.serves_alike(committed, commit.length)
        )

    def overwrote_since(self, epoch: int) -> bool:
        return epoch < self.committed.epoch

    def next_save_slot(self, named: set[int]) -> int:
        taken = named | self._avoided_saves
        return next(slot for slot in itertools.count() if slot not in taken)

    def hold_for_save(self) -> None:
        self._first_own_slot()

    def publish_saved(self, saved: Saved, *, tag: str | None, last: bool = True) -> None:
        self.settle()  # (a save flushed first: nothing is in flight)
        store = self.store
        commit = store.committed
        per_row = 1 if store.schema is None else store.schema.elements_per_row
        saved = dataclasses.replace(
            saved, pinned=True, slots=commit.slots, holes=_holes_to(commit, saved, per_row)
        )
        if tag is not None:
            versions = {**store.meta.versions, tag: saved}
            self.meta = dataclasses.replace(self.meta, versions=versions)
        self.publish(commit, saved=saved if last else None)
        self._drop_unnamed_states()

    def drop_version(self, tag: str) -> None:
        store = self.store
        versions = dict(store.meta.versions)
        del versions[tag]
        self.meta = dataclasses.replace(self.meta, versions=versions)
        self.publish(store.committed)
        self._drop_unnamed_states()

    def _drop_unnamed_states(self) -> None:
        """Delete the state groups of saves that no record names (dropped versions, a save
        a crash interrupted before it was published), but the one the next save writes."""
        saves = (self.meta.saved, *self.meta.versions.values())
        named = {saved.group for saved in saves if saved is not None}
        named.add(f"{STATE_GROUP}/{self.next_save_slot(self.meta.save_slots())}")
        groups = {
            "/".join(key.split("/")[:2]) for key in self.store.engine.location.list(STATE_GROUP)
        }
        for group in sorted(groups - named):
            if group.count("/") == 1 and group.split("/")[1].isdigit():
                self.store.engine.location.delete_prefix(group)


def _holes_to(commit: Commit, saved: Saved, per_row: int) -> tuple[tuple[int, int], ...]:
    """The holes of a save made at ``commit``: the commit's, and the rows past its length
    that the save's length covers. TorchRL's storage grows its length by the rows each
    ``set`` writes, so the same rows set twice leave it past the rows written; no commit
    declares those, and the save must not either."""
    rows = -(-saved.length // per_row)
    if rows <= commit.length:
        return commit.holes
    holes = list(commit.holes)
    if holes and holes[-1][1] == commit.length:
        holes[-1] = (holes[-1][0], rows)
    else:
        holes.append((commit.length, rows))
    return tuple(holes)
