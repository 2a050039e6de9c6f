"""Shared writers of one store (format 3) in one process, against the contract: every
writer and reader sees the rows LazyTensorStorage holds after the same writes in commit
order, never a torn row, never a stale one."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

from zarr_rb import Compression, NotSupportedError, ZarrStorage

BLOCKS_OF_4 = Compression(block_rows=4)


def rows(first: int, count: int) -> TensorDict:
    x = torch.arange(first, first + count)
    return TensorDict({"x": x, "y": x * 10}, batch_size=[count])


def test_a_writer_reads_rows_another_writer_put_in_a_slot_it_had_read_before(store_path):
    # Positions 0-3 are written twice by the other writer: first into a new slot (their
    # old one is freed), then into that old slot, taken again, at the same rows of the
    # arrays. The first writer, which read them before, must read the new rows, not its
    # copy in RAM of the rows that slot held before.
    mine = ZarrStorage(64, store_path, shared=True, compression=BLOCKS_OF_4)
    other = ZarrStorage(64, store_path, shared=True)
    twin = LazyTensorStorage(64)
    everything = torch.arange(64)
    try:
        mine.set(torch.arange(64), rows(0, 64))
        twin.set(torch.arange(64), rows(0, 64))
        assert torch.equal(mine.get(everything)["x"], everything)
        for first in (100, 200):
            other.set(torch.arange(4), rows(first, 4), set_cursor=False)
            twin.set(torch.arange(4), rows(first, 4), set_cursor=False)
        assert torch.equal(other.get(everything)["x"], twin.get(everything)["x"])
        assert torch.equal(mine.get(everything)["x"], twin.get(everything)["x"])
    finally:
        mine.close()
        other.close()


def test_an_extend_keeps_its_rows_in_order_when_its_writers_cursor_wraps(store_path):
    # Each buffer's writer keeps a cursor of its own; the store places an extend at the
    # record's cursor. When the writer's cursor wraps inside the extend (its index is
    # [6, 7, 0, 1]) but the record's does not, the rows must still go in the order
    # extended (a trajectory stays contiguous), where the returned index says.
    one = TensorDictReplayBuffer(
        storage=ZarrStorage(8, store_path, shared=True, compression=BLOCKS_OF_4), batch_size=2
    )
    two = TensorDictReplayBuffer(storage=ZarrStorage(8, store_path, shared=True), batch_size=2)
    twin = LazyTensorStorage(8)
    try:
        for buffer, data in ((one, rows(0, 6)), (two, rows(100, 4)), (one, rows(200, 4))):
            index = buffer.extend(data)
            twin.set(index, data)
            assert torch.equal(index, (index[0] + torch.arange(len(data))) % 8)
        everything = torch.arange(8)
        assert torch.equal(one.storage.get(everything)["x"], twin.get(everything)["x"])
    finally:
        one.storage.close()
        two.storage.close()


def test_writes_of_different_keys_of_one_row_by_two_writers_both_stay(store_path):
    # One writer writes key "x" of rows 0-1 while the other writes key "y" of the same
    # rows (committed in between: after the first read the keys it leaves out, before it
    # committed). As in TorchRL's storages, whichever commits last, both writes stay.
    mine = ZarrStorage(8, store_path, shared=True, compression=BLOCKS_OF_4)
    other = ZarrStorage(8, store_path, shared=True)
    twin = LazyTensorStorage(8)
    try:
        for storage in (mine, twin):
            storage.set(torch.arange(8), rows(0, 8))
        other.refresh()
        sharing = mine._store.commits
        take_room = sharing.room
        y = TensorDict({"y": torch.tensor([-1, -2])}, batch_size=[2])
        x = TensorDict({"x": torch.tensor([-3, -4])}, batch_size=[2])

        def other_writes_first(count):
            sharing.room = take_room
            other.set(torch.arange(2), y, set_cursor=False)
            return take_room(count)

        sharing.room = other_writes_first
        mine.set(torch.arange(2), x, set_cursor=False)
        twin.set(torch.arange(2), y, set_cursor=False)
        twin.set(torch.arange(2), x, set_cursor=False)
        everything = torch.arange(8)
        for storage in (mine, other):
            for key in ("x", "y"):
                assert torch.equal(storage.get(everything)[key], twin.get(everything)[key])
    finally:
        mine.close()
        other.close()


def test_an_extend_of_more_rows_than_the_ring_holds_lands_as_in_lazy_tensor_storage(
    store_path,
):
    # 13 rows into a ring of 8 from position 3: the last 8 land at positions 0-7 (row k
    # of the extend at (3 + k) % 8), the cursor moves by 13, the index has 13 positions.
    buffer = ReplayBuffer(
        storage=ZarrStorage(8, store_path, shared=True, compression=BLOCKS_OF_4), batch_size=2
    )
    twin = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    try:
        for data in (rows(0, 3), rows(100, 13), rows(200, 2)):
            assert torch.equal(buffer.extend(data), twin.extend(data))
            everything = torch.arange(len(twin))
            assert len(buffer) == len(twin)
            assert torch.equal(
                buffer.storage.get(everything)["x"], twin.storage.get(everything)["x"]
            )
    finally:
        buffer.storage.close()


def test_a_store_shared_before_its_first_write_takes_rows_and_keys_from_one_writer_later(
    store_path,
):
    # Made shared and closed before anything was written (a buffer handed to a child that
    # never wrote): its record has a ring and no rows. One writer that reopens it later
    # writes it as shared writers do (alone), extends, adds a key, and reads every row as
    # LazyTensorStorage holds them.
    ZarrStorage(8, store_path, shared=True, compression=BLOCKS_OF_4).close()
    storage = ZarrStorage(path=store_path)
    rb, twin = (
        TensorDictReplayBuffer(storage=storage),
        TensorDictReplayBuffer(storage=LazyTensorStorage(8)),
    )
    try:
        for buffer in (rb, twin):
            buffer.extend(TensorDict({"x": torch.arange(5)}, [5]))
            buffer.extend(TensorDict({"x": torch.arange(5, 11)}, [6]))
        assert len(rb) == len(twin) == 8
        assert torch.equal(rb[:]["x"], twin[:]["x"])
        # Shared writers fix the schema at the first write: a new key is refused before
        # anything is written, and the rows stay as they were.
        with pytest.raises(NotSupportedError, match="'y'"):
            rb.extend(TensorDict({"x": torch.tensor([11]), "y": torch.tensor([9])}, [1]))
        assert storage.schema is not None
        assert ("y",) not in {leaf.key for leaf in storage.schema.leaves}
        assert torch.equal(rb[:]["x"], twin[:]["x"])
        storage.flush()
    finally:
        storage.close()
    with ZarrStorage(path=store_path, read_only=True) as reader:
        assert torch.equal(reader[:]["x"], twin[:]["x"])


_WRITER_ON_COMMAND = """
import sys, torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from zarr_rb import ZarrStorage
rb = TensorDictReplayBuffer(storage=ZarrStorage(16, sys.argv[1], shared=True), batch_size=4)
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "extend":
        first, count = map(int, args)
        x = torch.arange(first, first + count)
        rb.extend(TensorDict({"x": x, "y": x * 10}, [count]))
    elif command == "refresh":
        rb.storage.refresh()
    print(len(rb), rb[:]["x"].tolist() if len(rb) else [], flush=True)
