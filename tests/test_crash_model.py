"""Model-based test of the ring across crashes: a TorchRL buffer on a ZarrStorage and its twin
on a LazyTensorStorage take the same extends, overwrites, flushes, saves, loads, dumps,
empties and reopens; a crash drops the ZarrStorage as a SIGKILL would, and the store it
reopens must be a state the buffer went through since its last durable point.

Every element of every row is a function of the version of the write that put it there
(:func:`rows_of`), so a row torn between two writes, a stale row or a row from another
position shows. After a crash, the reopened buffer must hold, for some number ``p`` of the
extended rows since the last flush (the ones committed):

* the length and writer cursor the twin had after those ``p`` rows;
* in every row of ``[0, len)``, the version the twin had there after those ``p`` rows, or a
  version an overwrite (``rb[i] = ...``) put there since (an overwrite may or may not have
  been committed), never anything else, and never a hole: every position is readable.

A row has two groups of keys, each with its own version: ``("next", "reward")`` and the
others (:data:`GROUPS`). An extend or an overwrite may leave one out, as TorchRL allows (the
rows keep their cells of it), so a row can hold versions of two writes; each group of each
row is checked against its own version (an extend of the ``p`` committed writes only the
groups it wrote).

The twin then becomes the reopened state, and the buffers go on. Stores have ``ndim=1`` or
``2``, blocks of 2 to 8 rows or the automatic layout, and sometimes rows too wide for a block
of the default layout and for one chunk (the layout's limits lowered to a test's scale);
the RAM tier on (``ram_bytes="auto"``) or off (``0``); writes of rows landing as they are
started, or only when waited for (a crash then finds a block written while the next rows
come not on disk at all).

Writes may fail (a full disk at a given write of row data, once or several times): the
failed extend, overwrite or flush raises a typed error and keeps what it wrote in RAM, so
every row still reads as the twin's, and a crash before the retry reopens at the last
commit as after any crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import (
    Crash,
    assert_identical,
    crash_at_row_write,
    fail_at_row_write,
    writes_held_back,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.engine import layout
from zarr_rb.engine import tensorstore as tensorstore_engine
from zarr_rb.errors import (
    LiveBufferError,
    NoSavedBufferError,
    RowsNotCommittedError,
    SaveOverwrittenError,
    StoreWriteError,
)
from zarr_rb.testing import simulate_crash

ROWS = 20
"""Rows (along the first dimension) of the ring."""


GROUPS = ("main", "reward")
"""The key groups of a row, each holding the version of the last write of it: ``reward``
(``("next", "reward")``) and ``main`` (every other key of :func:`rows_of`)."""

LEFT_OUT: dict[str | None, tuple[tuple[str, ...], tuple[str, ...]]] = {
    None: ((), GROUPS),
    "fixed": (("fixed",), GROUPS),  # a key every row shares: it changes no version
    "reward": (("next",), ("main",)),
    "main": (("step", "obs", "fixed"), ("reward",)),
}
"""What a write may leave out: the keys of :func:`rows_of` it leaves out, and the groups it
then writes."""

Versions = dict[str, list[int | None]]
"""Group -> the version of each row's cells of that group (``None``: never written)."""


def no_rows() -> Versions:
    return {group: [None] * ROWS for group in GROUPS}


def copied(versions: Versions) -> Versions:
    return {group: list(rows) for group, rows in versions.items()}


def rows_of(versions: torch.Tensor, envs: int, rewards: torch.Tensor | None = None) -> TensorDict:
    """Rows whose every element derives from the version of the write that made it: ``[n]``
    batches, or ``[envs, n]`` for a store of ``ndim=2`` (TorchRL extends along dim 1).
    ``("next", "reward")`` derives from ``rewards`` (by default ``versions``): the version
    of its own group, when the row's groups were written by different writes."""

    def spread(versions: torch.Tensor) -> torch.Tensor:
        v = versions.to(torch.int64)
        if envs > 1:
            v = v[None, :] * envs + torch.arange(envs)[:, None]  # [envs, n]
        return v

    v = spread(versions)
    r = v if rewards is None else spread(rewards)
    obs = (v[..., None, None, None] * 7 + torch.arange(4 * 16 * 16).view(4, 16, 16)) % 251
    return TensorDict(
        {
            "step": v,
            "obs": obs.to(torch.uint8),  # 1 KiB per element: a large, sharded leaf
            "next": {"reward": (r * 0.5).to(torch.float32)[..., None]},
            "fixed": torch.zeros_like(v, dtype=torch.int16),  # the same in every row
        },
        batch_size=v.shape,
    )


