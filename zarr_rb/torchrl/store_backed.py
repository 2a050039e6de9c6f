"""The part of :class:`~zarr_rb.ZarrStorage` that keeps TorchRL's bookkeeping in a store.

:class:`StoreBacked` holds the open :class:`~zarr_rb.core.store.Store` and answers from it
what TorchRL asks a storage (its length, full shape, cursor and mutation revision), opens
and closes it, and says where it is. The writes (:mod:`zarr_rb.torchrl.writes`) and reads
(:mod:`zarr_rb.torchrl.reads`) of a ZarrStorage are built on it, and the helpers that
steer TorchRL's samplers, writers and checkpointers use its public members only.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
from torchrl.data.replay_buffers.storages import TensorStorage

from zarr_rb.core.metadata import capacity_of
from zarr_rb.core.store import Store
from zarr_rb.engine.layout import Compression
from zarr_rb.errors import ReadOnlyError
from zarr_rb.format.record import Saved
from zarr_rb.format.schema import Schema
from zarr_rb.locations import LocalLocation
from zarr_rb.torchrl import compat, data_kinds
from zarr_rb.torchrl.gather_cache import GatherCache
from zarr_rb.torchrl.leaves import Ragged
from zarr_rb.util.progress import format_bytes

_F = TypeVar("_F", bound=Callable[..., Any])
_S = TypeVar("_S", bound="StoreBacked")


def io_boundary(fn: _F) -> _F:
    """Reads and writes of a store are I/O: ``torch.compile`` runs them as they are (one
    graph break) instead of tracing into them and recompiling whenever the store's state
    moves."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


