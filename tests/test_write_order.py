"""The order in which rows reach the disk: no row an extend wrote may land before a row
extended earlier that still waits in RAM (a block the cursor is in, a block written while
the next rows come, rows of a write that failed and wait to be written again), else the
next commit, whose cursor stops at the first row waiting, declares rows past it with
their new values: after a crash the store is in a state the buffer never was in. Rows too
long to wait in RAM, and extends that leave out some keys (as TorchRL allows: the rows
keep their other cells), are written at once, and take the same care.

Each test starts from a full ring of 8 rows (steps 0-7, blocks of 2 rows) and extends it
by steps 8, 9, ... from row 0: :func:`extended` lists the states it goes through.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import crash_and_read, fail_at_row_write, writes_held_back
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.testing import simulate_crash

LONG = 20_000
"""Tokens of a row too long to wait in RAM (80 kB, with the limit lowered to 64 KiB)."""


def _ragged(steps: range, tokens: int = 3) -> LazyStackedTensorDict:
    return lazy_stack(
        [
            TensorDict({"step": torch.tensor(s), "tokens": torch.full((tokens,), s)}, [])
            for s in steps
        ]
    )


def _rows(steps: torch.Tensor) -> TensorDict:
    return TensorDict(
        {"step": steps, "obs": (steps[:, None] * torch.ones(300)).to(torch.uint8)},
        [steps.numel()],
    ).set("r", steps.float())


def _full_ring(path: Path, *, ragged: bool) -> TensorDictReplayBuffer:
    """A buffer of 8 rows holding steps 0-7, committed; ``ragged``: rows of tokens, and rows
    of more than 64 KiB are too long to wait in RAM (see :data:`LONG`)."""
    storage = ZarrStorage(
        8,
        path,
        compression=Compression(block_rows=2),
        ram_bytes=0,
        ragged=["tokens"] if ragged else (),
    )
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_ragged(range(8)) if ragged else _rows(torch.arange(8)))
    rb.storage.flush()
    return rb


def extended(rows: int) -> list[tuple[list[int], int]]:
    """The states of the full ring extended by 0 to ``rows`` rows (steps 8, 9, ... from row
    0 on, around the ring as many times as they go): (steps, cursor)."""
    ring, states = list(range(8)), [(list(range(8)), 0)]
    for step in range(8, 8 + rows):
        ring[step % 8] = step
        states.append((list(ring), (step + 1) % 8))
    return states


class _Ring:
    """The states a ring of ``size`` rows goes through, from empty, as steps are extended
    into it (step ``s`` goes to row ``s % size``; each a consecutive step): the steps of
    rows ``[0, len)`` and the cursor after each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rows: list[int] = []
        self.states: list[tuple[list[int], int]] = [([], 0)]

    def extend(self, steps: range) -> None:
        for step in steps:
            if len(self.rows) < self.size:
                self.rows.append(step)
            else:
                self.rows[step % self.size] = step
            self.states.append((list(self.rows), (step + 1) % self.size))

    def since_now(self) -> None:
        """Drop the states before this one (a durable point: a crash keeps it)."""
        self.states = self.states[-1:]


@pytest.fixture
def long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zarr_rb.core.solo_staging.STAGED_RAGGED_BYTES", 64 * 1024)


@pytest.mark.usefixtures("long_rows")
def test_a_row_too_long_to_wait_in_ram_lands_after_a_failed_extend_s_rows(
    tmp_path: Path,
) -> None:
    """An extend of two rows fails and waits in RAM; the next extend's row is too long to
    wait in RAM (written at once). It must not land before the rows that wait: the next
    commit, at the cursor of the first of them, would declare the long row in place of the
    one it follows."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=True)
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(8, 10)))
    rb.extend(_ragged(range(10, 11), LONG))
    assert crash_and_read(rb, path) in extended(3)


@pytest.mark.usefixtures("long_rows")
def test_a_row_too_long_to_wait_is_kept_when_a_retry_before_it_fails(tmp_path: Path) -> None:
    """As above, with the retry of the failed rows (made by the long row's extend, first)
    failing as well: the long row must wait in RAM with them, not be dropped."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=True)
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(8, 10)))
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(10, 11), LONG))  # row 2
    rb.storage.flush()
    assert crash_and_read(rb, path) in extended(3)


