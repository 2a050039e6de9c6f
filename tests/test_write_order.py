"""The order in which rows reach the disk: no row an extend wrote may land before a row
extended earlier that still waits in RAM (a block the cursor is in, a block written while
the next rows come, rows of a write that failed and wait to be written again), else the
next commit, whose cursor stops at the first row waiting, declares rows past it with
their new values: after a crash the store is in a state the buffer never was in. Rows too
long to wait in RAM, and extends that leave out some keys (as TorchRL allows: the rows
keep their other cells), are written at once, and take the same care.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fail_at_row_write, writes_held_back
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.testing import simulate_crash


def _ragged(steps: range, tokens: int) -> LazyStackedTensorDict:
    return lazy_stack(
        [
            TensorDict({"step": torch.tensor(s), "tokens": torch.full((tokens,), s)}, [])
            for s in steps
        ]
    )


def _crash_and_read(rb: TensorDictReplayBuffer, path: Path) -> tuple[list[int], int]:
    simulate_crash(rb.storage)
    with ZarrStorage(path=path) as reopened:
        assert reopened._store.unreadable_rows().size == 0
        steps = reopened.get(torch.arange(len(reopened)))["step"].tolist()
        return steps, int(TensorDictReplayBuffer(storage=reopened)._writer._cursor)


def test_a_row_too_long_to_wait_does_not_land_before_the_block_written_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full ring; extends of 1 then 2 rows fill block 0, written behind (held back), row 2
    waits in block 1. An extend of a row too long to wait must wait for block 0's write
    before it writes block 1; block 0's write fails. Written without waiting, block 1
    landed, and the next commit (an overwrite of every key) recorded cursor 0 with row 2 =
    step 10 on disk: after a crash the store held step 10 at row 2 but steps 0, 1 at rows
    0, 1."""
    monkeypatch.setattr("zarr_rb.core.solo_writes.STAGED_RAGGED_BYTES", 64 * 1024)
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        storage = ZarrStorage(
            8, path, compression=Compression(block_rows=2), ram_bytes=0, ragged=["tokens"]
        )
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        rb.extend(_ragged(range(8), 3))
        rb.storage.flush()
        rb.extend(_ragged(range(8, 9), 3))  # row 0 waits in RAM
        rb.extend(_ragged(range(9, 11), 3))  # block 0 full: written behind; row 2 waits
        assert rb.storage._store.write_cache.writing is not None
        # Data writes 1-3: block 1 copied to a new slot; 4-6: row 2 there; 7: block 0's.
        with fail_at_row_write(7, 1), pytest.raises(StoreWriteError):
            rb.extend(_ragged(range(11, 12), 20_000))  # row 3: 80 kB, too long to wait
        overwrite = _ragged(range(100, 102), 3).set("index", torch.tensor([4, 5]))
        rb[torch.tensor([4, 5])] = overwrite  # every key: a commit
        got = _crash_and_read(rb, path)
    # The states the buffer went through: p of steps 8-11 extended, rows 4, 5 maybe rewritten.
    states = []
    for p in range(5):
        ring = [*range(8, 8 + p), *range(p, 8)]
        for four, five in ((4, 5), (100, 101)):
            states.append(([*ring[:4], four, five, *ring[6:]], p))
    assert got in states, got


def test_a_row_too_long_to_wait_is_kept_when_the_blocks_before_it_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full ring; row 0 waits in RAM; an extend of a row too long to wait (row 1) writes
    block 0 first, and that write fails. The error says the rows are kept in RAM, and row 1
    must be too (it was dropped: it read as its old value while the cursor was past it,
    and the next flush committed cursor 2 with row 1's old value)."""
    monkeypatch.setattr("zarr_rb.core.solo_writes.STAGED_RAGGED_BYTES", 64 * 1024)
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(
        8, path, compression=Compression(block_rows=2), ram_bytes=0, ragged=["tokens"]
    )
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_ragged(range(8), 3))
    rb.storage.flush()
    rb.extend(_ragged(range(8, 9), 3))  # row 0 waits in RAM
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(9, 10), 20_000))  # row 1: too long to wait
    rb.storage.flush()
    got = _crash_and_read(rb, path)
    states = [([*range(8, 8 + p), *range(p, 8)], p) for p in range(3)]
    assert got in states, got


