"""Model-based test of rows no write reached, across flushes, crashes, saves and loads.

TorchRL grows ``len`` by the rows of every ``storage.set`` (with ``set_cursor=True``, its
default), whether they were held already or lie past the length: ``len`` then counts rows
that no call wrote. LazyTensorStorage reads whatever its memory holds there; ZarrStorage
calls them holes (reads raise ``RowsNotCommittedError``, samplers skip them) and its
commits declare them, so that every row written after them is committed as usual.

A buffer on a ZarrStorage and its twin on a LazyTensorStorage take the same extends, sets
at given rows (inside the length, past it, or the same rows twice), writes of rows in
place, writes that add a key, flushes, empties and reopens. After every step, both have
the same length, the holes are exactly the rows no call wrote since the buffer was
emptied, and every other row reads the same on both. A flush then a crash, or a clean
reopen, gives exactly the buffer as it was (its length, its holes, every other row and
the cursor), a save then a crash loads exactly the buffer saved, its writer included, and
a version (a tagged save) reads as it was saved whatever the buffer did since.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machines import replayed, run_long
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import zarr_rb
from zarr_rb import Compression, RowsNotCommittedError, ZarrStorage
from zarr_rb.testing import simulate_crash

ROWS = 12


def rows_of(versions: list[int], added: bool = False) -> TensorDict:
    """Rows whose every element derives from the version of the write that made them;
    ``added``: with the key added later (:data:`ADDED`), ten times the version."""
    step = torch.tensor(versions, dtype=torch.int64)
    rows = TensorDict(
        {"step": step, "obs": step.float()[:, None].expand(-1, 3).clone()}, [len(versions)]
    )
    if added:
        rows[ADDED] = step * 10
    return rows


ADDED = "added"
"""A key a write adds once rows are on disk: rows written without it read zeros there."""


def values_at(storage: Any, rows: list[int]) -> list[tuple[int, int]]:
    """The ``step`` and the added key (0 where the storage lacks it) of each of ``rows`` of
    ``storage``, checked whole."""
    if not rows:
        return []
    got = storage.get(torch.tensor(rows))
    assert torch.equal(got["obs"], got["step"].float()[:, None].expand(-1, 3)), "torn rows"
    added = got[ADDED].tolist() if ADDED in got.keys() else [0] * len(rows)  # noqa: SIM118
    return list(zip(got["step"].tolist(), added, strict=True))


class Snapshot:
    """What a buffer holds: its length, cursor (the store's), holes and other rows."""

    def __init__(self, rb: ReplayBuffer) -> None:
        storage = rb.storage
        self.length = len(storage)
        self.cursor = storage.cursor
        self.writer = int(rb._writer._cursor)
        self.holes = storage.unreadable_rows().tolist()
        self.readable = [row for row in range(self.length) if row not in self.holes]
        self.steps = values_at(storage, self.readable)

    def check(self, rb: ReplayBuffer, *, loaded: bool) -> None:
        """``rb`` holds what this snapshot saw; ``loaded``: by a load, which restores its
        cursor and its writer's too (a store reopened puts a cursor past the length, after
        rows set past it, back at the length, and starts its writer there)."""
        again = Snapshot(rb)
        assert (again.length, again.holes, again.steps) == (self.length, self.holes, self.steps)
        if loaded:
            assert (again.cursor, again.writer) == (self.cursor, self.writer)
        else:
            assert again.cursor == again.writer == min(self.cursor, self.length)
        for row in self.holes:
            try:
                rb.storage.get(torch.tensor([row]))
            except RowsNotCommittedError:
                continue
            raise AssertionError(f"hole {row} was read")


class HolesMachine(RuleBasedStateMachine):
    @initialize(
        block_rows=st.sampled_from([2, 4, None]),
        ram_bytes=st.sampled_from(["auto", 0]),
    )
    def setup(self, block_rows: int | None, ram_bytes: int | str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-holes-model-"))
        self.path = self.dir / "rb.zarr"
        self.ram_bytes = ram_bytes
        compression = Compression(block_rows=block_rows, chunk_rows=2 if block_rows else 1)
        self.zarr = ReplayBuffer(
            storage=ZarrStorage(ROWS, self.path, compression=compression, ram_bytes=ram_bytes),
            batch_size=4,
        )
        self.twin = ReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=4)
        self.version = 0
        self.written: set[int] = set()
        """Rows a call wrote since the buffer was emptied (the others may be holes)."""
        self.added = False
        """Whether the buffer holds the key :data:`ADDED` (every write then carries it)."""
        self.versions: dict[str, Snapshot] = {}
        """What each tagged save holds."""

    def teardown(self) -> None:
        if hasattr(self, "zarr"):
            self.zarr.storage.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _versions(self, n: int) -> list[int]:
        self.version += n
        return list(range(self.version - n + 1, self.version + 1))

    # --- writes ------------------------------------------------------------------------

    @rule(n=st.integers(1, ROWS + 2))
    def extend(self, n: int) -> None:
        start = int(self.twin._writer._cursor)
        rows = rows_of(self._versions(n), self.added)
        for rb in (self.zarr, self.twin):
            rb.extend(rows)
        self.written.update((start + i) % ROWS for i in range(n))

    @rule(rows=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=4, unique=True))
    def set_at(self, rows: list[int]) -> None:
        """``storage.set`` at given rows (held or not, past the length or not): TorchRL's
        ``len`` grows by their number (up to the capacity)."""
        if self.zarr.storage.schema is None and not self.written:
            rows = sorted(rows)  # (a first write at scattered rows: any order works)
        data = rows_of(self._versions(len(rows)), self.added)
        for rb in (self.zarr, self.twin):
            rb.storage.set(torch.tensor(rows), data)
        self.written.update(rows)

    @precondition(lambda self: not self.added and self.zarr.storage.schema is not None)
    @rule(rows=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=3, unique=True))
    def add_a_key(self, rows: list[int]) -> None:
        """``storage.set`` with a key the buffer does not hold: every row on disk or in
        RAM gets zeros in it, scattered rows included."""
        data = rows_of(self._versions(len(rows)), added=True)
        for rb in (self.zarr, self.twin):
            rb.storage.set(torch.tensor(rows), data)
        self.added = True
        self.written.update(rows)

    @precondition(lambda self: len(self.twin) > 0)
    @rule(data=st.data())
    def write_in_place(self, data: st.DataObject) -> None:
        """``rb[rows] = ...``: rows of the length, which stays."""
        rows = data.draw(
            st.lists(st.integers(0, len(self.twin) - 1), min_size=1, max_size=3, unique=True)
        )
        values = rows_of(self._versions(len(rows)), self.added)
        for rb in (self.zarr, self.twin):
            rb[torch.tensor(rows)] = values
        self.written.update(rows)

    @rule()
    def empty(self) -> None:
        for rb in (self.zarr, self.twin):
            rb.empty()
        self.written = set()

    @rule()
    def flush(self) -> None:
        self.zarr.storage.flush()

    # --- crashes, reopens, saves -------------------------------------------------------

    def _adopt(self, rb: ReplayBuffer) -> None:
        """The twin becomes what ``rb`` holds (its holes: zeros, never compared)."""
        self.zarr = rb
        seen = Snapshot(rb)
        self.twin = ReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=4)
        self.added = self._holds_added(rb)
        if seen.length:
            steps, added = [0] * seen.length, [0] * seen.length
            for row, (step, value) in zip(seen.readable, seen.steps, strict=True):
                steps[row], added[row] = step, value
            rows = rows_of(steps)
            if self.added:
                rows[ADDED] = torch.tensor(added)
            self.twin.extend(rows)
        self.twin._writer._cursor = int(rb._writer._cursor)
        self.written = set(seen.readable)

    @staticmethod
    def _holds_added(rb: ReplayBuffer) -> bool:
        schema = rb.storage.schema
        return schema is not None and any(leaf.key == (ADDED,) for leaf in schema.leaves)

    def _reopened(self) -> ReplayBuffer:
        storage = ZarrStorage(ROWS, self.path, ram_bytes=self.ram_bytes)
        return ReplayBuffer(storage=storage, batch_size=4)

    @rule(clean=st.booleans())
    def reopen(self, clean: bool) -> None:
        """A flush then a crash, or a close: the store reopens as the buffer was."""
        if self.zarr.storage.schema is None:
            return  # (no store was made)
        self.zarr.storage.flush()
        before = Snapshot(self.zarr)
        if clean:
            self.zarr.storage.close()
        else:
            simulate_crash(self.zarr.storage)
        reopened = self._reopened()
        before.check(reopened, loaded=False)
        self._adopt(reopened)

    @rule()
    def save_crash_load(self) -> None:
        """A save then a crash: the load gives the buffer saved, its writer included."""
        if self.zarr.storage.schema is None:
            return
        zarr_rb.save(self.zarr)
        before = Snapshot(self.zarr)
        simulate_crash(self.zarr.storage)
        loaded = zarr_rb.load(self.path)
        before.check(loaded, loaded=True)
        self._adopt(loaded)
        self.twin._writer._cursor = before.writer

    @rule()
    def save_a_version(self) -> None:
        """``zarr_rb.save(rb, tag=...)``: a version that keeps its rows whatever the buffer
        does after (empties, writes over them, holes in the blocks it shares)."""
        if self.zarr.storage.schema is None:
            return
        tag = f"v{len(self.versions)}"
        zarr_rb.save(self.zarr, tag=tag)
        self.versions[tag] = Snapshot(self.zarr)

    @precondition(lambda self: bool(self.versions))
    @rule(data=st.data())
    def read_a_version(self, data: st.DataObject) -> None:
        tag = data.draw(st.sampled_from(sorted(self.versions)))
        saved = self.versions[tag]
        loaded = zarr_rb.load(self.path, version=tag, read_only=True)
        try:
            again = Snapshot(loaded)
            assert (again.length, again.holes, again.steps) == (
                saved.length,
                saved.holes,
                saved.steps,
            ), f"version {tag}"
        finally:
            loaded.storage.close()

    # --- checks --------------------------------------------------------------------------

    @invariant()
    def same_rows(self) -> None:
        if not hasattr(self, "zarr"):
            return
        assert len(self.zarr) == len(self.twin)
        seen = Snapshot(self.zarr)
        # The holes are the rows no call wrote (since the buffer was emptied): every other
        # row reads what the twin holds.
        unwritten = set(range(seen.length)) - self.written
        assert set(seen.holes) == unwritten, f"holes {seen.holes}, rows written {self.written}"
        twin = values_at(self.twin.storage, seen.readable)
        for row, values, expected in zip(seen.readable, seen.steps, twin, strict=True):
            assert values == expected, f"row {row}: {values}, the twin's {expected}"


HolesMachine.TestCase.settings = replayed(40, 25)
TestHolesMachine = HolesMachine.TestCase


@pytest.mark.slow
def test_holes_machine_long() -> None:
    """The same machine, many more sequences, new ones on every run."""
    run_long(HolesMachine)
