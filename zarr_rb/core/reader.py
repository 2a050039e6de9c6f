"""How a read-only store reads: only what the last commit declares readable, never a torn
transition (a seqlock on the commit record), and the commits it picks up."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from zarr_rb.core.disk_reads import spread_rows
from zarr_rb.core.metadata import check_is_store, parse_record, read_root
from zarr_rb.errors import RowsNotCommittedError, StoreCorruptedError, VersionNotFoundError
from zarr_rb.format.commit import Commit
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.schema import Schema, leaves_by_key
from zarr_rb.util.keys import Key
from zarr_rb.util.seqlock import seqlock_read

if TYPE_CHECKING:
    from zarr_rb.core.commits import StoreAPI

_READ_RETRIES = 20


def follows_writer(store: StoreAPI) -> bool:
    """Whether ``store`` is a reader of the writer's last commit, whose rows move (not a
    writer, nor a reader of a save or of an archive's history, whose rows never do)."""
    return store.read_only and store.pinned is None and not store.history


def reread_commit(store: StoreAPI) -> Commit:
    """Re-read the commit record: which rows may be read now, and the keys the writer
    added. A reader reads the rows of the commit it read last, so it shows that commit
    whole: its length and cursor too (a reader of a save stays at the save's, until
    ``Store.refresh``; a writer's stay its own)."""
    where = f"store {store.url!r}"
    document = read_root(store.engine)
    if document is None:
        raise StoreCorruptedError(f"{where}: its root zarr.json is gone")
    check_is_store(document, where)
    meta = parse_record(document, where, engine=store.engine)
    if store.history:
        return store.committed  # a history only grows: what it read stays (open it again)
    if (meta.max_size, meta.ndim) != (store.meta.max_size, store.meta.ndim) or not _grows(
        store.schema, meta.schema
    ):
        raise StoreCorruptedError(f"{where}: its size or schema changed while it was open")
    pinned = store.pinned
    if pinned is not None and pinned not in (meta.saved, *meta.versions.values()):
        # Its rows may be reused from now on: what was read from them cannot be trusted.
        raise VersionNotFoundError(
            f"{where}: the save it reads (number {pinned.slot}, length {pinned.length}) was "
            "replaced by a newer save or dropped while it was read, and the store no longer "
            "keeps its rows. Load the store again (zarr_rb.load(path, read_only=True)) for "
            "its last save, or keep a save with zarr_rb.save(rb, tag=...) to read it while "
            "training goes on",
        )
    earlier = store.committed
    moved = meta.commit.generation != earlier.generation
    before = store.schema
    store.commits.picked_up(meta)
    if meta.schema is not None and before is None:
        store.attach_schema(meta.schema, meta.block_rows or 1)
    elif meta.schema != before:
        assert meta.schema is not None
        store.leaves = leaves_by_key(meta.schema.leaves)  # keys added by the writer
    if moved:
        store.version += 1
    # Every record picked up becomes the one the next is compared with: one of the same
    # generation (a writer reserving slots mid-write) may list slots created since too.
    if store.engine.cache is not None and (moved or meta.commit.object_era != earlier.object_era):
        created = meta.commit.slots_created_since(earlier)
        if created is None:
            # Objects cached before now may have been rewritten: each is revalidated (once)
            # on its next use. (Arrays stay open: a ragged one reopens when a row is wider
            # than it, as on a local store.)
            store.engine.cache.new_epoch()
        else:
            # Objects created once: only those of slots created since are new.
            store.arrays.forget_slots(created)
    if pinned is not None:
        return meta.commit  # it reads the save's rows, which nothing changes
    if store.read_only and store.schema is not None:
        store.commits.use_map(meta.commit)  # the blocks a writer copied since are read there
        # Its rows are the commit's from now on, and so are the length and cursor that
        # samplers draw from (never rows of one commit under the length of another).
        store.commits.show(meta.commit)
    if store.ledger is not None:
        store.ledger.published_as(meta.commit.readable_mask(meta.commit.length))
    return meta.commit


