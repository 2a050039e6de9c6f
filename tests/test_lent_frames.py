"""Rows waiting in the write buffer leave their frames to the RAM tier, which holds them
already (``docs/design/ram-tier.md``, "The write buffer's frames"): a block holds the
stacks of its rows only from when it is written, and rows the tier lets go first have their
frames copied into their block. Every test reads the rows back against LazyTensorStorage.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import assert_identical, fail_at_row_write, writes_held_back
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.core.frame_lending import FrameLending
from zarr_rb.core.frames import FrameTier

ROWS = 32
BLOCK = 8
FRAME = (16, 16)  # a stack of 4 is 1,024 bytes: a large leaf, kept by frame


class Episode:
    """Rows of an episode of stacked frames: ``obs[t]`` is frames ``t..t+3``, and
    ``("next", "obs")[t]`` is ``obs[t + 1]``; frames differ from step to step."""

    def __init__(self) -> None:
        self.t = 0

    def rows(self, n: int) -> TensorDict:
        steps = torch.arange(self.t, self.t + n + 4)
        frames = (steps[:, None, None] * 13 + torch.arange(256).view(FRAME)) % 251
        frames = frames.to(torch.uint8)
        obs = torch.stack([frames[i : i + 4] for i in range(n)])
        nxt = torch.stack([frames[i + 1 : i + 5] for i in range(n)])
        data = {"step": steps[:n], "obs": obs, "next": {"obs": nxt}}
        self.t += n
        return TensorDict(data, [n])


def buffers(
    path: Path, ram_bytes: int = 2**20, *, frames: bool | None = None
) -> tuple[TensorDictReplayBuffer, ...]:
    compression = Compression(block_rows=BLOCK, frames=frames)
    zarr = ZarrStorage(ROWS, path, compression=compression, ram_bytes=ram_bytes)
    twin = LazyTensorStorage(ROWS)
    return tuple(TensorDictReplayBuffer(storage=s, batch_size=4) for s in (zarr, twin))


def extend(rbs: tuple[TensorDictReplayBuffer, ...], episode: Episode, n: int) -> None:
    data = episode.rows(n)
    for rb in rbs:
        rb.extend(data)


def assert_same_rows(rbs: tuple[TensorDictReplayBuffer, ...]) -> None:
    rb, twin = rbs
    assert len(rb) == len(twin)
    every = torch.arange(len(twin))
    assert_identical(
        rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
    )


def extends_whose_writes_fail(
    rbs: tuple[TensorDictReplayBuffer, ...], episode: Episode, *, rows: int, times: int
) -> None:
    """``times`` extends of ``rows`` rows while every write of row data fails (some extends
    raise; their rows wait for a retry), then a flush that writes them."""
    failed = 0
    with fail_at_row_write(1, 100):
        for _ in range(times):
            data = episode.rows(rows)
            try:
                rbs[0].extend(data)
            except StoreWriteError:
                failed += 1
            rbs[1].extend(data)
            assert_same_rows(rbs)
    assert failed
    assert_same_rows_through_a_flush(rbs)


def assert_same_rows_through_a_flush(rbs: tuple[TensorDictReplayBuffer, ...]) -> None:
    """The rows read the same before a flush and after it; the store is closed."""
    assert_same_rows(rbs)
    rbs[0].storage.flush()
    assert_same_rows(rbs)
    rbs[0].storage.close()


def test_rows_the_tier_holds_wait_without_their_frames(tmp_path):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 5)  # part of block 0: it waits in RAM
    store = rbs[0].storage._store
    cache = store.write_cache
    assert cache.lent_rows().tolist() == list(range(5))
    (block,) = list(cache)
    assert not block.frames_touched  # its frames' memory never written: no pages
    frames_bytes = sum(
        block.values[key].untyped_storage().nbytes() for key in store.ram.frames.keys
    )
    assert (
        cache.nbytes
        == sum(v.untyped_storage().nbytes() for v in block.values.values()) - frames_bytes
    )
    assert_same_rows_through_a_flush(rbs)
    reopened = ZarrStorage(ROWS, tmp_path / "rb.zarr")
    first = torch.arange(5)
    assert_identical(
        reopened.get(first).exclude("index"), rbs[1].storage.get(first).exclude("index")
    )
    reopened.close()


def test_a_writer_holds_the_stacks_of_one_block_at_a_time(tmp_path):
    """The block being written (or kept for the next) holds stacks, the block being filled
    none."""
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 3)
    cache = rbs[0].storage._store.write_cache
    (filling,) = list(cache)
    frames = {"obs", ("next", "obs")}
    small = sum(v.untyped_storage().nbytes() for k, v in filling.values.items() if k not in frames)
    stacks = sum(v.untyped_storage().nbytes() for k, v in filling.values.items() if k in frames)
    for _ in range(12):
        extend(rbs, episode, 3)
        # The block filling's small leaves, and at most one block with its stacks.
        assert cache.nbytes <= small + (small + stacks)
        for block in cache:
            assert not block.frames_touched
        assert_same_rows(rbs)
    rbs[0].storage.close()


def test_rows_the_tier_evicts_keep_their_frames(tmp_path):
    """A budget of a few rows: the tier evicts rows still waiting in RAM, whose frames are
    copied into their block first."""
    rbs = buffers(tmp_path / "rb.zarr", ram_bytes=ROWS * 2 * 4 * 4 + 6 * 256 + 4_000)
    episode = Episode()
    for n in (3, 3, 3, 3, 5, 7, 2):
        extend(rbs, episode, n)
        assert_same_rows(rbs)
    tier = rbs[0].storage._store.ram.frames
    assert tier is not None
    assert not tier.resident.all()
    assert_same_rows_through_a_flush(rbs)


def test_a_new_budget_keeps_the_frames_of_rows_lent_to_the_tier_before(tmp_path):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 5)
    store = rbs[0].storage._store
    store.ram.keep_in_ram(2**22)  # a new tier: the rows it did not read in are not lent
    assert store.write_cache.lent_rows().size == 0
    assert_same_rows(rbs)
    extend(rbs, episode, 7)
    assert_same_rows_through_a_flush(rbs)


def test_a_new_budget_whose_tier_cannot_be_made_keeps_the_tier_before(tmp_path):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 5)  # lent to the tier
    store = rbs[0].storage._store
    with (
        mock.patch.object(FrameTier, "__init__", side_effect=MemoryError),
        pytest.raises(MemoryError),
    ):
        store.ram.keep_in_ram(2**22)
    assert_same_rows(rbs)  # (read from the tier they lent their frames to)
    extend(rbs, episode, 7)
    assert_same_rows_through_a_flush(rbs)


def test_writing_one_frames_key_of_lent_rows_keeps_the_other(tmp_path):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 5)
    index = torch.tensor([1, 3])
    new = TensorDict({"obs": torch.full((2, 4, *FRAME), 7, dtype=torch.uint8)}, [2])
    for rb in rbs:
        rb.storage.set(index, new, set_cursor=False)
    store = rbs[0].storage._store
    assert store.write_cache.lent_rows().tolist() == [0, 2, 4]
    assert_same_rows_through_a_flush(rbs)


def test_a_failed_block_write_keeps_the_frames_of_its_rows(tmp_path):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 2)  # (the arrays are created)
    # Block 0 fills at the third extend: its write fails, then waits again.
    extends_whose_writes_fail(rbs, episode, rows=3, times=5)


@pytest.mark.parametrize("rows", [5, BLOCK], ids=["staged", "written at once"])
def test_rows_a_failed_put_left_in_the_tier_are_read_as_written(tmp_path, rows):
    """A put into the tier that fails takes the rows out of the tier; one interrupted
    before it did (here: a put that raises at once) left the rows' older frames there. The
    write goes on, and its rows read back as written, not as the tier's older frames."""
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 2 * BLOCK)
    rbs[0].storage.flush()
    index = torch.arange(rows)
    again = episode.rows(rows)
    with (
        mock.patch.object(FrameTier, "put", side_effect=KeyboardInterrupt),
        pytest.raises(KeyboardInterrupt),
    ):
        rbs[0].storage.set(index, again, set_cursor=False)
    rbs[1].storage.set(index, again, set_cursor=False)
    assert_same_rows_through_a_flush(rbs)


