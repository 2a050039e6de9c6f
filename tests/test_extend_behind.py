"""An extend's whole blocks, whose frames the RAM tier holds, are written behind together,
as one write, while the next rows come (``docs/design/block-writes.md``, "The whole blocks
of an extend"). Writes here land only when waited for (``writes_held_back``), so that a
crash finds the blocks in flight not on disk at all, as a SIGKILL in the middle of their
write would. Every row is read back against LazyTensorStorage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fail_at_row_write, writes_held_back
from tensordict import TensorDict
from test_lent_frames import ROWS, Episode, assert_same_rows, buffers, extend
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import StoreWriteError, ZarrStorage
from zarr_rb.testing import simulate_crash


def in_flight(rbs: tuple[TensorDictReplayBuffer, ...]) -> list[int]:
    """The blocks of the ZarrStorage's write in flight."""
    return [block.index for block in rbs[0].storage._store.write_cache.writing]


def committed_length(path: Path) -> int:
    with ZarrStorage(path=path, read_only=True) as reader:
        return len(reader)


def rows_of(rb: TensorDictReplayBuffer) -> TensorDict | None:
    return rb.storage.get(torch.arange(len(rb))).exclude("index") if len(rb) else None


def test_an_extend_of_whole_blocks_writes_them_behind_together(tmp_path):
    """Three whole blocks are one write in flight, read from RAM meanwhile and declared by
    no commit; the next extend finishes it and commits them before it starts its own."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rbs = buffers(path)
        episode = Episode()
        extend(rbs, episode, 24)
        assert in_flight(rbs) == [0, 1, 2]
        assert_same_rows(rbs)
        assert committed_length(path) == 0
        extend(rbs, episode, 8)
        assert in_flight(rbs) == [3]
        assert committed_length(path) == 24
        assert_same_rows(rbs)
        rbs[0].storage.flush()
        assert committed_length(path) == ROWS
    rbs[0].storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        twin = rbs[1]
        assert_same_rows((TensorDictReplayBuffer(storage=reader), twin))


def test_the_frames_of_an_extends_whole_blocks_stay_in_the_tier(tmp_path):
    """Staged to be written behind, a whole block holds copies of the small leaves alone:
    its frames are the tier's (lent), never copied into the block."""
    with writes_held_back():
        rbs = buffers(tmp_path / "rb.zarr")
        extend(rbs, Episode(), 16)
        blocks = rbs[0].storage._store.write_cache.writing
        assert [block.index for block in blocks] == [0, 1]
        assert all(block.lent.all() and not block.frames_touched for block in blocks)
        assert_same_rows(rbs)
    rbs[0].storage.close()


@pytest.mark.parametrize("crash_after", range(1, 7))
def test_a_crash_with_whole_blocks_in_flight_reopens_at_the_rows_before_them(tmp_path, crash_after):
    """Extends of 16 rows (two blocks each) go twice around a ring of four blocks; the
    writer dies after the ``crash_after``-th, whose blocks never landed: the store reopens
    with the rows of every extend before it, every row as written (past the first lap, its
    blocks moved to free slots: the commits made while they were in flight name the old
    ones), and the cursor where that extend started."""
    path = tmp_path / "rb.zarr"
    with writes_held_back() as held:
        rbs = buffers(path)
        episode = Episode()
        before: tuple[TensorDict | None, int] = (None, 0)
        for _ in range(crash_after):
            before = (rows_of(rbs[1]), int(rbs[1]._writer._cursor))
            extend(rbs, episode, 16)
        assert len(in_flight(rbs)) == 2
        held.drop()
        simulate_crash(rbs[0].storage)
    expected, cursor = before
    with ZarrStorage(path=path) as reopened:
        rb = TensorDictReplayBuffer(storage=reopened)
        assert len(rb) == (0 if expected is None else expected.shape[0])
        assert int(rb._writer._cursor) == cursor
        if expected is not None:
            assert (rows_of(rb) == expected).all()


def test_a_failed_write_of_whole_blocks_behind_is_raised_by_the_next_extend(tmp_path):
    """The write of an extend's whole blocks fails when the next extend finishes it (and so
    does that extend's own write): that extend raises, having kept every row, the store
    stays at its last commit, every row reads as written, and a flush once the disk has
    room commits them all."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rbs = buffers(path)
        episode = Episode()
        extend(rbs, episode, 8)
        extend(rbs, episode, 16)  # block 0 lands and is committed; blocks 1-2 in flight
        assert in_flight(rbs) == [1, 2]
        data = episode.rows(8)
        with fail_at_row_write(1, 100), pytest.raises(StoreWriteError):
            rbs[0].extend(data)
        rbs[1].extend(data)
    assert committed_length(path) == 8
    assert_same_rows(rbs)
    rbs[0].storage.flush()
    assert committed_length(path) == ROWS
    assert_same_rows(rbs)
    rbs[0].storage.close()
