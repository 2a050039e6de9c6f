"""A reader's sample reads one commit: the sampler's scan, the length and cursor it draws
from, and the rows the buffer gathers then, even when the writer commits in between; the
writer keeps the rows of its last commits for it (``Commit.kept_from``), and a sample whose
commit it no longer keeps raises rather than return rows written over.

The machine checks the writer's side: a reader that holds a commit reads the same rows
from it whatever the writer does meanwhile (extends around the ring, writes over rows,
empties, loads a save, crashes and reopens), as long as the record says the writer keeps
it, and raises once it does not."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from interrupted import DrawnThenInterrupted, Interrupted
from machines import replayed, run_long
from tensordict import TensorDict, lazy_stack
from torchrl.data import SliceSampler, TensorDictReplayBuffer
from writer_process import slices_beside_a_writer

import zarr_rb
from zarr_rb import Compression, RowsNotCommittedError, ZarrStorage
from zarr_rb.core.solo_slots import KEPT_COMMITS
from zarr_rb.testing import simulate_crash

RING = 32
EPISODE = 4
BLOCKS = Compression(block_rows=8)


def episodes(first: int, count: int) -> TensorDict:
    """Rows ``first`` to ``first + count`` of a run of episodes of :data:`EPISODE` steps:
    each row's episode is its step over the episode length, its ``obs`` its step."""
    step = torch.arange(first, first + count)
    return TensorDict(
        {"step": step, "episode": step // EPISODE, "obs": step.view(-1, 1).expand(-1, 4).clone()},
        batch_size=[count],
    )


def _writer_and_reader(path: Path, meanwhile: Any) -> tuple[Any, Any]:
    writer = TensorDictReplayBuffer(storage=ZarrStorage(RING, path, compression=BLOCKS))
    writer.extend(episodes(0, RING))
    writer.storage.flush()
    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=path, read_only=True),
        sampler=Interrupted(meanwhile, slice_len=EPISODE, traj_key="episode"),
        batch_size=3 * EPISODE,
    )
    return writer, reader


