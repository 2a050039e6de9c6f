"""A write that failed waits to be written again at the next flush; rows written since over
the same cells are newer, and the retry must not land over them."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import crash_and_read, fail_at_row_write, writes_held_back
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.core.write_cache import Block, WriteBuffer
from zarr_rb.util.io import observe_io


def steps(values: torch.Tensor) -> TensorDict:
    return TensorDict({"step": values, "obs": values.float()[:, None] * 2}, [values.numel()])


def test_a_failed_write_is_not_replayed_over_newer_rows(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(8, path, compression=Compression(block_rows=4)))
    rb.extend(steps(torch.arange(8)))
    rb.storage.flush()

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        rb.storage.set(torch.tensor([2]), steps(torch.tensor([500])))  # kept to retry
    rb.extend(steps(torch.arange(100, 108)))  # every row again, row 2 included
    assert rb.storage.get(torch.tensor([2]))["step"].item() == 102
    rb.storage.close()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(torch.arange(8))["step"].tolist() == list(range(100, 108))
    reader.close()


def test_a_failed_write_is_read_back_as_kept_not_from_the_last_read(tmp_path: Path) -> None:
    """A write that failed is kept (and written by the next flush): the writer's reads of
    its rows give the new values, never those of a read made before it (the storage keeps
    its last read for a sampler that reads the same rows twice)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4))
    TensorDictReplayBuffer(storage=storage).extend(steps(torch.arange(8)))
    storage.flush()
    rows = torch.arange(8)
    assert storage.get(rows)["step"].tolist() == list(range(8))  # kept as the last read

    def broken_disk(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.EIO, "Input/output error")

    with observe_io(broken_disk), pytest.raises(StoreWriteError):
        storage.set(torch.tensor([2]), steps(torch.tensor([500])))
    expected = [0, 1, 500, 3, 4, 5, 6, 7]
    assert storage.get(rows)["step"].tolist() == expected
    storage.flush()  # writes the kept row
    assert storage.get(rows)["step"].tolist() == expected
    storage.close()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(rows)["step"].tolist() == expected
    reader.close()


def test_rows_after_a_failed_write_wait_for_it_rather_than_leave_a_hole(tmp_path: Path) -> None:
    """A block whose write failed waits in RAM; rows written past it are not committed
    without it (a reader, or the store reopened after a crash, would find a hole), and the
    flush that writes it again publishes them all."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(96, path, compression=Compression(block_rows=8))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(steps(torch.arange(8)))

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        rb.extend(steps(torch.arange(8, 16)))  # kept in RAM to retry
    storage.set(torch.arange(16, 24), steps(torch.arange(16, 24)))  # a whole block, written
    reader = ZarrStorage(path=path, read_only=True)
    assert reader._store.unreadable_rows().size == 0
    assert reader.get(torch.arange(len(reader)))["step"].tolist() == list(range(len(reader)))
    storage.flush()
    reader = ZarrStorage(path=path, read_only=True)
    assert reader.get(torch.arange(len(reader)))["step"].tolist() == list(range(24))
    storage.close()


def frames_of(values: torch.Tensor) -> TensorDict:
    """Rows whose frames (a large leaf, kept on disk with ``ram_bytes=0``) derive from
    their step."""
    obs = (values[:, None, None] * 7 + torch.arange(32 * 32).view(32, 32)) % 251
    return TensorDict({"step": values, "obs": obs.to(torch.uint8)}, [values.numel()])


@pytest.mark.parametrize("ram_bytes", [0, "auto"])
def test_a_failed_write_of_some_keys_reads_back_whole(tmp_path: Path, ram_bytes) -> None:
    """A write that leaves a key out (``"index"``, which TorchRL's writers add on extend)
    and fails is kept for the next flush: every key it wrote reads back new, from RAM,
    whether the key is mirrored (``step``) or read from disk (``obs``), never new ``step``
    with the old frames; the flush writes it whole."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=ram_bytes)
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(frames_of(torch.arange(8)))
    storage.flush()

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        rb[torch.tensor([2, 5])] = frames_of(torch.tensor([100, 200]))
    expected = frames_of(torch.tensor([0, 1, 100, 3, 4, 200, 6, 7]))
    rows = torch.arange(8)
    assert storage._store.unreadable_rows().size == 0
    for _ in range(2):  # before the retry, and after it
        got = storage.get(rows)
        assert got["step"].tolist() == expected["step"].tolist()
        assert torch.equal(got["obs"], expected["obs"])
        storage.flush()
    storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        assert torch.equal(reader.get(rows)["obs"], expected["obs"])


def test_a_failed_first_write_says_its_rows_were_not_stored(tmp_path: Path) -> None:
    """The first write makes the arrays; when that fails, nothing of it is kept, and the
    error says to write the rows again (not to flush: there is nothing to flush)."""
    rb = TensorDictReplayBuffer(storage=ZarrStorage(8, tmp_path / "rb.zarr"))

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError) as error:
        rb.extend(steps(torch.arange(4)))
    assert "the rows of this write were not stored" in str(error.value)
    assert "write them again" in str(error.value)
    assert len(rb) == 0
    rb.extend(steps(torch.arange(4)))
    assert rb.storage.get(torch.arange(4))["step"].tolist() == [0, 1, 2, 3]
    rb.storage.close()