rb.storage.close()
"""


def _writer_on_command(store_path):
    """A shared writer of ``store_path`` in a child process, ready; and a function that
    sends it a command (``extend FIRST COUNT`` or ``refresh``) and returns its reply (its
    length and rows)."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER_ON_COMMAND, str(store_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None

    def other(command: str) -> str:
        child.stdin.write(command + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    assert child.stdout.readline().strip() == "ready"
    return child, other


def test_emptying_a_shared_buffer_empties_it_for_every_writer(store_path):
    # As emptying one process's handle of TorchRL's shared-memory storage: every writer
    # sees no row, the next rows go to 0; the buffer's sampler works on what comes next
    # (emptying was refused after TorchRL had reset the writer and sampler: the buffer
    # was left unable to sample).

    from torchrl.data import TensorDictPrioritizedReplayBuffer

    import zarr_rb

    buffer = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=ZarrStorage(16, store_path, shared=True), batch_size=4
    )
    twin = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16))
    buffer.extend(rows(0, 6))
    twin.extend(rows(0, 6))
    zarr_rb.save(buffer)
    child, other = _writer_on_command(store_path)
    try:
        assert other("extend 100 3") == "9 [0, 1, 2, 3, 4, 5, 100, 101, 102]"
        twin.extend(rows(100, 3))
        buffer.storage.refresh()
        assert len(buffer) == 9
        buffer.empty()
        twin.empty()
        assert len(buffer) == len(twin) == 0
        assert other("refresh") == "0 []"
        assert other("extend 200 2") == "2 [200, 201]"
        twin.extend(rows(200, 2))
        buffer.extend(rows(300, 3))
        twin.extend(rows(300, 3))
        everything = torch.arange(5)
        assert torch.equal(buffer.storage.get(everything)["x"], twin.storage.get(everything)["x"])
        assert other("refresh") == "5 [200, 201, 300, 301, 302]"
        assert buffer.sample()["x"].shape == (4,)
        with pytest.raises(zarr_rb.NoSavedBufferError):  # its rows are gone: so is the save
            zarr_rb.load(store_path, read_only=True)
    finally:
        child.stdin.close()
        child.wait(timeout=120)
        buffer.storage.close()


