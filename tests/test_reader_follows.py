"""A reader shows the commit whose rows it reads: a read that finds the writer's rows moved
since (the ring went on, rows written over) reads the newest commit, and the reader's
length, cursor and caches move with it, never rows of one commit under the length of
another, nor a row older than one it showed before."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.solo_slots import KEPT_COMMITS
from zarr_rb.errors import RowsNotCommittedError

RING = 32
BLOCKS = Compression(block_rows=8)


def steps(first: int, count: int) -> TensorDict:
    step = torch.arange(first, first + count)
    obs = step.view(-1, 1).expand(-1, 8).to(torch.uint8)
    return TensorDict({"step": step, "obs": obs}, batch_size=[count])


def test_a_row_read_again_is_never_older_than_it_was_shown(store_path) -> None:
    writer = ZarrStorage(RING, store_path, compression=BLOCKS)
    writer.set(torch.arange(RING), steps(0, RING))
    writer.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    assert reader._store is not writer._store
    index = torch.tensor([5])
    assert int(reader.get(index)["step"][0]) == 5  # (the last gather is kept)
    writer.set(torch.arange(8), steps(RING, 8))
    writer.flush()
    assert int(reader[5]["step"]) == 37  # a read finds the rows moved: the newest commit
    assert int(reader.get(index)["step"][0]) == 37  # not the gather kept before
    reader.close()
    writer.close()


def test_a_reader_shows_the_length_and_cursor_of_the_commit_it_reads(store_path) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(RING, store_path, compression=BLOCKS))
    rb.extend(steps(0, 16))
    rb.storage.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    assert len(reader) == 16
    rb.extend(steps(16, 24))  # around the ring: positions 0-7 hold steps 32-39
    rb.storage.flush()
    read = reader.get(torch.arange(16))["step"]  # rows 0-15 of the commit it finds
    assert read.tolist() == [*range(32, 40), *range(8, 16)]
    assert len(reader) == RING  # that commit's length ...
    assert reader._last_cursor == 7  # ... and the row written last
    everything = reader.get(torch.arange(RING))["step"]
    assert everything.tolist() == rb.storage.get(torch.arange(RING))["step"].tolist()
    reader.close()
    rb.storage.close()


def test_a_reader_that_reads_nothing_stays_where_it_refreshed(store_path) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(RING, store_path, compression=BLOCKS))
    rb.extend(steps(0, 16))
    rb.storage.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    rb.extend(steps(16, 8))
    rb.storage.flush()
    assert len(reader) == 16  # no read, no refresh: the commit it opened at
    reader.refresh()
    assert len(reader) == 24
    reader.close()
    rb.storage.close()


def test_a_readers_view_never_gives_keys_of_two_commits(store_path) -> None:
    """``rb[:]`` reads key by key: a key read after the writer moved the view's rows reads
    them as the view's commit has them while the writer keeps it, and raises after (the
    keys read before hold them as they were); a view taken again reads the new rows."""
    writer = ZarrStorage(RING, store_path, compression=BLOCKS)
    writer.set(torch.arange(RING), steps(0, RING))
    writer.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    view = reader[:]
    step = view["step"].clone()
    assert step.tolist() == list(range(RING))
    writer.set(torch.arange(8), steps(RING, 8))
    writer.flush()
    obs = view["obs"].clone()  # the view's commit, which the writer keeps
    assert torch.equal(obs[:, 0].long(), step % 256)
    for first in range(KEPT_COMMITS):  # (one block each: the writer keeps 8 commits)
        writer.set(torch.arange(8, 16), steps(100 + first * 8, 8))
        writer.flush()
    with pytest.raises(RowsNotCommittedError, match="take the view again"):
        view["obs"].clone()
    again = reader[:].to_tensordict()
    assert torch.equal(again["obs"][:, 0].long(), again["step"] % 256)
    assert again["step"][:8].tolist() == list(range(RING, RING + 8))
    reader.close()
    writer.close()


def test_an_episode_is_read_from_the_rows_it_was_found_in(store_path) -> None:
    """The writer writes over the ring after the view found its episodes: the episode read
    is one of the newer commit's, whole, never rows of two episodes."""

    def episodes(first: int, count: int, length: int) -> TensorDict:
        episode = torch.arange(first, first + count).repeat_interleave(length)
        done = torch.zeros(episode.numel(), 1, dtype=torch.bool)
        done[length - 1 :: length] = True
        obs = episode.float().view(-1, 1)
        return TensorDict(
            {"episode": episode, "obs": obs, "next": {"done": done}}, [episode.numel()]
        )

    rb = TensorDictReplayBuffer(storage=ZarrStorage(RING, store_path, compression=BLOCKS))
    rb.extend(episodes(0, 4, 8))
    rb.storage.flush()
    view = zarr_rb.open(store_path)
    assert len(view.episodes) == 4
    rb.extend(episodes(100, 2, 6))  # over positions 0-11: other episodes, other lengths
    rb.storage.flush()
    for number in range(len(view.episodes)):
        ids = view.episode(number)["episode"]
        assert ids.unique().numel() == 1, ids.tolist()
    rb.storage.close()