def test_a_failed_write_of_some_keys_in_place_keeps_the_rows_other_keys(tmp_path: Path) -> None:
    """Rows written since the last commit into a slot no record names are rewritten in
    place; when a write of some of their keys fails there, those cells may be torn on disk
    (the rows stop being whole, and no commit declares them), but the other keys' cells
    still hold their data: the rows read back whole, the failed keys from RAM."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
    storage.set(torch.arange(8), frames_of(torch.arange(8)))
    storage.flush()
    row = torch.tensor([1])
    # A write of one key: block 0 moves to a free slot, committed by the next commit only.
    storage.set(row, TensorDict({"step": torch.tensor([10])}, [1]), set_cursor=False)

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        storage.set(row, TensorDict({"obs": frames_of(torch.tensor([20]))["obs"]}, [1]))
    expected = frames_of(torch.arange(8))
    expected["step"][1] = 10
    expected["obs"][1] = frames_of(torch.tensor([20]))["obs"][0]
    assert storage._store.unreadable_rows().size == 0
    got = storage.get(torch.arange(8))
    assert got["step"].tolist() == expected["step"].tolist()
    assert torch.equal(got["obs"], expected["obs"])
    storage.flush()
    storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        got = reader.get(torch.arange(8))
        assert got["step"].tolist() == expected["step"].tolist()
        assert torch.equal(got["obs"], expected["obs"])


@pytest.mark.parametrize("then", ["extend", "flush"])
def test_a_block_write_that_fails_behind_an_extend_is_raised_by_the_next_call(
    tmp_path: Path, then: str
) -> None:
    """An extend that fills a block starts its write and returns; when that write fails,
    the next call that waits for it (the extend that fills the next block, a flush) raises,
    the store stays at its last commit, every row reads as written, and a flush once the
    disk has room commits them all."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(64, path, compression=Compression(block_rows=8), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage)
    with writes_held_back():
        rb.extend(frames_of(torch.arange(4)))
        rb.extend(frames_of(torch.arange(4, 8)))  # block 0 full: written behind
        if then == "extend":  # it waits for block 0 before it writes block 1
            call = lambda: rb.extend(frames_of(torch.arange(8, 16)))  # noqa: E731
        else:
            call = storage.flush
        with fail_at_row_write(1, 100), pytest.raises(StoreWriteError) as error:
            call()
    assert "an earlier extend" in str(error.value) or then == "flush"
    written = 16 if then == "extend" else 8
    with ZarrStorage(path=path, read_only=True) as reader:
        assert len(reader) == 0  # the last commit: block 0 was never declared
    expected = frames_of(torch.arange(written))
    got = storage.get(torch.arange(written))
    assert got["step"].tolist() == expected["step"].tolist()
    assert torch.equal(got["obs"], expected["obs"])
    storage.flush()
    storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        got = reader.get(torch.arange(len(reader)))
        assert len(reader) == written
        assert torch.equal(got["obs"], expected["obs"])


def _rows(v: torch.Tensor) -> TensorDict:
    return TensorDict(
        {"step": v, "obs": (v[:, None] * torch.ones(300)).to(torch.uint8), "r": v.float()},
        [v.numel()],
    )


def _failed_in_place(
    path: Path, extends: list[torch.Tensor], moved: int, torn: int, step: int, *, count: int = 3
) -> TensorDictReplayBuffer:
    """A buffer of 8 rows (blocks of 4) given ``extends`` then flushed; a write of some keys
    of row ``moved`` moves its block (no commit), then a write of some keys of row ``torn``
    there, in place, fails (``count`` faults)."""
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    for steps in extends:
        rb.extend(_rows(steps))
    rb.storage.flush()
    rb[torch.tensor([moved])] = _rows(torch.tensor([moved])).exclude("obs")
    with fail_at_row_write(1, count), pytest.raises(StoreWriteError):
        rb[torch.tensor([torn])] = _rows(torch.tensor([step])).exclude("obs")
    return rb


