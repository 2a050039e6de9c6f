"""Archive mode: a store written with ``archive=True`` keeps every row extended, after the
ring moved past it, and ``history=True`` reads them all, in the order committed.

The model test drives one writer through extends, overwrites, flushes, saves, loads,
empties, crashes (between writes and inside an extend) and reopens, and checks after every
step that the history a reader opens is exactly the first rows of everything extended (the
ones committed: all of them after a flush), every row whole. Shared writers append in the
order their extends commit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import Crash, crash_at_row_write
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machines import replayed
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, NoHistoryError, ZarrStorage
from zarr_rb.testing import forkserver_context, simulate_crash

SPAWN = forkserver_context()

ROWS = 12


def steps(values: torch.Tensor) -> TensorDict:
    """Rows whose every element derives from their step (a torn or stale row shows)."""
    v = values.to(torch.int64)
    obs = (v[:, None] * 7 + torch.arange(64)) % 251
    return TensorDict(
        {"step": v, "obs": obs.to(torch.uint8), "next": {"done": v % 5 == 4}}, [v.numel()]
    )


def history_of(path: Path) -> list[int]:
    """The steps of a store's history, each row checked whole."""
    if not (path / "zarr.json").exists():
        return []  # made at its first write
    reader = ZarrStorage(path=path, read_only=True, history=True)
    try:
        if not len(reader):
            return []
        rows = reader.get(torch.arange(len(reader)))
        expected = steps(rows["step"])
        for key in ("obs", ("next", "done")):
            assert torch.equal(rows[key], expected[key]), f"history rows torn at {key}"
        return rows["step"].tolist()
    finally:
        reader.close()


class ArchiveMachine(RuleBasedStateMachine):
    @initialize(block_rows=st.sampled_from([2, 4, 6]))
    def setup(self, block_rows: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-archive-"))
        self.path = self.dir / "rb.zarr"
        self.compression = Compression(block_rows=block_rows)
        self.rb = self._buffer(self._reopened(archive=True))
        self.step = 0
        self.extended: list[int] = []  # every step extended, in order
        self.durable = 0  # steps of ``extended`` the history must hold (a flush returned)
        self.saved = False

    def teardown(self) -> None:
        if hasattr(self, "rb"):
            self.rb.storage.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _reopened(self, *, archive: bool) -> ZarrStorage:
        # A store is made at its first write: one never made is made again, archiving.
        archive = archive or not (self.path / "zarr.json").exists()
        return ZarrStorage(ROWS, self.path, compression=self.compression, archive=archive)

    def _buffer(self, storage: ZarrStorage) -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=storage, batch_size=4)

    def _extend(self, n: int) -> None:
        values = torch.arange(self.step, self.step + n)
        self.step += n
        self.extended.extend(values.tolist())
        self.rb.extend(steps(values))

    @rule(n=st.integers(1, ROWS))
    def extend(self, n: int) -> None:
        self._extend(n)

    @precondition(lambda self: len(self.rb) > 0)
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        """An edit is not a new row: the history keeps the row as extended (committed
        first, when the edit reaches a row extended since the last commit)."""
        rows = data.draw(st.lists(st.integers(0, len(self.rb) - 1), min_size=1, max_size=3))
        rows = sorted(set(rows))
        self.rb[torch.tensor(rows)] = steps(torch.tensor(rows) + 10**6)

    @rule()
    def flush(self) -> None:
        self.rb.storage.flush()
        self.durable = len(self.extended)
        history = history_of(self.path)
        assert len(history) == len(self.extended)
        self._check(history)

    @rule()
    def save(self) -> None:
        zarr_rb.save(self.rb, progress=False)
        self.durable = len(self.extended)
        self.saved = True

    @precondition(lambda self: self.saved)
    @rule()
    def load(self) -> None:
        """Back to the save: the rows written since stay in the history."""
        self.rb.storage.close()
        self.rb = zarr_rb.load(self.path)
        self._settle()

    @rule()
    def empty(self) -> None:
        self.rb.empty()
        self.saved = False  # the save goes with the rows
        self._settle()

    @rule(archive=st.booleans())
    def crash(self, archive: bool) -> None:
        """Reopened with or without ``archive=True``: the store keeps archiving."""
        simulate_crash(self.rb.storage)
        self.rb = self._buffer(self._reopened(archive=archive))
        self._settle()

    @rule(n=st.integers(1, ROWS), at=st.integers(1, 4))
    def crash_during_extend(self, n: int, at: int) -> None:
        with crash_at_row_write(at), contextlib.suppress(Crash):
            self._extend(n)
        simulate_crash(self.rb.storage)
        self.rb = self._buffer(self._reopened(archive=False))
        self._settle()

    def _check(self, history: list[int]) -> None:
        """``history`` is the first rows extended, each as extended (edits are not)."""
        assert history == self.extended[: len(history)]

    def _settle(self) -> None:
        """Rows not committed are gone (a crash; an empty or a load drops rows in RAM)."""
        history = history_of(self.path)
        assert len(history) >= self.durable, "committed rows left the history"
        self._check(history)
        del self.extended[len(history) :]
        self.durable = len(history)

    @invariant()
    def history_is_a_prefix_of_the_rows_extended(self) -> None:
        if hasattr(self, "rb"):
            history = history_of(self.path)
            assert self.durable <= len(history) <= len(self.extended)
            self._check(history)