def test_a_load_beside_a_live_shared_writer_never_drops_rows_another_writer_committed(
    store_path, monkeypatch
):
    # The live buffer is at its save, so the load is allowed; another writer commits three
    # rows between that check and the record's rewrite to the save (the hook lets it, and
    # waits until it has). The rewrite must refuse, not drop those rows.

    import zarr_rb
    from zarr_rb.core import sharing
    from zarr_rb.errors import LiveBufferError

    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, store_path, shared=True))
    rb.extend(rows(0, 4))
    zarr_rb.save(rb)
    child, other = _writer_on_command(store_path)
    try:
        rebase = sharing.Sharing.rebase

        def after_another_commit(self, saved, kept):
            assert other("extend 100 3") == "7 [0, 1, 2, 3, 100, 101, 102]"
            return rebase(self, saved, kept)

        monkeypatch.setattr(sharing.Sharing, "rebase", after_another_commit)
        with pytest.raises(LiveBufferError, match="another writer committed"):
            zarr_rb.load(store_path)
        assert other("refresh") == "7 [0, 1, 2, 3, 100, 101, 102]"
    finally:
        child.stdin.close()
        child.wait(timeout=120)
        rb.storage.close()


@pytest.mark.parametrize("ram_bytes", [0, 2**22], ids=["small-leaves", "frames"])
def test_a_write_of_some_keys_that_another_writers_commit_outran_reads_its_rows_again(
    store_path, ram_bytes
):
    # The other writer commits whole new rows 0-2 just before this writer's compare-and-
    # swap of a write of one small key into them: the swap fails, and the next attempt
    # finds the rows moved. The rows this writer keeps in RAM (copies of small leaves,
    # frames) must then be read again, or the write's next attempt takes the keys it did
    # not write from them, and commits the old rows over the other writer's.
    def row(first: int, count: int) -> TensorDict:
        x = torch.arange(first, first + count)
        frames = (x.view(-1, 1, 1, 1) + torch.arange(4 * 32 * 32).view(1, 4, 32, 32)) % 251
        frames = frames.to(torch.uint8)
        return TensorDict(
            {"obs": frames, "x": x, "next": {"obs": frames + 1, "r": x.float()}},
            batch_size=[count],
        )

    mine = ZarrStorage(8, store_path, shared=True, ram_bytes=ram_bytes)
    other = ZarrStorage(8, store_path, mode="r+", shared=True, ram_bytes=ram_bytes)
    twin = LazyTensorStorage(8)
    positions = torch.arange(3)
    theirs = row(100, 3)
    small = TensorDict({"next": {"r": torch.full((3,), 7.0)}}, batch_size=[3])
    engine, sharing = mine._store.engine, mine._store.commits
    swap, commit_rows = engine.try_write_root_attributes, sharing.commit_rows
    outran: list[bool] = []

    def committing(*args, **kwargs):
        outran.append(False)  # the swaps of this commit, not of the slots the write takes
        return commit_rows(*args, **kwargs)

    def other_commits_first(attributes):
        if outran == [False]:
            outran[0] = True
            other.set(positions, theirs.clone(), set_cursor=False)
        return swap(attributes)

    try:
        mine.set(torch.arange(6), row(0, 6))
        twin.set(torch.arange(6), row(0, 6))
        other.refresh()
        engine.try_write_root_attributes = other_commits_first
        sharing.commit_rows = committing
        try:
            mine.set(positions, small.clone(), set_cursor=False)
        finally:
            engine.try_write_root_attributes = swap
            del sharing.commit_rows
        assert outran[0]
        twin.set(positions, theirs.clone(), set_cursor=False)
        twin.set(positions, small.clone(), set_cursor=False)
        expected = twin.get(torch.arange(6))
        for storage in (mine, other):
            storage.refresh()
            got = storage.get(torch.arange(6)).exclude("index")
            for key in expected.keys(include_nested=True, leaves_only=True):
                assert torch.equal(got[key], expected[key]), key
    finally:
        mine.close()
        other.close()