def test_a_key_added_while_a_failed_write_of_some_keys_waits(tmp_path: Path) -> None:
    """A failed in-place write of some keys of a committed row, then an extend that adds a
    key: zeros go into the row's cell of the new key too, and the row is whole again once
    the failed write is written (it stayed unreadable for good: the new key was counted
    only for whole rows; found by review)."""
    path = tmp_path / "rb.zarr"
    rb = _failed_in_place(path, [torch.arange(6)], moved=1, torn=0, step=100, count=2)
    rb.extend(_rows(torch.tensor([6, 7])).set("extra", torch.ones(2)))
    rb.storage.flush()
    expected = [100, 1, 2, 3, 4, 5, 6, 7]
    assert rb.storage.get(torch.arange(8))["step"].tolist() == expected
    assert rb.storage.get(torch.arange(8))["extra"].tolist() == [0.0] * 6 + [1.0] * 2
    rb.storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        assert reader.get(torch.arange(8))["step"].tolist() == expected


def _ring_of_8(path: Path, steps: int) -> TensorDictReplayBuffer:
    """A buffer of 8 rows (blocks of 2) holding steps ``0 .. steps - 1``, committed, of
    :func:`_rows`."""
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.arange(steps)))
    rb.storage.flush()
    return rb


def _add_a_key_at_row_2_and_reopen(rb: TensorDictReplayBuffer, path: Path) -> None:
    """Extend row 2 (step 10) with a new key, ``extra``: every other row reads zeros in it,
    and the store, flushed, reopens after a crash with rows 0-1 at steps 8-9 and cursor 3."""
    rb.extend(_rows(torch.tensor([10])).set("extra", torch.ones(1)))
    assert rb.storage._store.unreadable_rows().tolist() == []
    got = rb.storage.get(torch.arange(8))
    assert got["step"].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
    assert got["extra"].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    rb.storage.flush()
    assert crash_and_read(rb, path) == ([8, 9, 10, 3, 4, 5, 6, 7], 3)


