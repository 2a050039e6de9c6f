"""A store on disk: its schema, its arrays, the rows waiting in RAM and the commit protocol.

The commit protocol (see DESIGN.md):

* The root group's attributes are the commit record. They are replaced
  atomically and declare which rows are readable (``length`` minus ``holes``).
* Rows are declared readable only after every leaf of those rows is on disk.
* Before rows that the last commit declared readable are overwritten, a commit
  withdraws them, so no reader and no crash can pair one key's new row with
  another key's old row.
* Readers re-read the commit after each read; if its generation moved, the
  read is retried (a seqlock), so a read never returns a torn transition.

This module works with leaf dictionaries ``{key: tensor[rows, ...]}`` and row
numbers; it knows nothing about TorchRL. Stores are opened by :mod:`zarr_rb.core.open`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch

from zarr_rb._io import errno_of
from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy, to_numpy
from zarr_rb.core.format import (
    ATTRS_KEY,
    DATA_GROUP,
    FORMAT_NON_TENSOR,
    FORMAT_VERSION,
    STATE_GROUP,
    Commit,
    LeafSpec,
    LeaseFloor,
    Saved,
    Schema,
    StoreMeta,
    commit_from_mask,
    leaves_by_key,
    preview_rows,
)
from zarr_rb.core.history import Extended
from zarr_rb.core.layout import Compression, choose_block_rows, leaf_layout, row_nbytes
from zarr_rb.core.ledger import Ledger
from zarr_rb.core.pieces import MAPS_GROUP, is_piece_key, piece_keys, store_pieces
from zarr_rb.core.reader import read_committed, reread_commit
from zarr_rb.core.ring import SPARE_FACTOR, SlotMap, max_slots
from zarr_rb.core.runs import RunMap
from zarr_rb.core.sharing import RowsMovedError, Sharing, check_shareable, new_writer_id
from zarr_rb.core.write_cache import Block, Key, WriteBuffer
from zarr_rb.engine import Engine, RowArray
from zarr_rb.engine.tensorstore import is_run
from zarr_rb.errors import (
    FencedError,
    LiveBufferError,
    LockedError,
    NotSupportedError,
    ReadOnlyError,
    RowsNotCommittedError,
    SaveOverwrittenError,
    SlotsExhaustedError,
    StoreCorruptedError,
    StoreWriteError,
    ZarrRBError,
)
from zarr_rb.locations import LocalLocation, Location
from zarr_rb.locations.base import ROOT_METADATA, WriterHold

_MAX_STAGED_BLOCKS = 8
_SHARED_WRITE_ATTEMPTS = 50
"""Writes of some keys of given rows of a shared store, before giving up on rows that other
writers keep writing."""
STAGED_RAGGED_BYTES = 128 * 2**20
"""A block of rows of different lengths waits in RAM padded to its longest row; rows so
long that their block would take more than this are written at once instead."""
ARRAYS_WAIT_SECONDS = 10.0
"""How long a store that just got its schema from another writer waits for its arrays."""
MIRROR_LIMIT_BYTES = 256 * 2**20
"""Small leaves (actions, rewards, flags, trajectory ids) are mirrored in RAM by the writer
while all of them together, over the rows written so far, take at most this much."""


@dataclasses.dataclass(frozen=True, slots=True)
class _MirrorChoice:
    """Leaves the writer may mirror in RAM, and the bytes they may take there."""

    keys: frozenset[Key]
    row_bytes: int
    limit: int


Write = tuple[np.ndarray, Mapping[Key, torch.Tensor]]
"""Rows (sorted, unique) and the values of some or all leaves for them."""

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
        self._create = create
        """A new store, not yet on disk: makes its place there and takes its writer lock
        (see :meth:`ensure_on_disk`)."""
        self.meta = meta
        self.read_only = read_only
        self.compression = compression
        self.committed = meta.commit
        self._written_from = meta.commit.cursor
        """Where the rows written since the last commit (or since the cursor was moved)
        start: the commit records how far from there they are committed."""
        self._extended = Extended()
        """An archive's positions extended since the last commit (its history grows by
        those a commit publishes)."""
        self._archive = meta.commit.history is not None
        """Whether commits append to the history (an archive, or one starting)."""
        self._epoch_at_open = meta.commit.epoch
        """Rows written over before this epoch were written over by another process."""
        self.length = meta.commit.length * self._elements_per_row(meta.schema)
        self.cursor = meta.commit.cursor
        self._arrays: dict[Key, RowArray] = {}
        self._mirror: dict[Key, torch.Tensor] = {}
        self._mirrorable: frozenset[Key] = frozenset()
        self._mirror_choices: tuple[_MirrorChoice, ...] = ()
        """Widest first: every fixed-shape leaf (within ``ram_bytes``), the small ones."""
        self._mirror_cap = 0
        """The most rows the mirrors may cover (their leaves' limit)."""
        self._small_leaves: frozenset[Key] = frozenset()
        self.ram_bytes = 0
        """RAM the writer may take to mirror every fixed-shape leaf (see :meth:`keep_in_ram`)."""
        self._rows_written = 0
        """One past the highest row this process wrote (or staged)."""
        self._leaves: dict[Key, LeafSpec] = {}
        self._buffer: WriteBuffer | None = None
        self._ledger: Ledger | None = None
        self._retries: list[Write] = []
        """Writes of some keys that failed: written again by the next flush."""
        self._schema_on_disk = meta.schema
        """The schema of the last published record (keys added since are published next)."""
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
        self.sharing: Sharing | None = None
        """The shared-writer protocol, when this store has several writers."""
        self._slots: SlotMap | RunMap | None = None
        """Where each position is on disk: the writer's block map, which the next commit
        publishes (a reader's: the last commit's; a shared store's: the runs of the last
        commit). Set with the schema."""
        self._rewrote_published = False
        """Rows the last commit declared readable were written over (in other slots) since:
        the next commit moves the epoch."""
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
        self._avoided_saves: set[int] = set()
        """State groups this writer never saves into: those writers that held the store
        before it may still write late (a lease lost while saving), as the record this one
        took the store over at names them (see :class:`LeaseFloor`)."""
        if lock is not None and lock.late_writes and not read_only:
            lease = meta.commit.lease
            avoided = set(lease.avoid) if lease is not None else set()
            if lease is None or lease.held:
                # The writer before may have stalled while saving: into the group it
                # saves into next, which this record tells.
                named = self._named_save_slots() | avoided
                avoided.add(next(slot for slot in itertools.count() if slot not in named))
            self._avoided_saves = avoided
        self._known_empty: np.ndarray | None = None
        """Slots that held no object when :meth:`collect` last ran and were not handed
        out since (``None``: not known; the next collection lists the arrays)."""
        self._own_from: int | None = None
        """The first slot this writer reserved for itself, when a writer that held the
        store before it may still write (a lease it lost while it stalled: see
        ``WriterHold.late_writes``): slots below it are that writer's, so this one moves
        the blocks it writes out of them. ``None``: not fixed yet (when this writer first
        writes: the floor of a record whose writer closed cleanly, else its capacity)."""
        self._lease = meta.commit.lease
        """What this writer's commits record of the slots a writer on a lease owns: the
        record's, until this writer holds its own (see :class:`LeaseFloor`)."""
        self._holding = False
        """Whether the record says this writer holds slots from ``_own_from`` on."""
        if meta.schema is not None:
            self._attach_schema(meta.schema, meta.block_rows or 1)

    # --- schema ----------------------------------------------------------------------------

    @property
    def schema(self) -> Schema | None:
        return self.meta.schema

    @staticmethod
    def _elements_per_row(schema: Schema | None) -> int:
        return 1 if schema is None else schema.elements_per_row

    @property
    def rows(self) -> int:
        assert self.schema is not None
        return self.schema.rows

    @property
    def length_rows(self) -> int:
        """Rows covered by ``length`` (elements)."""
        return -(-self.length // self._elements_per_row(self.schema))

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
    def _physical_rows(self) -> int:
        """Rows the data arrays must have: those of every slot of the map."""
        ring = self.committed.ring
        if ring is not None and ring.capacity:
            return max(self.rows, ring.capacity * (self.meta.block_rows or 1))
        slots = self._slots
        if not isinstance(slots, SlotMap) or slots.is_identity:
            return self.rows
        return slots.capacity * slots.block_rows

    @property
    def _block_map(self) -> SlotMap:
        """The block map of a store of one writer."""
        assert isinstance(self._slots, SlotMap)
        return self._slots

    def position_map(self) -> SlotMap | RunMap | None:
        """Where each position is on disk, as this store reads it now."""
        return self._slots

    def with_lengths(self, keys: Iterable[Key]) -> list[Key]:
        """``keys`` and the lengths leaves of the ragged ones among them."""
        keys = list(keys)
        lengths = [self._leaf(key).lengths_key for key in keys if self._leaf(key).ragged]
        return keys + [key for key in dict.fromkeys(lengths) if key not in keys]

    def _plain_then_ragged(self, keys: Sequence[Key]) -> list[list[Key]]:
        """Keys in the order they are read: ragged leaves after the lengths they need."""
        plain = [key for key in keys if not self._leaf(key).ragged]
        ragged = [key for key in keys if self._leaf(key).ragged]
        return [group for group in (plain, ragged) if group]

    def _attach_schema(self, schema: Schema, block_rows: int) -> None:
        self._leaves = leaves_by_key(schema.leaves)
        self.use_slots(self.committed)
        if self.meta.commit.ring is not None:
            self._wait_for_arrays(schema)
        # Row masks are sized from the schema: check it against an array on disk first.
        first = next(leaf for leaf in schema.leaves if not leaf.ragged)
        self.engine.check_array_metadata(first.path, self._array_shape(first))
        self._buffer = WriteBuffer(
            element_shapes={leaf.key: self.element_shape(leaf) for leaf in schema.leaves},
            dtypes={leaf.key: TORCH_DTYPES[leaf.dtype] for leaf in schema.leaves},
            block_rows=block_rows,
            rows=schema.rows,
            ragged=frozenset(leaf.key for leaf in schema.leaves if leaf.ragged),
        )
        self._update_mirrorable()
        # Rows known to hold intact data: those of the commit. Rows past it were never
        # written or belong to an interrupted write; they become intact when written.
        self._ledger = Ledger(
            self.committed.readable_mask(self.committed.length), self._leaves, capacity=schema.rows
        )
        if self.sharing is not None:
            self._ledger.grow(schema.rows)  # other writers' blocks lie anywhere in the ring

    def _wait_for_arrays(self, schema: Schema) -> None:
        """The arrays of a shared store are created by the writer that set its schema,
        right after it published it: wait for the last of them."""
        last = schema.leaves[-1]
        deadline = time.monotonic() + ARRAYS_WAIT_SECONDS
        while self.engine.location.read(f"{last.path}/{ROOT_METADATA}") is None:
            if time.monotonic() > deadline:
                return  # reported by the checks that follow
            time.sleep(0.01)

    def use_slots(self, commit: Commit) -> None:
        """Read (and write) through the slot map of ``commit``: the one the store opened
        at, or a newer one a reader picked up."""
        assert self.schema is not None
        if commit.runs is not None:
            self._slots = commit.runs
        elif commit.ring is not None and not commit.ring.legacy:
            self._slots = RunMap.empty()
        elif commit.slots is not None:
            self._slots = commit.slots.copy()
        else:
            self._slots = SlotMap.identity(self.rows, self.meta.block_rows or 1)

    def _committed_slots(self) -> SlotMap:
        return self._slots_of(self.committed)

    def _slots_of(self, commit: Commit) -> SlotMap:
        assert self.schema is not None
        if commit.slots is not None:
            return commit.slots
        return SlotMap.identity(self.rows, self.meta.block_rows or 1)

    def _pinned_slots(self) -> list[SlotMap]:
        """The maps of the saves whose rows the store keeps (their slots are not free)."""
        return [self._slots_of(saved.commit()) for saved in self.meta.pinned()]

    def keep_in_ram(self, nbytes: int) -> None:
        """Let the writer mirror every fixed-shape leaf in RAM (frames too, not only the
        small leaves) while the rows it reached take at most ``nbytes`` there; the largest
        budget asked by the storages sharing this store holds."""
        if nbytes <= self.ram_bytes:
            return  # the mirrors chosen stand
        self.ram_bytes = int(nbytes)
        if self.schema is not None:
            self._update_mirrorable()

    def _update_mirrorable(self) -> None:
        schema = self.schema
        assert schema is not None
        fixed = [leaf for leaf in schema.leaves if not leaf.ragged]
        sizes = {leaf.key: row_nbytes(leaf, schema.batch_shape) for leaf in fixed}
        small = [key for key, size in sizes.items() if size < self.compression.large_row_bytes]
        self._small_leaves = frozenset(small)
        self._mirror_choices = tuple(
            _MirrorChoice(frozenset(keys), sum(sizes[key] for key in keys), limit)
            for keys, limit in (
                (list(sizes), self.ram_bytes),
                (small, max(self.ram_bytes, MIRROR_LIMIT_BYTES)),
            )
            if keys and limit
        )
        self._choose_mirror()

    def _choose_mirror(self) -> None:
        """Mirror the widest choice whose rows fit its limit; drop the mirrors of the others."""
        fitting = [
            choice
            for choice in self._mirror_choices
            if self._rows_reached * choice.row_bytes <= choice.limit
        ]
        if self.read_only or not fitting:
            self._mirrorable, self._mirror_cap = frozenset(), 0
        else:
            self._mirrorable = fitting[0].keys
            self._mirror_cap = fitting[0].limit // max(1, fitting[0].row_bytes)
        for key in self._mirror.keys() - self._mirrorable:
            del self._mirror[key]  # read from disk from now on

    @_serialized
    def initialize(
        self, schema: Schema, *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Create the arrays of ``schema`` (first write of a new store; ``samples``: the rows
        it writes, see :meth:`_create_arrays`)."""
        self._check_writable()
        block_rows = choose_block_rows(self.compression, schema.leaves, schema.batch_shape)
        self.ensure_on_disk()
        if self.sharing is not None:
            self.sharing.set_schema(schema, block_rows)
            return
        with self.writing("creating the arrays"):
            self._create_arrays(schema.leaves, schema.batch_shape, block_rows, samples=samples)
        self.meta = dataclasses.replace(self.meta, schema=schema, block_rows=block_rows)
        self._attach_schema(schema, block_rows)
        self.publish_meta()

    def ensure_arrays(self) -> None:
        """Create the arrays of the schema that are missing (shared stores: whichever
        writer gets there first; the same metadata from every one)."""
        schema = self.schema
        assert schema is not None
        with self.writing("creating the arrays"):
            self._create_arrays(
                schema.leaves,
                (self._physical_rows, *schema.batch_shape[1:]),
                self.meta.block_rows or 1,
                replace=False,
            )

    @_serialized
    def add_leaves(
        self, leaves: Sequence[LeafSpec], *, samples: Mapping[Key, torch.Tensor] | None = None
    ) -> None:
        """Add columns to an initialised store. Rows already written read as zeros in them,
        as in TorchRL's storages; the new schema is published with the next commit."""
        self._check_writable()
        if self.sharing is not None:
            raise NotSupportedError(
                f"store {self.url!r} is shared by several writers, whose schema is fixed by "
                f"the first write; cannot add keys {[leaf.key for leaf in leaves]}: write "
                "every key from the first extend on",
            )
        schema = self.schema
        assert schema is not None
        assert self._buffer is not None
        assert self._ledger is not None
        block_rows = self.meta.block_rows or 1
        physical_shape = (self._physical_rows, *schema.batch_shape[1:])
        on_disk = self._ledger.intact | self._ledger.published
        if on_disk.any():
            # The record says this writer holds its slots before it writes zeros there, and
            # names the keys only after (a reader of it would meet cells holding nothing).
            self._first_own_slot()
        with self.writing("creating the arrays of new keys"):
            self._create_arrays(leaves, physical_shape, block_rows, samples=samples)
        grown = schema.with_leaves(leaves)
        # A store of format 1 that takes leaves format 1 cannot read becomes format 2, so
        # that an older zarr_rb refuses it (FormatVersionError) instead of misreading it.
        fmt = self.meta.format
        if any(leaf.value != "tensor" for leaf in leaves):
            fmt = max(fmt, FORMAT_NON_TENSOR)
        self.meta = dataclasses.replace(self.meta, schema=grown, format=fmt)
        self._leaves = leaves_by_key(grown.leaves)
        for leaf in leaves:
            self._buffer.add_key(
                leaf.key, self.element_shape(leaf), TORCH_DTYPES[leaf.dtype], ragged=leaf.ragged
            )
        self._update_mirrorable()
        # Zeros on disk for every row that holds data there (intact here, or published to
        # readers), so that those rows stay whole with the new keys; rows waiting in RAM get
        # zeros there too (add_key).
        assert self._slots is not None
        committed = self._committed_slots()
        with self.writing("writing zeros into new keys"):
            futures = []
            row_sets = []
            for start, stop in _runs(on_disk, block_rows):
                # In the block's slot, and in its committed one (when the writer moved it
                # since): readers of the last commit read it there.
                positions = np.arange(start, stop)
                rows = np.union1d(self._slots.physical(positions), committed.physical(positions))
                row_sets.append(rows)
            history = self.committed.history
            if history is not None:  # an archive's rows read as zeros in the new keys too
                row_sets.append(np.unique(history.physical(np.arange(history.end))))
            for rows in row_sets:
                for leaf in leaves:
                    if leaf.ragged:
                        continue  # its rows are empty (their lengths are zeros): nothing to read
                    zeros = np.zeros((rows.size, *self.element_shape(leaf)), leaf.stored_dtype)
                    futures.append(self.array(leaf.key).write_rows(rows, zeros))
            for future in futures:
                future.result()
        self._ledger.add_keys(leaf.key for leaf in leaves)

    def _create_arrays(
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
            leaf = self._leaf(key)
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
            least = self.rows if self.committed.ring is not None else self._physical_rows
            shape_ok = (
                len(array.shape) == len(expected)
                and array.shape[0] >= least
                and all(
                    want is None or want == got
                    for want, got in zip(expected[1:], array.shape[1:], strict=False)
                )
            )
            if not shape_ok or array.dtype != np.dtype(leaf.stored_dtype):
                want = (self._physical_rows, *expected[1:])
                raise StoreCorruptedError(
                    f"store {self.url!r}: array {leaf.path!r} has shape "
                    f"{array.shape} and dtype {array.dtype}, expected {want} (at least as "
                    f"many rows) and {leaf.stored_dtype}",
                )
            self._arrays[key] = array
        return array

    # --- writing ---------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(
                f"store {self.url!r} was opened read-only; open it with "
                "read_only=False (one writer per store) to write",
            )
        if self.closed:
            raise ValueError(f"store {self.url!r} is closed")
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
        self._check_writable()
        assert self._buffer is not None
        if self._archive and self._extended.overlaps(rows):
            # Rows extended since the last commit, written over: into the history first, as
            # they were extended.
            self.flush()
        self.version += 1
        if cursor is not None:
            self.cursor = cursor
        if self.sharing is not None:
            self._write_shared(rows, values)
            return
        if cursor is not None and self._archive:
            self._extended.add(rows, cursor, self.rows)
        if self._retries:
            # Failed writes waiting to be written again must not land over these newer rows.
            self._retries = _without_cells(self._retries, rows, values.keys())
        values, zeros = self._zeros_where_unwritten(rows, values)
        self._update_mirror(rows, values)
        if values.keys() == self._leaves.keys():
            writes = self._stage_rows(rows, values, sequential=cursor is not None)
        else:
            # Rows waiting in RAM take the new values there; the others are written now.
            in_ram = self._buffer.patch(rows, values)
            elsewhere = np.flatnonzero(~in_ram)
            writes = zeros
            if elsewhere.size:
                picked = torch.from_numpy(elsewhere)
                writes.append((rows[elsewhere], {k: v[picked] for k, v in values.items()}))
        if writes:
            self._write_or_keep(writes)
            if values.keys() == self._leaves.keys():
                # (Writes of some keys wait for the next commit: a writer that writes a
                # buffer column by column, as TorchRL's checkpointers do, moves each block
                # once, not once per key.)
                self._commit()

    @_serialized
    def append(self, values: Mapping[Key, torch.Tensor], count: int) -> np.ndarray:
        """A shared store's extend: write ``count`` whole rows into this writer's slots,
        then commit them at the cursor; returns the positions they got."""
        self._check_writable()
        assert self.sharing is not None
        self.version += 1
        physical = self.sharing.room(count)
        values = self._whole_rows(physical, values)
        self._write_rows([(physical, values)], physical=True)
        positions = self.sharing.commit_rows(physical)
        if count > self.rows:  # a ring's worth at most: the last rows
            values = {key: value[count - self.rows :] for key, value in values.items()}
            self._update_mirror(positions[count - self.rows :], values)
        else:
            self._update_mirror(positions, values)
        return positions

    def _write_shared(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> None:
        """A shared writer's write to given positions (``rows``, sorted and unique): new
        rows in its slots, which the commit maps those positions to; keys left out keep
        their values (read first). The length stays, as in TorchRL's storages."""
        assert self.sharing is not None
        missing = [key for key in self._leaves if key not in values]
        given = values
        for _ in range(_SHARED_WRITE_ATTEMPTS):
            over = None
            if missing and rows.size:
                values = {**given, **self.read(rows, missing, unwritten_as_zeros=True)}
                over = self.committed.physical(rows)  # where what was read lies
            physical = self.sharing.room(rows.size)
            self._write_rows([(physical, values)], physical=True)
            try:
                self.sharing.commit_rows(physical, rows, over=over)
            except RowsMovedError:
                continue  # another writer wrote some of those rows since: read them again
            self._update_mirror(rows, values)
            return
        raise LockedError(
            f"store {self.url!r}: rows {preview_rows(rows)} kept being written by other "
            f"writers while this one wrote some of their keys ({_SHARED_WRITE_ATTEMPTS} "
            "attempts); write whole rows, or write them again",
            holder={},
        )

    def _whole_rows(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]
    ) -> Mapping[Key, torch.Tensor]:
        """``values`` with zeros for the keys an extend left out (the rows it goes to are
        new ones, as in a new TorchRL storage: what they held belongs to evicted rows)."""
        missing = [key for key in self._leaves if key not in values]
        if not missing:
            return values
        out = dict(values)
        for key in missing:
            leaf = self._leaf(key)
            shape = (rows.size, *self.element_shape(leaf))
            out[key] = torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])
        return out

    def _zeros_where_unwritten(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]
    ) -> tuple[Mapping[Key, torch.Tensor], list[Write]]:
        """A write that leaves keys out: cells of those keys that were never written (rows
        past the committed ones) get zeros, as in TorchRL's storages, whose unwritten cells
        read as zeros; cells that hold data keep it.

        Returns the values to write (whole rows when every left-out cell was empty) and,
        otherwise, writes of zeros into the empty cells alone.
        """
        missing = [key for key in self._leaves if key not in values]
        if not missing or not rows.size:
            return values, []
        assert self._buffer is not None
        assert self._ledger is not None
        hit, _ = self._buffer.staged_rows(rows)
        # Past the committed rows: cells never written. (Inside them, a cell that cannot be
        # read was lost to a crash or a failed write: it stays unreadable, not zero.)
        fresh = rows >= self.committed.length
        empty = {key: ~(self._ledger.readable(rows, key) | hit) & fresh for key in missing}
        if all(cells.all() for cells in empty.values()):
            return self._whole_rows(rows, values), []
        zeros: list[Write] = []
        for key, cells in empty.items():
            if cells.any():
                leaf = self._leaf(key)
                shape = (int(cells.sum()), *self.element_shape(leaf))
                zeros.append(
                    (rows[cells], {key: torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])})
                )
        return values, zeros

    @property
    def _rows_reached(self) -> int:
        """Rows that may hold data: those written or committed (a shared store's whole
        ring, which other writers fill)."""
        if self.sharing is not None:
            return self.rows
        return max(self._rows_written, self.committed.length)

    def _update_mirror(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> None:
        first = self._rows_reached == 0
        if rows.size and int(rows.max()) >= self._rows_written:
            self._rows_written = int(rows.max()) + 1
            if self._mirrorable:
                self._choose_mirror()
        if first:
            # A new store: mirrors start with its first rows (none to read back later).
            for key in self._mirrorable - self._mirror.keys():
                self._mirror_of(key)
        for key in self._mirror.keys() & values.keys():
            _put_rows(self._mirror_covering(key, self._rows_written), rows, values[key])

    def mirror_changed(self, rows: np.ndarray) -> None:
        """Rows (a mask) that other writers changed: read their small leaves again."""
        if not self._mirror:
            return
        assert self._ledger is not None
        picked = np.flatnonzero(self._ledger.fit(rows) & self._ledger.published)
        if picked.size > self.rows // 4:
            self._mirror.clear()  # read whole again when next needed
            return
        if picked.size:
            values = self._read_disk(dict.fromkeys(self._mirror, picked))
            self._update_mirror(picked, values)

    def _write_or_keep(self, writes: Sequence[Write]) -> None:
        """Write to disk; what a failed write held is kept for the next flush to retry."""
        try:
            self._write_to_disk(writes)
        except BaseException:
            self._keep_for_retry(writes)
            raise

    def _stage_rows(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, sequential: bool
    ) -> list[Write]:
        """Stage whole rows in RAM by block; returns what must be written now.

        ``sequential``: the rows are a writer's extend, ending just before :attr:`cursor`.
        Only the block it ends in may then stay in RAM: every other staged block (one it
        went past, partly on disk already after a flush in its middle, or the block an
        earlier extend ended in) is written now, so that the rows a commit publishes
        always run up to the cursor it records, with no row left behind in RAM.
        """
        assert self._buffer is not None
        if self._too_long_to_stage(values):
            # Written now, after the rows of their blocks that wait in RAM (older values).
            waiting = {int(i) for i in np.unique(rows // self._buffer.block_rows)}
            older = [block for block in self._buffer if block.index in waiting]
            if older:
                self._write_or_keep([_block_rows(self._buffer.pop(b.index)) for b in older])
            return [(rows, values)]
        direct, full = self._buffer.stage(rows, values)
        if sequential and rows.size:
            block_rows = self._buffer.block_rows
            last = (self.cursor - 1) % self._buffer.rows // block_rows
            passed = {block.index for block in self._buffer} - {last}
            full = sorted(set(full) | passed)
        blocks = [self._buffer.pop(index) for index in full]
        if len(self._buffer) > _MAX_STAGED_BLOCKS:
            # Too many partially filled blocks: write the oldest ones as they are.
            oldest = [block.index for block in self._buffer][
                : len(self._buffer) - _MAX_STAGED_BLOCKS
            ]
            blocks.extend(self._buffer.pop(index) for index in oldest)
        writes: list[Write] = [_block_rows(block) for block in blocks]
        # Slices of the caller's tensors: views, not copies.
        writes.extend(
            (rows[start:stop], {key: value[start:stop] for key, value in values.items()})
            for start, stop in direct
        )
        return writes

    def _too_long_to_stage(self, values: Mapping[Key, torch.Tensor]) -> bool:
        assert self._buffer is not None
        block_rows = self._buffer.block_rows
        return any(
            self._leaf(key).ragged and block_rows * value[:1].nbytes > STAGED_RAGGED_BYTES
            for key, value in values.items()
        )

    def _keep_for_retry(self, writes: Sequence[Write]) -> None:
        """Keep the rows of failed writes, so that the next flush writes them again: whole
        rows wait in RAM (and are served from there), writes of some keys are queued."""
        assert self._buffer is not None
        for rows, values in writes:
            if values.keys() == self._leaves.keys():
                self._buffer.stage(rows, values, force=True)
            else:
                self._retries.append((rows, values))

    def _write_to_disk(self, writes: Sequence[Write]) -> None:
        """Write rows. A block whose rows hold data (committed, or written since) is
        written by copy-on-write: into a free slot, with the rows of the block this write
        leaves alone; the next commit switches the block to it, and until then the block's
        old slot stays as it was (a crash or a failed write leaves it whole). Rows never
        written go straight into their block's slot."""
        assert self._ledger is not None
        assert self._slots is not None
        self.check_hold()
        self._ledger.grow(max((int(rows.max()) + 1 for rows, _ in writes if rows.size), default=0))
        touched = self._ledger.mask()
        for rows, _ in writes:
            touched[rows] = True
        keys = {key for _, values in writes for key in values}
        was_intact = self._ledger.intact & touched
        moved, before, copies, in_place = self._copy_on_write(writes, touched)
        # Rows rewritten in slots no record refers to (moved since the last commit): not
        # whole while the write runs (a failed write leaves them to be written again).
        self._ledger.start_write(in_place)
        try:
            self._write_rows([*copies, *writes])
        except BaseException:
            self._block_map.assign(moved, before)  # the blocks' rows are where they were
            raise
        self._ledger.finish_write(touched, was_intact, keys)

    def _copy_on_write(
        self, writes: Sequence[Write], touched: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[Write], np.ndarray]:
        """Move the blocks whose rows ``writes`` writes over to free slots, but those that
        are in a slot no record refers to already (moved since the last commit).

        Returns the blocks moved, the slots they were in, the writes that copy the rows of
        those blocks that ``writes`` leaves alone (of each key: the rows holding data of
        it) into their new slots, and the rows (a mask) written over where they are.
        """
        ledger = self._ledger
        assert ledger is not None
        block_map = self._block_map
        none = np.empty(0, dtype=np.int64)
        if (ledger.published & touched).any():
            self._rewrote_published = True
        block_rows = block_map.block_rows
        live = (ledger.intact | ledger.published) & touched
        touched_blocks = np.unique(np.flatnonzero(touched) // block_rows)
        slots = block_map.slots[touched_blocks]
        # A slot a kept save refers to is never written (its rows past this writer's length
        # are that save's); one the last commit refers to, where the write goes over rows
        # that hold data. A slot no record refers to is written in place.
        pinned = np.isin(slots, np.concatenate([none, *(m.slots for m in self._pinned_slots())]))
        history = self.committed.history
        if history is not None:  # nor one holding an archive's rows (after an empty, a load)
            pinned |= history.used_slots(block_rows, block_map.capacity)[slots]
        committed = np.isin(slots, self._committed_slots().slots)
        has_live = np.isin(touched_blocks, np.flatnonzero(live) // block_rows)
        # A slot another writer may still write (one that held the store before): moved.
        foreign = slots < self._first_own_slot()
        move = pinned | (committed & has_live) | foreign
        in_place = ledger.mask()
        for block in touched_blocks[has_live & ~pinned & ~committed & ~foreign].tolist():
            in_place[block * block_rows : (block + 1) * block_rows] = True
        in_place &= live
        blocks = touched_blocks[move]
        if not blocks.size:
            return none, none, [], in_place
        fresh = self._free_slots(blocks.size)
        before = block_map.slots[blocks].copy()
        positions = (blocks[:, None] * block_rows + np.arange(block_rows)).ravel()
        positions = positions[positions < ledger.extent]
        copies: list[Write] = []
        # Arrays whose shards are the blocks: the block's objects are copied as stored, and
        # the write goes over them (it rewrites the inner chunks it touches, as in place).
        whole = [key for key in self._leaves if self.array(key).chunk_rows == block_rows]
        with self.writing("copying blocks to other slots"):
            for key in whole:
                for source, target in zip(before.tolist(), fresh.tolist(), strict=True):
                    self.array(key).copy_chunk(source, target)
        others = [key for key in self._leaves if key not in whole]
        for group in self._plain_then_ragged(others):
            requests = {}
            for key in group:
                written = [rows for rows, values in writes if key in values]
                keep = ledger.readable(positions, key)
                if written:
                    keep &= ~np.isin(positions, np.concatenate(written))
                if keep.any():
                    requests[key] = positions[keep]
            lengths = {
                key: self._read_disk({self._leaf(key).lengths_key: rows})[
                    self._leaf(key).lengths_key
                ].numpy()
                for key, rows in requests.items()
                if self._leaf(key).ragged
            }
            for key, values in self._read_disk(requests, lengths).items():
                copies.append((requests[key], {key: values}))
        block_map.assign(blocks, fresh)
        return blocks, before, copies, in_place

    def _used_slots(self) -> np.ndarray:
        """Boolean mask over the slots of a store of one writer: those the writer's map,
        the last commit, a kept save or an archive's history refers to."""
        slots = self._block_map
        used = np.zeros(slots.capacity, dtype=bool)
        for kept in (slots, self._committed_slots(), *self._pinned_slots()):
            used[kept.slots[kept.slots < slots.capacity]] = True
        if self.committed.history is not None:  # an archive's rows are never written over
            used |= self.committed.history.used_slots(slots.block_rows, slots.capacity)
        return used

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
        if self.sharing is not None:
            return self.sharing.collect()
        if not isinstance(self._slots, SlotMap) or self._slots.is_identity:
            return 0
        slots = self._block_map
        spare = SPARE_FACTOR * slots.blocks
        if slots.capacity <= spare:
            return 0  # the arrays never grew past the slots the ring reuses
        eligible = ~self._used_slots()
        # (Slots below this writer's own are never written again: they go too.)
        eligible[self._own_floor() : spare] = False
        known = self._known_empty
        if known is not None:
            size = slots.capacity
            known = np.concatenate([known, np.zeros(max(0, size - known.size), bool)])
            free = np.flatnonzero(eligible & ~known[:size]).tolist()
            if not free:
                return 0
            if len(free) > SPARE_FACTOR * slots.blocks:
                known = None  # many slots not known to be empty: listing them costs less
        whole = self.whole_block_arrays()
        emptied: set[int] = set()
        with self.writing("deleting slots no record refers to"):
            stale = {
                key: free
                if known is not None
                else sorted(
                    self.array(key).stored_chunks() & set(np.flatnonzero(eligible).tolist())
                )
                for key in whole
            }
            if any(slot >= self._own_floor() for chunks in stale.values() for slot in chunks):
                # A DELETE is a write: one that lands late must not reach a writer that took
                # the store over at a record that leaves it these slots.
                self._first_own_slot()
            for key, chunks in stale.items():
                self.array(key).drop_chunks(chunks)
                emptied.update(chunks)
        self._known_empty = eligible
        return len(emptied)

    def whole_block_arrays(self) -> list[Key]:
        """The leaves whose write chunks (objects) each hold one block: one object per
        slot, which a collection can delete (larger shards keep their slots' rows, written
        over when the slots are reused)."""
        block_rows = self.meta.block_rows or 1
        return [key for key in self._leaves if self.array(key).chunk_rows == block_rows]

    def stored_slots(self, keys: Sequence[Key]) -> set[int]:
        """The slots of which an array of ``keys`` holds an object (one listing each)."""
        return set().union(*(self.array(key).stored_chunks() for key in keys))

    def drop_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Delete the objects of ``slots`` in the arrays of ``keys`` (slots no record
        refers to, that no writer writes)."""
        with self.writing("deleting slots no record refers to"):
            for key in keys:
                self.array(key).drop_chunks(slots)

    @property
    def late_writes(self) -> bool:
        """Whether this writer holds the store by a hold that a stalled holder may outlive
        (a lease): slots another writer may be writing are then never written."""
        return self._lock is not None and self._lock.late_writes

    @property
    def _late_writes(self) -> bool:
        """A single writer whose slots are reserved in the record before it writes."""
        return self.late_writes and self.sharing is None

    def write_past(self, slot: int) -> None:
        """Write no slot below ``slot`` (a writer that held the store before may still
        write there: see ``_own_from``); 0: every slot is this writer's."""
        self._own_from = slot
        if slot == 0:
            self._known_empty = np.zeros(0, bool)  # nor left objects in slots it adds

    def _own_floor(self) -> int:
        """The first slot this writer may write into: 0 unless a writer that held the
        store before it may still write (see ``_own_from``)."""
        if not self._late_writes:
            return 0
        if self._own_from is None:
            lease = self.committed.lease
            if lease is not None and not lease.held:
                self._own_from = lease.floor  # its writer closed: nothing of it lands late
            else:
                self._own_from = self._committed_slots().capacity
        return self._own_from

    def _first_own_slot(self) -> int:
        """:meth:`_own_floor`, recorded as held before this writer's first write: a writer
        that takes the store over from this one (were it to stall) starts past them."""
        own = self._own_floor()
        if self._late_writes and not self._holding:
            self._lease = LeaseFloor(floor=own, held=True, avoid=self._avoid())
            self._publish(self.committed, rows=False)
            self._holding = True
        return own

    def _release_slots(self) -> None:
        """After this writer's last write (a clean close): the next writer on the lease
        takes its slots again, from the same floor."""
        if not self._holding:
            return
        self._lease = LeaseFloor(floor=self._own_floor(), held=False, avoid=self._avoid())
        self._publish(self.committed, rows=False)
        self._holding = False

    def _avoid(self) -> tuple[int, ...]:
        return tuple(sorted(self._avoided_saves))

    def _free_slots(self, count: int) -> np.ndarray:
        """``count`` slots of this writer that neither the last commit nor the writer's
        map refers to; the arrays grow (their metadata only) when there are not enough."""
        slots = self._block_map
        own = self._own_floor()
        free = np.flatnonzero(~self._used_slots())
        free = free[free >= own]
        if free.size >= count:
            chosen = free[:count]
            if self._known_empty is not None:  # written from now on
                self._known_empty[chosen[chosen < self._known_empty.size]] = False
            reserved = self._committed_slots()
            if self._late_writes and chosen.size and int(chosen.max()) >= reserved.capacity:
                # Reserved before anything is written there (also when the arrays grew for
                # them before and that reservation failed): a writer that took the store
                # over from this one takes its slots past these (and this one's late
                # writes, were it stalled, land in slots no one else writes).
                reserved = reserved.with_capacity(slots.capacity)
                self._publish(dataclasses.replace(self.committed, slots=reserved), rows=False)
            return chosen
        # Metadata only (chunks are made as they are written): room for a whole ring more,
        # so that kept saves do not make every write grow the arrays.
        # (Past this writer's own first slot at once: it may lie far past the record's.)
        capacity = max(
            SPARE_FACTOR * slots.blocks, slots.capacity + max(count, slots.blocks), own + count
        )
        if capacity > max_slots(slots.blocks):
            capacity = max_slots(slots.blocks)
            if capacity - max(own, slots.capacity) < count:
                raise SlotsExhaustedError(
                    f"store {self.url!r}: its arrays hold {slots.capacity} slots of "
                    f"{slots.block_rows} rows, as many as a record may name (each writer that "
                    "took the store over on S3 reserved slots of its own); nothing was written. "
                    "Save the buffer into a new store (zarr_rb.save(rb, new_path)) and write there",
                )
        if self.meta.format < FORMAT_VERSION:
            # Readers that know no slot map refuse the store (FormatVersionError) from
            # before its arrays grow, rather than take them for damaged.
            self.meta = dataclasses.replace(self.meta, format=FORMAT_VERSION)
            self._publish(self.committed, rows=False)
        with self.writing("adding slots to the arrays"):
            for key in self._leaves:
                self.array(key).grow_rows(capacity * slots.block_rows)
        self._slots = slots.with_capacity(capacity)
        known = self._known_empty
        if known is not None:  # slots up to the old capacity may hold objects, new ones not
            self._known_empty = np.concatenate(
                [
                    known,
                    np.zeros(slots.capacity - known.size, bool),
                    np.ones(capacity - slots.capacity, bool),
                ]
            )
        return self._free_slots(count)  # reserved there

    def _write_rows(self, writes: Sequence[Write], *, physical: bool = False) -> None:
        """Write rows to the slots the writer's map gives their blocks (``physical``: the
        rows are rows of the data arrays already: a shared writer's)."""
        assert self._slots is not None
        if physical:
            self.check_hold()  # (its slots were taken with room in the arrays: Sharing._take)
        with self.writing("writing rows"):
            futures = []
            try:
                for rows, values in writes:
                    at = rows if physical else self._slots.physical(rows)
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

    def ensure_capacity(self, slots: int) -> None:
        """Give the data arrays rows for ``slots`` slots (a shared store whose writers took
        more): their metadata only. Resizes only ever grow an array, so that writers
        growing it at once leave it at the largest size asked."""
        if self.schema is None:
            return
        rows = slots * (self.meta.block_rows or 1)
        with self.writing("adding slots to the arrays"):
            for key in self._leaves:
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
            reason = str(err).split(" [source locations=")[0]
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
        self._check_writable()
        assert self._ledger is not None
        self.version += 1
        if self.sharing is not None:
            assert seen.ring is not None
            return self.sharing.withdraw(positions, physical, seen.ring)
        inside = positions < self.committed.length
        positions, physical = positions[inside], physical[inside]
        still = positions[self.committed.physical(positions) == physical]
        rows = np.zeros(max(self._ledger.extent, int(still.max(initial=-1)) + 1), dtype=bool)
        rows[still] = True
        rows = self._ledger.fit(rows)
        withdrawn = int((self._ledger.published & rows).sum())
        self._ledger.withdraw(rows)
        if withdrawn:
            self._publish_mask(
                self._ledger.published & ~rows, length=self.committed.length, rewrite=True
            )
        return withdrawn

    @_serialized
    def flush(self) -> None:
        """Write every row held in RAM and publish a commit that covers them."""
        if self.read_only or self.closed or self._buffer is None:
            return
        if self.fenced is not None:
            raise FencedError(str(self.fenced), holder=self.fenced.holder)
        if self.sharing is not None:
            self.sharing.refresh()  # nothing waits in RAM: every write was published
            return
        writes = [_block_rows(block) for block in self._buffer]
        self._buffer.clear()
        if writes:
            self._write_or_keep(writes)
        while self._retries:
            retry = self._retries[0]
            self._write_to_disk([retry])
            self._retries.pop(0)
        self._commit()

    @_serialized
    def discard(self) -> None:
        """Forget rows held in RAM (after ``empty``)."""
        self.version += 1
        if self._buffer is not None:
            self._buffer.clear()
        self._mirror.clear()
        self._retries.clear()

    def _staged_mask(self, rows: int) -> np.ndarray:
        """The rows waiting in RAM, as a mask over the first ``rows`` rows."""
        mask = np.zeros(rows, dtype=bool)
        assert self._buffer is not None
        for block in self._buffer:
            start = block.index * self._buffer.block_rows
            if start < rows:
                stop = min(start + block.length, rows)
                mask[start:stop] |= block.dirty[: stop - start]
        return mask

    def _commit(self) -> None:
        """Publish every row that is on disk and within the storage's length."""
        if self.schema is None:
            self._publish(dataclasses.replace(self.committed, length=0, holes=()))
            return
        assert self._ledger is not None
        # Rows waiting in RAM keep their previous, still intact, committed content.
        ledger = self._ledger
        readable = ledger.intact & ~(self._staged_mask(ledger.extent) & ~ledger.published)
        readable[self.length_rows :] = False
        # Rows past the committed ones are published as a prefix: rows after one that is
        # not on disk (a failed write kept in RAM) wait for it, rather than leave a hole.
        first_missing = _first_unset(readable, self.committed.length, self.length_rows)
        if first_missing is not None:
            readable[first_missing:] = False
        self._publish_mask(readable, rewrite=self._rewrote_published)

    def _committable_cursor(self, readable: np.ndarray) -> int:
        """The cursor a commit that declares the ``readable`` rows records: this writer's,
        unless rows it wrote since the last commit still wait in RAM or are not readable in
        it (withdrawn while they are rewritten); then the first of them in ring order, so
        that a writer reopened after a crash appends right after the rows the commit
        publishes (or, in a full ring, rewrites the oldest or withdrawn ones first), never
        over rows it published."""
        assert self._buffer is not None
        start, rows = self._written_from, self._buffer.rows
        span = (self.cursor - start) % rows
        first = span
        # The span in ring order: one or two runs of rows (never a mask over all of them).
        runs = [(start, min(start + span, rows))]
        if start + span > rows:
            runs.append((0, start + span - rows))
        offset = 0
        for lo, hi in runs:
            found = _first_unset(readable, lo, hi)
            if found is not None:
                first = offset + found - lo
                break
            offset += hi - lo
        for block in self._buffer:
            offsets = np.flatnonzero(block.dirty[: block.length])
            distance = (block.index * self._buffer.block_rows + offsets - start) % rows
            waiting = distance[distance < first]
            if waiting.size:
                first = int(waiting.min())
        return (start + first) % rows

    def _publish_mask(
        self, readable: np.ndarray, *, length: int | None = None, rewrite: bool = False
    ) -> None:
        """Publish a commit declaring the ``readable`` rows; ``rewrite``: rows the last
        commit declared readable are about to be written over (the epoch moves)."""
        assert self._ledger is not None
        commit = commit_from_mask(
            readable,
            generation=self.committed.generation + 1,
            cursor=self._committable_cursor(readable),
            length=length,
        )
        commit = dataclasses.replace(
            commit, epoch=self.committed.epoch + rewrite, slots=self._slots_record()
        )
        waiting = None
        if self._archive:
            # The rows extended since that this commit publishes: those on disk (the others
            # wait in RAM, for a later commit), in the order written.
            assert self._slots is not None
            assert self._buffer is not None
            pending = self._extended.pending()
            in_ram, _ = self._buffer.staged_rows(pending)
            done = ~in_ram & commit.readable(pending)
            waiting = pending[~done]
            history = self.committed.history or RunMap.empty()
            commit = dataclasses.replace(
                commit, history=history.appended(self._slots.physical(pending[done]))
            )
        if (
            commit.length == self.committed.length
            and commit.holes == self.committed.holes
            and commit.cursor == self.committed.cursor
            and commit.epoch == self.committed.epoch
            and commit.slots == self.committed.slots
            and commit.history == self.committed.history
            and self.schema == self._schema_on_disk
        ):
            return
        self._publish(commit)
        self._ledger.published_as(readable)
        self._rewrote_published = False
        if waiting is not None:
            self._extended.keep(waiting)

    def move_cursor(self, cursor: int) -> None:
        """Put the next sequential write at ``cursor`` (a buffer emptied or loaded), not
        after rows written (the next commit records it as it is)."""
        self.cursor = self._written_from = cursor
        self._extended.restart()

    def start_archive(self) -> None:
        """Keep every row extended from the next commit on (an archive's history); a store
        that keeps one already goes on."""
        self._check_writable()
        self._archive = True
        if self.sharing is not None:
            self.sharing.start_history()

    @_serialized
    def empty(self) -> None:
        """Drop every row, as TorchRL's ``rb.empty()`` does, and commit: nothing is
        readable, the cursor is back at 0, the epoch moves and the last save is dropped
        (its rows are gone)."""
        self._check_writable()
        self.discard()
        self.length = 0
        self.move_cursor(0)
        if not self.on_disk:
            return  # nothing was ever written
        if self.meta.saved is not None:
            # The rows of the last save are gone: so is the save.
            self.meta = dataclasses.replace(self.meta, saved=None)
        if self._ledger is None:
            commit = dataclasses.replace(
                self.committed,
                generation=self.committed.generation + 1,
                length=0,
                cursor=0,
                holes=(),
                epoch=self.committed.epoch + 1,
            )
            self._publish(commit)
            return
        self._publish_mask(self._ledger.mask(), rewrite=True)

    @_serialized
    def use_save(self, saved: Saved) -> None:
        """Serve the rows a pinned save kept (a save being loaded). A writer's next commit
        publishes them, which drops the rows committed since the save, as loading a save
        means; a reader reads them until :meth:`refresh` moves it to the last commit."""
        if not saved.pinned or self.schema is None:
            return
        assert self._ledger is not None
        assert self._slots is not None
        commit = saved.commit(self._elements_per_row(self.schema))
        if self.sharing is not None and not self.read_only:
            # A store with runs, which this writer holds alone (a save made before it became
            # shared): its positions go back to the rows the save kept, at once.
            self._check_writable()
            self.discard()
            self.sharing.rebase(saved, commit)
            return
        readable = commit.readable_mask(commit.length)
        # Rows withdrawn since the save (a repair found them damaged) in blocks still in the
        # slots the save has: the damage is the save's too.
        kept, head = self._slots_of(commit), self._committed_slots()
        for start, stop in self.committed.holes:
            lost = np.arange(start, min(stop, commit.length))
            blocks = lost // kept.block_rows
            shared = kept.slots[blocks] == head.slots[blocks]
            readable[lost[shared]] = False
        if self.read_only:
            self.pinned = saved
            self.use_slots(commit)
            self._ledger.published_as(readable)
            self.version += 1
            return
        self._check_writable()
        self.discard()
        kept = self._slots_of(commit)
        self._slots = SlotMap(
            kept.slots.copy(),
            block_rows=kept.block_rows,
            capacity=max(kept.capacity, self._block_map.capacity),
        )
        self._ledger.rebase(readable)
        # The rows committed since the save are dropped: the epoch moves (unless they are
        # the save's rows, as when a save is loaded right after it was made).
        self._rewrote_published = (commit.length, commit.holes, commit.slots) != (
            self.committed.length,
            self.committed.holes,
            self.committed.slots,
        )

    @_serialized
    def check_loadable(
        self, *, length: int, cursor: int, epoch: int, exact: bool, kept: Commit | None = None
    ) -> None:
        """Check that a save (or an in-place dump) made at ``length`` (elements), ``cursor``
        and ``epoch`` can be loaded on this store. ``exact``: its rows must be the ones it
        covered (TorchRL's ``rb.loads``); otherwise only rows this process wrote over count
        (``zarr_rb.load`` resumes a run whose rows moved on, see the README). ``kept``: the
        rows of a save the store kept (a save of format 3), whatever was written since.

        Raises:
            SaveOverwrittenError: rows the save covered were written over since.
            LiveBufferError: a storage of this process writes this store and went on since
                the save: loading would move it back and drop the rows it committed since.
        """
        where = f"store {self.url!r}"
        live = not self.read_only and self.users > 1
        if live:
            self.flush()  # the live buffer's rows in RAM are committed, so that they count
        rows = -(-length // self._elements_per_row(self.schema))
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
        if not pinned and self.sharing is None and since < self.committed.epoch:
            # Rows of the save written over in this process. (A process that reopens a store
            # after a crash resumes from the save with the rows as they are now, as the
            # README says: what it gets back are the rows that were committed.)
            raise SaveOverwrittenError(
                f"{where}: the rows its last save covered (length {length}) were written over "
                "since (the ring wrapped past them, rows were rewritten, or the buffer was "
                "emptied), so the saved state no longer matches them. Open the rows as they "
                "are with ZarrStorage(path=...), or keep saves that training cannot touch: "
                "zarr_rb.save(rb, other_path) writes an independent snapshot",
            )
        moved = kept is not None and (
            kept.slots != self.committed.slots
            or kept.holes != self.committed.holes
            or kept.runs != self.committed.runs
        )
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
            reason = str(err).split(" [source locations=")[0]
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
        named = self._named_save_slots()
        if self.sharing is not None:
            return self.sharing.new_save_slot(named)
        taken = named | self._avoided_saves
        return next(slot for slot in itertools.count() if slot not in taken)

    def take_save_slot(self) -> int:
        """:meth:`next_save_slot`, for a save about to write its state: a writer on a lease
        first records that it holds the store (a writer that takes it over from this one,
        were it to stall while saving, then keeps its saves out of that group)."""
        self._first_own_slot()
        return self.next_save_slot()

    def _named_save_slots(self) -> set[int]:
        saves = [self.meta.saved, *self.meta.versions.values()]
        return {saved.slot for saved in saves if saved is not None}

    @_serialized
    def publish_saved(self, saved: Saved, *, tag: str | None = None) -> None:
        """Flush, then publish the data commit together with a new save record, made at
        that commit: its epoch and, pinned, its rows (a shared writer's saves pin none:
        its rows are written in place). ``tag``: keep it as a version of that name too.
        State groups no record names any longer are deleted."""
        self.flush()
        commit = self.committed
        saved = dataclasses.replace(saved, epoch=commit.epoch, time=time.time())
        if self.sharing is not None:
            self.sharing.publish_saved(saved, tag=tag)
            named = {f"{STATE_GROUP}/{slot}" for slot in self._named_save_slots()}
            for group in self.sharing.state_groups_unnamed(named):
                self.engine.location.delete_prefix(group)
            self.collect()  # the slots the save it replaced kept
            return
        saved = dataclasses.replace(saved, pinned=True, slots=commit.slots, holes=commit.holes)
        if tag is not None:
            versions = {**self.meta.versions, tag: saved}
            self.meta = dataclasses.replace(self.meta, versions=versions)
        self._publish(commit, saved=saved)
        self._drop_unnamed_states()
        self.collect()  # the slots the save it replaced kept

    @_serialized
    def drop_version(self, tag: str) -> None:
        """Stop keeping the version ``tag`` (its rows and state, unless the last save
        names them too)."""
        self._check_writable()
        if self.sharing is not None:
            # Other writers publish too: the record changes by compare-and-swap only.
            dropped = self.sharing.drop_version(tag)
            if dropped.slot not in self._named_save_slots():
                self.engine.location.delete_prefix(dropped.group)
            self.collect()
            return
        versions = dict(self.meta.versions)
        del versions[tag]
        self.meta = dataclasses.replace(self.meta, versions=versions)
        self._publish(self.committed)
        self._drop_unnamed_states()
        self.collect()

    def _drop_unnamed_states(self) -> None:
        """Delete the state groups of saves that no record names (dropped versions, a save
        a crash interrupted before it was published), but the one the next save writes."""
        saves = (self.meta.saved, *self.meta.versions.values())
        named = {saved.group for saved in saves if saved is not None}
        named.add(f"{STATE_GROUP}/{self.next_save_slot()}")
        groups = {"/".join(key.split("/")[:2]) for key in self.engine.location.list(STATE_GROUP)}
        for group in sorted(groups - named):
            if group.count("/") == 1 and group.split("/")[1].isdigit():
                self.engine.location.delete_prefix(group)

    @_serialized
    def publish_meta(self) -> None:
        """Publish the store's settings and schema with the current commit."""
        self._publish(self.committed)

    def _slots_record(self) -> SlotMap | None:
        """The writer's map as a commit records it (``None``: the identity)."""
        if not isinstance(self._slots, SlotMap) or self._slots.is_identity:
            return None
        return self._slots.copy()

    def _publish(self, commit: Commit, *, saved: Saved | None = None, rows: bool = True) -> None:
        """Publish ``commit`` (with ``saved``, the new last save). ``rows=False``: a record
        published in the middle of a write (slots reserved or held) that commits no row of
        it: the rows written since the last commit still start where they did. (Such a
        record keeps the commit's generation: readers, which compare generations, see no
        change, and there is none for them.)"""
        self.ensure_on_disk()
        if self._archive and commit.history is None:
            commit = dataclasses.replace(commit, history=RunMap.empty())
        if self._late_writes:
            commit = dataclasses.replace(commit, lease=self._lease)
        meta = dataclasses.replace(self.meta, commit=commit)
        if saved is not None:
            meta = dataclasses.replace(meta, saved=saved)
        self.check_hold()
        with self.writing("publishing a commit"):
            self.store_pieces(meta)  # (a failed publish leaves them: garbage, see collect)
            self.engine.write_root_attributes({ATTRS_KEY: meta.to_json()})
            self.drop_pieces(self.meta, meta)
        self.meta = meta
        self.committed = commit
        if rows:
            self._written_from = commit.cursor if self.sharing is None else self.cursor
        self._schema_on_disk = meta.schema

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
        if self.sharing is not None:
            return self.sharing.read_checked(
                lambda: self._read_as_writer(
                    rows,
                    keys,
                    unwritten_as_zeros=unwritten_as_zeros,
                    unreadable_as_zeros=unreadable_as_zeros,
                ),
                rows,
            )
        return self._read_as_writer(
            rows,
            keys,
            unwritten_as_zeros=unwritten_as_zeros,
            unreadable_as_zeros=unreadable_as_zeros,
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
        assert self._buffer is not None
        assert self._ledger is not None
        hit, served = self._buffer.staged_rows(rows)
        wanted = self.with_lengths(keys)
        on_disk: dict[Key, np.ndarray] = {}
        for key in wanted:
            readable = self._ledger.readable(rows, key) | hit
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
        for group in self._plain_then_ragged(wanted):
            mirrored = [key for key in group if key in self._mirrorable]
            out.update({key: self._mirrored_rows(key, index) for key in mirrored})
            requests = {key: rows[on_disk[key]] for key in group if key not in mirrored}
            lengths = {
                key: out[self._leaf(key).lengths_key][torch.from_numpy(on_disk[key])].numpy()
                for key in requests
                if self._leaf(key).ragged
            }
            parts = self._read_disk(requests, lengths)
            everything = not hit.any() and all(on_disk[key].all() for key in requests)
            for key, part in parts.items():
                if everything:
                    out[key] = part
                    continue
                leaf = self._leaf(key)
                width = self._widest(leaf, out) if leaf.ragged else 0
                tensor = torch.zeros(
                    (rows.size, *self.element_shape(leaf, width)), dtype=part.dtype
                )
                _place(tensor, torch.from_numpy(np.flatnonzero(on_disk[key])), part)
                for block, positions in served:
                    offsets = rows[positions] - block.index * self._buffer.block_rows
                    staged = block.values[key][torch.from_numpy(offsets)]
                    _place(tensor, torch.from_numpy(positions), staged)
                out[key] = tensor
        return {key: out[key] for key in keys}

    def _mirror_of(self, key: Key) -> torch.Tensor:
        """The whole array of a leaf in RAM, read once, then kept up to date by writes."""
        mirror = self._mirror.get(key)
        if mirror is None:
            assert self._buffer is not None
            assert self._ledger is not None
            leaf = self._leaf(key)
            covered = self._mirror_rows(key, max(self._rows_reached, self._ledger.extent), 0)
            mirror = _zeros((covered, *self.element_shape(leaf)), TORCH_DTYPES[leaf.dtype])
            # Only cells known to be on disk: others were never written, or were lost to a
            # crash or a failed write, and are not readable until they are rewritten.
            every_row = np.arange(covered)
            on_disk = np.flatnonzero(self._ledger.readable(every_row, key))
            _put_rows(mirror, on_disk, self._read_disk({key: on_disk})[key])
            _, served = self._buffer.staged_rows(every_row)
            for block, positions in served:
                offsets = torch.from_numpy(positions - block.index * self._buffer.block_rows)
                mirror[torch.from_numpy(positions)] = block.values[key][offsets]
            self._mirror[key] = mirror
        return mirror

    def _mirror_covering(self, key: Key, rows: int) -> torch.Tensor:
        """The mirror of ``key``, grown to cover ``rows``."""
        mirror = self._mirror[key]
        if rows > mirror.shape[0]:
            grown = _zeros(
                (self._mirror_rows(key, rows, mirror.shape[0]), *mirror.shape[1:]), mirror.dtype
            )
            grown[: mirror.shape[0]] = mirror
            self._mirror[key] = mirror = grown
        return mirror

    def _mirror_rows(self, key: Key, rows: int, now: int) -> int:
        """Rows for a mirror of ``now`` rows to cover ``rows``: small leaves grow by doubling;
        large ones (mirrored within ``ram_bytes``) take every row they may reach at once,
        their pages taken from the OS only as rows are written."""
        if key in self._small_leaves:
            return min(self.rows, max(rows, min(2 * now, self._mirror_cap)))
        return min(self.rows, max(rows, self._mirror_cap))

    def _mirrored_rows(self, key: Key, index: torch.Tensor) -> torch.Tensor:
        """``index`` rows of the mirror of ``key`` (zeros for rows never written)."""
        mirror = self._mirror_of(key)
        # index_select: several times faster than mirror[index] on frames, on some CPUs.
        if not index.numel() or int(index.max()) < mirror.shape[0]:
            return mirror.index_select(0, index)
        out = mirror.new_zeros((index.numel(), *mirror.shape[1:]))
        inside = index < mirror.shape[0]
        out[inside] = mirror.index_select(0, index[inside])
        return out

    def _leaf(self, key: Key) -> LeafSpec:
        return self._leaves[key]

    def _read_disk(
        self,
        requests: Mapping[Key, np.ndarray],
        lengths: Mapping[Key, np.ndarray] | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Read ``requests[key]`` rows of each key; the reads of all keys run together.

        Ragged leaves need the lengths of the rows asked (``lengths[key]``): each row is read
        up to its length only, and rows come back padded with zeros to the longest.
        """
        futures: dict[Key, list[tuple[np.ndarray, int | None, Any]]] = {}
        assert self._slots is not None
        for key, positions in requests.items():
            if not positions.size:
                continue
            array = self.array(key)
            rows = self._slots.physical(positions)
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
            leaf = self._leaf(key)
            dtype = TORCH_DTYPES[leaf.dtype]
            if not leaf.ragged:
                parts = futures.get(key)
                if parts is None:
                    out[key] = torch.empty((0, *self.element_shape(leaf)), dtype=dtype)
                    continue
                try:
                    out[key] = from_numpy(parts[0][2].result(), dtype)
                except ValueError as err:
                    raise self.array(key).damage_error(self._slots.physical(rows), err) from None
                continue
            assert lengths is not None
            sizes = lengths[key]
            widest = int(sizes.max()) if sizes.size else 0
            padded = np.zeros((rows.size, *self.element_shape(leaf, widest)), leaf.stored_dtype)
            for picked, width, future in futures.get(key, []):
                try:
                    part = future.result()
                except ValueError as err:
                    physical = self._slots.physical(rows[picked])
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

    def _read_disk_all(self, requests: Mapping[Key, np.ndarray]) -> dict[Key, torch.Tensor]:
        """:meth:`_read_disk` of leaves and of the lengths of their ragged ones (the rows of
        a ragged leaf's lengths must be asked with it)."""
        plain = {key: rows for key, rows in requests.items() if not self._leaf(key).ragged}
        out = self._read_disk(plain)
        ragged = {key: rows for key, rows in requests.items() if self._leaf(key).ragged}
        if ragged:
            lengths = {key: out[self._leaf(key).lengths_key].numpy() for key in ragged}
            out.update(self._read_disk(ragged, lengths))
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
        assert self._ledger is not None
        n = self.length_rows
        ledger = self._ledger
        readable = ledger.first(ledger.published if self.read_only else ledger.intact, n)
        if readable.all():
            return np.empty(0, dtype=np.int64)
        unreadable = ~readable
        if not self.read_only:
            unreadable &= ~self._staged_mask(n)
        return np.flatnonzero(unreadable)

    @_serialized
    def refresh(self) -> Commit:
        """Re-read the commit record and move to it: its length, cursor and rows (readers,
        and the writers of a shared store); returns it."""
        if self.sharing is not None:
            self.sharing.refresh()
            return self.committed
        self.pinned = None  # to the last commit, from a save it was reading
        commit = reread_commit(self)
        self.length = commit.length * self._elements_per_row(self.schema)
        self.cursor = commit.cursor
        return commit

    # --- lifetime --------------------------------------------------------------------------

    # --- sharing -----------------------------------------------------------------------------

    @_serialized
    def become_shared(self) -> None:
        """Let other processes join this store as writers (it is handed to one): flush,
        trade the single writer's hold for a shared one, start sharing."""
        if self.sharing is not None or self.read_only:
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
                if self.sharing is not None:
                    self.sharing.leave()
                elif self._late_writes:
                    self.collect()  # the slots of the writers before, which it moved out of
                    self._release_slots()
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


def _first_unset(mask: np.ndarray, start: int, stop: int) -> int | None:
    """The first row of ``[start, stop)`` that ``mask`` leaves unset (rows past the mask are
    unset), or ``None``."""
    end = min(stop, mask.size)
    if start < end:
        unset = np.flatnonzero(~mask[start:end])
        if unset.size:
            return start + int(unset[0])
    past = max(start, mask.size)
    return past if past < stop else None


def _runs(mask: np.ndarray, step: int) -> Iterator[tuple[int, int]]:
    """The ``True`` runs of ``mask`` as ``(start, stop)``, cut at multiples of ``step``."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        for first in range(start, stop, step):
            yield first, min(stop, (first // step + 1) * step)


_MAPPED_BYTES = 2**20
"""Mirrors of at least this many bytes are private anonymous mappings of their own."""


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in memory the OS maps on first write: rows of a mirror not yet written take no
    RAM.

    Large ones are anonymous mappings rather than numpy's ``calloc``: numpy asks the kernel
    for huge pages (``MADV_HUGEPAGE``) on large arrays, and where the kernel's ``defrag``
    setting is ``madvise`` (a common default) each first write then waits for memory to be
    compacted into huge pages, which made filling a 0.5 GB mirror 2-5 times slower than
    copying the rows into ``torch.empty`` memory. A plain mapping gets huge pages only as the
    kernel's own settings give them, without that wait.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    if nbytes >= _MAPPED_BYTES and hasattr(mmap, "MAP_ANONYMOUS"):
        # Private: copy-on-write in forked children, as any other memory of the process.
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).reshape(shape)
    return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).reshape(shape)


def _put_rows(tensor: torch.Tensor, rows: np.ndarray, values: torch.Tensor) -> None:
    """``tensor[rows] = values`` (``rows`` unique): a copy for a run of rows."""
    if is_run(rows):
        tensor[int(rows[0]) : int(rows[0]) + rows.size] = values
    elif rows.size:
        tensor.index_copy_(0, torch.from_numpy(rows), values.to(tensor.dtype))


def _place(tensor: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``tensor[where] = values``; ragged rows (narrower or wider than ``tensor``) up to the
    width they share (beyond their lengths, rows are padding)."""
    if values.ndim > 1 and values.shape[1] != tensor.shape[1]:
        span = min(values.shape[1], tensor.shape[1])
        tensor[where, :span] = values[:, :span]
    else:
        tensor[where] = values


def _whole_chunks(tensor: torch.Tensor, array: RowArray) -> torch.Tensor:
    """Ragged rows padded with zeros to whole chunks along their length (no chunk is
    partly written, which would read it back first)."""
    width = tensor.shape[1]
    whole = -(-width // array.chunk_length) * array.chunk_length
    if whole == width:
        return tensor
    padded = tensor.new_zeros((tensor.shape[0], whole, *tensor.shape[2:]))
    padded[:, :width] = tensor
    return padded


def _without_cells(writes: Sequence[Write], rows: np.ndarray, keys: Iterable[Key]) -> list[Write]:
    """``writes`` without the cells of ``keys`` in ``rows`` (a newer write holds them)."""
    keys = set(keys)
    out: list[Write] = []
    for written, values in writes:
        kept = ~np.isin(written, rows)
        index = torch.from_numpy(np.flatnonzero(kept))
        covered = {key: value[index] for key, value in values.items() if key in keys}
        others = {key: value for key, value in values.items() if key not in keys}
        if covered and kept.any():
            out.append((written[kept], covered))
        if others:
            out.append((written, others))
    return out


def _block_rows(block: Block) -> Write:
    """The rows a block holds and their values (all of them when the block is full)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}
