"""The commit record of a store that several writers write: changed by compare-and-swap
only (:meth:`SharingRecord.update`), read again to pick up what other writers committed
(:meth:`SharingRecord.refresh`, :meth:`SharingRecord.adopt`), and the reads checked
against it (a seqlock, :meth:`SharingRecord.read_checked`).

:class:`SharingRecord` is the part of :class:`~zarr_rb.core.sharing.Sharing` (which derives
from it) that owns this; see ``docs/design/ring.md``, "Step 2" and "Step 5".
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from zarr_rb.core.metadata import check_is_store, parse_record, read_root
from zarr_rb.core.pieces import forget_pieces
from zarr_rb.core.sharing_slots import SharingSlots
from zarr_rb.errors import RowsNotCommittedError, ServerBusyError, StoreCorruptedError
from zarr_rb.format.commit import Commit, Ring
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.format.record import StoreMeta
from zarr_rb.format.ring import SlotMap
from zarr_rb.format.runs import RunMap
from zarr_rb.locations.base import ROOT_METADATA
from zarr_rb.util.io import load_json
from zarr_rb.util.seqlock import seqlock_read

_R = TypeVar("_R")
Edit = Callable[[StoreMeta], StoreMeta | None]
"""A change of the commit record, applied to the record as it is now (``None``: none)."""

BUSY_SERVER_SECONDS = 60.0
"""How long a commit is retried while an object store answers with server errors."""
_READ_RETRIES = 50


class SharingRecord(SharingSlots):
    """The commit record of a shared store as one of its writers sees and changes it (see
    the module's docstring)."""

    _mine: np.ndarray | None
    """Positions this writer is committing (their mirrors are its own to update)."""
    _latest: tuple[object, Commit] | None = None
    """The record's generation and commit as :meth:`latest_commit` last read them."""

    @property
    def ring(self) -> Ring:
        ring = self.committed.ring
        assert ring is not None
        return ring

    def update(self, edit: Edit) -> StoreMeta:
        """Apply ``edit`` to the commit record by compare-and-swap, re-reading and
        re-applying it after every conflict; the store then shows the record written."""
        store = self.store
        attempt = 0
        deadline = time.monotonic() + BUSY_SERVER_SECONDS
        # The record read and the one written by an attempt whose outcome is not known.
        unsure: tuple[StoreMeta, StoreMeta] | None = None
        while True:
            try:
                meta = self.read_record()
                if unsure is not None and self._landed(meta, unsure[1].commit.generation):
                    # Refused, or answered with a server error, yet published (a retried
                    # request whose first attempt landed, its answer lost), perhaps under
                    # records other writers published on top since: not applied again.
                    store.pieces.drop(*unsure)
                    self.adopt(meta)
                    return meta
                unsure = None
                try:
                    edited = edit(meta)
                except BaseException:
                    self.adopt(meta)  # the record was read: show it (refresh() skips it)
                    raise
                if edited is None:
                    self.adopt(meta)
                    return meta
                edited = self._as_published(edited, meta.commit.generation + 1)
                store.lifetime.check_hold()
                with store.writing("publishing a commit"):
                    written = store.pieces.store(edited)
                    unsure = (meta, edited)
                    if store.engine.try_write_root_attributes({ATTRS_KEY: edited.to_json()}):
                        store.pieces.drop(meta, edited)
                        self.adopt(edited, own=self._mine)
                        return edited
                    if self._landed(self.read_record(), edited.commit.generation):
                        continue  # (taken as published above)
                    unsure = None
                    # Named by this attempt alone: no record names them, no other writer
                    # knows them.
                    forget_pieces(edited.run_maps(), written)
                    for key in written:
                        store.engine.location.delete(key)
            except ServerBusyError:
                # Object stores may answer many conditional writes of one object at once
                # with server errors: the record is read again (an attempt that landed is
                # taken as published), the edit applied again.
                if time.monotonic() > deadline:
                    raise
            attempt += 1
            time.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))

    def _as_published(self, edited: StoreMeta, generation: int) -> StoreMeta:
        """``edited`` as this writer publishes it, as the record of ``generation``."""
        # (Its writers keep no older commit's rows for readers: see Commit.kept_from.)
        commit = dataclasses.replace(edited.commit, generation=generation, kept_from=None)
        if commit.ring is not None:
            commit = dataclasses.replace(
                commit, ring=commit.ring.published_by(self.writer, generation)
            )
        if commit.object_era is not None and not self.store.lifetime.creates_once:
            # This writer writes objects over: readers must revalidate their caches.
            commit = dataclasses.replace(commit, object_era=None)
        return dataclasses.replace(edited, commit=commit)

    def _landed(self, meta: StoreMeta, generation: int) -> bool:
        """Whether this writer's record of ``generation`` was published: ``meta`` (the
        record as it is now) is it, or was published on top of it."""
        ring = meta.commit.ring
        return ring is not None and ring.names_commit(self.writer, generation)

    def read_record(self) -> StoreMeta:
        return self._parse(read_root(self.store.engine, adopt=True))

    def latest_commit(self) -> Commit:
        """The record's commit as it is now, without picking it up (the next commit stays
        conditional on the record this writer last adopted): one read, parsed only when
        the record was written since the last such read."""
        found = self.store.engine.location.read_versioned(ROOT_METADATA)
        if self._latest is not None and self._latest[0] == found.generation:
            return self._latest[1]
        try:
            document = None if found.value is None else load_json(found.value)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise StoreCorruptedError(
                f"store {self.store.url!r}: root zarr.json is not valid JSON ({err})"
            ) from None
        if document is not None and not isinstance(document, dict):
            raise StoreCorruptedError(
                f"store {self.store.url!r}: root zarr.json is not a JSON object"
            )
        commit = self._parse(document, adopt=False).commit
        self._latest = (found.generation, commit)
        return commit

    def _parse(self, document: dict[str, Any] | None, *, adopt: bool = True) -> StoreMeta:
        """The record ``document``; ``adopt``: the next commit is conditional on it (see
        :func:`~zarr_rb.core.metadata.parse_record`)."""
        where = f"store {self.store.url!r}"
        if document is None:
            raise StoreCorruptedError(f"{where}: its root zarr.json is gone")
        check_is_store(document, where)
        return parse_record(document, where, engine=self.store.engine, adopt=adopt)

    def refresh(self) -> Commit:
        """Pick up what other writers committed (one read of the record, no more when it
        did not change); returns the record's commit."""
        document = self.store.engine.root_if_changed()
        if document is not None:
            self.adopt(self._parse(document))
        return self.committed

    def adopt(self, meta: StoreMeta, *, own: np.ndarray | None = None) -> None:
        """Show the rows of ``meta``'s commit (those of every writer).

        ``own``: positions this writer published in ``meta`` itself (the record it wrote
        and nothing since), whose RAM copies it keeps itself. Any other record, even one
        read in a commit of this writer's, may hold other writers' rows anywhere."""
        store = self.store
        if meta.commit.ring is None:
            raise StoreCorruptedError(
                f"store {store.url!r} is no longer shared: a single writer took it over"
            )
        before = store.committed
        new_schema = store.schema is None and meta.schema is not None
        self.meta = dataclasses.replace(self.meta, **_shared_fields(meta))
        self.committed = meta.commit
        self.cursor = meta.commit.cursor
        if new_schema:
            assert meta.schema is not None
            store.arrays.ensure()
            store.attach_schema(meta.schema, meta.block_rows or 1)
        if store.schema is None:
            return
        self.length = meta.commit.length * store.schema.elements_per_row
        if meta.commit.generation == before.generation and not new_schema:
            return
        store.version += 1
        old = self.positions
        self.use_map(meta.commit)
        new = self.positions
        ledger = store.ledger
        assert ledger is not None
        readable = meta.commit.readable_mask(store.rows)
        ledger.published_as(readable)
        ledger.intact = readable.copy()
        if store.engine.cache is not None:
            # Before the changed rows are read again: objects cached before now may hold
            # what those rows held before other writers rewrote them; where every object is
            # created once, only those of the slots created since.
            created = meta.commit.slots_created_since(before)
            if created is None:
                store.engine.cache.new_epoch()
            else:
                store.arrays.forget_slots(created)
        if store.ram.mirrored:
            self._refresh_mirror(before, meta.commit, old, new, own)

    def _refresh_mirror(
        self,
        before: Commit,
        after: Commit,
        old: SlotMap | RunMap | None,
        new: SlotMap | RunMap | None,
        own: np.ndarray | None,
    ) -> None:
        """Read again the mirrored leaves of the positions whose rows changed between two
        records: those put in other rows, and those in slots taken (and written) since,
        though at the same rows of the arrays; not ``own`` (see :meth:`adopt`)."""
        store = self.store
        taken = None
        if before.ring is not None and after.ring is not None:
            taken = after.ring.taken_since(before.ring)
        if taken is None or not isinstance(old, RunMap) or not isinstance(new, RunMap):
            store.ram.changed(np.ones(store.rows, dtype=bool))  # read whole when next needed
            return
        changed = np.zeros(store.rows, dtype=bool)
        changed[new.moved_since(old)] = True
        if taken:
            slots = np.unique(np.fromiter(taken, dtype=np.int64))
            changed[new.positions_in(slots, self.block_rows)] = True
        if own is not None:
            changed[own] = False  # this writer's own: it mirrors them itself
        if changed.any():
            store.ram.changed(changed)

    def read_checked(self, read: Callable[[], _R], rows: np.ndarray) -> _R:
        """``read()`` of positions ``rows``, retried while other writers took slots those
        rows were read from (a seqlock on the record). A read that fails is tried again
        when the record moved meanwhile: when a chunk it met is damaged under the record
        of now, only if ``rows`` moved (a collection emptied a slot the older record
        named); when none is (a ``ValueError`` other than ``StoreCorruptedError``: an object
        another writer replaced while it was read, of ``rows`` or of the other rows the
        read takes, as the mirror of small leaves loads every row on disk), always."""
        failed: list[ValueError] = []

        def attempt() -> _R:
            failed.clear()
            try:
                return read()
            except ValueError as error:
                failed.append(error)
                raise

        def stands(before: Commit, whole: bool) -> bool:
            held = self.held()
            if held is not None:
                latest = self.latest_commit()
                if not whole and not isinstance(failed[0], StoreCorruptedError):
                    return latest.generation == before.generation  # (moved: read again)
                return self._read_of_held(held, rows, latest)
            self.refresh()
            after = self.committed
            if after.generation == before.generation:
                return True
            if not whole and not isinstance(failed[0], StoreCorruptedError):
                return False
            return before.reads_alike(after, rows, self.block_rows)

        return seqlock_read(
            lambda: self.committed,
            lambda _: attempt(),
            stands,
            attempts=_READ_RETRIES,
            # Failed under the record of now: damage, or a bug, not a writer's doing.
            retried=(ValueError,),
            lasting=(ValueError,),
            pause=0.0005,
            gave_up=lambda _: RowsNotCommittedError(
                f"store {self.store.url!r}: rows kept being rewritten by other writers while "
                f"being read ({_READ_RETRIES} attempts)",
            ),
        )

    def _read_of_held(self, held: Commit, rows: np.ndarray, latest: Commit) -> bool:
        """Whether a read of positions ``rows`` through the map of ``held``, the commit this
        thread holds (a sample's: see :meth:`Commits.hold`), read what ``held`` has there:
        no writer took their slots since (nor a collection emptied them). The record is
        read, not picked up: the store stays where it was. Read again, it would read a
        newer commit: a read that does not stand raises instead (``latest``: the record's
        commit as it is now)."""
        if held.still_holds(latest, rows, self.block_rows):
            return True
        raise RowsNotCommittedError(
            f"store {self.store.url!r}: other writers wrote over rows "
            f"{preview_rows(np.unique(rows))} while a sample drew them from commit "
            f"{held.generation}. Nothing wrong was returned; sample again",
        )


def _shared_fields(meta: StoreMeta) -> dict[str, Any]:
    """What a writer takes from the record others write."""
    return {
        "schema": meta.schema,
        "block_rows": meta.block_rows,
        "saved": meta.saved,
        "versions": meta.versions,
        "commit": meta.commit,
        "format": meta.format,
        "compression": meta.compression,  # (frames, decided by the first write)
    }