def test_a_key_added_while_a_failed_block_written_behind_waits_reads_zeros_there(
    tmp_path: Path,
) -> None:
    """Rows 0-5 committed; extends of rows 6, then 7 fill block 3, written behind; an extend
    of some keys of rows 0-1 waits for it, and block 3's write fails. Block 3 waits as a
    patch, as it was extended before the rows that wait after it. A later extend adds a
    key: rows 6-7 must read zeros in it, as every other row written without it does (they
    read as holding nothing there, and the flush committed length 6 with cursor 6 over
    rows 0-1 holding steps 8-9; found by review)."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = _ring_of_8(path, 6)
        rb.extend(_rows(torch.tensor([6])))  # row 6 waits in RAM
        rb.extend(_rows(torch.tensor([7])))  # block 3 full: written behind
        assert rb.storage._store.write_cache.writing is not None
        with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
            rb.extend(_rows(torch.arange(8, 10)).exclude("r"))  # rows 0-1
        _add_a_key_at_row_2_and_reopen(rb, path)


def test_a_key_added_while_a_row_kept_before_a_failed_extend_of_some_keys_waits_reads_zeros(
    tmp_path: Path,
) -> None:
    """Rows 0-6 committed; row 7 (step 7) waits in RAM; an extend of some keys of rows 0-1
    writes block 3 (row 7, every key) before it and fails: row 7 waits as a patch, before
    theirs. A later extend adds a key: row 7 must read zeros in it."""
    path = tmp_path / "rb.zarr"
    rb = _ring_of_8(path, 7)
    rb.extend(_rows(torch.tensor([7])))  # row 7 waits in RAM (block 3)
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(8, 10)).exclude("r"))  # rows 0-1, with block 3
    _add_a_key_at_row_2_and_reopen(rb, path)


def test_a_key_added_while_a_failed_extend_of_some_keys_of_a_new_row_waits_reads_zeros(
    tmp_path: Path,
) -> None:
    """Rows 0-6 committed; an extend of some keys of rows 7, 0 fails (row 7 never written:
    zeros of ``r`` and its other keys wait as patches). A later extend adds a key: row 7
    must read zeros in it (patches got none: new keys' zeros went to the blocks in RAM
    and the rows on disk only)."""
    path = tmp_path / "rb.zarr"
    rb = _ring_of_8(path, 7)
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(7, 9)).exclude("r"))  # rows 7, 0
    rb.extend(_rows(torch.tensor([9])).set("extra", torch.ones(1)))  # row 1: a new key
    assert rb.storage._store.unreadable_rows().tolist() == []
    rb.storage.flush()
    assert crash_and_read(rb, path) == ([8, 9, 2, 3, 4, 5, 6, 7], 2)


def test_a_key_whose_zeros_could_not_be_written_is_not_added(tmp_path: Path) -> None:
    """Rows 0-5 committed; an extend of rows 6-7 adds a key, and the write of its zeros into
    the rows on disk fails (a full disk): the extend stores nothing ("not stored": write
    them again), so the buffer must be as before, without the key. (It held the key with
    those rows' cells of it never written: every read failed with ChunkCorruptedError, and
    the next commit named the key, so the store reopened unreadable; found by the crash
    machine.)"""
    path = tmp_path / "rb.zarr"
    rb = _ring_of_8(path, 6)
    zeros = [0]

    def no_space_for_zeros(kind: str, where: object) -> None:
        if kind == "write" and str(where).endswith("data/extra"):  # (not its metadata)
            zeros[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(where))

    with observe_io(no_space_for_zeros), pytest.raises(StoreWriteError, match="not stored"):
        rb.extend(_rows(torch.tensor([6, 7])).set("extra", torch.ones(2)))
    assert zeros[0]
    assert len(rb) == 6
    got = rb.storage.get(torch.arange(6))
    assert "extra" not in set(got.keys())
    assert got["step"].tolist() == list(range(6))
    rb.extend(_rows(torch.tensor([6, 7])).set("extra", torch.ones(2)))  # written again
    got = rb.storage.get(torch.arange(8))
    assert got["extra"].tolist() == [0] * 6 + [1] * 2
    rb.storage.flush()
    assert crash_and_read(rb, path) == (list(range(8)), 0)
    with ZarrStorage(path=path, read_only=True) as reader:
        assert reader.get(torch.arange(8))["extra"].tolist() == [0] * 6 + [1] * 2


def test_a_failed_write_of_some_keys_of_a_withdrawn_last_row_keeps_its_cells(
    tmp_path: Path,
) -> None:
    """Row 7's write of some keys fails (kept to be written again), a commit withdraws the
    row (the committed length is 7), then a write of its other keys fails too: the cells
    the first write holds are not taken for cells never written (they were given zeros,
    which the reads and the disk then held; found by review)."""
    from torchrl.data import LazyTensorStorage

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    for b in (rb, twin):
        b.extend(_rows(torch.arange(8)))
    rb.storage.flush()
    for b in (rb, twin):
        b[torch.tensor([6])] = _rows(torch.tensor([60])).exclude("obs")  # block 1 moves
    twin[torch.tensor([7])] = _rows(torch.tensor([70])).exclude("obs")
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb[torch.tensor([7])] = _rows(torch.tensor([70])).exclude("obs")
    for b in (rb, twin):
        b.extend(_rows(torch.arange(100, 104)))  # rows 0-3, and a commit without row 7
    twin[torch.tensor([7])] = _rows(torch.tensor([77])).exclude("step", "r")
    with fail_at_row_write(1, 5), pytest.raises(StoreWriteError):
        rb[torch.tensor([7])] = _rows(torch.tensor([77])).exclude("step", "r")
    every = torch.arange(8)
    for key in ("step", "obs", "r"):
        assert torch.equal(rb.storage.get(every)[key], twin.storage.get(every)[key]), key
    rb.storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        for key in ("step", "obs", "r"):
            assert torch.equal(reader.get(every)[key], twin.storage.get(every)[key]), key


def test_a_committed_row_whose_overwrite_failed_in_place_survives_a_crash(tmp_path: Path) -> None:
    """Row 0 (committed) is written over twice: the first write moves its block to a slot
    of its own (no commit), the second, in place there, fails. The next commit must not
    withdraw row 0 (it named the block's new slot, where row 0 is torn, and declared a
    hole): it names the slot the last commit named, and a crash then reopens with row 0's
    committed value (found by review)."""
    from zarr_rb.testing import simulate_crash

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.arange(6)))
    rb.storage.flush()
    rb[torch.tensor([1])] = _rows(torch.tensor([10]))  # "index" left out: no commit
    with fail_at_row_write(1, 3), pytest.raises(StoreWriteError):
        rb[torch.tensor([0])] = _rows(torch.tensor([20]))
    assert rb.storage.get(torch.arange(2))["step"].tolist() == [20, 10]
    rb.extend(_rows(torch.arange(6, 8)))  # block 3 full: written, and a commit
    simulate_crash(rb.storage)
    with ZarrStorage(path=path) as reopened:
        assert reopened._store.unreadable_rows().size == 0
        assert len(reopened) == 8 or len(reopened) == 6
        # Each row as committed, or as written over since (the failed write is made
        # again with the extend's rows, before them).
        first, second = reopened.get(torch.arange(2))["step"].tolist()
        assert first in (0, 20)
        assert second in (1, 10)
    # Without a crash, the failed write is made again by the next flush, and committed.
    storage = ZarrStorage(8, path, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb[torch.tensor([1])] = _rows(torch.tensor([10]))
    with fail_at_row_write(1, 3), pytest.raises(StoreWriteError):
        rb[torch.tensor([0])] = _rows(torch.tensor([20]))
    rb.storage.flush()
    simulate_crash(rb.storage)
    with ZarrStorage(path=path, read_only=True) as reader:
        assert reader.get(torch.arange(2))["step"].tolist() == [20, 10]


def _states(rows: list[int], cursor: int, steps: list[int]) -> list[tuple[list[int], int]]:
    """The states of a ring of 8 rows holding ``rows`` with its writer at ``cursor``, then
    extended by each of ``steps`` in turn: (its rows' steps, its cursor) after each."""
    ring, states = list(rows), [(list(rows), cursor)]
    for step in steps:
        if cursor < len(ring):
            ring[cursor] = step
        else:
            ring.append(step)
        cursor = (cursor + 1) % 8
        states.append((list(ring), cursor))
    return states


def test_commits_wait_while_a_failed_write_over_committed_rows_waits(tmp_path: Path) -> None:
    """While a failed write over committed rows in place waits to be made again, the
    writer's commits wait (the next write to disk makes it again, first). A first version
    committed the rows the last commit declared in the block's old slot, but moved the
    cursor past rows extended into that block since, or declared rows extended after them:
    after a crash the store held a state the buffer never was in (found by review)."""
    path = tmp_path / "rb.zarr"
    # Rows 8 9 10 11 12 5 6 7, cursor 5; block 1 moved, row 4 torn in place (its write
    # over it puts the same step there).
    rb = _failed_in_place(path, [torch.arange(8), torch.arange(8, 13)], moved=6, torn=4, step=12)
    rb.extend(_rows(torch.arange(13, 16)))  # rows 5-7
    rb.extend(_rows(torch.tensor([16])))  # row 0: block 1 written
    committed = [8, 9, 10, 11, 12, 5, 6, 7]
    assert crash_and_read(rb, path) in _states(committed, 5, [13, 14, 15, 16])
    # The ring not full yet: rows extended into the block, then rows after them.
    path = tmp_path / "second.zarr"
    rb = _failed_in_place(path, [torch.arange(6)], moved=5, torn=4, step=4)
    rb.extend(_rows(torch.arange(6, 8)))
    rb.extend(_rows(torch.arange(8, 12)))  # rows 0-3: the ring wraps
    assert crash_and_read(rb, path) in _states(list(range(6)), 6, list(range(6, 12)))


def test_an_overwrite_after_a_failed_extend_commits_its_rows_in_order(tmp_path: Path) -> None:
    """Extend [0]; an extend of steps 1-8 (rows 1-7, then row 0) fails and waits in RAM; an
    overwrite of row 1 fills block 0 (row 0 holding step 8) and writes it. The commit then
    declared row 0 = step 8 while steps 2-7 waited: after a crash the store held a state the
    buffer never was in (found by review). A write to given rows that writes blocks waiting
    in RAM now writes them all."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=2), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(_rows(torch.tensor([0])))
    with fail_at_row_write(1, 1), pytest.raises(StoreWriteError):
        rb.extend(_rows(torch.arange(1, 9)))
    row = rb.storage.get(torch.tensor([1])).clone()
    row["r"] = torch.tensor([1000.0])
    rb[torch.tensor([1])] = row  # every key: a commit
    # The states the buffer went through: steps 0 to p - 1 extended, in a ring of 8 rows.
    states = []
    for p in range(10):
        ring: list[int | None] = [None] * 8
        for step in range(p):
            ring[step % 8] = step
        states.append(([step for step in ring if step is not None], p % 8))
    assert crash_and_read(rb, path) in states


def _ring(path: Path) -> tuple[ZarrStorage, TensorDictReplayBuffer]:
    """A ring of 16 rows in blocks of 4, without a tier of frames."""
    storage = ZarrStorage(16, path, compression=Compression(block_rows=4), ram_bytes=0)
    return storage, TensorDictReplayBuffer(storage=storage, batch_size=2)


def _no_room(error: type[BaseException] = MemoryError) -> Any:
    """Making a new block of RAM fails (``MemoryError``: no room for it)."""
    return mock.patch.object(WriteBuffer, "_new_block", side_effect=error)


@pytest.mark.parametrize(("error", "before"), [(MemoryError, 4), (KeyboardInterrupt, 3)])
def test_an_extend_that_fails_before_it_keeps_its_rows_leaves_a_hole_and_commits_go_on(
    tmp_path: Path, error: type[BaseException], before: int
) -> None:
    """An extend that fails before it holds its rows anywhere (no room for a block of RAM,
    or an interrupt while it copies them) loses those rows: TorchRL's writer has moved its
    cursor past them, so they are a hole, as rows withdrawn by a crash are. The rows
    extended after it are committed as usual: the store reopens as the buffer was, the
    hole included (found by review: commits waited at the hole until the ring came around
    to it, and a flush returned with the newer rows not committed)."""
    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(before)))
    # (From row 3: row 3 goes into the block waiting in RAM, rows 4-5 need a new one.)
    with _no_room(error), pytest.raises(error):
        rb.extend(steps(torch.arange(before, 6)))
    rb.extend(steps(torch.arange(6, 10)))
    assert (len(rb), int(rb._writer._cursor)) == (10, 10)
    assert storage._store.unreadable_rows().tolist() == [4, 5]
    rb.storage.flush()
    rb.storage.close()
    with ZarrStorage(path=path) as reopened:
        again = TensorDictReplayBuffer(storage=reopened, batch_size=2)
        assert (len(again), int(again._writer._cursor)) == (10, 10)
        assert reopened._store.unreadable_rows().tolist() == [4, 5]
        kept = torch.tensor([0, 1, 2, 3, 6, 7, 8, 9])
        assert reopened.get(kept)["step"].tolist() == kept.tolist()
        again.extend(steps(torch.arange(10, 16)))  # the first lap ends; the hole stays
        assert reopened._store.unreadable_rows().tolist() == [4, 5]
        again.extend(steps(torch.arange(16, 22)))  # the ring writes over the hole
        assert reopened._store.unreadable_rows().size == 0
        assert reopened.get(torch.arange(16))["step"].tolist()[:6] == list(range(16, 22))


def test_an_extend_that_fails_over_rows_of_the_last_lap_leaves_their_values(
    tmp_path: Path,
) -> None:
    """Over rows that hold the last lap's values, an extend that fails before it keeps its
    rows leaves those values, as LazyTensorStorage's memory does: no hole, and the
    commits after it declare them."""
    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(16)))
    with _no_room(), pytest.raises(MemoryError):
        rb.extend(steps(torch.arange(100, 102)))
    rb.extend(steps(torch.arange(102, 106)))
    expected = [0, 1, 102, 103, 104, 105, *range(6, 16)]
    assert storage._store.unreadable_rows().size == 0
    got = storage.get(torch.arange(16))
    assert got["step"].tolist() == expected
    assert got["obs"].tolist() == steps(torch.tensor(expected))["obs"].tolist()
    rb.storage.flush()
    rb.storage.close()
    with ZarrStorage(path=path) as reopened:
        again = TensorDictReplayBuffer(storage=reopened, batch_size=2)
        assert (len(again), int(again._writer._cursor)) == (16, 6)
        assert reopened.get(torch.arange(16))["step"].tolist() == expected


def _crash_and_reopen(storage: ZarrStorage, path: Path) -> ZarrStorage:
    from zarr_rb.testing import simulate_crash

    simulate_crash(storage)
    return ZarrStorage(path=path)


def test_rows_a_failed_extend_lost_last_are_committed_as_holes(tmp_path: Path) -> None:
    """The lost rows come last (nothing extended after them): a flush commits the rows
    before them and declares them as holes (found by review of the first version, whose
    commits then declared nothing, and a crash, or even a clean close, reopened empty)."""
    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(3)))
    with _no_room(), pytest.raises(MemoryError):
        rb.extend(steps(torch.arange(3, 6)))  # row 3 waits in block 0; rows 4-5 are lost
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert len(reopened) == 6
        assert reopened._store.unreadable_rows().tolist() == [4, 5]
        assert reopened.get(torch.arange(4))["step"].tolist() == [0, 1, 2, 3]


def test_a_failed_write_leaves_no_row_of_ram_torn(tmp_path: Path) -> None:
    """A write at rows 5 and 9 fails making the block for row 5, while row 9 waits in RAM
    from an earlier extend: both keep their values, frames included (found by review:
    the tier of frames took the failed call's frame for row 9, beside its old step)."""

    def rows(values: list[int]) -> TensorDict:
        step = torch.tensor(values)
        frames = step.to(torch.uint8)[:, None, None, None].expand(-1, 4, 84, 84).clone()
        return TensorDict({"step": step, "index": step, "obs": frames}, [len(values)])

    def pairs(storage: ZarrStorage) -> list[tuple[int, int]]:
        got = storage.get(torch.tensor([5, 9]))
        return [(int(s), int(o[0, 0, 0])) for s, o in zip(got["step"], got["obs"], strict=True)]

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=4))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(rows(list(range(10))))  # rows 8-9 wait in RAM
    assert storage._store.ram.frames is not None
    with _no_room(), pytest.raises(MemoryError):
        storage.set(torch.tensor([5, 9]), rows([55, 99]))
    assert pairs(storage) == [(5, 5), (9, 9)]
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert pairs(reopened) == [(5, 5), (9, 9)]


