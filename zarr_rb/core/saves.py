"""A store's saves, as the API uses them: whether a save can be loaded, the rows of a
pinned save served, and saves and versions published and dropped. How a save's record is
made is the owner of the commits' business (:mod:`zarr_rb.core.solo_saves`,
:mod:`zarr_rb.core.sharing_saves`); the state a save holds is :mod:`zarr_rb.state`'s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Protocol

from zarr_rb.core.calls import Calls, serialized
from zarr_rb.core.lifetime import Lifetime
from zarr_rb.core.store_facts import StoreFacts
from zarr_rb.errors import LiveBufferError, SaveOverwrittenError
from zarr_rb.format.commit import Commit
from zarr_rb.format.record import Saved

if TYPE_CHECKING:
    from zarr_rb.core.commits import Commits


class SavesOwner(StoreFacts, Protocol):
    """What the saves use of their store (:class:`~zarr_rb.core.store.Store`)."""

    calls: Calls
    epoch_at_open: int

    @property
    def commits(self) -> Commits: ...
    @property
    def lifetime(self) -> Lifetime: ...
    @property
    def length(self) -> int: ...
    @property
    def cursor(self) -> int: ...
    def flush(self) -> None: ...
    def collect(self) -> int: ...
    def check_writable(self) -> None: ...


class StoreSaves:
    """The saves of one open store."""

    def __init__(self, store: SavesOwner) -> None:
        self.store = store
        self.calls = store.calls

    @serialized
    def use_save(self, saved: Saved) -> None:
        """Serve the rows a pinned save kept (a save being loaded). A writer's next commit
        publishes them, which drops the rows committed since the save, as loading a save
        means; a reader reads them until :meth:`Store.refresh` moves it to the last commit."""
        schema = self.store.schema
        if not saved.pinned or schema is None:
            return
        self.store.commits.use_save(saved, saved.commit(schema.elements_per_row))

    @serialized
    def check_loadable(
        self, *, length: int, cursor: int, epoch: int, exact: bool, kept: Commit | None = None
    ) -> None:
        """Check that a save (or an in-place dump) made at ``length`` (elements), ``cursor``
        and ``epoch`` can be loaded on this store. ``exact``: its rows must be the ones it
        covered (TorchRL's ``rb.loads``); otherwise only rows this process wrote over count
        (``zarr_rb.load`` resumes a run whose rows moved on, see
        ``docs/saving-and-loading.md``). ``kept``: the rows of a save the store kept (a save
        of format 3), whatever was written since.

        Raises:
            SaveOverwrittenError: rows the save covered were written over since.
            LiveBufferError: a storage of this process writes this store and went on since
                the save: loading would move it back and drop the rows it committed since.
        """
        store = self.store
        where = f"store {store.url!r}"
        live = not store.read_only and store.lifetime.users > 1
        if live:
            store.flush()  # the live buffer's rows in RAM are committed, so that they count
        rows = -(-length // (1 if store.schema is None else store.schema.elements_per_row))
        # A kept save's rows are there: nothing written since changed them.
        pinned = kept is not None
        if not pinned and store.committed.length < rows:
            raise SaveOverwrittenError(
                f"{where}: the rows its last save (or dump) covered, {rows} of them, are no "
                f"longer in the store, which holds {store.committed.length} (the buffer was "
                "emptied since). Open the rows as they are with ZarrStorage(path=...), or "
                "keep saves that training cannot touch: zarr_rb.save(rb, other_path) writes "
                "an independent snapshot",
            )
        since = epoch if exact else max(epoch, store.epoch_at_open)
        if not pinned and store.commits.overwrote_since(since):
            # Rows of the save written over in this process. (A process that reopens a store
            # after a crash resumes from the save with the rows as they are now, as
            # docs/saving-and-loading.md says: what it gets back are the rows that were
            # committed.)
            raise SaveOverwrittenError(
                f"{where}: the rows its last save covered (length {length}) were written over "
                "since (the ring wrapped past them, rows were rewritten, or the buffer was "
                "emptied), so the saved state no longer matches them. Open the rows as they "
                "are with ZarrStorage(path=...), or keep saves that training cannot touch: "
                "zarr_rb.save(rb, other_path) writes an independent snapshot",
            )
        # The live buffer's positions may lead elsewhere than the save's where it holds
        # none of the save's rows (a block copied on write: the rows the save holds in it
        # count as moved, as this map cannot tell them from rows written since).
        moved = kept is not None and not kept.serves_alike(store.committed, rows)
        if live and ((store.length, store.cursor) != (length, cursor) or moved):
            raise LiveBufferError(
                f"{where} is open for writing in this process by a buffer that went on since "
                f"the save (saved at length {length}, cursor {cursor}; now length "
                f"{store.length}, cursor {store.cursor}): loading the save would move that "
                "buffer back and drop the rows it committed since. Save it again "
                "(zarr_rb.save(rb)) to load its current state, close it first "
                "(rb.storage.close()), or read the save with zarr_rb.load(path, "
                "read_only=True)",
            )

    def check_saved(self, saved: Saved) -> None:
        """:meth:`check_loadable` of a save the record names, to resume from it (rows this
        process wrote over count; a pinned save's rows are its map and holes).

        Raises:
            SaveOverwrittenError: rows the save covered were written over since.
            LiveBufferError: see :meth:`check_loadable`.
        """
        self.check_loadable(
            length=saved.length,
            cursor=saved.cursor,
            epoch=saved.epoch,
            exact=False,
            kept=saved.commit() if saved.pinned else None,
        )

    def next_slot(self) -> int:
        """The number of the next save: the lowest that no save the record names has. Its
        state group is then the one of the save before the last (untagged saves alternate
        between two groups, and the state writer rewrites only the chunks that changed),
        never a kept version's, whose state no save rewrites while it is kept."""
        return self.store.commits.next_save_slot(self.store.meta.save_slots())

    def take_slot(self) -> int:
        """:meth:`next_slot`, for a save about to write its state: a writer on a lease
        first records that it holds the store (a writer that takes it over from this one,
        were it to stall while saving, then keeps its saves out of that group)."""
        self.store.commits.hold_for_save()
        return self.next_slot()

    @serialized
    def publish(self, saved: Saved, *, tag: str | None = None, last: bool = True) -> None:
        """Flush, then publish the data commit together with a new save record, made at
        that commit: its epoch and, pinned, its rows (a shared writer's saves pin none:
        its rows are written in place). ``tag``: keep it as a version of that name too;
        ``last=False``: only as that version (the last save, which ``zarr_rb.load(path)``
        loads, stays as it is). State groups no record names any longer are deleted."""
        if not last and tag is None:
            raise ValueError("a save that is not the last one is a version: give its tag")
        store = self.store
        store.flush()
        saved = dataclasses.replace(saved, epoch=store.committed.epoch, time=time.time())
        store.commits.publish_saved(saved, tag=tag, last=last)
        store.collect()  # the slots the save it replaced kept

    @serialized
    def drop_version(self, tag: str) -> None:
        """Stop keeping the version ``tag`` (its rows and state, unless the last save
        names them too)."""
        self.store.check_writable()
        self.store.commits.drop_version(tag)
        self.store.collect()