@pytest.mark.usefixtures("long_rows")
def test_a_row_too_long_to_wait_is_kept_when_the_blocks_before_it_fail(tmp_path: Path) -> None:
    """Row 0 waits in RAM; an extend of a row too long to wait (row 1) writes block 0
    first, and that write fails. The error says the rows are kept in RAM, and row 1 must
    be too: it was dropped, read as its old value while the cursor was past it (or raised:
    the mirrored lengths held the long row's), and the next flush committed cursor 2 with
    row 1's old value."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=True)
    rb.extend(_ragged(range(8, 9)))  # row 0 waits in RAM
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(9, 10), LONG))
    assert rb.storage.get(torch.arange(2))["step"].tolist() == [8, 9]
    rb.storage.flush()
    assert crash_and_read(rb, path) in extended(2)


@pytest.mark.usefixtures("long_rows")
def test_a_row_too_long_to_wait_does_not_land_before_the_block_written_behind(
    tmp_path: Path,
) -> None:
    """Extends of 1 then 2 rows fill block 0, written behind (held back); row 2 waits in
    block 1. An extend of a row too long to wait must wait for block 0's write before it
    writes block 1; block 0's write fails. Written without waiting, block 1 landed, and the
    next commit (an overwrite of every key) recorded cursor 0 with row 2 = step 10 on disk:
    after a crash the store held step 10 at row 2 but steps 0, 1 at rows 0, 1."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = _full_ring(path, ragged=True)
        rb.extend(_ragged(range(8, 9)))  # row 0 waits in RAM
        rb.extend(_ragged(range(9, 11)))  # block 0 full: written behind; row 2 waits
        assert rb.storage._store.write_cache.writing is not None
        # Data writes 1-3: block 1 copied to a new slot; 4-6: row 2 there; 7: block 0's.
        with fail_at_row_write(7, 1), pytest.raises(StoreWriteError):
            rb.extend(_ragged(range(11, 12), LONG))  # row 3
        overwrite = _ragged(range(100, 102)).set("index", torch.tensor([4, 5]))
        rb[torch.tensor([4, 5])] = overwrite  # every key: a commit
        got = crash_and_read(rb, path)
    # Rows 4 and 5 as extended, or as written over.
    assert got in [
        ([*ring[:4], *four_five, *ring[6:]], p)
        for ring, p in extended(4)
        for four_five in ([4, 5], [100, 101])
    ]


def _at_their_step_or_rewritten(got: tuple[list[int], int]) -> None:
    """Each row as the ring extended up to the cursor holds it, or written over (step 100
    plus its row)."""
    steps, cursor = got
    ring = [*range(8, 8 + cursor), *range(cursor, 8)]
    for row, step in enumerate(steps):
        assert step in (ring[row], 100 + row), got


def test_an_extend_of_some_keys_lands_after_an_earlier_extend_s_rows(tmp_path: Path) -> None:
    """Row 0 (step 8) waits in RAM; an extend of some keys (``r`` left out) writes rows
    1-3 at once. The next commit (an overwrite of rows 4-5) must not record cursor 0, row 0
    waiting, with rows 1-3 holding steps 9-11 (a state the buffer never was in): block 0
    is written first."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    rb.extend(_rows(torch.tensor([8])))  # row 0 waits in RAM
    rb.extend(_rows(torch.arange(9, 12)).exclude("r"))  # rows 1-3, written now
    rb[torch.tensor([4, 5])] = _rows(torch.tensor([104, 105])).set("index", torch.tensor([4, 5]))
    _at_their_step_or_rewritten(crash_and_read(rb, path))


def test_a_failed_extend_of_some_keys_is_not_committed_past(tmp_path: Path) -> None:
    """An extend of some keys (``r`` left out) of rows 0-1 fails: its cells wait in RAM as
    a patch. The next extend (rows 2-3) must write them first: it committed cursor 4,
    declaring rows 0-1 with their old steps 0-1 (a state the buffer never was in)."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(8, 10)).exclude("r"))
    rb.extend(_rows(torch.arange(10, 12)))  # rows 2-3 (block 1, whole): a commit
    _at_their_step_or_rewritten(crash_and_read(rb, path))