def test_a_failure_copying_a_block_out_keeps_its_rows(tmp_path: Path) -> None:
    """An extend takes a block partly filled by an earlier extend out of RAM to write it,
    and copying its rows out fails: the block stays in RAM with the earlier rows (found by
    review: they were gone, unreadable, and commits stopped short of them)."""
    from zarr_rb.core import write_cache

    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(2)))
    storage.flush()
    rb.extend(steps(torch.arange(2, 3)))  # row 2 waits in RAM, in block 0 (rows 0-1 on disk)
    copy = write_cache.block_write

    def no_room(block: write_cache.Block) -> write_cache.Write:
        if not block.full:
            raise MemoryError
        return copy(block)

    with mock.patch.object(write_cache, "block_write", no_room), pytest.raises(MemoryError):
        rb.extend(steps(torch.arange(3, 6)))  # goes past block 0: takes it out, rows 2-3
    # (Rows 3-5 were staged before it failed: they wait in RAM with row 2.)
    assert storage.get(torch.arange(6))["step"].tolist() == list(range(6))
    rb.extend(steps(torch.arange(6, 8)))
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert reopened.get(torch.arange(8))["step"].tolist() == list(range(8))


def test_an_interrupt_copying_into_a_new_block_leaves_no_empty_block(tmp_path: Path) -> None:
    """An interrupt while rows are copied into a new block of RAM leaves no block there:
    a later write that fails keeps its rows and raises StoreWriteError (found by review: an
    empty block stayed, and keeping the failed write raised ValueError and dropped it)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(16, path, compression=Compression(block_rows=4), ram_bytes=0)
    storage.set(torch.arange(3), steps(torch.arange(3)))  # rows 0-2 wait in block 0
    put = Block.put

    def interrupted(block: Block, *args: Any, **kwargs: Any) -> None:
        if not block.dirty.any():
            raise KeyboardInterrupt
        put(block, *args, **kwargs)

    with mock.patch.object(Block, "put", interrupted), pytest.raises(KeyboardInterrupt):
        storage.set(torch.tensor([13, 14]), steps(torch.tensor([13, 14])))
    assert [block.index for block in storage._store.write_cache.held()] == [0]

    def no_space(kind: str, where: object) -> None:
        if kind == "write" and "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")

    with observe_io(no_space), pytest.raises(StoreWriteError):
        storage.set(torch.arange(3, 9), steps(torch.arange(3, 9)))
    assert storage.get(torch.arange(9))["step"].tolist() == list(range(9))
    storage.flush()
    assert storage.get(torch.arange(9))["step"].tolist() == list(range(9))


def test_holes_at_the_end_stay_holes_in_the_commits_after_a_reopen(tmp_path: Path) -> None:
    """Rows lost at the end of the ring are committed as holes; after a reopen, the next
    commits keep them inside the length (found by review: the writer reopened knew nothing
    of them, and its next commit cut the length back to the rows before them)."""
    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(12)))
    with _no_room(), pytest.raises(MemoryError):
        rb.extend(steps(torch.arange(12, 19)))  # rows 12-15 lost; rows 0-2 keep theirs
    storage.flush()
    storage = _crash_and_reopen(storage, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(steps(torch.arange(100, 103)))
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert len(reopened) == 16
        assert reopened._store.unreadable_rows().tolist() == [12, 13, 14, 15]
        assert reopened.get(torch.arange(6))["step"].tolist() == [0, 1, 2, 100, 101, 102]


def test_a_call_interrupted_while_it_waits_for_the_block_written_behind(tmp_path: Path) -> None:
    """An extend interrupted while it waits for the block written before it: its rows are
    lost like those of any call that failed before it kept them, and commits go on (found
    by review: that wait came before the call's failure handling, and commits stopped at
    its rows)."""
    from zarr_rb.core.solo_behind import SoloBehind
    from zarr_rb.core.solo_writes import SoloWrites

    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(2)))
    rb.extend(steps(torch.arange(2, 4)))  # block 0 filled in RAM: written behind
    finish = SoloWrites._finish_write

    def interrupted(self: SoloWrites, started: Any, *, what: str = "writing rows") -> None:
        if "earlier extend" in what:
            raise KeyboardInterrupt
        finish(self, started, what=what)

    with (
        mock.patch.object(SoloBehind, "_in_flight_landed", return_value=True),
        mock.patch.object(SoloWrites, "_finish_write", interrupted),
        pytest.raises(KeyboardInterrupt),
    ):
        rb.extend(steps(torch.arange(4, 6)))
    rb.extend(steps(torch.arange(6, 10)))
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert len(reopened) == 10
        assert reopened._store.unreadable_rows().tolist() == [4, 5]
        kept = torch.tensor([0, 1, 2, 3, 6, 7, 8, 9])
        assert reopened.get(kept)["step"].tolist() == kept.tolist()


def test_a_row_interrupted_between_its_keys_is_not_read_torn(tmp_path: Path) -> None:
    """A write over a row waiting in RAM interrupted after its first key: the row is not
    read with the new value of one key beside the old value of another (found by review:
    it was, and a flush committed it so), nor lost (a later version held no data until
    written again): it holds its values before the write, whole."""
    path = tmp_path / "rb.zarr"
    storage, rb = _ring(path)
    rb.extend(steps(torch.arange(6)))  # rows 4-5 wait in RAM
    put, calls = Block.put, []

    def interrupted(self: Block, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:  # after the first key of the row
            raise KeyboardInterrupt
        put(self, *args, **kwargs)

    every = steps(torch.tensor([55]))
    every["index"] = torch.tensor([5])
    for row, held in ((steps(torch.tensor([55])), 5), (every, 55)):  # some keys, every key
        calls.clear()
        with mock.patch.object(Block, "put", interrupted), pytest.raises(KeyboardInterrupt):
            storage.set(torch.tensor([5]), row)
        before = storage.get(torch.tensor([5]))
        assert before["step"].tolist() == [held]
        assert torch.equal(before["obs"], steps(torch.tensor([held]))["obs"])
        storage.set(torch.tensor([5]), every)  # written again
        assert storage.get(torch.tensor([5]))["step"].tolist() == [55]
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert reopened.get(torch.arange(6))["step"].tolist() == [0, 1, 2, 3, 4, 55]


def test_a_failed_call_reads_its_rows_again_into_the_mirror_alone(tmp_path: Path) -> None:
    """A failed call re-reads the small leaves of its own rows into the mirror, as the
    write buffer and the store hold them: the copies of the other rows stay (before, the
    whole mirror was dropped and read again at the next read, up to 256 MB per failure)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(32, path, compression=Compression(block_rows=4), ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(steps(torch.arange(14)))  # rows 12-13 wait in RAM
    storage.get(torch.arange(14))  # the mirror takes its copies
    mirror = storage._store.ram.mirror
    held = set(mirror.held_keys())
    assert held
    with _no_room(), pytest.raises(MemoryError):  # (no room for row 20's block)
        rb.extend(steps(torch.tensor([133, 166, 177, 188, 199, 200, 201])))  # rows 14-20
    assert set(mirror.held_keys()) == held  # not dropped
    assert storage.get(torch.arange(14))["step"].tolist() == list(range(14))
    storage.flush()
    with _crash_and_reopen(storage, path) as reopened:
        assert reopened.get(torch.arange(14))["step"].tolist() == list(range(14))


def test_an_archive_write_whose_history_commit_fails_leaves_the_buffer_as_it_was(
    tmp_path: Path,
) -> None:
    """In an archive, an extend over rows extended since the last commit commits those
    first (the history has them as extended). When that commit meets a full disk, the
    call stores nothing and says so, and TorchRL's writer and length stay as they were:
    the same extend, made again, stores its rows (found by review: the writer had moved
    past rows never stored, as holes and old rows, and the error said a flush would write
    them)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(8, path, compression=Compression(block_rows=4), archive=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(steps(torch.arange(6)))  # rows 4-5 wait in RAM, extended
    again = steps(torch.arange(6, 14))  # rows 6, 7, then 0-5: over rows 4-5
    with fail_at_row_write(1), pytest.raises(StoreWriteError, match="were not stored"):
        rb.extend(again)
    assert (len(rb), int(rb._writer._cursor)) == (6, 6)
    assert storage.unreadable_rows().tolist() == []
    assert storage.get(torch.arange(6))["step"].tolist() == list(range(6))
    rb.extend(again)
    assert storage.get(torch.arange(8))["step"].tolist() == [8, 9, 10, 11, 12, 13, 6, 7]
    storage.close()
    history = ZarrStorage(path=path, read_only=True, history=True)
    assert history.get(torch.arange(len(history)))["step"].tolist() == list(range(14))
    history.close()
