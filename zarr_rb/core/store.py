"""A store on disk: its schema and arrays, the rows this process holds in RAM, and reads.

* **Positions and commits** belong to :attr:`Store.commits`, one object behind one
  interface (:class:`~zarr_rb.core.commits.Commits`): :class:`~zarr_rb.core.solo.SoloCommits`
  for a store of one writer (copy-on-write of blocks, a record replaced whole) and
  :class:`~zarr_rb.core.sharing.Sharing` for a store of several (rows appended into
  slots of each writer's own, placed by compare-and-swap of the record). ``Store`` asks it
  where rows are and has it write and commit; it never branches on which one it is.
* **The commit record** (the root group's attributes) is replaced atomically; the rows it
  declares readable are on disk, whole, and no slot it refers to is ever written again
  (see ``docs/design/ring.md``).
* **Reads** go through the map of the record they started from; a reader re-reads the
  record after each read and retries if the rows it read moved (a seqlock), so a read
  never returns a torn transition.

This module works with leaf dictionaries ``{key: tensor[rows, ...]}`` and row
numbers; it knows nothing about TorchRL. Stores are opened by :mod:`zarr_rb.core.open`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch

from zarr_rb.core.commits import Commits
from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy, to_numpy
from zarr_rb.core.ledger import Ledger
from zarr_rb.core.mirror import Mirror, put_rows, zeros
from zarr_rb.core.pieces import store_pieces
from zarr_rb.core.reader import read_committed
from zarr_rb.core.sharing import Sharing, check_shareable, new_writer_id
from zarr_rb.core.solo import SoloCommits
from zarr_rb.core.write_cache import Write, WriteBuffer
from zarr_rb.engine import Engine, RowArray, once
from zarr_rb.engine.layout import Compression, choose_block_rows, leaf_layout
from zarr_rb.errors import (
    FencedError,
    LiveBufferError,
    ReadOnlyError,
    RowsNotCommittedError,
    SaveOverwrittenError,
    StoreClosedError,
    StoreCorruptedError,
    StoreWriteError,
    ZarrRBError,
)
from zarr_rb.format.commit import Commit
from zarr_rb.format.index_key import INDEX_KEY, put_positions
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.names import ATTRS_KEY, DATA_GROUP
from zarr_rb.format.pieces import MAPS_GROUP, is_piece_key, piece_keys
from zarr_rb.format.record import Saved, StoreMeta
from zarr_rb.format.ring import SlotMap
from zarr_rb.format.runs import RunMap
from zarr_rb.format.schema import LeafSpec, Schema, leaves_by_key
from zarr_rb.locations import LocalLocation, Location
from zarr_rb.locations.base import ROOT_METADATA, WriterHold
from zarr_rb.util.io import errno_of, short_reason
from zarr_rb.util.keys import Key

ARRAYS_WAIT_SECONDS = 10.0
"""How long a store that just got its schema from another writer waits for its arrays."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialized(method: _F) -> _F:
    """One thread at a time in a store: a buffer's prefetch threads, a training loop and a
    writer thread may share one."""

    @functools.wraps(method)
    def serialized(self: Store, *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            self._depth += 1
            try:
                result = method(self, *args, **kwargs)
            except FencedError as err:
                self.fenced = err  # nothing more is written: see close
                raise
            finally:
                self._depth -= 1
            if not self._depth and self._flush_on_exit:
                # The rows of a user dropped inside this call (see drop_user).
                self._flush_on_exit = False
                self.flush()
            return result

    return cast(_F, serialized)


class Store:
    """One zarr_rb store: open it with :func:`zarr_rb.core.open.open_store`."""

    def __init__(
        self,
        engine: Engine,
        meta: StoreMeta,
        *,
        read_only: bool,
        compression: Compression,
        lock: WriterHold | None = None,
        create: Callable[[], WriterHold] | None = None,
        history: bool = False,
    ) -> None:
        self.engine = engine
        self.history = history
        """Read-only rows of an archive's history (``meta`` made by ``as_history``): they
        stay as opened, and nothing they read is ever written again."""
        self._mutex = threading.RLock()
        self._depth = 0
        """Calls of this store under way (on the thread that holds :attr:`_mutex`)."""
        self._flush_on_exit = False
        """A user was dropped inside a call: the call commits its rows as it ends."""
        self._lock = lock
        self._creates_once: bool | None = None
        """Whether the location refuses to create an object that exists (asked once)."""
        self._create = create
        """A new store, not yet on disk: makes its place there and takes its writer lock
        (see :meth:`ensure_on_disk`)."""
        self.read_only = read_only
        self.compression = compression
        self.archive = meta.commit.history is not None
        """Whether commits append to the history (an archive, or one starting)."""
        self._epoch_at_open = meta.commit.epoch
        """Rows written over before this epoch were written over by another process."""
        self._arrays: dict[Key, RowArray] = {}
        self._mirror = Mirror(
            rows=0, large_row_bytes=compression.large_row_bytes, read_only=read_only
        )
        """The leaves this writer keeps in RAM, and their copies."""
        self.rows_written = 0
        """One past the highest row this process wrote (or staged)."""
        self.leaves: dict[Key, LeafSpec] = {}
        self.write_cache: WriteBuffer | None = None
        self.ledger: Ledger | None = None
        self.users = 1
        """Storages of this process that have this store open (they share one writer)."""
        self.version = 0
        """Grows with every change of the rows this store serves (lazy columns' caches)."""
        self.shared: dict[str, Any] = {}
        """State that the storages sharing this store share (their mutation revision)."""
        self._remove: list[Location] = []
        self._on_close: list[Callable[[Store], None]] = []
        self.closed = False
        self.fenced: FencedError | None = None
        """Why this writer was fenced (another writer took the store over): it then
        commits nothing more, and closing it releases it without a flush."""
        self.pinned: Saved | None = None
        """A reader's save whose rows it reads (a loaded save), until :meth:`refresh`."""
        self._listed_pieces: set[str] = set()
        """Map pieces that were in the store when this writer opened it and that no record
        named then, or named since: those a writer that crashed between its pieces and its
        record left. Deleted after this writer's first commit (any writer whose pieces
        they are lost its swap to it)."""
        if not read_only and create is None:  # (a store on disk, opened to write)
            listed = engine.location.list(MAPS_GROUP)
            self._listed_pieces = {key for key in listed if is_piece_key(key)}
            self._listed_pieces -= piece_keys(meta.run_maps())
        self.commits: Commits = SoloCommits(
            self, meta, late_writes=lock is not None and lock.late_writes
        )
        """The owner of the positions and the commits: this store's own, until other
        writers join it (:class:`~zarr_rb.core.sharing.Sharing`)."""
        if meta.schema is not None:
            self.attach_schema(meta.schema, meta.block_rows or 1)

    # --- schema ----------------------------------------------------------------------------

    @property
    def meta(self) -> StoreMeta:
        """The record as this store last read or published it (its commits object's)."""
        return self.commits.meta

    @property
    def committed(self) -> Commit:
        """The commit this store serves (see :attr:`Commits.committed`)."""
        return self.commits.committed

    @property
    def schema(self) -> Schema | None:
        return self.meta.schema

    @staticmethod
    def elements_per_row(schema: Schema | None) -> int:
        return 1 if schema is None else schema.elements_per_row

    @property
    def rows(self) -> int:
        assert self.schema is not None
        return self.schema.rows

    @property
    def length_rows(self) -> int:
        """Rows covered by ``length`` (elements)."""
        return -(-self.length // self.elements_per_row(self.schema))

    def element_shape(self, leaf: LeafSpec, width: int = 0) -> tuple[int, ...]:
        """Shape of one row of a leaf's array (of a ragged leaf: ``width`` long)."""
        assert self.schema is not None
        if leaf.ragged:
            return (width, *leaf.shape)
        return (*self.schema.batch_shape[1:], *leaf.shape)

    def _array_shape(self, leaf: LeafSpec) -> tuple[int | None, ...]:
        """The shape a leaf's array must have (``None``: any length along that dimension:
        the rows, at least the capacity's and more once slots were added for copies; a
        ragged array's width)."""
        if leaf.ragged:
            return (None, None, *leaf.shape)
        return (None, *self.element_shape(leaf))

    @property
    def physical_rows(self) -> int:
        """Rows the data arrays must have: those of every slot of the map."""
        ring = self.committed.ring
        if ring is not None and ring.capacity:
            return max(self.rows, ring.capacity * (self.meta.block_rows or 1))
        slots = self.commits.positions
        if not isinstance(slots, SlotMap) or slots.is_identity:
            return self.rows
        return slots.capacity * slots.block_rows

    def position_map(self) -> SlotMap | RunMap | None:
        """Where each position is on disk, as this store reads it now."""
        return self.commits.positions

    @property
    def length(self) -> int:
        """Elements in the buffer, as TorchRL counts them (see :attr:`Commits.length`)."""
        return self.commits.length

    @property
    def cursor(self) -> int:
        """Where the next extend goes (see :attr:`Commits.cursor`)."""
        return self.commits.cursor

    def set_length(self, length: int) -> None:
        """The length TorchRL's storage gives the buffer as it writes; a shared store's is
        its record's, whatever is set."""
        self.commits.set_length(length)

    @property
    def is_shared(self) -> bool:
        """Whether other writers write this store too."""
        return self.commits.shared

    def with_lengths(self, keys: Iterable[Key]) -> list[Key]:
        """``keys`` and the lengths leaves of the ragged ones among them."""
        keys = list(keys)
        lengths = [self.leaf(key).lengths_key for key in keys if self.leaf(key).ragged]
        return keys + [key for key in dict.fromkeys(lengths) if key not in keys]

    def plain_then_ragged(self, keys: Sequence[Key]) -> list[list[Key]]:
        """Keys in the order they are read: ragged leaves after the lengths they need."""
        plain = [key for key in keys if not self.leaf(key).ragged]
        ragged = [key for key in keys if self.leaf(key).ragged]
        return [group for group in (plain, ragged) if group]

    def attach_schema(self, schema: Schema, block_rows: int) -> None:
        self.leaves = leaves_by_key(schema.leaves)
        self.commits.use_map(self.committed)
        if self.meta.commit.ring is not None:
            self._wait_for_arrays(schema)
        # Row masks are sized from the schema: check it against an array on disk first.
        first = next(leaf for leaf in schema.leaves if not leaf.ragged)
        self.engine.check_array_metadata(first.path, self._array_shape(first))
        self.write_cache = WriteBuffer(
            element_shapes={leaf.key: self.element_shape(leaf) for leaf in schema.leaves},
            dtypes={leaf.key: TORCH_DTYPES[leaf.dtype] for leaf in schema.leaves},
            block_rows=block_rows,
            rows=schema.rows,
            ragged=frozenset(leaf.key for leaf in schema.leaves if leaf.ragged),
        )
        self.update_mirrorable()
        # Rows known to hold intact data: those of the commit. Rows past it were never
        # written or belong to an interrupted write; they become intact when written.
        self.ledger = Ledger(
            self.committed.readable_mask(self.committed.length), self.leaves, capacity=schema.rows
        )
        if self.commits.shared:
            self.ledger.grow(schema.rows)  # other writers' blocks lie anywhere in the ring

    def _wait_for_arrays(self, schema: Schema) -> None:
        """The arrays of a shared store are created by the writer that set its schema,
        right after it published it: wait for the last of them."""
        last = schema.leaves[-1]
        deadline = time.monotonic() + ARRAYS_WAIT_SECONDS
        while self.engine.location.read(f"{last.path}/{ROOT_METADATA}") is None:
            if time.monotonic() > deadline:
                return  # reported by the checks that follow
            time.sleep(0.01)

    def keep_in_ram(self, nbytes: int) -> None:
        """Let the writer mirror every fixed-shape leaf in RAM (frames too, not only the
        small leaves) while the rows it reached take at most ``nbytes`` there; the largest
        budget asked by the storages sharing this store holds."""
        if nbytes <= self._mirror.ram_bytes:
            return  # the mirrors chosen stand
        self._mirror.ram_bytes = int(nbytes)
        if self.schema is not None:
            self.update_mirrorable()

    @property
    def ram_bytes(self) -> int:
        """RAM the writer may take to mirror every fixed-shape leaf (see :meth:`keep_in_ram`)."""
        return self._mirror.ram_bytes

    def update_mirrorable(self) -> None:
        """Choose the leaves to mirror in RAM (a new schema, a new budget)."""
        schema = self.schema
        assert schema is not None
        self._mirror.choose(schema.leaves, schema.batch_shape, self.commits.rows_reached)

    @_serialized
    def initialize(
        self, schema: Schema, *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Create the arrays of ``schema`` (first write of a new store; ``samples``: the rows
        it writes, see :meth:`create_arrays`)."""
        self.check_writable()
        block_rows = choose_block_rows(self.compression, schema.leaves, schema.batch_shape)
        self.ensure_on_disk()
        self.commits.initialize(schema, block_rows, samples)

    def ensure_arrays(self) -> None:
        """Create the arrays of the schema that are missing (shared stores: whichever
        writer gets there first; the same metadata from every one)."""
        schema = self.schema
        assert schema is not None
        with self.writing("creating the arrays"):
            self.create_arrays(
                schema.leaves,
                (self.physical_rows, *schema.batch_shape[1:]),
                self.meta.block_rows or 1,
                replace=False,
            )

    @_serialized
    def add_leaves(
        self, leaves: Sequence[LeafSpec], *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Add columns to an initialised store. Rows already written read as zeros in them,
        as in TorchRL's storages; the new schema is published with the next commit."""
        self.check_writable()
        self.commits.add_leaves(leaves, samples)

    def create_arrays(
        self,
        leaves: Sequence[LeafSpec],
        batch_shape: tuple[int, ...],
        block_rows: int,
        *,
        replace: bool = True,
        samples: Mapping[Key, torch.Tensor] | None = None,
    ) -> None:
        """Create the arrays of ``leaves``. ``samples``: the first rows written of some of
        them; a large leaf among those that the codec does not shrink is stored raw.

        Raises:
            UnsupportedDataError: a leaf that cannot be laid out in chunks; raised before
                any array is created.
        """
        self.check_hold()
        layouts = [
            leaf_layout(
                leaf, batch_shape=batch_shape, block_rows=block_rows, compression=self.compression
            )
            for leaf in leaves
        ]
        groups = sorted(
            {
                "/".join(leaf.path.split("/")[:i])
                for leaf in leaves
                for i in range(2, leaf.path.count("/") + 1)
            }
        )
        for group in groups:
            self.engine.create_group(group)
        for leaf, layout in zip(leaves, layouts, strict=True):
            compression = self.compression
            sample = None if samples is None else samples.get(leaf.key)
            large = layout.shards is not None and not leaf.ragged
            if large and sample is not None and not compression.shrinks(to_numpy(sample)):
                compression = dataclasses.replace(compression, codec="none")
            self.engine.create_array(
                leaf.path,
                layout=layout,
                dtype=leaf.stored_dtype,
                compression=compression,
                attributes={ATTRS_KEY: {"dtype": leaf.dtype, "batch_dims": len(batch_shape)}},
                replace=replace,
            )

    def array(self, key: Key) -> RowArray:
        array = self._arrays.get(key)
        if array is None:
            assert self.schema is not None
            leaf = self.leaf(key)
            expected = self._array_shape(leaf)
            self.engine.check_array_metadata(leaf.path, expected)
            try:
                array = self.engine.open_array(
                    leaf.path, read_only=self.read_only, ragged=leaf.ragged
                )
            except ValueError as err:
                raise StoreCorruptedError(
                    f"store {self.url!r}: cannot open array {leaf.path!r} ({err})"
                ) from None
            # (A shared store's writers grow its arrays after they took more slots: other
            # writers may not have yet; reads and writes past them grow or reopen them.)
            least = self.rows if self.committed.ring is not None else self.physical_rows
            shape_ok = (
                len(array.shape) == len(expected)
                and array.shape[0] >= least
                and all(
                    want is None or want == got
                    for want, got in zip(expected[1:], array.shape[1:], strict=False)
                )
            )
            if not shape_ok or array.dtype != np.dtype(leaf.stored_dtype):
                want = (self.physical_rows, *expected[1:])
                raise StoreCorruptedError(
                    f"store {self.url!r}: array {leaf.path!r} has shape "
                    f"{array.shape} and dtype {array.dtype}, expected {want} (at least as "
                    f"many rows) and {leaf.stored_dtype}",
                )
            self._arrays[key] = array
        return array

    # --- writing ---------------------------------------------------------------------------

    def check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(
                f"store {self.url!r} was opened read-only; open it with "
                "read_only=False (one writer per store) to write",
            )
        if self.closed:
            raise StoreClosedError(f"store {self.url!r} is closed")
        if self.fenced is not None:
            raise FencedError(str(self.fenced), holder=self.fenced.holder)

    @_serialized
    def write(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, cursor: int | None = None
    ) -> None:
        """Write ``values[key][i]`` to row ``rows[i]`` (``rows`` sorted and unique).

        ``values`` holds every leaf (a row write) or some of them (the other leaves of those
        rows keep their values). ``cursor``: the row the next sequential write goes to once
        this one is done (a writer's extend); set before anything is committed, so that
        every commit made during the write records where its rows end.
        """
        self.check_writable()
        self.commits.write(rows, values, cursor=cursor)

    @_serialized
    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        """A shared store's extend: write ``count`` whole rows into this writer's slots,
        then commit them at the cursor; returns the positions they got."""
        self.check_writable()
        return self.commits.append(values, count)

    def whole_rows(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]
    ) -> Mapping[Key, torch.Tensor]:
        """``values`` with zeros for the keys an extend left out (the rows it goes to are
        new ones, as in a new TorchRL storage: what they held belongs to evicted rows)."""
        missing = [key for key in self.leaves if key not in values]
        if not missing:
            return values
        out = dict(values)
        for key in missing:
            leaf = self.leaf(key)
            shape = (rows.size, *self.element_shape(leaf))
            out[key] = torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])
        return out

    def update_mirror(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> None:
        """Rows (unique) this writer wrote or placed: into the copies of mirrored leaves."""
        first = self.commits.rows_reached == 0
        if rows.size and int(rows.max()) >= self.rows_written:
            self.rows_written = int(rows.max()) + 1
            if self._mirror.keys:
                self._mirror.fit(self.commits.rows_reached)
        if first:
            # A new store: mirrors start with its first rows (none to read back later).
            for key in self._mirror.missing():
                self._mirror.copy_of(key, self._mirror_reach(), self._load_mirror)
        self._mirror.put(rows, values, self.rows_written)

    def mirror_changed(self, rows: np.ndarray) -> None:
        """Rows (a mask) that other writers changed: read their small leaves again."""
        if not self._mirror.held:
            return
        assert self.ledger is not None
        picked = np.flatnonzero(self.ledger.fit(rows) & self.ledger.published)
        if picked.size > self.rows // 4:
            self._mirror.clear()  # read whole again when next needed
            return
        if picked.size:
            values = self.read_disk(dict.fromkeys(self._mirror.held_keys(), picked))
            self.update_mirror(picked, values)

    def collect(self) -> int:
        """Delete the objects of slots that nothing refers to, past the first
        ``SPARE_FACTOR`` rings' worth (those the ring takes first when it moves blocks),
        so that the disk kept saves held is given back once they are replaced or dropped.
        Returns how many slots it emptied (or found empty).

        Only after a commit that refers to none of them: a reader of an earlier record
        that meets a deleted object reads again through the last record (the seqlock).
        Arrays whose shards hold more than one block keep them (their rows are written
        over when their slots are reused).

        Its cost follows the slots freed since it last ran, not the store's size: the
        first collection of a writer lists the arrays' objects, later ones delete the
        slots that became free since (a save replaced, a version dropped)."""
        if self.schema is None or self.read_only:
            return 0
        return self.commits.collect()

    def whole_block_arrays(self) -> list[Key]:
        """The leaves whose write chunks (objects) each hold one block: one object per
        slot, which a collection can delete (larger shards keep their slots' rows, written
        over when the slots are reused)."""
        block_rows = self.meta.block_rows or 1
        return [key for key in self.leaves if self.array(key).chunk_rows == block_rows]

    def stored_slots(self, keys: Sequence[Key]) -> set[int]:
        """The slots of which an array of ``keys`` holds an object (one listing each)."""
        return set().union(*(self.array(key).stored_chunks() for key in keys))

    def drop_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Delete the objects of ``slots`` in the arrays of ``keys`` (slots no record
        refers to, that no writer writes)."""
        with self.writing("deleting slots no record refers to"):
            for key in keys:
                self.array(key).drop_chunks(slots)

    def write_past(self, slot: int) -> None:
        """Write no slot below ``slot`` (see :meth:`SoloCommits.write_past`): a writer that
        took the store over on a lease, or made it."""
        assert isinstance(self.commits, SoloCommits)
        self.commits.write_past(slot)

    @property
    def mirrored(self) -> bool:
        """Whether this writer mirrors leaves in RAM (which other writers' rows change)."""
        return self._mirror.held

    @property
    def late_writes(self) -> bool:
        """Whether this writer holds the store by a hold that a stalled holder may outlive
        (a lease): slots another writer may be writing are then never written."""
        return self._lock is not None and self._lock.late_writes

    @property
    def creates_once(self) -> bool:
        """Whether this writer creates each data object once, never writing over one (a
        writer on a lease, on a server that refuses to create an object that exists: see
        ``docs/design/ring.md``, step 5). Its writes then cover every row of each slot they
        go to (:meth:`SoloCommits._copy_on_write` moves every block written into a slot
        that may hold an object; a shared writer writes each write into fresh slots)."""
        if not self.late_writes:
            return False
        if self._creates_once is None:
            self._creates_once = self.engine.location.creates_once()
        return self._creates_once

    def write_rows(
        self,
        writes: Sequence[Write],
        *,
        physical: bool = False,
        seeds: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Write rows to the slots the writer's map gives their blocks (``physical``: the
        rows are rows of the data arrays already: a shared writer's). ``seeds``: when
        objects are created once, ``(slot, new slot)`` whose objects (of the arrays
        sharded by block) the new slot's start from, as stored."""
        assert self.commits.positions is not None
        if physical:
            self.check_hold()  # (its slots were taken with room in the arrays: Sharing._take)
        if self.creates_once:
            self._create_rows(writes, seeds, physical=physical)
            return
        assert not seeds
        with self.writing("writing rows"):
            futures = []
            try:
                for rows, values in writes:
                    at = rows if physical else self.commits.physical(rows)
                    for key, tensor in values.items():
                        array = self.array(key)
                        if array.ragged:
                            tensor = _whole_chunks(tensor, array)
                            if not tensor.shape[1]:
                                continue  # empty rows: nothing to write
                            array.grow(tensor.shape[1])
                        futures.append(array.write_rows(at, to_numpy(tensor)))
            finally:
                errors = []
                for future in futures:
                    try:
                        future.result()
                    except ValueError as err:
                        errors.append(err)
            if errors:
                raise errors[0]

    def _create_rows(
        self, writes: Sequence[Write], seeds: Sequence[tuple[int, int]], *, physical: bool
    ) -> None:
        """:meth:`write_rows`, every object created once: the rows of each key together."""
        assert self.commits.positions is not None
        block_rows = self.meta.block_rows or 1
        seeded = [k for k in self.leaves if seeds and self.array(k).chunk_rows == block_rows]
        by_key: dict[Key, list[tuple[np.ndarray, torch.Tensor]]] = {key: [] for key in seeded}
        for rows, values in writes:
            at = rows if physical else self.commits.physical(rows)
            for key, tensor in values.items():
                by_key.setdefault(key, []).append((at, tensor))
        with self.writing("writing rows"):
            started = []
            try:
                for key, pieces in by_key.items():
                    array = self.array(key)
                    width = None
                    if array.ragged and pieces:
                        pieces = [(at, _whole_chunks(tensor, array)) for at, tensor in pieces]
                        width = max(int(tensor.shape[1]) for _, tensor in pieces)
                        if not width and key not in seeded:
                            continue  # empty rows: nothing to write
                        array.grow(width)
                        pieces = [(at, _padded(tensor, width)) for at, tensor in pieces]
                    writes_of_key = [(at, to_numpy(tensor)) for at, tensor in pieces if width != 0]
                    key_seeds = seeds if key in seeded else ()
                    # A shared writer's slots are mostly taken again once free: with the
                    # objects of the rows they held (deleted first, in one round).
                    creation = array.create_rows(
                        writes_of_key, width=width, seeds=key_seeds, clear=physical
                    )
                    started.append((array, creation))
            finally:
                # (Every key's requests in flight at once; those started are waited for.)
                once.finish_all([creation for _, creation in started])
            for array, creation in started:
                array.forget(creation)

    def forget_slots(self, slots: Sequence[int]) -> None:
        """Drop the cached objects of ``slots`` (a reader: their objects were created
        anew since it cached them)."""
        cache = self.engine.cache
        if cache is None or not slots or self.schema is None:
            return
        block_rows = self.meta.block_rows or 1
        rows = np.asarray(sorted(set(slots)), dtype=np.int64) * block_rows
        for key in self.leaves:
            cache.invalidate(self.array(key).chunk_keys(rows, run=False))

    def ensure_capacity(self, slots: int) -> None:
        """Give the data arrays rows for ``slots`` slots (a shared store whose writers took
        more): their metadata only. Resizes only ever grow an array, so that writers
        growing it at once leave it at the largest size asked."""
        if self.schema is None:
            return
        rows = slots * (self.meta.block_rows or 1)
        with self.writing("adding slots to the arrays"):
            for key in self.leaves:
                array = self.array(key)
                for _ in range(5):
                    if array.shape[0] >= rows:
                        break
                    try:
                        array.grow_rows(rows)
                    except ValueError:
                        array.refresh()  # another writer resized it meanwhile
                else:
                    array.grow_rows(rows)

    def check_hold(self) -> None:
        """Nothing is written by a writer that lost its hold (a lease taken over).

        Raises:
            FencedError: it did.
        """
        if self._lock is not None:
            self._lock.check()

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn a failed write (a full disk, an I/O error) into a :class:`StoreWriteError`."""
        try:
            yield
        except (OSError, ValueError) as err:
            if isinstance(err, ZarrRBError):
                raise
            reason = short_reason(err)
            raise StoreWriteError(
                errno_of(err),
                f"store {self.url!r}: {what} failed ({reason}). The store "
                f"stays at its last commit (generation {self.committed.generation}, length "
                f"{self.committed.length}); rows not yet committed are kept in RAM. Free "
                "space or fix the disk, then retry with flush() or zarr_rb.save(), or reopen "
                "the store",
            ) from None

    @_serialized
    def withdraw(self, positions: np.ndarray, physical: np.ndarray, seen: Commit) -> int:
        """Withdraw ``positions``, found damaged in rows ``physical`` of the data arrays
        (where the commit ``seen`` has them), from the readable range until they are
        rewritten. Those that a write moved since stay. Returns how many were withdrawn."""
        self.check_writable()
        assert self.ledger is not None
        self.version += 1
        return self.commits.withdraw(positions, physical, seen)

    @_serialized
    def flush(self) -> None:
        """Write every row held in RAM and publish a commit that covers them."""
        if self.read_only or self.closed or self.write_cache is None:
            return
        if self.fenced is not None:
            raise FencedError(str(self.fenced), holder=self.fenced.holder)
        self.commits.flush()

    @_serialized
    def discard(self) -> None:
        """Forget rows held in RAM (after ``empty``)."""
        self.version += 1
        if self.write_cache is not None:
            self.write_cache.clear()
        self._mirror.clear()
        self.commits.discard()

    def staged_mask(self, rows: int) -> np.ndarray:
        """The rows waiting in RAM, as a mask over the first ``rows`` rows."""
        mask = np.zeros(rows, dtype=bool)
        assert self.write_cache is not None
        for block in self.write_cache:
            start = block.index * self.write_cache.block_rows
            if start < rows:
                stop = min(start + block.length, rows)
                mask[start:stop] |= block.dirty[: stop - start]
        return mask

    def move_cursor(self, cursor: int) -> None:
        """Put the next sequential write at ``cursor`` (a buffer emptied or loaded), not
        after rows written (the next commit records it as it is)."""
        self.commits.move_cursor(cursor)

    def start_archive(self) -> None:
        """Keep every row extended from the next commit on (an archive's history); a store
        that keeps one already goes on."""
        self.check_writable()
        self.archive = True
        self.commits.start_history()

    @_serialized
    def empty(self) -> None:
        """Drop every row, as TorchRL's ``rb.empty()`` does, and commit: nothing is
        readable, the cursor is back at 0, the epoch moves and the last save is dropped
        (its rows are gone)."""
        self.check_writable()
        self.discard()
        self.commits.set_length(0)
        self.move_cursor(0)
        if not self.on_disk:
            return  # nothing was ever written
        self.commits.empty()

    @_serialized
    def use_save(self, saved: Saved) -> None:
        """Serve the rows a pinned save kept (a save being loaded). A writer's next commit
        publishes them, which drops the rows committed since the save, as loading a save
        means; a reader reads them until :meth:`refresh` moves it to the last commit."""
        if not saved.pinned or self.schema is None:
            return
        commit = saved.commit(self.elements_per_row(self.schema))
        self.commits.use_save(saved, commit)

    @_serialized
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
        where = f"store {self.url!r}"
        live = not self.read_only and self.users > 1
        if live:
            self.flush()  # the live buffer's rows in RAM are committed, so that they count
        rows = -(-length // self.elements_per_row(self.schema))
        # A kept save's rows are there: nothing written since changed them.
        pinned = kept is not None
        if not pinned and self.committed.length < rows:
            raise SaveOverwrittenError(
                f"{where}: the rows its last save (or dump) covered, {rows} of them, are no "
                f"longer in the store, which holds {self.committed.length} (the buffer was "
                "emptied since). Open the rows as they are with ZarrStorage(path=...), or "
                "keep saves that training cannot touch: zarr_rb.save(rb, other_path) writes "
                "an independent snapshot",
            )
        since = epoch if exact else max(epoch, self._epoch_at_open)
        if not pinned and self.commits.overwrote_since(since):
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
        moved = kept is not None and not kept.serves_alike(self.committed, rows)
        if live and ((self.length, self.cursor) != (length, cursor) or moved):
            raise LiveBufferError(
                f"{where} is open for writing in this process by a buffer that went on since "
                f"the save (saved at length {length}, cursor {cursor}; now length "
                f"{self.length}, cursor {self.cursor}): loading the save would move that "
                "buffer back and drop the rows it committed since. Save it again "
                "(zarr_rb.save(rb)) to load its current state, close it first "
                "(rb.storage.close()), or read the save with zarr_rb.load(path, "
                "read_only=True)",
            )

    @property
    def on_disk(self) -> bool:
        """Whether the store was made on disk (a new one is, at its first write)."""
        return self._create is None

    @_serialized
    def ensure_on_disk(self) -> None:
        """Make a new store on disk: its directory, its writer lock, its root record and
        data group. As TorchRL's storages, which make their files at the first write, a
        new store is made when something is first written into it (rows, a save), so
        that a storage built and never written leaves nothing behind, and a storage built
        in a directory deleted before its first write (TorchRL's scripts build theirs in
        a ``TemporaryDirectory`` that they leave at once) still works.

        Raises:
            LockedError: another writer holds the new store's lock.
            StoreExistsError: another writer made a store there since this one was opened.
        """
        create = self._create
        if create is None:
            return
        try:
            self._lock = create()
        except OSError as err:
            if isinstance(err, ZarrRBError):
                raise
            reason = short_reason(err)
            raise StoreWriteError(
                errno_of(err),
                f"store {self.url!r} could not be made ({reason}); nothing was written. Free "
                "space or fix the disk, then write again",
            ) from None
        self._create = None
        self.write_past(0)  # made by this writer: no other ever wrote into it
        try:
            self.publish_meta()
            with self.writing("creating the data group"):
                self.engine.create_group(DATA_GROUP)
        except BaseException:
            # Nothing was published (the root record is written whole or not at all) or the
            # store exists, empty: either way, a later write starts again from here.
            if self.engine.location.read(ROOT_METADATA) is None:
                self._lock.release()
                self._lock = None
                self._create = create
            raise

    def next_save_slot(self) -> int:
        """The number of the next save: the lowest that no save the record names has. Its
        state group is then the one of the save before the last (untagged saves alternate
        between two groups, and the state writer rewrites only the chunks that changed),
        never a kept version's, whose state no save rewrites while it is kept."""
        return self.commits.next_save_slot(self.meta.save_slots())

    def take_save_slot(self) -> int:
        """:meth:`next_save_slot`, for a save about to write its state: a writer on a lease
        first records that it holds the store (a writer that takes it over from this one,
        were it to stall while saving, then keeps its saves out of that group)."""
        self.commits.hold_for_save()
        return self.next_save_slot()

    @_serialized
    def publish_saved(self, saved: Saved, *, tag: str | None = None) -> None:
        """Flush, then publish the data commit together with a new save record, made at
        that commit: its epoch and, pinned, its rows (a shared writer's saves pin none:
        its rows are written in place). ``tag``: keep it as a version of that name too.
        State groups no record names any longer are deleted."""
        self.flush()
        commit = self.committed
        saved = dataclasses.replace(saved, epoch=commit.epoch, time=time.time())
        self.commits.publish_saved(saved, tag=tag)
        self.collect()  # the slots the save it replaced kept

    @_serialized
    def drop_version(self, tag: str) -> None:
        """Stop keeping the version ``tag`` (its rows and state, unless the last save
        names them too)."""
        self.check_writable()
        self.commits.drop_version(tag)
        self.collect()

    @_serialized
    def publish_meta(self) -> None:
        """Publish the store's settings and schema with the current commit."""
        self.commits.publish_meta()

    def store_pieces(self, meta: StoreMeta) -> list[str]:
        """Write the pieces of the run maps of ``meta`` that its record will name and that
        are not stored yet (before the record that names them). Returns their keys."""
        return store_pieces(meta.run_maps(), self.engine.location.write)

    def drop_pieces(self, before: StoreMeta, after: StoreMeta) -> None:
        """Delete the pieces that the record ``before`` named and ``after``, which replaced
        it, does not (a reader of ``before`` that meets one gone reads the record again)."""
        named = piece_keys(after.run_maps())
        stale = piece_keys(before.run_maps()) - named
        if self._listed_pieces:
            # Listed before the record that ``after`` replaced was read: a writer that
            # wrote them for a swap of its own against that record, or an earlier one,
            # lost it to this one.
            stale |= self._listed_pieces - named
            self._listed_pieces = set()
        for key in sorted(stale):
            self.engine.location.delete(key)

    # --- reading ---------------------------------------------------------------------------

    @_serialized
    def read(
        self,
        rows: np.ndarray,
        keys: Iterable[Key],
        *,
        unwritten_as_zeros: bool = False,
        unreadable_as_zeros: bool = False,
    ) -> dict[Key, torch.Tensor]:
        """Read rows (any order, repeats allowed) of some leaves, RAM-held rows included.

        Args:
            unwritten_as_zeros: rows past the length that hold no data for a key read as
                zeros (as the unused capacity of TorchRL's storages), instead of raising.
            unreadable_as_zeros: every row that cannot be read (holes too) reads as zeros;
                for callers that then leave those rows out (samplers' trajectory scans).

        Raises:
            RowsNotCommittedError: a row holds no intact data for a key (a read-only store:
                a row outside the commit).
        """
        keys = list(keys)
        if self.read_only:
            committed = read_committed(
                self, rows, self.with_lengths(keys), unreadable_as_zeros=unreadable_as_zeros
            )
            return {key: committed[key] for key in keys}
        return self.commits.read(
            lambda: self._read_as_writer(
                rows,
                keys,
                unwritten_as_zeros=unwritten_as_zeros,
                unreadable_as_zeros=unreadable_as_zeros,
            ),
            rows,
        )

    def _read_as_writer(
        self,
        rows: np.ndarray,
        keys: list[Key],
        *,
        unwritten_as_zeros: bool,
        unreadable_as_zeros: bool,
    ) -> dict[Key, torch.Tensor]:
        """Rows as this writer has them: on disk, in its RAM buffer, in its mirror."""
        assert self.write_cache is not None
        assert self.ledger is not None
        hit, served = self.write_cache.staged_rows(rows)
        wanted = self.with_lengths(keys)
        on_disk: dict[Key, np.ndarray] = {}
        for key in wanted:
            readable = self.ledger.readable(rows, key) | hit
            if not readable.all() and not unreadable_as_zeros:
                lost = ~readable
                if unwritten_as_zeros:
                    lost &= rows < self.length_rows  # past the length: unused capacity
                if lost.any():
                    raise RowsNotCommittedError(
                        f"store {self.url!r}: rows {preview_rows(rows[lost])} "
                        f"hold no intact data for key {key!r}: nothing was written there yet, "
                        "or a write to them was interrupted (a crash or a failed write) and "
                        "they have not been rewritten since",
                    )
            on_disk[key] = readable & ~hit
        out: dict[Key, torch.Tensor] = {}
        index = torch.from_numpy(rows)
        # Plain leaves first: they include the lengths that ragged leaves are read by.
        for group in self.plain_then_ragged(wanted):
            mirrored = [key for key in group if key in self._mirror.keys]
            reach = self._mirror_reach()
            out.update(
                {key: self._mirror.gather(key, index, reach, self._load_mirror) for key in mirrored}
            )
            requests = {key: rows[on_disk[key]] for key in group if key not in mirrored}
            lengths = {
                key: out[self.leaf(key).lengths_key][torch.from_numpy(on_disk[key])].numpy()
                for key in requests
                if self.leaf(key).ragged
            }
            parts = self.read_disk(requests, lengths)
            everything = not hit.any() and all(on_disk[key].all() for key in requests)
            for key, part in parts.items():
                if everything:
                    out[key] = part
                    continue
                leaf = self.leaf(key)
                width = self._widest(leaf, out) if leaf.ragged else 0
                tensor = torch.zeros(
                    (rows.size, *self.element_shape(leaf, width)), dtype=part.dtype
                )
                _place(tensor, torch.from_numpy(np.flatnonzero(on_disk[key])), part)
                for block, positions in served:
                    offsets = rows[positions] - block.index * self.write_cache.block_rows
                    staged = block.values[key][torch.from_numpy(offsets)]
                    _place(tensor, torch.from_numpy(positions), staged)
                out[key] = tensor
        return {key: out[key] for key in keys}

    def _mirror_reach(self) -> int:
        """Rows a new copy of a mirrored leaf covers: those this writer may have reached."""
        assert self.ledger is not None
        return max(self.commits.rows_reached, self.ledger.extent)

    def _load_mirror(self, key: Key, covered: int) -> torch.Tensor:
        """A new copy of a leaf, ``covered`` rows long, as this writer has them."""
        assert self.write_cache is not None
        assert self.ledger is not None
        leaf = self.leaf(key)
        mirror = zeros((covered, *self.element_shape(leaf)), TORCH_DTYPES[leaf.dtype])
        # Only cells known to be on disk: others were never written, or were lost to a
        # crash or a failed write, and are not readable until they are rewritten.
        every_row = np.arange(covered)
        on_disk = np.flatnonzero(self.ledger.readable(every_row, key))
        put_rows(mirror, on_disk, self.read_disk({key: on_disk})[key])
        _, served = self.write_cache.staged_rows(every_row)
        for block, positions in served:
            offsets = torch.from_numpy(positions - block.index * self.write_cache.block_rows)
            mirror[torch.from_numpy(positions)] = block.values[key][offsets]
        return mirror

    def leaf(self, key: Key) -> LeafSpec:
        return self.leaves[key]

    def read_disk(
        self,
        requests: Mapping[Key, np.ndarray],
        lengths: Mapping[Key, np.ndarray] | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Read ``requests[key]`` rows of each key; the reads of all keys run together.

        Ragged leaves need the lengths of the rows asked (``lengths[key]``): each row is read
        up to its length only, and rows come back padded with zeros to the longest.
        """
        futures: dict[Key, list[tuple[np.ndarray, int | None, Any]]] = {}
        assert self.commits.positions is not None
        for key, positions in requests.items():
            if not positions.size:
                continue
            array = self.array(key)
            rows = self.commits.physical(positions)
            if int(rows.max()) >= array.shape[0]:
                array.refresh()  # the writer added slots since it was opened
                if int(rows.max()) >= array.shape[0]:
                    raise StoreCorruptedError(
                        f"store {self.url!r}: its commit record maps rows to row "
                        f"{int(rows.max())} of array {'/'.join(key)!r}, which has "
                        f"{array.shape[0]}: the record or the array's metadata is damaged. "
                        "Restore the store from a copy, or run zarr_rb.verify(path)",
                    )
            if not array.ragged:
                futures[key] = [(np.arange(rows.size), None, array.read_rows(rows))]
                continue
            assert lengths is not None
            sizes = self._checked_lengths(key, lengths[key], array)
            # Rows grouped by how many chunks they span: each read touches only chunks
            # that were written with those rows (a missing chunk is an error, not zeros).
            spans = -(-sizes // array.chunk_length)
            futures[key] = [
                (picked, width, array.read_rows(rows[picked], width))
                for span in np.unique(spans[spans > 0]).tolist()
                for picked, width in [(np.flatnonzero(spans == span), span * array.chunk_length)]
            ]
        out = {}
        for key, rows in requests.items():
            leaf = self.leaf(key)
            dtype = TORCH_DTYPES[leaf.dtype]
            if not leaf.ragged:
                parts = futures.get(key)
                if parts is None:
                    out[key] = torch.empty((0, *self.element_shape(leaf)), dtype=dtype)
                    continue
                try:
                    values = parts[0][2].result()
                except ValueError as err:
                    raise self.array(key).damage_error(self.commits.physical(rows), err) from None
                if key == INDEX_KEY:
                    values = put_positions(values, rows)
                out[key] = from_numpy(values, dtype)
                continue
            assert lengths is not None
            sizes = lengths[key]
            widest = int(sizes.max()) if sizes.size else 0
            padded = np.zeros((rows.size, *self.element_shape(leaf, widest)), leaf.stored_dtype)
            for picked, width, future in futures.get(key, []):
                try:
                    part = future.result()
                except ValueError as err:
                    physical = self.commits.physical(rows[picked])
                    raise self.array(key).damage_error(physical, err, width) from None
                span = min(widest, part.shape[1])
                padded[picked, :span] = part[:, :span]
            if widest:
                padded[np.arange(widest) >= sizes[:, None]] = 0  # what lies past each length
            out[key] = from_numpy(padded, dtype)
        return out

    def _checked_lengths(self, key: Key, sizes: np.ndarray, array: RowArray) -> np.ndarray:
        """Row lengths of a ragged leaf, checked against its array (stores are untrusted)."""
        if sizes.size and (int(sizes.max()) > array.width or int(sizes.min()) < 0):
            array.refresh()  # the writer made it wider since this store opened it
        if sizes.size and (int(sizes.max()) > array.width or int(sizes.min()) < 0):
            raise StoreCorruptedError(
                f"store {self.url!r}: key {key!r} has rows of length "
                f"{int(sizes.min())}..{int(sizes.max())}, its array holds rows of at most "
                f"{array.width}",
            )
        return sizes.astype(np.int64)

    def read_disk_all(self, requests: Mapping[Key, np.ndarray]) -> dict[Key, torch.Tensor]:
        """:meth:`_read_disk` of leaves and of the lengths of their ragged ones (the rows of
        a ragged leaf's lengths must be asked with it)."""
        plain = {key: rows for key, rows in requests.items() if not self.leaf(key).ragged}
        out = self.read_disk(plain)
        ragged = {key: rows for key, rows in requests.items() if self.leaf(key).ragged}
        if ragged:
            lengths = {key: out[self.leaf(key).lengths_key].numpy() for key in ragged}
            out.update(self.read_disk(ragged, lengths))
        return out

    def _widest(self, leaf: LeafSpec, out: Mapping[Key, torch.Tensor]) -> int:
        """The longest of the rows read of a ragged leaf (its lengths are in ``out``)."""
        sizes = out[leaf.lengths_key]
        return int(sizes.max()) if sizes.numel() else 0

    @_serialized
    def unreadable_rows(self) -> np.ndarray:
        """Rows inside the length that cannot be read: withdrawn by a crash, a failed write
        or a repair, and not rewritten since (samplers must not draw them)."""
        if self.schema is None:
            return np.empty(0, dtype=np.int64)
        assert self.ledger is not None
        n = self.length_rows
        ledger = self.ledger
        readable = ledger.first(ledger.published if self.read_only else ledger.intact, n)
        if readable.all():
            return np.empty(0, dtype=np.int64)
        unreadable = ~readable
        if not self.read_only:
            unreadable &= ~self.staged_mask(n)
        return np.flatnonzero(unreadable)

    @_serialized
    def refresh(self) -> Commit:
        """Re-read the commit record and move to it: its length, cursor and rows (readers,
        and the writers of a shared store); returns it."""
        return self.commits.refresh()

    # --- sharing and lifetime ---------------------------------------------------------------

    @_serialized
    def become_shared(self) -> None:
        """Let other processes join this store as writers (it is handed to one): flush,
        trade the single writer's hold for a shared one, start sharing."""
        if self.commits.shared or self.read_only:
            return
        check_shareable(self)
        self.ensure_on_disk()
        self.flush()
        writer = new_writer_id()
        if self._lock is not None:
            self._lock.release()
        self._lock = self.engine.location.join_writers(writer)
        Sharing.start(self, writer)

    @_serialized
    def acquire(self) -> Store:
        """One more user of this open store (another storage of this process)."""
        self.users += 1
        return self

    def remove_when_closed(self, location: Location) -> None:
        """Delete everything at ``location`` (the store, or the temporary directory holding
        it) once the last user has closed the store."""
        self._remove.append(location)

    @_serialized
    def close(self) -> bool:
        """One user is done with the store; the last one flushes it, releases its lock and
        deletes what :meth:`remove_when_closed` named. Returns whether something was
        deleted."""
        if self.closed:
            return False
        self.users -= 1
        if self.users > 0:
            if not self._gone():
                self.flush()
            return False
        try:
            if not self._gone():
                self.flush()
                self.commits.leave()
        finally:  # the lock or lease is given up even when the store cannot be reached
            self.closed = True
            self._arrays.clear()
            if self._lock is not None:
                self._lock.release()
            for callback in self._on_close:
                callback(self)
        removed = False
        for location in self._remove:
            if location is self.engine.location and not self.on_disk:
                continue  # never made by this store: what is there is another writer's
            removed = removed or location.exists()
            location.delete_prefix("")
        return removed

    def drop_user(self) -> None:
        """A user dropped without :meth:`close` (its finalizer). The garbage collector runs
        it at any allocation, perhaps inside a call of this store on this thread, whose
        lock is re-entrant: a flush there would commit that call's write half-done, so the
        rows of a user that is not the last are committed as the call ends; outside any
        call, at once. The last one closes."""
        with self._mutex:  # (another thread's call ends first)
            if self.closed:
                return
            if self.users <= 1:
                self.close()
                return
            self.users -= 1
            if self._depth:
                self._flush_on_exit = True
            elif not self._gone():
                self.flush()

    @_serialized
    def abandon(self) -> None:
        """Drop the store as a process killed at this instant would: the rows in RAM are
        lost, nothing is flushed or committed, the writer's lock is released (as the kernel
        releases a dead process's locks). For crash tests."""
        if self.closed:
            return
        self.closed = True
        self.users = 0
        self._arrays.clear()
        if self._lock is not None:
            self._lock.release()  # a shared writer's blocks are then taken for a dead one's
        for callback in self._on_close:
            callback(self)

    def _gone(self) -> bool:
        """Whether there is nothing to flush into: a reader, a fenced writer (the error was
        raised at its write), or a store deleted from under it (by another program)."""
        if self.read_only or not self.on_disk or self.fenced is not None:
            return True
        return self.engine.location.read(ROOT_METADATA) is None

    def on_close(self, callback: Callable[[Store], None]) -> None:
        self._on_close.append(callback)

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def path(self) -> Path | str:
        """The directory of a local store, the URL of any other."""
        location = self.engine.location
        return location.root if isinstance(location, LocalLocation) else location.url


def _place(tensor: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``tensor[where] = values``; ragged rows (narrower or wider than ``tensor``) up to the
    width they share (beyond their lengths, rows are padding)."""
    if values.ndim > 1 and values.shape[1] != tensor.shape[1]:
        span = min(values.shape[1], tensor.shape[1])
        tensor[where, :span] = values[:, :span]
    else:
        tensor[where] = values


def _padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Ragged rows padded with zeros to ``width`` along their length."""
    if tensor.shape[1] == width:
        return tensor
    padded = tensor.new_zeros((tensor.shape[0], width, *tensor.shape[2:]))
    padded[:, : tensor.shape[1]] = tensor
    return padded


def _whole_chunks(tensor: torch.Tensor, array: RowArray) -> torch.Tensor:
    """Ragged rows padded with zeros to whole chunks along their length (no chunk is
    partly written, which would read it back first)."""
    width = tensor.shape[1]
    return _padded(tensor, -(-width // array.chunk_length) * array.chunk_length)
