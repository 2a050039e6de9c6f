"""A writer of a shared store samples one commit: the sampler's scan, the length and cursor
it draws from, and the rows the buffer gathers then, even when other writers commit in
between. Rows whose slots another writer took again meanwhile raise rather than come back
written over; a random draw is then drawn again from the newest commit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from interrupted import DrawnThenInterrupted, Interrupted
from tensordict import TensorDict
from torchrl.data import SliceSampler, TensorDictReplayBuffer
from writer_process import slices_beside_a_writer

import zarr_rb
from zarr_rb import Compression, RowsNotCommittedError, ZarrStorage

RING = 32
EPISODE = 4
BLOCKS = Compression(block_rows=8)


def episodes(first: int, count: int) -> TensorDict:
    """Rows ``first`` to ``first + count`` of episodes of :data:`EPISODE` steps."""
    step = torch.arange(first, first + count)
    return TensorDict(
        {"step": step, "episode": step // EPISODE, "obs": step.view(-1, 1).expand(-1, 4).clone()},
        batch_size=[count],
    )


def check_slices(batch: TensorDict, length: int = EPISODE) -> None:
    """Each slice is ``length`` consecutive steps of one episode, each row whole."""
    steps = batch["step"].view(-1, length)
    assert bool((steps[:, 1:] - steps[:, :-1] == 1).all()), steps.tolist()
    assert torch.equal(batch["episode"].view(-1, length), steps // EPISODE), steps.tolist()
    if "obs" in batch.keys():  # noqa: SIM118 (a TensorDict has no __contains__)
        assert torch.equal(batch["obs"][:, 0], batch["step"])


class Other:
    """Another writer of the shared store, in this process (a storage of its own)."""

    def __init__(self, path: Path) -> None:
        storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
        self.rb = TensorDictReplayBuffer(storage=storage)
        self.next = 0
        self.extend(RING)

    def extend(self, count: int, *, by: int | None = None) -> None:
        """``count`` rows, committed ``by`` rows at a time (all at once by default)."""
        by = by or count
        for first in range(0, count, by):
            n = min(by, count - first)
            self.rb.extend(episodes(self.next, n))
            self.next += n
            self.rb.storage.flush()


def sampler_writer(path: Path, sampler: Any, batch_size: int) -> TensorDictReplayBuffer:
    storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
    return TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=batch_size)


def test_slices_stay_whole_when_another_writer_commits_before_the_gather(tmp_path) -> None:
    """Another writer writes over more than half the ring between the scan and the gather:
    the slices are those of the scan, whole (before, the gather read the newer commit and
    joined two episodes: steps [228, 229, 198, 199])."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    sampler = Interrupted(
        lambda: other.extend(RING // 2 + 2), slice_len=EPISODE, traj_key="episode"
    )
    rb = sampler_writer(path, sampler, 3 * EPISODE)
    for _ in range(20):
        batch = rb.sample()
        check_slices(batch)
        assert bool((batch["step"] < other.next - (RING // 2 + 2)).all())  # (the scan's)
    rb.storage.close()
    other.rb.storage.close()


def test_a_sample_raises_when_its_rows_slots_were_taken_again(tmp_path) -> None:
    """Other writers go three times around the ring, 7 rows a commit, between the scan and
    the gather: the slots the scan's rows were in are written again, so the sample raises
    (nothing returned), and a sample with no commit in between works."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    busy = [True]

    def meanwhile() -> None:
        if busy[0]:
            other.extend(3 * RING, by=7)

    sampler = Interrupted(meanwhile, slice_len=EPISODE, traj_key="episode")
    rb = sampler_writer(path, sampler, 3 * EPISODE)
    with pytest.raises(RowsNotCommittedError, match="sample again"):
        rb.sample()
    busy[0] = False
    batch = rb.sample()
    check_slices(batch)
    assert bool((batch["step"] >= other.next - RING).all())
    rb.storage.close()
    other.rb.storage.close()


def test_a_random_draw_whose_slots_were_taken_again_is_drawn_again(tmp_path) -> None:
    """Other writers go three times around the ring between every other draw and its
    gather: the rows come from the newest commit, each whole."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    calls = [0]

    def meanwhile() -> None:
        calls[0] += 1
        if calls[0] % 2:
            other.extend(3 * RING, by=7)

    rb = sampler_writer(path, DrawnThenInterrupted(meanwhile), 16)
    for _ in range(10):
        batch = rb.sample()
        assert torch.equal(batch["obs"][:, 0], batch["step"])
        assert bool((batch["step"] >= other.next - RING).all()), batch["step"]
    rb.storage.close()
    other.rb.storage.close()


# --- another writer process that commits without pause -----------------------------------


def test_slices_are_whole_episodes_while_another_writer_process_commits(tmp_path) -> None:
    """Another process extends the shared 64-row ring by 1-23 rows and commits, without
    pause; this writer samples 4-step slices meanwhile: every slice it returns is 4
    consecutive steps of one episode."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(64, path, compression=BLOCKS, shared=True)
    rb = TensorDictReplayBuffer(
        storage=storage, sampler=SliceSampler(slice_len=4, traj_key="episode"), batch_size=32
    )
    rb.extend(TensorDict({"step": torch.arange(64), "episode": torch.arange(64) // 8}, [64]))
    rb.storage.flush()
    try:
        whole, raised = slices_beside_a_writer(path, rb, shared=True, first_step=64)
    finally:
        storage.close()
    assert raised < whole, (raised, whole)


def test_a_readers_slices_stay_whole_when_a_shared_writer_commits_before_the_gather(
    tmp_path,
) -> None:
    """A reader of a shared store: a writer writes over more than half the ring between
    the scan and the gather, into slots no writer held before. The slices are the scan's,
    whole, read through the map of its commit (before, such a sample raised: the rows had
    moved)."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    sampler = Interrupted(
        lambda: other.extend(RING // 2 + 2), slice_len=EPISODE, traj_key="episode"
    )
    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=path, read_only=True), sampler=sampler, batch_size=3 * EPISODE
    )
    for _ in range(20):
        batch = reader.sample()
        check_slices(batch)
        assert bool((batch["step"] < other.next - (RING // 2 + 2)).all())  # (the scan's)
    reader.storage.close()
    other.rb.storage.close()


def test_a_readers_sample_raises_when_its_rows_slots_were_taken_again(tmp_path) -> None:
    """A reader of a shared store, whose writers go three times around the ring between the
    scan and the gather: the slots of the scan's rows are written again, so it raises."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    sampler = Interrupted(
        lambda: other.extend(3 * RING, by=7), slice_len=EPISODE, traj_key="episode"
    )
    reader = TensorDictReplayBuffer(
        storage=ZarrStorage(path=path, read_only=True), sampler=sampler, batch_size=3 * EPISODE
    )
    with pytest.raises(RowsNotCommittedError, match="sample again"):
        reader.sample()
    reader.storage.close()
    other.rb.storage.close()


def _with_versions(path: Path) -> tuple[Other, Callable[[], None]]:
    """Another writer that kept 22 tagged saves (so the arrays grew past the slots writers
    take first), and what it does between a scan and a gather: it writes the ring once
    over (the scan's slots come free) and drops the saves, which collects free slots:
    their objects are deleted."""
    other = Other(path)
    for i in range(22):
        zarr_rb.save(other.rb, tag=f"v{i}", progress=False)
        other.extend(RING)

    def meanwhile() -> None:
        other.extend(RING)
        for i in range(22):
            zarr_rb.drop_version(path, f"v{i}")

    return other, meanwhile


@pytest.mark.parametrize("reader", [False, True], ids=["shared writer", "reader"])
def test_slots_a_collection_emptied_under_a_sample_raise_as_taken(tmp_path, reader) -> None:
    """A collection between the scan and the gather deletes the objects of the slots the
    scan's rows were in: the sample raises RowsNotCommittedError ("sample again"), not an
    error saying the store is damaged (found by review: ChunkCorruptedError, "chunk
    missing", as a collection counted no slot as taken)."""
    path = tmp_path / "rb.zarr"
    other, meanwhile = _with_versions(path)
    calls = [0]

    def once() -> None:
        calls[0] += 1
        if calls[0] == 1:
            meanwhile()

    sampler = Interrupted(once, slice_len=EPISODE, traj_key="episode")
    if reader:
        storage = ZarrStorage(path=path, read_only=True)
    else:
        storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=3 * EPISODE)
    with pytest.raises(RowsNotCommittedError, match="sample again"):
        rb.sample()
    check_slices(rb.sample())
    rb.storage.close()
    other.rb.storage.close()


def test_slices_stay_whole_when_the_writer_itself_commits_before_the_gather(tmp_path) -> None:
    """Another buffer on the same storage extends between the scan and the gather (as a
    collector thread does): the slices are the scan's, read through its commit's map, and
    none raises (found by review: all 20 raised, the rows having moved)."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
    collector = TensorDictReplayBuffer(storage=storage)
    state = {"next": other.next}

    def meanwhile() -> None:
        collector.extend(episodes(state["next"], RING // 2 + 2))
        state["next"] += RING // 2 + 2
        len(storage)  # (another thread's len picks up the record)

    sampler = Interrupted(meanwhile, slice_len=EPISODE, traj_key="episode")
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=3 * EPISODE)
    for _ in range(20):
        batch = rb.sample()
        check_slices(batch)
        assert bool((batch["step"] < state["next"] - (RING // 2 + 2)).all())  # (the scan's)
    storage.close()
    other.rb.storage.close()


def test_a_draw_never_gathered_is_let_go_by_refresh(tmp_path) -> None:
    """A sampler's draw called by itself holds the commit until a gather; ``refresh()``
    lets it go (found by review: ``len`` stayed the drawn commit's)."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    other.rb.empty()
    other.extend(RING // 2)
    assert len(rb) == RING // 2
    rb.sampler.sample(storage, 4)  # (drawn, never gathered)
    other.extend(RING // 2)
    assert len(rb) == RING // 2  # (the commit drawn from, until the gather)
    storage.refresh()
    assert len(rb) == RING
    storage.close()
    other.rb.storage.close()


def test_a_write_after_a_draw_never_gathered_keeps_another_writers_newer_rows(tmp_path) -> None:
    """A draw holds its commit; a write of some keys that follows it (before any gather)
    reads the other keys as the store has them now, not as the commit drawn from (found by
    review: another writer's newer values of the keys not written were written over with
    the older ones)."""
    path = tmp_path / "rb.zarr"
    other = Other(path)
    storage = ZarrStorage(RING, path, compression=BLOCKS, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    rb.sampler.sample(storage, 4)  # (drawn, never gathered)
    rewritten = episodes(1000, 4)
    rewritten["index"] = torch.arange(4)
    other.rb.storage.set(torch.arange(4), rewritten, set_cursor=False)
    storage.write_leaves(np.arange(4), {("step",): torch.tensor([-1, -2, -3, -4])})
    reader = ZarrStorage(path=path, read_only=True)
    rows = reader.get(torch.arange(4))
    assert rows["step"].tolist() == [-1, -2, -3, -4]
    assert rows["obs"][:, 0].tolist() == [1000, 1001, 1002, 1003]  # (the other writer's)
    reader.close()
    storage.close()
    other.rb.storage.close()