def test_a_failed_extend_of_some_keys_with_the_blocks_before_it_keeps_other_cells(
    tmp_path: Path,
) -> None:
    """Row 0 waits in RAM; a write of some keys moves block 0 (no commit); an extend of
    some keys of row 1, written with block 0 (every key) before it, fails in place. Row
    1's cell of the key it left out was not written and stays readable (when both went in
    one call, the ledger took every key as written to row 1: it read as lost, and the next
    flush committed a hole there)."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    rb.extend(_rows(torch.tensor([8])))  # row 0 waits in RAM
    rb[torch.tensor([1])] = _rows(torch.tensor([50])).exclude("r")  # block 0 moves
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.tensor([9])).exclude("r"))  # row 1, in place
    assert rb.storage._store.unreadable_rows().size == 0
    assert rb.storage.get(torch.arange(2))["step"].tolist() == [8, 9]
    rb.storage.flush()
    steps, cursor = crash_and_read(rb, path)
    assert (steps[:2], cursor) == ([8, 9], 2)


def test_a_failed_write_retried_with_a_write_of_other_keys_keeps_their_cells(
    tmp_path: Path,
) -> None:
    """A write of ``r`` to row 6 fails and waits; a write of the other keys of row 4 (its
    block moved since the last commit) is made with it and fails in place. Row 4's ``r``
    was not written and stays readable (in one call, the ledger took it as written: row 4
    read as lost, and the next flush committed a hole there)."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    rb[torch.tensor([4])] = _rows(torch.tensor([40])).exclude("r")  # block 2 moves
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb[torch.tensor([6])] = _rows(torch.tensor([60])).select("r")
    # Data writes 1-5: the failed write, again (block 3 copied to a new slot, then row 6's
    # r); 6: row 4's.
    with fail_at_row_write(6, 1), pytest.raises(StoreWriteError):
        rb[torch.tensor([4])] = _rows(torch.tensor([41])).exclude("r")
    assert rb.storage._store.write_cache.patches.rows().tolist() == [4]
    assert rb.storage._store.unreadable_rows().size == 0
    rb.storage.flush()
    steps, _ = crash_and_read(rb, path)
    assert steps[4] == 41