def test_rows_staged_after_the_tier_was_replaced_are_not_lent_to_it(tmp_path):
    """A new budget replaces the tier between a write's put into it and the staging of its
    rows (another storage opened on the store; here, inside the write): the rows keep their
    frames in their block, since the new tier does not hold them."""
    from zarr_rb.core.solo_staging import SoloStaging

    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 3)
    store = rbs[0].storage._store
    writes_for = SoloStaging._writes_for

    def replaced(self, *args, **kwargs):
        store.ram.keep_in_ram(2**22)
        return writes_for(self, *args, **kwargs)

    with mock.patch.object(SoloStaging, "_writes_for", replaced):
        extend(rbs, episode, 3)
    assert store.write_cache.lent_rows().size == 0
    assert_same_rows_through_a_flush(rbs)


def test_rows_whose_eviction_was_interrupted_go_first_later(tmp_path):
    """An eviction interrupted in the write buffer's copy of the frames leaves its rows in the
    tier, still the first to be evicted (they were lost to eviction for good: the tier kept
    them until they were written again)."""
    rbs = buffers(tmp_path / "rb.zarr", ram_bytes=ROWS * 2 * 4 * 4 + 10 * 256)
    episode = Episode()
    extend(rbs, episode, 4)  # 8 frames of the 10 the tier holds
    tier = rbs[0].storage._store.ram.frames
    assert tier is not None
    keep = tier.before_release
    calls = []

    def interrupted_once(rows):
        calls.append(rows)
        if len(calls) == 1:
            raise KeyboardInterrupt
        keep(rows)

    tier.before_release = interrupted_once
    data = episode.rows(4)
    with pytest.raises(KeyboardInterrupt):
        rbs[0].extend(data)  # 4 new frames: the tier evicts rows 0-3, interrupted
    rbs[1].extend(data)  # (the rows are stored: the tier's error is raised after)
    first = calls[0].tolist()
    assert first == [0, 1, 2, 3]
    assert tier.resident[first].all()
    assert_same_rows(rbs)
    extend(rbs, episode, 4)
    assert not tier.resident[first].any()  # evicted first
    assert_same_rows_through_a_flush(rbs)