class StoreBacked(TensorStorage):  # type: ignore[misc]
    """A TorchRL ``TensorStorage`` whose length, cursor and shape are those of a store."""

    _store: Store
    _gathers: GatherCache
    initialized: bool
    device: torch.device | Literal["auto"] | None
    writes_begun: int
    """Writes that passed validation (a refused write leaves the writer as it was)."""

    @property
    def _ragged(self) -> Ragged:
        ragged: Ragged = self.__dict__.get("_ragged", False)
        return ragged

    def _attach_store(self, store: Store) -> None:
        self.__dict__["_store"] = store
        self.__dict__["_thread_state"] = threading.local()
        self.__dict__["writes_begun"] = 0  # writes past validation (see guards.guard_writer)
        self.__dict__["_gathers"] = GatherCache()
        # Storages of this process on one store see one data revision (samplers' caches).
        compat.share_revision(self, store.shared)
        # Dropped without close(): the garbage collector runs this at any allocation,
        # perhaps inside another storage's write to the same store (see Lifetime.drop_user).
        self._finalizer = weakref.finalize(self, store.lifetime.drop_user)

    # --- TorchRL bookkeeping, backed by the store ------------------------------------------

    def _pick_up_other_writers(self) -> None:
        """A shared store: the rows other writers published, and the schema if another
        writer made it (one read of the commit record)."""
        self.__dict__["_store"].refresh()
        self._show_store()

    def _show_store(self) -> None:
        """The store moved to another commit: the schema if it got one, and the commit."""
        store = self.__dict__["_store"]
        if not self.initialized and store.schema is not None:
            self.initialized = True
            self.max_size = capacity_of(store.meta)
        self._show_commit()

    def _show_commit(self) -> None:
        """Tell TorchRL of a commit the store moved to since this storage last showed one:
        the row written last, and a new revision for samplers' caches."""
        # Compared with the record this storage last showed, not the one before the
        # refresh: the store may have taken a newer record meanwhile (a commit, a save, a
        # collection read the record as it was, other writers' rows included; a reader's
        # read, which moves it to the commit whose rows it read).
        store = self.__dict__["_store"]
        generation = store.committed.generation
        if self.__dict__.get("_generation_shown") != generation and store.schema is not None:
            self.__dict__["_generation_shown"] = generation
            # The row written last, by any writer (the record's cursor follows it); the
            # rows changed, for the caches of samplers and gathers too.
            compat.set_last_cursor(self, (store.cursor - 1) % store.rows)
            compat.bump_revision(self)

    @property
    def _last_cursor_index(self) -> Any:
        """The row written last, as TorchRL's samplers see it: in a thread that holds a
        commit (a reader's sample), that commit's."""
        store: Store | None = self.__dict__.get("_store")
        held = None if store is None else store.commits.held()
        if store is None or held is None:
            return compat.stored_last_cursor(self)
        return (held.cursor - 1) % store.rows

    @property
    def _len(self) -> int:
        store = self.__dict__["_store"]
        interval = self.__dict__.get("_refresh_interval")
        if store.commits.held() is not None:
            pass  # (inside a sample: the commit it holds, see begin_sample)
        elif store.is_shared:
            self._pick_up_other_writers()
        elif interval is not None and time.monotonic() - self._refreshed_at >= interval:
            self.refresh()
        elif store.read_only:
            self._show_commit()  # (one its reads moved to)
        return int(store.length)

    @_len.setter
    def _len(self, value: int) -> None:
        self.__dict__["_store"].commits.set_length(int(value))  # (a shared store's is its record's)

    @property
    def _total_shape(self) -> torch.Size | None:
        schema = self._store.schema
        return None if schema is None else torch.Size(schema.batch_shape)

    def placed_last(self) -> np.ndarray | None:
        """The positions the last extend of this thread put its rows at, in the order of
        its index, where a store of several writers placed them (at the record's cursor,
        not at the writer's); ``None`` before any."""
        placed: np.ndarray | None = getattr(self._thread_state, "placed", None)
        return placed

    @contextlib.contextmanager
    def writes_by(self, *, index_is_position: bool) -> Iterator[None]:
        """Inside the block, in this thread, writes come from a TorchRL writer, which sets
        each row's ``"index"`` to its position (``index_is_position``, TensorDict writers)
        or leaves it to the data: a shared store marks the first kind only (see
        :mod:`zarr_rb.format.index_key`). Writes made outside any writer mark an
        ``"index"`` that holds the positions they were given."""
        with self._in_this_thread("index_is_position", index_is_position):
            yield

    def index_is_position(self) -> bool | None:
        """What :meth:`writes_by` says of the writes of this thread (``None``: no writer)."""
        found: bool | None = getattr(self._thread_state, "index_is_position", None)
        return found

    @property
    def reads_holes_as_zeros(self) -> bool:
        """Whether, in this thread, lazy views read rows that cannot be read as zeros (see
        :meth:`holes_as_zeros`)."""
        return bool(getattr(self._thread_state, "unreadable_as_zeros", False))

    @contextlib.contextmanager
    def holes_as_zeros(self) -> Iterator[None]:
        """Inside the block, and in this thread only, rows that cannot be read (holes) read as
        zeros from lazy views: for trajectory scans that then leave those rows out."""
        with self._in_this_thread("unreadable_as_zeros", True):
            yield

    @contextlib.contextmanager
    def _in_this_thread(self, name: str, value: object) -> Iterator[None]:
        """``name`` of this thread's state set to ``value`` inside the block."""
        state = self._thread_state
        previous = getattr(state, name, None)
        setattr(state, name, value)
        try:
            yield
        finally:
            setattr(state, name, previous)

    # --- public API ------------------------------------------------------------------------

    @property
    def path(self) -> Path | str:
        """Directory of a local store; the URL (``s3://...``) of any other."""
        return self._store.path

    @property
    def url(self) -> str:
        """Where the store is: its absolute path, or its URL."""
        return self._store.url

    @property
    def storage_options(self) -> dict[str, Any]:
        """The ``storage_options`` the store was opened with."""
        return dict(self.__dict__.get("_storage_options") or {})

    @property
    def _where(self) -> str:
        return f"store {self.url!r}"

    @property
    def scratch_dir(self) -> str:
        """``LazyMemmapStorage``'s name for :attr:`path`."""
        return str(self.path)

    @property
    def cursor(self) -> int:
        """Row the next sequential write goes to: one past the last row written. A buffer
        built on a reopened store starts its writer there."""
        return int(self._store.cursor)

    @property
    def read_only(self) -> bool:
        return self._store.read_only

    @property
    def schema(self) -> Schema | None:
        """Keys, dtypes and shapes of the stored data (``None`` before the first write)."""
        return self._store.schema

    @property
    def compression(self) -> Compression:
        """The store's chunking and compression settings."""
        return self._store.compression

    def flush(self) -> None:
        """Write the rows held in RAM and commit: other processes then see every row."""
        self._store.flush()

    def close(self) -> None:
        """Flush and release the store. The storage cannot be used afterwards.

        A temporary store (``path=None``), or any store with ``auto_cleanup=True``, is
        deleted as it closes.
        """
        if self._finalizer.detach() is not None:
            self._store.close()

    @property
    def closed(self) -> bool:
        return self._store.closed

    @property
    def store(self) -> Store:
        """The store this storage reads and writes (the layer below TorchRL's: what
        ``zarr_rb.save``, ``zarr_rb.load`` and the analysis view work on)."""
        return self._store

    def abandon(self) -> None:
        """Drop this storage as a process killed at this instant would (for tests of
        crashes, see :func:`zarr_rb.testing.crash.simulate_crash`): the rows it holds in RAM
        are lost, nothing is flushed or committed, its writer lock is released."""
        self._finalizer.detach()
        self._store.lifetime.abandon()

    def cleanup(self) -> bool:
        """Close the storage and delete its store from disk (as ``LazyMemmapStorage.cleanup``).

        Returns:
            Whether a directory was deleted: ``False`` once it is gone (a second call, or a
            store deleted by someone else).
        """
        if self.read_only:
            raise ReadOnlyError(
                f"store {str(self.path)!r} was opened read-only: a reader does not delete the "
                "store; call cleanup() on its writer, or close() this reader",
            )
        if not self._finalizer.alive:
            return False
        self._finalizer.detach()
        self._store.lifetime.remove_when_closed(self._store.engine.location)
        return self._store.close()

    def refresh(self) -> None:
        """Pick up the latest commit (readers, and the writers of a shared store); a
        commit this thread held (a sample drawn and not gathered) is let go."""
        self.__dict__["_refreshed_at"] = time.monotonic()
        self._store.hold(False)
        self._store.refresh()
        self.initialized = self._store.schema is not None
        if self.initialized:
            self.max_size = capacity_of(self._store.meta)
        self._show_commit()
        compat.bump_revision(self)  # (a reader of a save moved to the last commit, too)

    def wait_for_ram(self, timeout: float | None = None) -> bool:
        """Wait until the rows already in the store are in RAM, as many as the budget
        holds: a writer with the default ``ram_bytes`` reads them in behind the buffer's
        back after it opens or loads a save, from its first read on (this starts it if
        no read did). Returns whether they are (``False``: ``timeout`` seconds passed)."""
        fill = self._store.ram.fill
        fill.start()
        return fill.wait(timeout)

    def nbytes_on_disk(self) -> int:
        """Bytes of all files of the store."""
        return self._store.engine.nbytes()

    def nbytes_raw(self) -> int:
        """Uncompressed bytes of the rows currently held (``len(self)`` elements)."""
        schema = self._store.schema
        if schema is None:
            return 0
        return compat.length_along_dim0(self) * schema.row_nbytes

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        schema = self._store.schema
        keys = (
            [] if schema is None else [".".join(leaf.key) or "<tensor>" for leaf in schema.leaves]
        )
        # A writer's RAM budget (readers keep nothing in RAM).
        ram = "" if self.read_only else f", ram_bytes={format_bytes(self._store.ram.ram_bytes)!r}"
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, len={len(self)}, "
            f"max_size={self.max_size}, ndim={self.ndim}, keys={keys}, "
            f"read_only={self.read_only}{ram})"
        )

    @property
    def _build_device(self) -> torch.device | None:
        """The device of returned TensorDicts as they are built (CPU data is built there)."""
        return torch.device("cpu") if self.device == torch.device("cpu") else None

    def read_rows(self, rows: np.ndarray) -> Any:
        """Rows ``rows`` (sorted, unique) as the data kind the store holds, read at once (no
        lazy columns, no index forms, no device move): for exports and copies."""
        schema = self._store.schema
        assert schema is not None
        return self._read(rows, schema)

    def _read(self, rows: np.ndarray, schema: Schema, *, unused_as_zeros: bool = False) -> Any:
        keys = [leaf.key for leaf in schema.leaves]
        leaves = self._store.read(rows, keys, unwritten_as_zeros=unused_as_zeros)
        batch_shape = (rows.size, *schema.batch_shape[1:])
        return data_kinds.build(
            leaves, schema=schema, batch_shape=batch_shape, device=self._build_device
        )

    def restore(self, *, length: int, cursor: int, save: Saved | None = None) -> None:
        """Set length and cursor (e.g. to those of a save) and commit them; with ``save``
        (one that kept its rows), the rows are the save's too."""
        if save is not None:
            self._store.saves.use_save(save)
        self._len = length
        self._store.commits.move_cursor(cursor)
        if self.initialized and length:
            compat.set_last_cursor(self, (cursor - 1) % self._store.rows)
        self._store.flush()
        compat.bump_revision(self)

    # --- rows, for the helpers that steer TorchRL's components --------------------------

    @property
    def rows(self) -> int:
        """Rows of the ring: ``max_size`` in rows of ``shape[1:]`` elements (known once the
        store holds data)."""
        return self._store.rows

    @property
    def rows_held(self) -> int:
        """Rows that hold the ``len(self)`` elements of the storage."""
        return self._store.length_rows

    def unreadable_rows(self) -> np.ndarray:
        """Rows inside the length that cannot be read: withdrawn by a crash, a failed write
        or a repair, and not written since (samplers must not draw them)."""
        return self._store.unreadable_rows()

    def commit_point(self) -> tuple[int, int, int]:
        """``(length, cursor, epoch)`` of the store once every row is committed (a new store
        is made on disk for it): what a dump in place records, for
        :meth:`check_unchanged_since` to check when it is loaded."""
        self._store.lifetime.ensure_on_disk()  # a dump is a write: it makes a new store
        self.flush()
        return len(self), self.cursor, self._store.committed.epoch

    def committed_epoch(self) -> int:
        """The epoch of the last commit (it moves whenever committed rows are written over)."""
        return self._store.committed.epoch

    @property
    def store_id(self) -> str | None:
        """What tells this store from another made at its path (``None``: made by a zarr_rb
        that did not record it)."""
        return self._store.meta.store_id

    def holds_rows_of(self, *, length: int, epoch: int) -> bool:
        """Whether the first ``length`` elements are still those of the commit at ``epoch``
        (every row committed first): none written over since, the buffer not emptied. A
        store of several writers answers no (its epochs are not one writer's), and so does
        a reader (the commit it shows may not be the last)."""
        self.flush()
        store = self._store
        if store.is_shared or store.read_only:
            return False
        return store.committed.epoch == epoch and self.holds_readable_rows(length)

    def holds_readable_rows(self, length: int) -> bool:
        """Whether the first ``length`` elements are all committed and readable."""
        store = self._store
        rows = -(-length // (1 if store.schema is None else store.schema.elements_per_row))
        if store.committed.length < rows:
            return False
        return not bool((store.unreadable_rows() < rows).any())

    def check_unchanged_since(self, *, length: int, cursor: int, epoch: int) -> None:
        """Check that the rows of a :meth:`commit_point` are still those it covered.

        Raises:
            SaveOverwrittenError: rows it covered were written over since.
        """
        self.flush()
        self._store.saves.check_loadable(length=length, cursor=cursor, epoch=epoch, exact=True)

    def snapshot_to(self, path: Path) -> None:
        """Copy the store, every row committed, into a new local store at ``path``."""
        self._store.lifetime.ensure_on_disk()
        self.flush()
        self._store.engine.snapshot_to(LocalLocation(path), progress=False)