def test_a_row_written_over_in_ram_after_its_extend_landed_does_not_hold_the_cursor_back(
    tmp_path: Path,
) -> None:
    """An extend of some keys writes row 0 at once; then row 0 is written over with every
    key, which waits in RAM, and a write of block 2 commits. Row 0's extended value is on
    disk: the commit's cursor must be past it (it stopped at row 0, which waits in RAM, as
    if its extend had not landed: after a crash the store held step 8 at row 0 with the
    cursor before it; found by the crash machine)."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    rb.extend(_rows(torch.tensor([8])).exclude("r"))  # row 0, written at once
    rb[torch.tensor([0])] = _rows(torch.tensor([100])).set("index", torch.tensor([0]))
    rb[torch.tensor([4, 5])] = _rows(torch.tensor([104, 105])).set("index", torch.tensor([4, 5]))
    _at_their_step_or_rewritten(crash_and_read(rb, path))


def test_a_failed_extend_of_some_keys_replaced_on_the_next_lap_is_not_committed_past(
    tmp_path: Path,
) -> None:
    """Rows 6-7's extend of some keys fails and waits as a patch; the next extend goes
    around the ring over row 6 again (its cells in the patch are dropped: newer values),
    and row 6 waits in RAM. No commit may stop at row 6 then: it would declare row 6's
    value of the lap before (step 14), which never reached the disk (the store reopened
    with step 6 there; found by review). The commits wait until row 6 lands."""
    for flushed in (False, True):
        path = tmp_path / f"{flushed}.zarr"
        rb = _full_ring(path, ragged=False)
        rb.extend(_rows(torch.arange(8, 14)))  # rows 0-5: cursor 6
        with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
            rb.extend(_rows(torch.arange(14, 16)).exclude("r"))  # rows 6-7: kept as a patch
        rb.extend(_rows(torch.arange(16, 23)))  # rows 0-6: row 6 waits in RAM
        if flushed:  # the commits go on once row 6 lands
            rb.storage.flush()
            assert crash_and_read(rb, path) == extended(15)[-1]
        else:
            assert crash_and_read(rb, path) in extended(15)


def test_a_row_written_over_before_its_failed_extend_landed_holds_the_commits(
    tmp_path: Path,
) -> None:
    """An extend of some keys of rows 6, 7, 0, 1 fails and waits as patches; row 6 is
    then written over with every key (waiting in RAM: its extended value never lands),
    and a write of block 2 writes the other patches and commits. That commit may not
    stop at row 6 with rows 7, 0, 1 extended past it on disk: row 6 holds neither its
    extended value nor the overwrite's there. The commits wait until row 6 lands (found
    by a random sequence tester in review)."""
    for flushed in (False, True):
        path = tmp_path / f"{flushed}.zarr"
        rb = _full_ring(path, ragged=False)
        rb.extend(_rows(torch.arange(8, 14)))  # rows 0-5: cursor 6
        with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
            rb.extend(_rows(torch.arange(14, 18)).exclude("r"))  # rows 6, 7, 0, 1
        rb[torch.tensor([6])] = _rows(torch.tensor([106])).set("index", torch.tensor([6]))
        rb[torch.tensor([4, 5])] = _rows(torch.tensor([104, 105])).set(
            "index", torch.tensor([4, 5])
        )
        if flushed:
            rb.storage.flush()
            assert crash_and_read(rb, path) == ([16, 17, 10, 11, 104, 105, 106, 15], 2)
        else:
            _at_their_step_or_rewritten(crash_and_read(rb, path))


def test_a_failed_extend_of_some_keys_does_not_land_before_the_row_extended_before_it(
    tmp_path: Path,
) -> None:
    """Found by the crash machine with versions per key group. Row 0 (step 8) waits in RAM;
    an extend of some keys of rows 1-2 writes block 0 with them, and fails. Row 0 waited in
    RAM again as a block, rows 1-2 as a patch, and a write of some keys to another row
    wrote the patches first, but not block 0: rows 1-2 landed before row 0. The next commit
    (rows 4-5 written over) stopped its cursor at row 0 and declared rows 1-2 with steps
    9-10: after a crash the store held them with cursor 0, a state the buffer never was
    in. Now row 0 is written first, and that commit goes past rows 0-2."""
    path = tmp_path / "rb.zarr"
    rb = _full_ring(path, ragged=False)
    rb.extend(_rows(torch.tensor([8])))  # row 0 waits in RAM
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(9, 11)).exclude("r"))  # rows 1-2, with block 0
    rb[torch.tensor([6])] = _rows(torch.tensor([106])).select("r")  # writes what waits
    rb[torch.tensor([4, 5])] = _rows(torch.tensor([104, 105])).set("index", torch.tensor([4, 5]))
    got = crash_and_read(rb, path)
    _at_their_step_or_rewritten(got)
    assert got == ([8, 9, 10, 3, 104, 105, 6, 7], 3)


def test_a_failed_block_written_behind_lands_before_the_extend_of_some_keys_after_it(
    tmp_path: Path,
) -> None:
    """Block 0 (rows 0-1) is written behind; row 2 waits in RAM; an extend of some keys of
    rows 3-4 waits for block 0's write first, and that write fails. Block 0 is older than
    every row of the extend: it must land before them. (Kept as a block, it waited while
    the extend's rows, kept as patches, landed with the next write: a commit then stopped
    at row 0 with rows 2-4 holding their new steps on disk.)"""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = _full_ring(path, ragged=False)
        rb.extend(_rows(torch.tensor([8])))  # row 0 waits in RAM
        rb.extend(_rows(torch.arange(9, 11)))  # block 0 full: written behind; row 2 waits
        assert rb.storage._store.write_cache.writing is not None
        with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
            rb.extend(_rows(torch.arange(11, 13)).exclude("r"))  # rows 3-4
        rb[torch.tensor([6])] = _rows(torch.tensor([106])).select("r")  # writes what waits
        rb[torch.tensor([6, 7])] = _rows(torch.tensor([106, 107])).set(
            "index", torch.tensor([6, 7])
        )
        got = crash_and_read(rb, path)
    _at_their_step_or_rewritten(got)
    assert got == ([8, 9, 10, 11, 12, 5, 106, 107], 5)


def test_an_extend_that_wraps_past_the_committed_rows_of_the_first_lap_commits_a_state(
    tmp_path: Path,
) -> None:
    """The ring's first lap, committed up to row 8 of 20 (blocks of 4; rows 8-11 were
    extended, their block written while the next rows come), then one extend of 19 rows:
    rows 12-19, then 0-10, its rows 8-10 waiting in RAM at the end. Its commit declared
    rows 0-7 (with the new lap's values, rows past 8 waiting for rows 8-10 to land) and a
    cursor at 11: a crash reopened a buffer of length 8 whose writer appended at 11, in
    a state the buffer never was in (no state holds the new lap's rows 0-7 and not its rows
    12-19). Every commit records a state the buffer went through."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(20, path, compression=Compression(block_rows=4, chunk_rows=2))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    ring, step = _Ring(20), 0
    for n in (1, 3, 1, 3, 2, 2, 19):
        rb.extend(_rows(torch.arange(step, step + n)))
        ring.extend(range(step, step + n))
        step += n
    assert crash_and_read(rb, path) in ring.states


def test_a_failed_extend_s_rows_in_the_block_an_extend_ends_in_land_before_its_later_rows(
    tmp_path: Path,
) -> None:
    """A full ring of 20 rows in blocks of 8, cursor at 4 (committed); an extend of rows
    4-19 fails and waits in RAM (rows 4-7 in block 0, rows 8-19 in blocks 1-2). The next
    extend (rows 0-2) ends in block 0 and wrote blocks 1-2 alone: rows 8-19 landed before
    rows 4-7, which were extended before them, and the commit recorded cursor 4 with rows
    8-19 new (a state the buffer never was in). Block 0 is written with them."""
    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=8, chunk_rows=2)
    storage = ZarrStorage(20, path, compression=compression, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.arange(20)))
    rb.extend(_rows(torch.arange(20, 24)))  # rows 0-3, the cursor at 4
    rb.storage.flush()
    with fail_at_row_write(1, 2), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(24, 40)))  # rows 4-19
    rb.extend(_rows(torch.arange(40, 43)))  # rows 0-2
    ring = _Ring(20)
    ring.extend(range(24))
    ring.since_now()  # (the flush)
    ring.extend(range(24, 43))
    assert crash_and_read(rb, path) in ring.states