@pytest.fixture
def blocks_kept(monkeypatch) -> list[int]:
    """The blocks whose tensors took the frames of rows they lent to the tier."""
    kept: list[int] = []
    keep = FrameLending.keep

    def spied(self, block, offsets):
        if offsets.size:
            kept.append(block.index)
        return keep(self, block, offsets)

    monkeypatch.setattr(FrameLending, "keep", spied)
    return kept


@pytest.mark.parametrize("frames", [None, False], ids=["frames on disk", "stacks on disk"])
def test_a_full_block_stored_as_frames_is_written_from_the_tier(tmp_path, blocks_kept, frames):
    """Rows stored as frames on disk (the default for them): a full block the tier holds is
    written from the tier's frames, and its tensors never take the stacks (no pages); stored
    as stacks, it takes them to be written. Rows read back as written either way."""
    rbs = buffers(tmp_path / "rb.zarr", frames=frames)
    episode = Episode()
    for n in (3, 3, 2, 8, 5, 3, 16):  # (16: two full blocks in one write, not behind)
        extend(rbs, episode, n)
        assert_same_rows(rbs)
    stored = rbs[0].storage._store.meta.schema.frames
    assert bool(stored) == (frames is None)
    assert (blocks_kept == []) == (frames is None)
    assert_same_rows_through_a_flush(rbs)


@pytest.mark.parametrize("n", [8, 16], ids=["one block, behind", "two blocks, at once"])
def test_a_failed_write_of_blocks_from_the_tier_waits_with_their_frames(tmp_path, n):
    rbs = buffers(tmp_path / "rb.zarr")
    episode = Episode()
    extend(rbs, episode, 8)  # (the arrays are created, block 0 waits or is written)
    rbs[0].storage.flush()
    extends_whose_writes_fail(rbs, episode, rows=n, times=3)


def test_rows_of_the_block_being_written_are_read_from_the_tier(tmp_path):
    """The block being written holds its rows' stacks, copied from the tier, which still
    holds their frames: a read of them is one gather from the tier per key, as for rows on
    disk (read from the block instead, a sample mixing both took twice as long)."""
    gathers: list[list[int]] = []
    gather = FrameTier.gather

    def spied(self, key, rows):
        gathers.append(rows.tolist())
        return gather(self, key, rows)

    with writes_held_back():
        rbs = buffers(tmp_path / "rb.zarr")
        episode = Episode()
        for n in (3, 3, 2):  # block 0 fills: written behind, held back
            extend(rbs, episode, n)
        cache = rbs[0].storage._store.write_cache
        assert cache.writing is not None
        assert cache.writing.index == 0
        every = list(range(BLOCK))
        with mock.patch.object(FrameTier, "gather", spied):
            rbs[0].storage.get(torch.tensor(every))
        assert gathers == [every, every]  # obs, ("next", "obs")
        assert_same_rows_through_a_flush(rbs)