def test_episodes_are_found_again_when_the_writer_commits_during_the_scan(store_path) -> None:
    """The writer commits more rows (a ring not yet full) right after the scan of the
    episode keys read its first key: the next key reads at the new length, and the scan
    starts again there (it raised ValueError, found by review)."""

    def episodes(first: int, count: int, length: int) -> TensorDict:
        episode = torch.arange(first, first + count).repeat_interleave(length)
        done = torch.zeros(episode.numel(), 1, dtype=torch.bool)
        done[length - 1 :: length] = True
        reward = torch.ones(episode.numel(), 1)
        return TensorDict(
            {"episode": episode, "next": {"done": done, "reward": reward}}, [episode.numel()]
        )

    rb = TensorDictReplayBuffer(storage=ZarrStorage(64, store_path, compression=BLOCKS))
    rb.extend(episodes(0, 4, 5))
    rb.storage.flush()
    view = zarr_rb.open(store_path)
    arrays = view.storage.store.arrays
    read_all = arrays.read_all
    armed = [True]

    def commit_after_first_read(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = read_all(*args, **kwargs)
        if armed:
            armed.clear()
            rb.extend(episodes(100, 2, 5))
            rb.storage.flush()
        return out

    arrays.read_all = commit_after_first_read
    assert len(view.episodes) == 6
    assert not armed
    rb.storage.close()


def test_a_readers_view_gives_the_strings_of_its_commit(store_path) -> None:
    """An entry no tensor column holds (strings) is read in the view's commit too, not in
    the newest (found by review: its names came from the commit after its steps')."""
    from tensordict import NonTensorStack

    def rows(first: int, count: int) -> TensorDict:
        td = TensorDict({"step": torch.arange(first, first + count)}, [count])
        td["name"] = NonTensorStack(*[f"s{i}" for i in range(first, first + count)])
        return td

    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, store_path, compression=BLOCKS))
    rb.extend(rows(0, 16))
    rb.storage.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    view = reader[:]
    rb.extend(rows(16, 8))  # over rows 0-7
    rb.storage.flush()
    assert view["step"].tolist() == list(range(16))
    assert view.get("name").tolist() == [f"s{i}" for i in range(16)]
    reader.close()
    rb.storage.close()


def test_a_view_taken_after_many_commits_reads_the_newest(store_path) -> None:
    """A reader that read nothing while the writer committed more than it keeps takes a
    view of the newest commit (found by review: the view of its old commit raised at its
    first read)."""
    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, store_path, compression=BLOCKS))
    rb.extend(steps(0, 16))
    rb.storage.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    for first in range(16, 64, 4):
        rb.extend(steps(first, 4))
        rb.storage.flush()
    assert reader[:]["step"].tolist() == list(range(48, 64))
    assert len(reader) == 16
    reader.close()
    rb.storage.close()


def test_a_read_overtaken_by_every_commit_says_the_store_is_not_damaged(
    store_path, monkeypatch
) -> None:
    # Every attempt of the reader fails as a read of an object a writer is replacing does
    # (on S3, a shard deleted and created anew under it), and the writer commits meanwhile.
    writer = ZarrStorage(RING, store_path, compression=BLOCKS)
    writer.set(torch.arange(RING), steps(0, RING))
    writer.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    arrays = reader._store.arrays
    written = [RING]

    def overtaken(*args, **kwargs):
        writer.set(torch.arange(8), steps(written[0], 8))
        writer.flush()
        written[0] += 8
        raise ValueError(
            "array 'data/obs', rows 5, cannot be read back intact (NOT_FOUND: chunk missing); "
            "run python -m zarr_rb verify <store> --repair"
        )

    monkeypatch.setattr(arrays, "read_all", overtaken)
    with pytest.raises(RowsNotCommittedError) as raised:
        reader.get(torch.arange(RING))
    message = str(raised.value)
    assert "not damaged" in message
    assert "--repair" not in message  # (the store needs no repair)
    assert isinstance(raised.value.__cause__, ValueError)  # the last attempt's, chained
    monkeypatch.undo()
    reader.close()
    writer.close()