@dataclasses.dataclass
class Durable:
    """The twin's state at a point the store must keep: its rows' versions (of each group),
    length (rows) and writer cursor."""

    versions: Versions
    length: int
    cursor: int


class CrashMachine(RuleBasedStateMachine):
    @initialize(
        # (Most draws in blocks of a few rows, one env and narrow rows: the layouts where
        # blocks wait in RAM and are written while the next rows come.)
        block_rows=st.sampled_from([4, 2, 8, None]),
        envs=st.sampled_from([1, 1, 3]),
        wide_rows=st.sampled_from([False, False, True]),
        ram_bytes=st.sampled_from(["auto", 0]),
        held_back=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        block_rows: int | None,
        envs: int,
        wide_rows: bool,
        ram_bytes: int | str,
        held_back: bool,
    ) -> None:
        self.limits = contextlib.ExitStack()
        # Writes of rows land only when waited for: a crash finds the block written while
        # the next rows come not on disk at all (else it lands as it is started).
        self.held = self.limits.enter_context(writes_held_back()) if held_back else None
        if wide_rows:
            # Rows too wide for a block of the default layout and for one chunk, at a scale
            # a test can run: blocks of 1 row, each row cut into several chunks.
            self.limits.enter_context(mock.patch.object(layout, "_TARGET_SHARD_BYTES", 2048))
            for module in (layout, tensorstore_engine):
                self.limits.enter_context(mock.patch.object(module, "MAX_CHUNK_ELEMENTS", 512))
            block_rows = None
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-crash-model-"))
        self.path = self.dir / "rb.zarr"
        self.compression = Compression(block_rows=block_rows, chunk_rows=2 if block_rows else 1)
        self.envs = envs
        self.ndim = 1 if envs == 1 else 2
        self.ram_bytes = ram_bytes
        self.fault: tuple[int, int] | None = None  # (at, count): see _writes_may_fail
        self.zarr = self._buffer(
            ZarrStorage(
                ROWS * envs,
                self.path,
                ndim=self.ndim,
                compression=self.compression,
                ram_bytes=ram_bytes,
            )
        )
        self.twin = self._buffer(LazyTensorStorage(ROWS * envs, ndim=self.ndim))
        self.version = 0
        self.versions = no_rows()  # the twin's rows
        self.durable = Durable(no_rows(), 0, 0)
        # (row, version, groups written) extended since durable
        self.extended: list[tuple[int, int, tuple[str, ...]]] = []
        # (group, row) -> versions overwritten since
        self.overwritten: dict[tuple[str, int], list[int]] = {}
        self.saved: Durable | None = None
        self.dumped: Durable | None = None
        self.rewritten_since_save = False  # rows that held data written over since
        self.saved_gone = False  # the buffer was emptied since its save
        self.rewritten_since_dump = False

    def teardown(self) -> None:
        if hasattr(self, "zarr"):
            self.zarr.storage.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        if hasattr(self, "limits"):
            self.limits.close()

    def _reopened(self) -> ZarrStorage:
        # With its capacity: a store closed before its first write was never made.
        return ZarrStorage(ROWS * self.envs, self.path, ndim=self.ndim, ram_bytes=self.ram_bytes)

    @contextlib.contextmanager
    def _writes_may_fail(self) -> Iterator[list[StoreWriteError]]:
        """Inside, the writes of row data fail as :attr:`fault` says (then it is reset): the
        call raises a typed error (given in the list yielded), and keeps what it wrote in
        RAM for the next flush."""
        fault, self.fault = self.fault, None
        failed: list[StoreWriteError] = []
        if fault is None:
            yield failed
            return
        with fail_at_row_write(*fault):
            try:
                yield failed
            except StoreWriteError as error:
                failed.append(error)

    def _buffer(self, storage: Any) -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=storage, batch_size=4)

    @property
    def length(self) -> int:
        return len(self.twin) // self.envs

    @property
    def block_rows(self) -> int:
        """Rows of a block of the store (its unit of copy-on-write)."""
        return self.zarr.storage._store.meta.block_rows or 1

    @property
    def cursor(self) -> int:
        return int(self.twin._writer._cursor)

    def _mark_durable(self) -> None:
        self.durable = self._state()
        self.extended = []
        self.overwritten = {}

    def _state(self) -> Durable:
        return Durable(copied(self.versions), self.length, self.cursor)

    def _rewritten(self) -> None:
        self.rewritten_since_save = self.rewritten_since_dump = True

    # --- writes ------------------------------------------------------------------------

    @rule(n=st.integers(1, ROWS + 4))
    def extend(self, n: int, *, left_out: str | None = None) -> None:
        if self.envs > 1:
            n = max(n, 2)  # TorchRL's index of a one-step extend of [envs, 1] fails to broadcast
        versions = torch.arange(self.version + 1, self.version + 1 + n)
        self.version += n
        start = self.cursor
        first = self.zarr.storage.schema is None
        keys, groups = LEFT_OUT[left_out]
        with self._writes_may_fail() as failed:
            self.zarr.extend(rows_of(versions, self.envs).exclude(*keys))
        if failed and first:
            # Creating the store failed: nothing was written, nothing is kept (no array
            # holds the rows), and the writer stays where it was.
            assert "the rows of this write were not stored" in str(failed[0])
            assert len(self.zarr) == 0
            assert int(self.zarr._writer._cursor) == 0
            return
        # An extend longer than the ring repeats indices, and LazyTensorStorage writes them
        # with one index_put_, which leaves repeated indices undefined: a row can then mix
        # two of the extend's rows (seen: `step` of one, `obs` of the other). The twin takes
        # such an extend in two halves, each shorter than the ring. (It writes the keys given
        # alone, the rows keeping their other cells, as ZarrStorage must: the same rows.)
        halves = [versions] if n <= ROWS else [versions[: n // 2], versions[n // 2 :]]
        for half in halves:
            self.twin.extend(rows_of(half, self.envs).exclude(*keys))
        for i, version in enumerate(versions.tolist()):
            row = (start + i) % ROWS
            if self.versions["main"][row] is not None:
                self._rewritten()
            elif self.saved is not None and row // self.block_rows < -(
                -self.saved.length // self.block_rows
            ):
                # A block holding rows of the save, copied on write: its rows of the save
                # are the same, but the store's map cannot tell them from new ones.
                self.rewritten_since_save = True
            for group in groups:
                self.versions[group][row] = version
            self.extended.append((row, version, groups))

    @precondition(lambda self: self.envs == 1 and self.length == ROWS)
    @rule(
        n=st.integers(1, ROWS + 4),
        left_out=st.sampled_from(["reward", "main", "reward", "fixed"]),
        at=st.none() | st.integers(1, 3),
        back=st.none() | st.integers(1, 8),
        then=st.none() | st.integers(0, ROWS - 1),
        die=st.booleans(),
    )
    def extend_some_keys(
        self,
        n: int,
        left_out: str,
        at: int | None,
        back: int | None,
        then: int | None,
        die: bool,
    ) -> None:
        """An extend that leaves out keys the buffer holds, as TorchRL allows (the rows keep
        their cells of them): a group (see :data:`LEFT_OUT`), so that its rows hold versions
        of two writes, or ``fixed``, whose value every row shares. Its rows are written at
        once (the rows extended before them, waiting in RAM, with them); a failed one
        (``at``: a full disk at its ``at``-th write of row data) waits in RAM as a write of
        some keys (a patch). (Once the ring is full: every row it writes holds data.)

        Then, as the bugs of these paths needed: ``back``, one of its rows (``back`` rows
        before the cursor) is written over with every key (it waits in RAM, perhaps before
        its extended value landed); ``then``, the block of row ``then`` is written over
        whole, which writes it at once and commits while those rows wait; ``die``, the
        writer crashes, which shows what the commits declared."""
        if at is not None:
            self.fault = (at, 1)
        self.extend(n, left_out=left_out)
        if back is not None:
            self._overwrite([(self.cursor - min(back, n)) % ROWS], whole=True)
        if then is not None:
            self._overwrite(self._block_of(then), whole=True)
        if die:
            self.crash(load=False)

    @precondition(lambda self: self.envs == 1)
    @rule(part=st.integers(1, 7), then=st.integers(0, 3), die=st.booleans())
    def fill_the_block(self, part: int, then: int, die: bool) -> None:
        """Extend to the end of the block the cursor is in (from its start: by ``part`` of
        it first), then by ``then`` rows more: a block filled in RAM by extends is written
        while the next rows come, and the next extend commits while it is in flight (over
        rows already written, once the ring has wrapped: in a slot of its own). ``die``:
        the writer crashes then, the block perhaps still in flight."""
        block = self.block_rows
        if self.cursor % block == 0 and part < block:
            self.extend(part)
        self.extend(block - self.cursor % block)
        if then:
            self.extend(then)
        if die:
            self.crash(load=False)

    @precondition(lambda self: self.envs == 1)
    @rule(
        n=st.integers(2, ROWS + 4),
        at=st.integers(1, 3),
        back=st.integers(1, 8),
        die=st.booleans(),
        left_out=st.sampled_from([None, "reward", "main"]),
        over_left_out=st.sampled_from([None, None, "reward", "main"]),
        then=st.none() | st.integers(0, ROWS - 1),
        lap=st.booleans(),
    )
    def write_over_a_failed_extend(
        self,
        n: int,
        at: int,
        back: int,
        die: bool,
        left_out: str | None,
        over_left_out: str | None,
        then: int | None,
        lap: bool,
    ) -> None:
        """An extend of ``n`` rows fails (a full disk at its ``at``-th write of row data)
        and its rows wait in RAM; the user catches the error and writes over one of them
        (``back`` rows before the cursor), which fills its block: what is then written
        must not land before the extend's earlier rows. Once the ring is full, the extend
        may leave a group out (its rows then wait as patches, and the row written over
        is then alone in RAM), and the write over may leave a group out (else it writes
        every key). ``lap``: the write over is the next lap of the ring, an extend that
        ends at that row (where it waits in RAM). ``then``: the block of a row is written
        over whole, which writes it at once and commits, the failed rows perhaps still
        waiting. ``die``: the writer crashes then."""
        self.fault = (at, 1)
        some_keys = self.length == ROWS and self.envs == 1
        self.extend(n, left_out=left_out if some_keys else None)
        if lap and self.length:
            self.extend(ROWS - min(back, n) + 1, left_out=over_left_out if some_keys else None)
        elif self.length:
            self._overwrite(
                [(self.cursor - min(back, n)) % ROWS % self.length],
                whole=over_left_out is None,
                left_out=over_left_out,
            )
        if then is not None and self.length:
            self._overwrite(self._block_of(then % self.length), whole=True)
        if die:
            self.crash(load=False)

    @precondition(lambda self: self.length > 0)
    @rule(row=st.integers(0, ROWS - 1), die=st.booleans())
    def commit_with_rows_waiting(self, row: int, die: bool) -> None:
        """Every key of the rows of a block (``row``'s) written over: a full block is
        written at once and commits, while rows of other writes may wait in RAM (in
        blocks, or failed writes of some keys as patches); what it declares must be a
        state the buffer went through. ``die``: the writer crashes then, which shows it
        (a flush would write every row first)."""
        self._overwrite(self._block_of(row % self.length), whole=True)
        if die:
            self.crash(load=False)

    @precondition(lambda self: self.length > 0)
    @rule(
        data=st.data(),
        whole=st.booleans(),
        left_out=st.sampled_from([None, "reward", "main"]),
        block=st.booleans(),
    )
    def overwrite(
        self, data: st.DataObject, whole: bool, left_out: str | None, block: bool
    ) -> None:
        """``rb[rows] = ...`` (see :meth:`_overwrite`); ``block``: every row of the block of
        the first one, so that a write of every key fills it (it is written at once, and
        commits), where a few rows drawn at random mostly wait in RAM."""
        rows = data.draw(
            st.lists(st.integers(0, self.length - 1), min_size=1, max_size=4, unique=True)
        )
        self._overwrite(self._block_of(rows[0]) if block else rows, whole=whole, left_out=left_out)

    def _block_of(self, row: int) -> list[int]:
        """The rows of ``row``'s block that the buffer holds."""
        start = row - row % self.block_rows
        return list(range(start, min(start + self.block_rows, self.length)))

    def _overwrite(self, rows: list[int], *, whole: bool, left_out: str | None = None) -> None:
        """``rb[rows] = ...``; ``whole``: with every key the buffer's rows hold (TorchRL's
        ``index`` too), as a row read from the buffer and changed is written back; else
        without ``index``, which writes some keys of each row, and without the group
        ``left_out`` too (TorchRL's storages write the keys given alone)."""
        versions = torch.arange(self.version + 1, self.version + 1 + len(rows))
        self.version += len(rows)
        keys, groups = LEFT_OUT[None if whole else left_out]
        batch = rows_of(versions, self.envs).exclude(*keys)
        if whole and self.envs == 1:
            batch["index"] = torch.tensor(rows)
        for rb in (self.zarr, self.twin):
            # (With ndim=2, TorchRL writes rb[:, i] = rows key by key, into storage[:]; a
            # failure in the middle leaves the keys written before it, as on TorchRL's
            # storages: the fault waits for a write made in one call.)
            fails = rb is self.zarr and self.envs == 1
            with self._writes_may_fail() if fails else contextlib.nullcontext([]):
                if self.envs > 1:
                    rb[:, torch.tensor(rows)] = batch
                else:
                    rb[torch.tensor(rows)] = batch
        for row, version in zip(rows, versions.tolist(), strict=True):
            for group in groups:
                self.versions[group][row] = version
                self.overwritten.setdefault((group, row), []).append(version)
        self._rewritten()

    @rule()
    def flush(self) -> None:
        self.zarr.storage.flush()
        self._mark_durable()

    @rule(at=st.integers(1, 6), count=st.integers(1, 3))
    def next_write_fails(self, at: int, count: int) -> None:
        """The next extend or overwrite meets a full disk at its ``at``-th write of row
        data, for ``count`` writes: it raises a typed error (or succeeds, when it writes
        less), and every row reads as written; a later flush writes them."""
        self.fault = (at, count)

    @rule(at=st.integers(1, 3))
    def flush_that_fails(self, at: int) -> None:
        """A flush meets a full disk: it raises, nothing becomes durable that was not, and
        the rows it kept read as written."""
        self.fault = (at, 1)
        with self._writes_may_fail():
            self.zarr.storage.flush()
            self._mark_durable()

    @rule()
    def empty(self) -> None:
        for rb in (self.zarr, self.twin):
            rb.empty()
        self.versions = no_rows()
        self._mark_durable()
        self._rewritten()
        self.saved_gone = True

    @rule()
    def reopen(self) -> None:
        """A clean close and reopen: nothing moves, the writer goes on where it was."""
        self.zarr.storage.close()
        self.zarr = self._buffer(self._reopened())
        assert int(self.zarr._writer._cursor) == self.cursor
        self._mark_durable()

    # --- save, load, dumps, loads ------------------------------------------------------

    @rule()
    def save(self) -> None:
        zarr_rb.save(self.zarr)
        self._mark_durable()
        self.saved = self._state()
        self.rewritten_since_save = False
        self.saved_gone = False

    @precondition(lambda self: self.saved is not None)
    @rule()
    def load_beside_the_live_buffer(self) -> None:
        """``zarr_rb.load`` in the process that has the buffer open never changes it: it
        gives a buffer at the save when nothing moved since, a typed error otherwise."""
        if self.saved_gone:
            with pytest.raises(NoSavedBufferError):
                zarr_rb.load(self.path)
        elif (self.length, self.cursor) != (self.saved.length, self.saved.cursor):
            with pytest.raises(LiveBufferError):
                zarr_rb.load(self.path)
        else:
            try:
                loaded = zarr_rb.load(self.path)
            except LiveBufferError:
                assert self.rewritten_since_save  # it would move the live buffer's rows back
            else:
                assert len(loaded) == len(self.twin)
                self._check_same(loaded)
                loaded.storage.close()
        self._check_same(self.zarr)

    @rule()
    def dumps(self) -> None:
        self.zarr.dumps(self.path)
        self._mark_durable()
        self.dumped = self._state()
        self.rewritten_since_dump = False

    @precondition(lambda self: self.dumped is not None)
    @rule()
    def loads(self) -> None:
        """``rb.loads`` of the store's own dump: the dumped rows, as TorchRL's storages give
        them, or a typed error once they were written over."""
        dumped = self.dumped
        assert dumped is not None
        try:
            self.zarr.loads(self.path)
        except SaveOverwrittenError:
            assert self.rewritten_since_dump
            self._check_same(self.zarr)  # left as it was
            return
        assert len(self.zarr) == dumped.length * self.envs
        assert int(self.zarr._writer._cursor) == dumped.cursor
        stored = self._stored_versions(dumped.length)
        self._adopt(stored, dumped.length, dumped.cursor)
        assert self.versions == dumped.versions

    # --- crashes -------------------------------------------------------------------------

    @rule(load=st.booleans())
    def crash(self, load: bool) -> None:
        """The writer dies without flushing; the store reopens at its last commit (or is
        loaded from its last save)."""
        self._die()
        if load and self.saved is not None:
            self._load_after_crash()
            return
        self.zarr = self._buffer(self._reopened())
        self._check_reopened()

    @rule(n=st.integers(1, ROWS + 4), at=st.integers(1, 6))
    def crash_during_extend(self, n: int, at: int) -> None:
        """The writer dies at its ``at``-th write of row data during an extend (the rows
        written so far may or may not have been committed); the store reopens at its
        last commit, every position of ``[0, len)`` readable and whole."""
        if self.envs > 1:
            n = max(n, 2)
        versions = torch.arange(self.version + 1, self.version + 1 + n)
        self.version += n
        start = self.cursor
        with crash_at_row_write(at), contextlib.suppress(Crash):
            self.zarr.extend(rows_of(versions, self.envs))
        for i, version in enumerate(versions.tolist()):
            if self.versions["main"][(start + i) % ROWS] is not None:
                self._rewritten()
            self.extended.append(((start + i) % ROWS, version, GROUPS))
        self._die()
        self.zarr = self._buffer(self._reopened())
        self._check_reopened()

    def _die(self) -> None:
        if self.held is not None:
            self.held.drop()
        simulate_crash(self.zarr.storage)

    def _load_after_crash(self) -> None:
        """``zarr_rb.load`` after a crash restores the save: its length, writer cursor and
        rows."""
        saved = self.saved
        assert saved is not None
        if self.saved_gone:
            with pytest.raises(NoSavedBufferError):
                zarr_rb.load(self.path)
            self.zarr = self._buffer(self._reopened())
            self._check_reopened()
            return
        self.zarr = zarr_rb.load(self.path)
        self.rewritten_since_dump = True  # moved back to the save: the dump's rows may be gone
        assert len(self.zarr) == saved.length * self.envs
        assert int(self.zarr._writer._cursor) == saved.cursor
        # The store kept the saved rows, whatever was written over them since.
        stored = self._stored_versions(saved.length)
        for group in GROUPS:
            assert stored[group][: saved.length] == saved.versions[group][: saved.length]
        self._adopt(stored, saved.length, saved.cursor)

    def _check_reopened(self) -> None:
        durable = self.durable
        length = len(self.zarr) // self.envs
        cursor = int(self.zarr._writer._cursor)
        # Candidates: how many of the rows extended since the durable point were committed.
        fits = []
        for p in range(len(self.extended) + 1):
            if (durable.cursor + p) % ROWS != cursor:
                continue
            ends = (row + 1 for row, _, _ in self.extended[:p])
            if min(ROWS, max(durable.length, max(ends, default=0))) != length:
                continue
            # Each extend wrote its own groups alone: the others keep the version before.
            versions = copied(durable.versions)
            for row, version, groups in self.extended[:p]:
                for group in groups:
                    versions[group][row] = version
            fits.append(versions)
        assert fits, (
            f"reopened at length {length}, cursor {cursor}: no number of the "
            f"{len(self.extended)} rows extended since the last flush (at length "
            f"{durable.length}, cursor {durable.cursor}) gives that"
        )
        stored = self._stored_versions(length)
        failures = []
        for versions in fits:
            bad = [
                (group, row)
                for group in GROUPS
                for row in range(length)
                if stored[group][row] is not None
                and stored[group][row] != versions[group][row]
                and stored[group][row] not in self.overwritten.get((group, row), [])
            ]
            if not bad:
                break
            failures.append(bad)
        else:
            raise AssertionError(
                f"(group, row)s {failures} hold versions the buffer never committed: stored "
                f"{stored}, candidates {fits}"
            )
        self._adopt(stored, length, cursor)

    def _stored_versions(self, length: int) -> Versions:
        """The version of each group of each row of the reopened store (``None``: a hole),
        checked whole."""
        storage = self.zarr.storage
        holes = set(storage._store.unreadable_rows().tolist())
        assert not holes, f"holes {sorted(holes)} in [0, len): every position must be readable"
        out = no_rows()
        readable = [row for row in range(length) if row not in holes]
        if readable:
            got = storage.get(torch.tensor(readable))
            for i, row in enumerate(readable):
                version = int(got["step"][i].reshape(-1)[0]) // self.envs
                reward = int(got["next", "reward"][i].reshape(-1)[0] * 2) // self.envs
                assert_identical(
                    got[i].exclude("index"),
                    rows_of(torch.tensor([version]), self.envs, torch.tensor([reward]))[
                        (slice(None), 0) if self.envs > 1 else 0
                    ],
                )
                out["main"][row], out["reward"][row] = version, reward
        for row in holes:
            with pytest.raises(RowsNotCommittedError):
                storage.get(torch.tensor([row]))
        return out

    def _adopt(self, versions: Versions, length: int, cursor: int) -> None:
        """The twin becomes the reopened state."""
        self.twin = self._buffer(LazyTensorStorage(ROWS * self.envs, ndim=self.ndim))
        if length:
            # Holes read as zeros on the twin: never compared (samplers skip them).
            full = {g: torch.tensor([v or 0 for v in versions[g][:length]]) for g in GROUPS}
            self.twin.extend(rows_of(full["main"], self.envs, full["reward"]))
            self.twin._writer._cursor = cursor
        self.versions = {
            group: [v if row < length else None for row, v in enumerate(versions[group])]
            for group in GROUPS
        }
        self._mark_durable()

    # --- checks --------------------------------------------------------------------------

    def _check_same(self, rb: TensorDictReplayBuffer) -> None:
        assert len(rb) == len(self.twin)
        assert not rb.storage._store.unreadable_rows().size
        rows = list(range(self.length))
        if rows:
            index = torch.tensor(rows)
            assert_identical(
                rb.storage.get(index).exclude("index"),
                self.twin.storage.get(index).exclude("index"),
            )

    @invariant()
    def same_rows(self) -> None:
        if hasattr(self, "zarr"):
            self._check_same(self.zarr)
            assert int(self.zarr._writer._cursor) == self.cursor


CrashMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,  # the same sequences on every run; -m slow draws new ones
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCrashMachine = CrashMachine.TestCase


@pytest.mark.slow
def test_crash_machine_long(request):
    """The same machine, many more sequences, new ones on every run."""
    runner = CrashMachine.TestCase("runTest")
    runner.settings = settings(
        max_examples=400,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    runner.runTest()


def test_a_save_loads_beside_a_live_buffer_that_holds_its_rows_again(tmp_path):
    """Found by the long run: a buffer saved, extended, then rewound by ``rb.loads`` of a
    dump made before the extend holds what the save holds. Its store's map differs from
    the save's (the extend took new blocks), but not at any position the buffer holds:
    ``zarr_rb.load`` gives the save, where it raised LiveBufferError. A block holding rows
    of the save that was copied on write, or a row of the save written over, still
    refuses the load (the map cannot tell a copied row from a new one)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(ROWS, path, compression=Compression(block_rows=2, chunk_rows=2))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    try:
        rb.extend(rows_of(torch.arange(1, 5), 1))  # blocks 0 and 1, full
        zarr_rb.save(rb)
        rb.dumps(path)
        rb.extend(rows_of(torch.arange(5, 7), 1))  # block 2
        rb.loads(path)
        loaded = zarr_rb.load(path)
        assert len(loaded) == len(rb) == 4
        assert_identical(loaded[:], rb[:])
        loaded.storage.close()
        rb[torch.tensor([0])] = rows_of(torch.tensor([9]), 1)  # a row of the save, rewritten
        with pytest.raises(LiveBufferError):
            zarr_rb.load(path)
    finally:
        storage.close()