def read_committed(
    store: StoreAPI,
    rows: np.ndarray,
    keys: list[Key],
    *,
    unreadable_as_zeros: bool,
    under: Commit | None = None,
) -> dict[Key, torch.Tensor]:
    """Rows of a read-only store as the last commit has them, never torn: the commit is
    re-read after the read, and the read retried if it moved meanwhile (a seqlock).

    ``under``: rows as that commit has them (a view's: the commit it was taken at), and
    so are a sample's (the commit held: :meth:`Commits.hold`). Such a read stands while
    the record re-read after it keeps that commit (:meth:`Commit.keeps`), or the rows read
    are alike in both; otherwise it raises :class:`RowsNotCommittedError`."""
    ledger = store.ledger
    assert ledger is not None
    under = under or store.commits.held()  # (a sample's read: see Commits.hold)
    if not follows_writer(store):
        under = None  # (a save's rows, which nothing changes: read as they are)
    block_rows = store.meta.block_rows or 1

    def begin() -> tuple[Commit, np.ndarray]:
        if under is not None and under.generation != store.committed.generation:
            return under, under.readable(rows)  # (read through its own map)
        return store.committed, ledger.published_rows(rows)

    def read(before: tuple[Commit, np.ndarray]) -> dict[Key, torch.Tensor]:
        commit, published = before
        if not published.all() and not unreadable_as_zeros:
            raise RowsNotCommittedError(
                f"store {store.url!r}: rows {preview_rows(rows[~published])} "
                f"are not readable in commit {commit.generation} (length {commit.length}, "
                f"holes {list(commit.holes)}); call refresh() to pick up newer commits",
            )
        elsewhere = commit.generation != store.committed.generation
        physical = commit.physical if elsewhere else None
        out = store.arrays.read_all(dict.fromkeys(keys, rows[published]), physical=physical)
        if not published.all():
            out = {key: spread_rows(value, published) for key, value in out.items()}
        return out

    def stands(before: tuple[Commit, np.ndarray], whole: bool) -> bool:
        commit, published = before
        now = reread_commit(store)
        if whole and (store.pinned is not None or store.history):
            # A save's rows are never written while a record names it (re-read above:
            # it raises if none does any longer): a writer moving on changes nothing.
            return True
        # Shared writers commit at every extend: rows that no commit since moved, in
        # slots no writer took since, were read whole all the same.
        if under is None:
            alike = commit.reads_alike(now, rows[published], block_rows)
            return now.generation == commit.generation or alike
        # Read through the map of the commit held: rows in slots no writer took since
        # hold what it has there, wherever its positions moved.
        if now.keeps(commit) or commit.still_holds(now, rows[published], block_rows):
            return True
        # (Nor will it later: the commits a writer keeps only move on.)
        kept = (
            "only those of its last commit"
            if now.kept_from is None
            else f"those of commit {now.kept_from} on"
        )
        raise RowsNotCommittedError(
            f"store {store.url!r}: the writer committed {now.generation - commit.generation} "
            f"times since commit {commit.generation}, which this read reads (a sample's, or a "
            f"view's taken then), and no longer keeps its rows (it keeps {kept}): rows "
            f"{preview_rows(rows)} may have been written over. Nothing wrong was returned; "
            "sample again, or take the view again (rb[:]), or read rows with all their keys "
            "at once (storage.get(index))",
        )

    return seqlock_read(
        begin,
        read,
        stands,
        attempts=_READ_RETRIES,
        # A store damaged, or a shard replaced while it was read (damaged for good when
        # the commit stands).
        retried=(ValueError,),
        lasting=(StoreCorruptedError,),
        gave_up=lambda last_error: RowsNotCommittedError(
            f"store {store.url!r}: writers kept writing over rows {preview_rows(rows)} while "
            f"this reader read them: each of {_READ_RETRIES} attempts was overtaken by a newer "
            "commit (an object it read being replaced is no sign of damage: the store is not "
            "damaged by it). Nothing was returned; read again, or fewer rows at once (the "
            "last attempt's error is chained below)",
        ),
    )


def _grows(old: Schema | None, new: Schema | None) -> bool:
    """Whether ``new`` is ``old`` with more leaves (the only change a writer publishes)."""
    if old is None or new is None:
        return old is None
    same = dataclasses.replace(new, leaves=old.leaves) == old
    return same and set(old.leaves) <= set(new.leaves)
