"""Writes of rows to a store's data arrays: started (a write ``behind`` is waited for and
synced on a thread of its own), waited for, and made durable by the next commit; objects
created once (on S3) are written whole. :class:`~zarr_rb.core.arrays.StoreArrays` derives
from :class:`ArrayWrites`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import tensorstore as ts
import torch

from zarr_rb.core.disk_reads import RowsOwner, padded
from zarr_rb.core.dtypes import to_numpy
from zarr_rb.core.frame_plans import KnownFrames
from zarr_rb.core.write_patches import Write
from zarr_rb.engine import Engine, RowArray, once
from zarr_rb.engine.layout import Compression
from zarr_rb.util.keys import Key


class _Hold(Protocol):
    def check_hold(self) -> None: ...
    @property
    def creates_once(self) -> bool: ...


class _KnowsFrames(Protocol):
    def known_frames(self, key: Key, positions: np.ndarray) -> KnownFrames | None: ...
    def keep_lent_frames(self) -> None: ...


class ArraysOwner(RowsOwner, Protocol):
    """What the arrays use of their store (:class:`~zarr_rb.core.store.Store`)."""

    @property
    def engine(self) -> Engine: ...
    @property
    def compression(self) -> Compression: ...
    @property
    def physical_rows(self) -> int: ...
    @property
    def lifetime(self) -> _Hold: ...

    def writing(
        self, what: str, *, kept: bool = True
    ) -> contextlib.AbstractContextManager[None]: ...

    @property
    def ram(self) -> _KnowsFrames: ...


def least_rows(store: ArraysOwner) -> int:
    """The rows an array of ``store`` must have at least when it is opened: the store's
    physical rows, or its ring's rows for a shared store (whose writers grow its arrays
    after they took more slots: other writers may not have yet; reads and writes past them
    grow or reopen them)."""
    return store.rows if store.committed.ring is not None else store.physical_rows


@dataclasses.dataclass(eq=False)
class PendingWrite:
    """A write of rows started and not waited for (see :meth:`StoreArrays.start_rows`)."""

    futures: list[ts.WriteFutures]
    behind: bool
    """Whether commits made until it finishes do not depend on it (see
    :meth:`StoreArrays.start_rows`)."""
    written: list[tuple[RowArray, list[str]]]
    """The chunk objects each array writes: durable at the first commit after the write
    completes (a commit while it runs may sync them before they hold their data)."""
    landed: concurrent.futures.Future[list[ValueError]] | None = None
    """A write ``behind``: its wait and the sync of its objects, on a thread of its own (the
    errors of the write)."""
    lent: list[weakref.ref[np.ndarray]] = dataclasses.field(default_factory=list)
    """A write ``behind``: the arrays TensorStore writes without a copy (see
    :meth:`released`)."""

    def has_landed(self) -> bool:
        """Whether a write ``behind`` has finished (written and synced, or failed): waiting
        for it returns at once."""
        return self.landed is not None and self.landed.done()

    def released(self) -> bool:
        """Whether TensorStore holds none of the arrays it wrote without a copy: their
        memory may take other values. (TensorStore may keep them after the write; it lets
        go of them when it completes, as measured, and this checks it each time.)"""
        return all(ref() is None for ref in self.lent)


FramedWrite = tuple[np.ndarray, np.ndarray | None, Mapping[Key, torch.Tensor]]
"""A write of leaves stored as frames: rows of the arrays, the buffer's positions of them
(when known), and the values."""


class FrameWrites(Protocol):
    """The writes of the leaves stored as frames
    (:class:`~zarr_rb.core.frame_arrays.FrameArrays`)."""

    def keys(self) -> frozenset[Key]: ...
    def start_writes(
        self, writes: Sequence[FramedWrite], *, behind: bool
    ) -> list[tuple[RowArray, Any, list[str]]]: ...
    def create_writes(
        self, writes: Sequence[FramedWrite]
    ) -> list[tuple[RowArray, list[tuple[np.ndarray, np.ndarray]]]]: ...


class ArrayWrites:
    """The writes of :class:`~zarr_rb.core.arrays.StoreArrays` (see the module's docstring)."""

    store: ArraysOwner
    frames: FrameWrites
    _pending: list[PendingWrite]
    _landing: concurrent.futures.ThreadPoolExecutor | None

    def get(self, key: Key) -> RowArray:
        raise NotImplementedError

    def whole_block_keys(self) -> list[Key]:
        raise NotImplementedError

    def write_rows(
        self,
        writes: Sequence[Write],
        *,
        physical: bool = False,
        seeds: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Write rows to the slots the writer's map gives their blocks (``physical``: the
        rows are rows of the arrays already: a shared writer's). ``seeds``: when objects
        are created once, ``(slot, new slot)`` whose objects (of the arrays sharded by
        block) the new slot's start from, as stored."""
        store = self.store
        if physical:
            # (Its slots were taken with room in the arrays: Sharing._take.)
            store.lifetime.check_hold()
        if store.lifetime.creates_once:
            self._create_rows(writes, seeds, physical=physical)
            return
        assert not seeds
        self.finish(self.start_rows(writes, physical=physical))

    def start_rows(
        self, writes: Sequence[Write], *, physical: bool = False, behind: bool = False
    ) -> PendingWrite:
        """Start writing rows (as :meth:`write_rows`, to objects that may be written over)
        and return without waiting: :meth:`finish` waits. The values must not change until
        then. ``behind``: no commit made before it finishes depends on the objects it
        writes (they hold no row such a commit declares), and the values must never change
        (TensorStore writes them without a copy, and may keep them)."""
        store = self.store
        pending = PendingWrite([], behind, [])
        with store.writing("writing rows"):
            try:
                framed_writes: list[FramedWrite] = []
                for rows, values in writes:
                    at = rows if physical else store.physical(rows)
                    framed = self.frames.keys() & values.keys()
                    if framed:
                        given = {key: values[key] for key in framed}
                        framed_writes.append((at, None if physical else rows, given))
                    for key, tensor in values.items():
                        if key in framed:
                            continue
                        array = self.get(key)
                        if array.ragged:
                            tensor = _whole_chunks(tensor, array)
                            if not tensor.shape[1]:
                                continue  # empty rows: nothing to write
                            array.grow(tensor.shape[1])
                        source = to_numpy(tensor)
                        future, keys = array.start_write_rows(at, source, behind=behind)
                        if behind:
                            pending.lent.append(weakref.ref(source))
                        del source
                        pending.futures.append(future)
                        pending.written.append((array, keys))
                if framed_writes:
                    for array, future, keys in self.frames.start_writes(
                        framed_writes, behind=behind
                    ):
                        pending.futures.append(future)
                        pending.written.append((array, keys))
            except BaseException:
                self._wait(pending)  # what was started ends before the error is raised
                raise
        if behind:
            if self._landing is None:
                self._landing = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="zarr_rb-landing"
                )
            pending.landed = self._landing.submit(self._land, pending)
        self._pending.append(pending)
        return pending

    def finish(self, pending: PendingWrite, *, what: str = "writing rows") -> None:
        """Wait for a write :meth:`start_rows` started; raises the first of its errors."""
        self._pending.remove(pending)
        with self.store.writing(what):
            errors = self._wait(pending)
            if errors:
                raise errors[0]
        for array, keys in pending.written:
            # (Again: a commit while it ran may have synced them before they were whole.)
            array.mark_written(keys, behind=pending.behind)

    @classmethod
    def _land(cls, pending: PendingWrite) -> list[ValueError]:
        """Wait for a write and sync what it wrote (on the landing thread)."""
        errors = cls._wait_futures(pending)
        if not errors:
            RowArray.sync_objects(pending.written)
        return errors

    @classmethod
    def _wait(cls, pending: PendingWrite) -> list[ValueError]:
        """Wait for a write; returns its errors."""
        if pending.landed is not None:
            return pending.landed.result()
        return cls._wait_futures(pending)

    @staticmethod
    def _wait_futures(pending: PendingWrite) -> list[ValueError]:
        errors = []
        for future in pending.futures:
            try:
                future.result()
            except ValueError as err:
                errors.append(err)
        return errors

    def _create_rows(
        self, writes: Sequence[Write], seeds: Sequence[tuple[int, int]], *, physical: bool
    ) -> None:
        """:meth:`write_rows`, every object created once: the rows of each key together."""
        store = self.store
        seeded = self.whole_block_keys() if seeds else []
        by_key: dict[Key, list[tuple[np.ndarray, torch.Tensor]]] = {key: [] for key in seeded}
        framed = self.frames.keys()
        framed_writes: list[FramedWrite] = []
        for rows, values in writes:
            at = rows if physical else store.physical(rows)
            given = {key: values[key] for key in framed & values.keys()}
            if given:  # (copied by value into a moved block's slot, never seeded)
                framed_writes.append((at, None if physical else rows, given))
            for key, tensor in values.items():
                if key not in framed:
                    by_key.setdefault(key, []).append((at, tensor))
        with store.writing("writing rows"):
            started = []
            try:
                for key, pieces in by_key.items():
                    array = self.get(key)
                    width = None
                    if array.ragged and pieces:
                        pieces = [(at, _whole_chunks(tensor, array)) for at, tensor in pieces]
                        width = max(int(tensor.shape[1]) for _, tensor in pieces)
                        if not width and key not in seeded:
                            continue  # empty rows: nothing to write
                        array.grow(width)
                        pieces = [(at, padded(tensor, width)) for at, tensor in pieces]
                    writes_of_key = [(at, to_numpy(tensor)) for at, tensor in pieces if width != 0]
                    key_seeds = seeds if key in seeded else ()
                    # A shared writer's slots are mostly taken again once free: with the
                    # objects of the rows they held (deleted first, in one round).
                    creation = array.create_rows(
                        writes_of_key, width=width, seeds=key_seeds, clear=physical
                    )
                    started.append((array, creation))
                for array, cells_or_ids in self.frames.create_writes(framed_writes):
                    started.append((array, array.create_rows(cells_or_ids, clear=physical)))
            finally:
                # (Every key's requests in flight at once; those started are waited for.)
                once.finish_all([creation for _, creation in started])
            for array, creation in started:
                array.forget(creation)


def _whole_chunks(tensor: torch.Tensor, array: RowArray) -> torch.Tensor:
    """Ragged rows padded with zeros to whole chunks along their length (no chunk is
    partly written, which would read it back first)."""
    width = tensor.shape[1]
    return padded(tensor, -(-width // array.chunk_length) * array.chunk_length)
