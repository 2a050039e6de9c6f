"""The saves and versions of a store that several writers write: a save pins the record's
runs (no writer takes their slots while a record names the save), versions are kept and
dropped by compare-and-swap, a load puts every position back where a kept save has it, and
each writer saves its state into groups of its own.

:class:`SharingSaves` is the part of :class:`~zarr_rb.core.sharing.Sharing` (which derives
from it) that owns this; see ``docs/design/ring.md``, "Step 2" and "Versions and garbage
collection".
"""

from __future__ import annotations

import dataclasses
import secrets

from zarr_rb.core.sharing_record import SharingRecord
from zarr_rb.core.sharing_slots import runs_of
from zarr_rb.errors import LiveBufferError, VersionExistsError, VersionNotFoundError
from zarr_rb.format.commit import Commit
from zarr_rb.format.names import STATE_GROUP
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.runs import RunMap


class SharingSaves(SharingRecord):
    """Saves and versions of a shared store (see the module's docstring)."""

    _state_groups: set[int]
    """The numbers of the state groups this writer saved into (see new_save_slot)."""

    def use_save(self, saved: Saved, commit: Commit) -> None:
        # A store with runs, which this writer holds alone (a save made before it became
        # shared): its positions go back to the rows the save kept, at once.
        self.store.check_writable()
        self.store.discard()
        self.rebase(saved, commit)

    def overwrote_since(self, epoch: int) -> bool:
        return False  # a save keeps its rows through the runs it names

    def next_save_slot(self, named: set[int]) -> int:
        return self.new_save_slot(named)

    def hold_for_save(self) -> None:
        pass  # slots are held one by one, in the record, as they are taken

    def publish_saved(self, saved: Saved, *, tag: str | None, last: bool = True) -> None:
        store = self.store
        self._publish_save(saved, tag=tag, last=last)
        named = {f"{STATE_GROUP}/{slot}" for slot in self.meta.save_slots()}
        for group in self.state_groups_unnamed(named):
            store.engine.location.delete_prefix(group)

    def drop_version(self, tag: str) -> None:
        # Other writers publish too: the record changes by compare-and-swap only.
        dropped = self._drop_version(tag)
        if dropped.slot not in self.meta.save_slots():
            self.store.engine.location.delete_prefix(dropped.group)

    def _publish_save(self, saved: Saved, *, tag: str | None, last: bool) -> None:
        """Publish a save made at the record as it is now: the rows it covers are those
        of that record (its length, cursor and runs, which it keeps: no writer takes their
        slots while a record names the save); ``tag``: kept as a version too (``last=False``:
        only)."""
        schema = self.store.schema
        per_row = 1 if schema is None else schema.elements_per_row  # (no schema: no row)

        def save(meta: StoreMeta) -> StoreMeta:
            commit = meta.commit
            made = dataclasses.replace(
                saved,
                length=commit.length * per_row,
                cursor=commit.cursor,
                pinned=True,
                runs=commit.runs or RunMap.empty(),
                holes=commit.holes,
            )
            if tag is not None and tag in meta.versions:
                raise VersionExistsError(
                    f"store {self.store.url!r}: another writer kept a version tagged {tag!r} "
                    "meanwhile; pick another tag",
                )
            versions = meta.versions if tag is None else {**meta.versions, tag: made}
            return dataclasses.replace(meta, saved=made if last else meta.saved, versions=versions)

        self.update(save)

    def _drop_version(self, tag: str) -> Saved:
        """Stop keeping the version ``tag`` (its slots are collected once no record refers
        to them); returns it.

        Raises:
            VersionNotFoundError: the record keeps no version ``tag`` (another writer
                dropped it).
        """
        dropped: list[Saved] = []

        def drop(meta: StoreMeta) -> StoreMeta:
            saved = meta.versions.get(tag)
            if saved is None:
                raise VersionNotFoundError(
                    f"store {self.store.url!r} keeps no version {tag!r} (another writer "
                    "dropped it); zarr_rb.versions(path) lists those kept",
                )
            dropped[:] = [saved]
            versions = {name: kept for name, kept in meta.versions.items() if name != tag}
            return dataclasses.replace(meta, versions=versions)

        self.update(drop)
        return dropped[0]

    def new_save_slot(self, named: set[int]) -> int:
        """The state group number of this writer's next save: drawn at random, so that
        writers saving at once never write into one group (a record names a group only
        once its save is published, so the lowest free number is free for all of them)."""
        while True:
            slot = secrets.randbelow(2**31)
            if slot not in named and slot not in self._state_groups:
                self._state_groups.add(slot)
                return slot

    def state_groups_unnamed(self, named: set[str]) -> list[str]:
        """The state groups of this writer's saves that no record names (replaced, or
        never published): no other writer writes them, so they can be deleted. They are
        forgotten here."""
        groups = {f"{STATE_GROUP}/{slot}": slot for slot in self._state_groups}
        unnamed = sorted(set(groups) - named)
        self._state_groups -= {groups[group] for group in unnamed}
        return unnamed

    def rebase(self, saved: Saved, kept: Commit) -> None:
        """Put every position back where ``kept`` (the commit of ``saved``, a kept save)
        has it: its length, cursor and rows (loading it; the rows committed since are
        dropped).

        Raises:
            VersionNotFoundError: the record no longer keeps ``saved`` (dropped or replaced
                since it was read): its rows may be collected already.
            LiveBufferError: another writer committed since this writer last read the
                record (after the load was checked): loading would drop those rows.
        """
        runs = runs_of(kept)
        seen = self.committed  # what the load was checked against (StoreSaves.check_loadable)

        def rebase(meta: StoreMeta) -> StoreMeta:
            if not any((s.slot, s.time) == (saved.slot, saved.time) for s in meta.pinned()):
                raise VersionNotFoundError(
                    f"store {self.store.url!r} no longer keeps the save being loaded (number "
                    f"{saved.slot}): it was dropped or replaced by a later save meanwhile; "
                    "nothing was changed. zarr_rb.versions(path) lists those kept",
                )
            now = meta.commit
            if (now.length, now.cursor, now.runs) != (seen.length, seen.cursor, seen.runs):
                raise LiveBufferError(
                    f"store {self.store.url!r}: another writer committed rows (commit "
                    f"{now.generation}, length {now.length}) since this load was checked at "
                    f"commit {seen.generation}; loading the save would drop them, so nothing "
                    "was changed. Save again (zarr_rb.save(rb)) to load the buffer as it is "
                    "now, or read the save with zarr_rb.load(path, read_only=True)",
                )
            commit = dataclasses.replace(
                meta.commit,
                length=kept.length,
                cursor=kept.cursor,
                runs=runs,
                holes=runs.holes(kept.length),
            )
            return dataclasses.replace(meta, commit=commit)

        self.update(rebase)