ArchiveMachine.TestCase.settings = replayed(25, 20)
TestArchiveMachine = ArchiveMachine.TestCase


def test_the_history_of_a_ring_turned_over_reads_every_row_and_episode(tmp_path):
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(50, path, archive=True))
    for start in range(0, 400, 37):
        rb.extend(steps(torch.arange(start, min(start + 37, 400))))
    rb.storage.close()
    assert history_of(path) == list(range(400))
    view = zarr_rb.open(path, history=True)
    assert len(view) == 400
    assert len(view.episodes) == 80  # done every 5th step, across the ring's 8 rounds
    assert view.episode(79)["step"].tolist() == list(range(395, 400))
    view.close()
    # The ring itself holds the last 50, as a LazyTensorStorage would.
    ring = ZarrStorage(path=path, read_only=True)
    assert sorted(ring.get(torch.arange(50))["step"].tolist()) == list(range(350, 400))
    ring.close()


def test_shared_writers_append_in_the_order_their_extends_commit(tmp_path):
    path = tmp_path / "rb.zarr"
    writers = [
        TensorDictReplayBuffer(storage=ZarrStorage(30, path, shared=True, archive=True))
        for _ in range(2)
    ]
    batches = []
    for i in range(12):
        batch = torch.arange(100 * i, 100 * i + 7 + i % 3)
        writers[i % 2].extend(steps(batch))
        batches.append(batch.tolist())
    for rb in writers:
        rb.storage.close()
    assert history_of(path) == [step for batch in batches for step in batch]


def test_reading_a_history_a_store_does_not_keep(tmp_path):
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, path))
    rb.extend(steps(torch.arange(4)))
    rb.storage.close()
    with pytest.raises(NoHistoryError, match="archive=True"):
        ZarrStorage(path=path, read_only=True, history=True)
    with pytest.raises(ValueError, match="read_only=True"):
        ZarrStorage(path=path, history=True)
    with pytest.raises(ValueError, match="history=True"):
        ZarrStorage(path=path, read_only=True, archive=True)
    # Archiving starts when asked, on a store that kept none: from the next commit.
    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=path, archive=True))
    rb.extend(steps(torch.arange(4, 9)))
    rb.storage.close()
    assert history_of(path) == [4, 5, 6, 7, 8]


def test_independent_writers_and_one_killed_lose_no_committed_row_of_the_history(where):
    """Three writer processes open an archive (``shared=True``: the store keeps archiving)
    and wrap its ring of 100 rows many times; one is SIGKILLed mid-way. The history holds
    every batch each writer committed, whole and in its order, and nothing else."""
    from shared_workers import WRITER_STRIDE, independent_writer, stamped, torn

    url, options = where
    rb = ZarrStorage(100, url, archive=True, storage_options=options)
    rb.set(torch.arange(10), stamped(9, 0, 10))
    rb.close()
    progress = [SPAWN.Queue() for _ in range(3)]
    writers = [
        SPAWN.Process(
            target=independent_writer,
            args=(url, w, 12, 25, options, progress[w], 0.02 if w == 2 else 0.0),
        )
        for w in range(3)
    ]
    for process in writers:
        process.start()
    pid = progress[2].get(timeout=60)[2]
    while progress[2].get(timeout=60)[2] < 4:  # the killed writer committed 5 batches or more
        pass
    os.kill(pid, signal.SIGKILL)
    for w in range(2):
        while progress[w].get(timeout=120)[0] != "done":
            pass
    for process in writers:
        process.join(60)
    reader = ZarrStorage(path=url, read_only=True, history=True, storage_options=options)
    rows = reader.get(torch.arange(len(reader)))
    reader.close()
    assert torn(rows) == 0
    stamps = rows["stamp"]
    assert stamps[:10].tolist() == list(range(9 * WRITER_STRIDE, 9 * WRITER_STRIDE + 10))
    for w in range(3):
        mine = (stamps[stamps // WRITER_STRIDE == w] % WRITER_STRIDE).tolist()
        if w < 2:
            assert mine == list(range(12 * 25))
        else:
            assert len(mine) >= 5 * 25
            assert mine == list(range(len(mine)))
            assert len(mine) % 25 == 0  # whole batches: a batch commits at once
    assert stamps.numel() == stamps.unique().numel()


def test_children_handed_an_archived_buffer_add_their_rows_to_its_history(tmp_path):
    from shared_workers import WRITER_STRIDE, extend_buffer, stamped

    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(64, path, archive=True), batch_size=8)
    rb.extend(stamped(9, 0, 10))  # before it is shared: one writer's commit
    children = [SPAWN.Process(target=extend_buffer, args=(rb, w, 6, 20)) for w in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0]
    rb.storage.close()
    stamps = torch.tensor(history_of_stamps(path))
    assert stamps.numel() == 10 + 2 * 6 * 20
    assert stamps[:10].tolist() == list(range(9 * WRITER_STRIDE, 9 * WRITER_STRIDE + 10))
    for w in range(2):
        assert (stamps[stamps // WRITER_STRIDE == w] % WRITER_STRIDE).tolist() == list(range(120))


def history_of_stamps(path: Path) -> list[int]:
    reader = ZarrStorage(path=path, read_only=True, history=True)
    try:
        return reader.get(torch.arange(len(reader)))["stamp"].tolist()
    finally:
        reader.close()