def _check_slices(batch: TensorDict) -> None:
    """Each slice is one whole episode, its steps in order."""
    steps = batch["step"].view(-1, EPISODE)
    assert torch.equal(batch["episode"].view(-1, EPISODE), steps // EPISODE), steps.tolist()
    assert bool((steps[:, 1:] - steps[:, :-1] == 1).all()), steps.tolist()
    assert bool((steps[:, 0] % EPISODE == 0).all()), steps.tolist()
    if "obs" in batch.keys():  # noqa: SIM118 (a TensorDict has no __contains__)
        assert torch.equal(batch["obs"][:, 0], batch["step"])


class _Writer:
    """A writer of whole episodes around a ring of :data:`RING` rows, which commits at each
    extend, and what each of its commits holds."""

    def __init__(self, path: Path) -> None:
        self.rb = TensorDictReplayBuffer(storage=ZarrStorage(RING, path, compression=BLOCKS))
        self.next = 0
        self.extend(RING)

    def extend(self, count: int) -> None:
        self.rb.extend(episodes(self.next, count))
        self.next += count
        self.rb.storage.flush()

    def rows(self) -> torch.Tensor:
        """The ``step`` of every row of the last commit."""
        return self.rb.storage.get(torch.arange(len(self.rb)))["step"]


def _reader(path: Path, meanwhile: Any) -> Any:
    return TensorDictReplayBuffer(
        storage=ZarrStorage(path=path, read_only=True),
        sampler=Interrupted(meanwhile, slice_len=EPISODE, traj_key="episode"),
        batch_size=3 * EPISODE,
    )


def _sample_checked(reader: Any, expected: torch.Tensor) -> None:
    """A sample of ``reader``: whole episodes, each row as the commit ``expected`` holds."""
    batch, info = reader.sample(return_info=True)
    _check_slices(batch)
    index = info["index"]
    index = torch.as_tensor(index[0] if isinstance(index, tuple) else index).reshape(-1)
    assert torch.equal(batch["step"], expected[index]), (batch["step"], expected[index])


def test_a_slice_sample_reads_the_commit_its_scan_read(store_path: Path) -> None:
    """The writer goes once around the ring, in two commits, between each sample's scan
    and its gather: the sample gathers the rows of the commit it scanned (before,
    TorchRL's slices joined rows of the new lap under the old boundaries)."""
    writer = _Writer(store_path)
    reader = _reader(store_path, lambda: (writer.extend(RING // 2), writer.extend(RING // 2)))
    for _ in range(4):
        _sample_checked(reader, writer.rows())
    reader.storage.close()
    writer.rb.storage.close()


class _ThenWrite(SliceSampler):
    """A slice sampler after whose draw the writer commits, before the buffer's gather."""

    def __init__(self, meanwhile: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.meanwhile = meanwhile

    def sample(self, storage: Any, batch_size: int) -> Any:
        drawn = super().sample(storage, batch_size)
        self.meanwhile()
        return drawn


@pytest.mark.parametrize("reader_kind", ["refresh_interval", "ragged"])
def test_the_samplers_own_reads_do_not_end_its_sample(store_path: Path, reader_kind: str) -> None:
    """TorchRL's SliceSampler reads ``storage[index]`` itself while it draws: that read ends
    no sample, so the buffer's gather still reads the commit drawn from when the writer
    commits between the two. (Found by review: with a ragged key, whose gathers are not
    kept, or a reader refreshing on an interval, the gather read the newer commit.)"""
    ragged = reader_kind == "ragged"

    def rows(first: int, count: int) -> Any:
        if not ragged:
            return episodes(first, count)
        return lazy_stack(
            [
                TensorDict(
                    {
                        "step": torch.tensor(i),
                        "episode": torch.tensor(i // EPISODE),
                        "tokens": torch.full((1 + i % 3,), i),
                    },
                    [],
                )
                for i in range(first, first + count)
            ]
        )

    storage = ZarrStorage(RING, store_path, compression=BLOCKS, ragged=["tokens"] if ragged else ())
    writer = TensorDictReplayBuffer(storage=storage)
    written = [0]

    def extend(count: int) -> None:
        writer.extend(rows(written[0], count))
        written[0] += count
        writer.storage.flush()

    extend(RING)
    interval = {"refresh_interval": 0.0} if not ragged else {}
    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=store_path, read_only=True, **interval),
        sampler=_ThenWrite(lambda: extend(RING // 2 + 2), slice_len=EPISODE, traj_key="episode"),
        batch_size=3 * EPISODE,
    )
    for _ in range(6):
        expected = writer.storage.get(torch.arange(RING))["step"]
        _sample_checked(reader, expected)
    reader.storage.close()
    writer.storage.close()


def test_a_sample_whose_commit_the_writer_no_longer_keeps_raises(store_path: Path) -> None:
    """More commits than the writer keeps between a sample's scan and its gather: the
    gather raises (it returns no row written over), and the next sample reads the last
    commit."""
    writer = _Writer(store_path)
    laps = [KEPT_COMMITS]

    def commits() -> None:
        for _ in range(laps.pop() if laps else 1):
            writer.extend(EPISODE)

    reader = _reader(store_path, commits)
    expected = writer.rows()
    with pytest.raises(RowsNotCommittedError, match="sample again"):
        _sample_checked(reader, expected)
    _sample_checked(reader, writer.rows())  # one commit during it: kept
    reader.storage.close()
    writer.rb.storage.close()


def test_a_random_sample_reads_the_length_it_drew_from(store_path: Path) -> None:
    """The writer empties the buffer and writes fewer rows between a random draw and its
    gather: the rows drawn are gathered as the commit drawn from has them."""
    writer = _Writer(store_path)

    def shorter() -> None:
        writer.rb.empty()
        writer.extend(EPISODE)

    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=store_path, read_only=True),
        sampler=DrawnThenInterrupted(shorter),
        batch_size=64,
    )
    expected = writer.rows()
    batch, info = reader.sample(return_info=True)
    index = info["index"]
    index = torch.as_tensor(index[0] if isinstance(index, tuple) else index).reshape(-1)
    assert int(index.max()) >= EPISODE  # (drawn from the whole ring)
    assert torch.equal(batch["step"], expected[index])
    reader.storage.get(torch.tensor([0]))  # a read after the sample: the last commit
    assert len(reader) == EPISODE
    reader.storage.close()
    writer.rb.storage.close()


def test_two_threads_sampling_one_reader_each_read_their_commit(store_path: Path) -> None:
    """Each thread's sample holds a commit of its own: a thread that starts a sample after
    the writer committed reads the newer commit, while the first thread's sample goes on
    reading the commit it drew from (its rows, length and cursor)."""
    writer = _Writer(store_path)
    reader = ZarrStorage(path=store_path, read_only=True)
    writer.rb.empty()
    writer.extend(RING // 2)
    reader.begin_sample()
    held = (len(reader), reader._last_cursor_index)
    writer.extend(EPISODE)
    seen: list[Any] = []

    def other() -> None:
        reader.begin_sample()
        seen.append((len(reader), reader._last_cursor_index))
        seen.append(reader.get(torch.arange(RING // 2 + EPISODE))["step"])  # (ends it)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen[0] == (RING // 2 + EPISODE, RING // 2 + EPISODE - 1)
    assert seen[1].tolist() == list(range(RING, RING + RING // 2 + EPISODE))
    assert (len(reader), reader._last_cursor_index) == held == (RING // 2, RING // 2 - 1)
    steps = reader.get(torch.arange(RING // 2))["step"]  # (the gather ends it)
    assert steps.tolist() == list(range(RING, RING + RING // 2))
    assert len(reader) == RING // 2 + EPISODE
    reader.close()
    writer.rb.storage.close()


# --- a writer process that commits without pause -----------------------------------------


def test_a_readers_slices_are_whole_episodes_while_a_writer_process_commits(tmp_path) -> None:
    """A writer process extends a 64-row ring by 1-23 rows and commits, without pause; a
    reader samples slices of episodes of 8 steps meanwhile: every slice it returns is 4
    consecutive steps of one episode (before, a commit landing between a sample's scan and
    its gather joined two episodes, or crossed the writer's head)."""
    path = tmp_path / "rb.zarr"
    seed = TensorDictReplayBuffer(storage=ZarrStorage(64, path, compression=BLOCKS))
    seed.extend(TensorDict({"step": torch.arange(64), "episode": torch.arange(64) // 8}, [64]))
    seed.storage.close()
    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=path, read_only=True),
        sampler=SliceSampler(slice_len=4, traj_key="episode"),
        batch_size=32,
    )
    try:
        whole, raised = slices_beside_a_writer(path, reader, shared=False, first_step=0)
    finally:
        reader.storage.close()
    assert raised < whole, (raised, whole)


# --- the writer's side: a commit held by a reader reads the same until it is not kept ----

ROWS = 16
KEYS = [("step",), ("obs",)]


def _steps(first: int, count: int) -> TensorDict:
    step = torch.arange(first, first + count)
    return TensorDict({"step": step, "obs": step.view(-1, 1).expand(-1, 3) * 7}, [count])


class KeptCommitsMachine(RuleBasedStateMachine):
    """A writer extends, writes over rows, flushes, empties, saves, loads, crashes and
    reopens; a reader holds a commit at times, and takes views of the commit it shows
    (read later by key, while the reader moves on). While the writer keeps it (fewer than
    :data:`KEPT_COMMITS` commits since, by the writer that was there when it was taken,
    writing at most half the ring: blocks of 2 or 4 rows, a ring's worth of slots at most
    besides the last commit's), the reader reads it as it read it first; after, a read
    raises or reads it as it was."""

    @initialize(block_rows=st.sampled_from([2, 4]), ram_bytes=st.sampled_from(["auto", 0]))
    def setup(self, block_rows: int, ram_bytes: int | str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-kept-"))
        self.path = self.dir / "rb.zarr"
        self.compression = Compression(block_rows=block_rows, chunk_rows=2)
        self.ram_bytes = ram_bytes
        self.rb = self._writer(ZarrStorage(ROWS, self.path, compression=self.compression))
        self.next = 0
        self.written = 0
        self.unflushed = 0
        """Rows written since the last flush (they may land in commits after a hold)."""
        self.extend(ROWS // 2)
        self.rb.storage.flush()
        self.reader = ZarrStorage(path=self.path, read_only=True)
        self.held: tuple[int, int, int, dict[Any, torch.Tensor]] | None = None
        """The generation a reader holds, the writer's opens and the rows written when it
        took it, and its rows."""
        self.opens = 0
        self.saved = False
        self.view: tuple[Any, int, int, dict[Any, torch.Tensor]] | None = None
        """A view's commit, the writer's opens and the rows written when it was taken, and
        its rows."""

    def teardown(self) -> None:
        if hasattr(self, "rb"):
            self.reader.close()
            self.rb.storage.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _writer(self, storage: Any) -> Any:
        return TensorDictReplayBuffer(storage=storage, batch_size=4)

    def _reopened(self) -> Any:
        self.opens += 1
        return self._writer(ZarrStorage(ROWS, self.path, ram_bytes=self.ram_bytes))

    @property
    def _generation(self) -> int:
        return int(self.rb.storage._store.committed.generation)

    # --- the writer --------------------------------------------------------------------

    @rule(n=st.integers(1, ROWS + 3))
    def extend(self, n: int) -> None:
        self.rb.extend(_steps(self.next, n))
        self.next += n
        self.written += n
        self.unflushed += n

    @rule(rows=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=5, unique=True))
    def write_over(self, rows: list[int]) -> None:
        rows = [row for row in rows if row < len(self.rb)]
        if rows:
            self.rb.storage.set(torch.tensor(sorted(rows)), _steps(self.next, len(rows)))
            self.next += len(rows)
            self.written += len(rows)
            self.unflushed += len(rows)

    @rule()
    def flush(self) -> None:
        self.rb.storage.flush()
        self.unflushed = 0

    @rule()
    def empty(self) -> None:
        self.rb.empty()
        self.unflushed = 0
        self.saved = False  # (the rows of the last save are gone: so is the save)

    @rule()
    def save(self) -> None:
        zarr_rb.save(self.rb, progress=False)
        self.unflushed = 0
        self.saved = True

    @precondition(lambda self: self.saved)
    @rule()
    def load(self) -> None:
        """The writer closes; the save is loaded for writing (its rows again, in the
        slots it kept)."""
        self.rb.storage.close()
        self.opens += 1
        self.unflushed = 0
        self.rb = zarr_rb.load(self.path)

    @rule(clean=st.booleans())
    def reopen(self, clean: bool) -> None:
        if clean:
            self.rb.storage.close()
        else:
            simulate_crash(self.rb.storage)
        self.unflushed = 0
        self.rb = self._reopened()

    # --- the reader ----------------------------------------------------------------------

    def _read(self, length: int, *, under: Any = None) -> dict[Any, torch.Tensor]:
        store = self.reader._store
        return store.read(np.arange(length), KEYS, unreadable_as_zeros=True, under=under)

    @precondition(lambda self: self.held is None)
    @rule()
    def hold(self) -> None:
        store = self.reader._store
        store.hold()
        commit = store.committed
        written = self.written - self.unflushed  # (rows after it may land in commits since)
        self.held = (commit.generation, self.opens, written, self._read(commit.length))

    @precondition(lambda self: self.held is not None)
    @rule()
    def let_go(self) -> None:
        self.reader._store.hold(False)
        self.held = None

    @precondition(lambda self: self.held is None)
    @rule()
    def reader_moves(self) -> None:
        """A reader outside a sample moves to the newest commit (a refresh, or a read)."""
        self.reader.refresh()

    @precondition(lambda self: self.view is None)
    @rule()
    def take_view(self) -> None:
        """A view (``rb[:]``) of the newest commit, or of the commit held, read later."""
        store = self.reader._store
        commit = store.commits.held()  # (a view taken in a sample: of its commit)
        if commit is None or self.held is None:
            store.refresh()  # (as ZarrStorage.follow_writer before it takes a view)
            commit, opens, written = store.committed, self.opens, self.written - self.unflushed
        else:
            _, opens, written, _ = self.held  # (kept as long as that commit)
        rows = self._read(commit.length, under=commit)
        self.view = (commit, opens, written, rows)

    @precondition(lambda self: self.view is not None)
    @rule()
    def drop_view(self) -> None:
        self.view = None

    def _kept(self, generation: int, opens: int, written: int) -> bool:
        """Kept for sure: fewer commits since than it keeps, by the same writer, which moved
        fewer blocks since than a ring holds (each moved block keeps one slot more)."""
        return (
            opens == self.opens
            and self._generation - generation < KEPT_COMMITS
            and self.written - written <= ROWS // 2
        )

    @invariant()
    def a_view_reads_as_it_did(self) -> None:
        if not hasattr(self, "rb") or self.view is None:
            return
        commit, opens, written, rows = self.view
        try:
            again = self._read(commit.length, under=commit)
        except RowsNotCommittedError:
            assert not self._kept(commit.generation, opens, written), commit.generation
            self.view = None
            return
        for key in KEYS:
            assert torch.equal(again[key], rows[key]), (key, again[key], rows[key])

    @invariant()
    def a_held_commit_reads_as_it_did(self) -> None:
        if not hasattr(self, "rb") or self.held is None:
            return
        generation, opens, written, rows = self.held
        length = len(next(iter(rows.values())))
        kept = self._kept(generation, opens, written)
        try:
            again = self._read(length)
        except RowsNotCommittedError:
            assert not kept, f"commit {generation} raised, {self._generation} is the last"
            with pytest.raises(RowsNotCommittedError):  # (until it lets go)
                self._read(length)
            self.let_go()
            return
        for key in KEYS:
            assert torch.equal(again[key], rows[key]), (key, again[key], rows[key])


KeptCommitsMachine.TestCase.settings = replayed(15, 30)
TestKeptCommitsMachine = KeptCommitsMachine.TestCase


@pytest.mark.slow
def test_kept_commits_machine_long() -> None:
    """The same machine, many more sequences, new ones on every run."""
    run_long(KeptCommitsMachine)