def test_a_row_too_long_to_wait_is_kept_when_a_retry_before_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario of test_a_row_too_long_to_wait_in_ram_lands_after_a_failed_extend_s_rows,
    with the retry of the failed rows (made by the long row's extend, first) failing as
    well: the long row must wait in RAM with them, not be dropped."""
    monkeypatch.setattr("zarr_rb.core.solo_writes.STAGED_RAGGED_BYTES", 64 * 1024)
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(
        8, path, compression=Compression(block_rows=2), ram_bytes=0, ragged=["tokens"]
    )
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_ragged(range(8), 3))
    rb.storage.flush()
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(8, 10), 3))
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(10, 11), 20_000))  # row 2: too long to wait
    rb.storage.flush()
    got = _crash_and_read(rb, path)
    states = [([*range(8, 8 + p), *range(p, 8)], p) for p in range(4)]
    assert got in states, got


def _rows(v: torch.Tensor) -> TensorDict:
    return TensorDict(
        {"step": v, "obs": (v[:, None] * torch.ones(300)).to(torch.uint8), "r": v.float()},
        [v.numel()],
    )


def _whole(steps: list[int], rows: list[int]) -> TensorDict:
    """Rows to write over ``rows`` with every key (TorchRL's ``index`` too): a commit."""
    return _rows(torch.tensor(steps)).set("index", torch.tensor(rows))


def test_an_extend_of_some_keys_lands_after_an_earlier_extend_s_rows(tmp_path: Path) -> None:
    """A full ring; row 0 (step 8) waits in RAM; an extend of some keys (``r`` left out,
    as TorchRL allows: the rows keep their other cells) writes rows 1-3 at once. The next
    commit (an overwrite of rows 4-5) must not record cursor 0, row 0 waiting, with rows
    1-3 holding steps 9-11 (a state the buffer never was in): block 0 is written first."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.arange(8)))
    rb.storage.flush()
    rb.extend(_rows(torch.tensor([8])))  # row 0 waits in RAM
    rb.extend(_rows(torch.arange(9, 12)).exclude("r"))  # rows 1-3, written now
    rb[torch.tensor([4, 5])] = _whole([104, 105], [4, 5])  # a commit
    steps, cursor = _crash_and_read(rb, path)
    ring = [*range(8, 8 + cursor), *range(cursor, 8)]
    for row, step in enumerate(steps):
        assert step == ring[row] or step == 100 + row, (steps, cursor)


def test_a_failed_extend_of_some_keys_is_not_committed_past(tmp_path: Path) -> None:
    """A full ring; an extend of some keys (``r`` left out) of rows 0-1 fails: its cells
    wait in RAM as a patch. The next extend (rows 2-3) must write them first: it committed
    cursor 4, declaring rows 0-1 with their old steps 0-1 (a state the buffer never was
    in)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.arange(8)))
    rb.storage.flush()
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(8, 10)).exclude("r"))
    rb.extend(_rows(torch.arange(10, 12)))  # rows 2-3 (block 1, whole): a commit
    steps, cursor = _crash_and_read(rb, path)
    ring = [*range(8, 8 + cursor), *range(cursor, 8)]
    for row, step in enumerate(steps):
        assert step == ring[row] or step == 100 + row, (steps, cursor)


def test_a_row_too_long_to_wait_reads_as_extended_after_the_blocks_before_it_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As test_a_row_too_long_to_wait_is_kept_when_the_blocks_before_it_fail: the live read
    of rows 0-1 right after the failed extend reads them as extended (it raised: the
    mirrored lengths held the long row's, the disk the old row)."""
    monkeypatch.setattr("zarr_rb.core.solo_writes.STAGED_RAGGED_BYTES", 64 * 1024)
    storage = ZarrStorage(
        8,
        tmp_path / "rb.zarr",
        compression=Compression(block_rows=2),
        ram_bytes=0,
        ragged=["tokens"],
    )
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_ragged(range(8), 3))
    rb.storage.flush()
    rb.extend(_ragged(range(8, 9), 3))  # row 0 waits in RAM
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_ragged(range(9, 10), 20_000))  # row 1: too long to wait
    try:
        assert rb.storage.get(torch.arange(2))["step"].tolist() == [8, 9]
    finally:
        storage.close()