def _obs(value: float, n: int) -> TensorDict:
    return TensorDict({"obs": torch.full((n, 3), value)}, [n])


def test_a_flush_after_rows_set_twice_commits_them(tmp_path: Path) -> None:
    """``storage.set`` of rows written since the last commit (the same rows again) moves
    the cursor back, not on: a commit must not take them for rows that went on past the
    rows on disk and wait (found by a review of the commit that waits when extends went
    around the ring past rows waiting: it waited here, and the flush committed nothing)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(100, path, compression=Compression(block_rows=4))
    storage.set(torch.arange(10), _obs(1.0, 10))
    storage.flush()
    storage.set(torch.arange(10), _obs(2.0, 10))  # the same rows again
    storage.flush()
    simulate_crash(storage)
    with ZarrStorage(path=path) as reopened:
        assert reopened.get(torch.arange(10))["obs"][:, 0].tolist() == [2.0] * 10


def test_commits_go_on_after_rows_set_twice(tmp_path: Path) -> None:
    """As above, then an extend from the writer's own cursor: the save commits every row,
    and the rows TorchRL's ``len`` counts past them, which no call wrote, as holes."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(40, path, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_obs(0.0, 8))
    storage.flush()
    storage.set(torch.tensor([8, 9]), _obs(1.0, 2))
    storage.set(torch.tensor([8, 9]), _obs(2.0, 2))
    rb.extend(_obs(3.0, 12))  # the writer's cursor is 8: rows 8-19
    zarr_rb.save(rb)
    committed = storage._store.committed
    assert len(storage) == 24  # (TorchRL counts the rows set twice again)
    assert (committed.length, committed.cursor) == (24, 20)
    assert committed.holes == ((20, 24),)


def test_an_extend_around_the_first_lap_after_a_row_set_at_a_given_position_commits_a_state(
    tmp_path: Path,
) -> None:
    """As the test of an extend that wraps past the committed rows of the first lap, after
    ``storage.set`` of one row (which moves the store's cursor, not the writer's): the
    extend then does not run on from the store's cursor, which turned the check of those
    commits off, and the commit declared length 6 with the cursor at 8 (found by a review).
    Ring of 19 rows, blocks of 6."""
    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=6, chunk_rows=2)
    storage = ZarrStorage(19, path, compression=compression, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    ring = _Ring(19)

    def extend(steps: range) -> None:
        rb.extend(_rows(torch.tensor(list(steps))))
        ring.extend(steps)

    for start, n in ((0, 4), (4, 2), (6, 4), (10, 4), (14, 2)):
        extend(range(start, start + n))  # rows 0-15
    row = _rows(torch.tensor([100])).set("index", torch.tensor([14]))
    storage.set(torch.tensor([14]), row)  # the store's cursor at 15, the writer's at 16
    ring.rows[14] = 100
    ring.states.append((list(ring.rows), 15))
    extend(range(16, 27))  # rows 16-18, then 0-7
    assert crash_and_read(rb, path) in ring.states
