"""Many writers on one store: real processes, on a local disk and on S3 (SeaweedFS)."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal

import numpy as np
import pytest
import torch
from shared_workers import (
    WRITER_STRIDE,
    extend_buffer,
    independent_writer,
    sampling_reader,
    stamped,
    torn,
)
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
)

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.errors import (
    LocksUnsupportedError,
    NotSupportedError,
    RowsNotCommittedError,
    SchemaMismatchError,
    StoreNotFoundError,
)
from zarr_rb.testing import forkserver_context

SPAWN = forkserver_context()
"""Children get the storage as spawned ones do (pickled as a handle, since a child is being
started), from a server that has torch and TorchRL imported: each starts in milliseconds,
not the seconds an interpreter takes to import them."""
FRESH = mp.get_context("spawn")
"""Children in fresh interpreters, as TorchRL's collectors start them (for one test: each
takes seconds to import torch)."""


def readable_rows(storage: ZarrStorage) -> torch.Tensor:
    storage.refresh()
    rows = np.setdiff1d(np.arange(len(storage)), storage._store.unreadable_rows())
    return torch.from_numpy(rows)


def every_row(storage: ZarrStorage):
    """The stamps of every readable row, after checking that none is torn."""
    data = storage.get(readable_rows(storage))
    assert torn(data) == 0
    return data["stamp"]


def join(processes, timeout=120.0):
    for process in processes:
        process.join(timeout)
    assert [p.exitcode for p in processes] == [0] * len(processes)


# --- a buffer handed to other processes ----------------------------------------------------


def test_spawned_children_extend_one_buffer_and_the_parent_sees_every_row(store_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(4000, store_path), batch_size=16)
    rb.extend(stamped(9, 0, 10))  # written before it is shared, by a single writer
    children = [
        FRESH.Process(target=extend_buffer, args=(rb, writer, 10, 50)) for writer in range(3)
    ]
    for child in children:
        child.start()
    samples = 0
    while any(child.is_alive() for child in children):
        if len(rb):
            assert torn(rb.sample()) == 0  # the parent samples throughout
            samples += 1
    join(children)
    assert samples
    assert len(rb) == 1510  # the rows written: as LazyTensorStorage counts them
    assert torch.equal(readable_rows(rb.storage), torch.arange(1510))  # no hole
    stamps = rb[:]["stamp"]
    assert torch.equal(rb.storage.get(torch.arange(len(rb)))["stamp"], stamps)
    assert stamps.numel() == 1510 == stamps.unique().numel()  # every row, once, whole
    for writer in range(3):
        mine = stamps[stamps // WRITER_STRIDE == writer] % WRITER_STRIDE
        assert torch.equal(mine.sort().values, torch.arange(500))


def test_rows_extended_in_another_process_are_in_len_and_samples_once_extend_returns(
    store_path,
):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(1000, store_path), batch_size=8)
    rb.extend(stamped(0, 0, 5))
    done, go = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=extend_buffer, args=(rb, 1, 3, 7, done, go))
    child.start()
    for batch in range(3):
        if batch:
            go.put(batch)  # the child extends again only once the parent looked
        writer, i, index = done.get(timeout=60)
        assert (writer, i) == (1, batch)
        # As with a shared memmap: the rows are there as soon as extend returned there.
        assert len(rb) == 5 + 7 * (batch + 1)
        got = rb.storage.get(torch.tensor(index))["stamp"]
        assert torch.equal(got, WRITER_STRIDE + torch.arange(batch * 7, batch * 7 + 7))
    join([child])
    stamps = every_row(rb.storage)
    assert stamps.numel() == 26


def test_the_index_extend_returns_says_where_the_rows_went(store_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(640, store_path, shared=True), batch_size=4)
    index = rb.extend(stamped(0, 0, 30))
    assert torch.equal(rb.storage.get(index)["stamp"], torch.arange(30))
    index = rb.extend(stamped(0, 30, 30))
    assert torch.equal(rb[index]["stamp"], torch.arange(30, 60))


def test_a_buffer_made_before_its_store_is_initialised_is_shared_from_the_first_write(
    store_path,
):
    # As collectors hand a buffer to their workers before any data exists.
    rb = TensorDictReplayBuffer(storage=ZarrStorage(2000, store_path), batch_size=8)
    children = [
        SPAWN.Process(target=extend_buffer, args=(rb, writer, 4, 25)) for writer in range(3)
    ]
    for child in children:
        child.start()
    join(children)
    stamps = every_row(rb.storage)
    assert stamps.numel() == 300 == stamps.unique().numel()


def test_writes_to_given_rows_from_another_process(store_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(320, store_path), batch_size=4)
    rb.extend(stamped(0, 0, 20))
    child = SPAWN.Process(target=_set_rows, args=(rb,))
    child.start()
    join([child])
    assert len(rb) == 20
    got = rb[torch.arange(20)]["stamp"]
    assert torch.equal(got[3:6], 7 * WRITER_STRIDE + torch.arange(3))
    assert torch.equal(got[:3], torch.arange(3))


def _set_rows(rb):
    rb[torch.arange(3, 6)] = stamped(7, 0, 3)
    rb.storage.close()


# --- independent writers (shared=True), on a local disk and on S3 --------------------------


def test_four_writers_one_killed_mid_way_the_others_lose_nothing(where):
    url, options = where
    ZarrStorage(20_000, url, shared=True, storage_options=options).close()
    # A queue each: a process killed while it writes to a queue takes the queue's lock
    # with it.
    progress = [SPAWN.Queue() for _ in range(4)]
    writers = [
        SPAWN.Process(
            target=independent_writer,
            args=(url, writer, 30, 20, options, progress[writer], 0.02 if writer == 3 else 0.0),
        )
        for writer in range(4)
    ]
    results = SPAWN.Queue()
    reader = SPAWN.Process(target=sampling_reader, args=(url, options, 4.0, results))
    for process in [*writers, reader]:
        process.start()
    pid = progress[3].get(timeout=60)[2]
    batches = -1
    while batches < 10:  # mid-way: holding a block, rows in flight
        batches = progress[3].get(timeout=60)[2]
    os.kill(pid, signal.SIGKILL)
    killed = True
    assert killed
    for writer in range(3):
        while progress[writer].get(timeout=120)[0] != "done":
            pass
    join(writers[:3])
    writers[3].join(10)
    read, bad = results.get(timeout=60)
    join([reader])
    assert read > 0
    assert bad == 0  # the reader never saw a torn row
    storage = ZarrStorage(path=url, storage_options=options, shared=True)
    try:
        stamps = every_row(storage)
        for writer in range(3):
            mine = stamps[stamps // WRITER_STRIDE == writer] % WRITER_STRIDE
            assert torch.equal(mine.sort().values, torch.arange(600))  # nothing lost
        # The killed writer loses at most what it had not published.
        theirs = stamps[stamps // WRITER_STRIDE == 3] % WRITER_STRIDE
        assert theirs.numel() >= 20 * (batches + 1)
        assert torch.equal(theirs.sort().values, torch.arange(theirs.numel()))
        # No hole: the length counts the rows committed, every one of them readable.
        assert len(storage) == 3 * 600 + theirs.numel()
        assert torch.equal(readable_rows(storage), torch.arange(len(storage)))
        # Its open slot is given back by the next writer that takes one.
        storage.set(torch.arange(1), stamped(5, 0, 1))
        opened = {who for who, _ in storage._store.committed.ring.open}
        assert all(storage._store.engine.location.writer_alive(who) for who in opened)
    finally:
        storage.close()


def test_writers_wrapping_around_a_small_ring_never_tear_a_row(where):
    url, options = where
    ZarrStorage(256, url, shared=True, storage_options=options).close()
    progress = SPAWN.Queue()
    writers = [
        SPAWN.Process(target=independent_writer, args=(url, w, 25, 16, options, progress, 0.0))
        for w in range(3)
    ]
    for writer in writers:
        writer.start()
    storage = ZarrStorage(path=url, storage_options=options, shared=True)
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)
    try:
        while any(w.is_alive() for w in writers):
            if len(rb) > 0:
                try:
                    batch = rb.sample()
                except RowsNotCommittedError:
                    # The writers turned the ring over under every redraw of this sample
                    # (more likely the busier the machine): refused, typed, nothing
                    # returned. What comes back is never torn.
                    continue
                assert torn(batch) == 0
        join(writers)
        assert torn(rb.sample()) == 0  # no writer left: a sample is never refused
        assert len(storage) == 256
        stamps = every_row(storage)
        assert stamps.numel() == 256  # no hole
        for writer in range(3):  # the oldest rows went first: each keeps its newest rows
            mine = stamps[stamps // WRITER_STRIDE == writer] % WRITER_STRIDE
            if mine.numel():
                first = int(mine.min())
                assert torch.equal(mine.sort().values, torch.arange(first, 25 * 16))
    finally:
        storage.close()


@pytest.mark.parametrize("ram_bytes", [0, 2**20], ids=["small-leaves-in-ram", "frames-in-ram"])
def test_a_block_another_writer_rewrote_is_read_as_it_is_now(where, ram_bytes):
    # A writer that read a block keeps its small leaves in RAM (its frames too, within
    # ram_bytes; and, on S3, the objects in its cache): after another writer takes that
    # block again and rewrites it, it must read the new rows, not the ones it read before.
    url, options = where
    frames = Compression(large_row_bytes=64)  # "obs" (8x8 bytes) is a large leaf
    ZarrStorage(256, url, shared=True, storage_options=options, compression=frames).close()
    other = ZarrStorage(path=url, mode="r+", shared=True, storage_options=options)
    mine = ZarrStorage(
        path=url, mode="r+", shared=True, storage_options=options, ram_bytes=ram_bytes
    )
    try:
        other.set(torch.arange(256), stamped(1, 0, 256))  # the whole ring
        other.set(torch.arange(8), stamped(1, 256, 8))  # one block more
        mine.refresh()
        assert torn(mine.get(torch.arange(256))) == 0
        tier = mine._store.ram.frames
        assert (tier is not None and bool(tier.resident.all())) == bool(ram_bytes)  # in RAM
        other.set(torch.arange(8), stamped(2, 0, 8))  # the oldest block, taken again
        mine.refresh()
        everything = torch.arange(256)
        assert torch.equal(mine.get(everything)["stamp"], other.get(everything)["stamp"])
        assert torn(mine.get(everything)) == 0
        assert set((every_row(mine) // WRITER_STRIDE).tolist()) == {1, 2}
    finally:
        mine.close()
        other.close()


def test_a_read_that_fails_while_another_writer_commits_is_tried_again(store_path):
    """A read meets an object another writer replaced (or a collection emptied) while it
    read, among rows other than those asked for (the mirror of small leaves loads every
    row on disk): the record moved meanwhile, so it is read again, not raised (found in a
    run of three writers wrapping around a small ring on S3: a sample raised NOT_FOUND on
    a chunk of a row it had not drawn)."""
    from unittest import mock

    from zarr_rb.core.ram_rows import RamRows

    ZarrStorage(256, store_path, shared=True).close()
    other = ZarrStorage(path=store_path, mode="r+", shared=True)
    mine = ZarrStorage(path=store_path, mode="r+", shared=True)
    try:
        other.set(torch.arange(16), stamped(1, 0, 16))
        mine.refresh()
        read, calls = RamRows.read, []

        def replaced_meanwhile(self: RamRows, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                other.set(torch.arange(16, 24), stamped(1, 16, 8))  # the record moves
                raise ValueError("NOT_FOUND: chunk {6} stored at 'data/stamp/c.6' is missing")
            return read(self, *args, **kwargs)

        with mock.patch.object(RamRows, "read", replaced_meanwhile):
            got = mine.get(torch.arange(8))
        assert len(calls) == 2
        assert torch.equal(got["stamp"], other.get(torch.arange(8))["stamp"])
    finally:
        mine.close()
        other.close()


def test_a_shared_buffer_saves_everyones_rows_and_its_own_sampler_state(where, tmp_path):
    url, options = where
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(1000, url, shared=True, storage_options=options), batch_size=4
    )
    rb.extend(stamped(0, 0, 40))
    other = ZarrStorage(1000, url, shared=True, storage_options=options)
    other.set(torch.arange(30), stamped(1, 0, 30))  # ("index", which rb.extend adds: zeros)
    torch.manual_seed(3)
    zarr_rb.save(rb)
    expected = rb.sample()["stamp"]
    other.close()
    rb.storage.close()
    loaded = zarr_rb.load(url, storage_options=options)
    try:
        torch.manual_seed(3)
        assert torch.equal(loaded.sample()["stamp"], expected)
        assert every_row(loaded.storage).numel() == 70
    finally:
        loaded.storage.close()


# --- TorchRL's own multi-process paths ------------------------------------------------------


def test_multi_sync_collector_workers_write_straight_into_the_store(store_path):
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs import GymEnv

    rb = TensorDictReplayBuffer(storage=ZarrStorage(5000, store_path), batch_size=32)
    collector = MultiSyncCollector(
        [_cartpole, _cartpole],
        policy=None,
        frames_per_batch=200,
        total_frames=1200,
        replay_buffer=rb,
    )
    try:
        batches = 0
        for _ in collector:
            batches += 1
            sample = rb.sample()
            assert sample["observation"].shape == (32, 4)
    finally:
        collector.shutdown()
    assert batches
    # Every frame the workers collected, once: as many as TorchRL's own storage counts.
    frames = batches * 200
    assert len(rb) == frames
    data = rb[:]
    assert data.numel() == frames
    assert torch.equal(readable_rows(rb.storage), torch.arange(frames))
    assert torch.equal(data["index"], torch.arange(frames))  # each row's position
    del GymEnv


@pytest.mark.slow  # (the sync collector runs by default; CI runs it)
def test_multi_async_collector_workers_write_straight_into_the_store(store_path):
    from torchrl.collectors import MultiAsyncCollector

    rb = TensorDictReplayBuffer(storage=ZarrStorage(5000, store_path), batch_size=32)
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(5000), batch_size=32)
    collector = MultiAsyncCollector(
        [_cartpole, _cartpole],
        policy=None,
        frames_per_batch=100,
        total_frames=800,
        replay_buffer=rb,
    )
    try:
        for _ in collector:
            assert rb.sample()["observation"].shape == (32, 4)
    finally:
        collector.shutdown()
    # Each worker extends by 50 rows. A worker writes its batch before it queues it, and one
    # whose queue stays full for TorchRL's one-second timeout collects and writes another, so
    # how many batches land past the 800 frames depends on how fast this process consumes
    # them: len counts whole batches, every row of them readable, up to the capacity.
    length = len(rb)
    assert length % 50 == 0
    assert 800 <= length <= 5000
    twin.extend(rb[:])
    assert len(twin) == length
    assert torch.equal(readable_rows(rb.storage), torch.arange(length))
    assert torch.equal(rb[:]["index"], torch.arange(length))  # each row's position


def _cartpole():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def test_torchrl_shared_init_buffers_initialised_by_children(store_path):
    storage = ZarrStorage(100, store_path, shared_init=True)
    rb = ReplayBuffer(storage=storage, batch_size=2).share(True)
    children = [SPAWN.Process(target=_extend_two, args=(rb, i)) for i in range(4)]
    for child in children:
        child.start()
    join(children)
    assert len(rb) == 8
    values = rb.storage.get(readable_rows(rb.storage))
    assert sorted(values.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]


def _extend_two(rb, worker):
    index = rb.extend(torch.full((2,), worker))
    assert (rb[index] == worker).all()
    rb.storage.close()


def test_a_max_value_writer_is_refused_for_sharing_as_torchrl_refuses_it(store_path):
    from torchrl.data import TensorDictMaxValueWriter

    for storage in (LazyTensorStorage(21), ZarrStorage(21, store_path)):
        rb = TensorDictReplayBuffer(storage=storage, writer=TensorDictMaxValueWriter())
        rb.extend(TensorDict({"a": torch.zeros(10), "next": {"reward": torch.ones(10)}}, [10]))
        child = SPAWN.Process(target=extend_buffer, args=(rb, 0, 1, 2))
        with pytest.raises(RuntimeError, match="cannot be shared between processes"):
            child.start()


def test_the_round_robin_pattern_of_torchrls_tests(store_path):
    """A child extends after the parent, the parent after the child: each sees the
    other's rows where its writer put them (rows written in order, blocks of two rows)."""
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(21, store_path),
        writer=TensorDictRoundRobinWriter(),
        sampler=RandomSampler(),
    )
    rb.extend(TensorDict({"a": torch.zeros(10), "next": {"reward": torch.ones(10)}}, [10]))
    q0, q1 = SPAWN.Queue(1), SPAWN.Queue(1)
    child = SPAWN.Process(target=_round_robin_child, args=(rb, q0, q1))
    child.start()
    try:
        assert q0.get(timeout=100) == "extended"
        assert len(rb) == 20
        assert (rb["a"][10:20] == 1).all()
        rb.extend(TensorDict({"a": torch.zeros(10) + 2}, [10]))
        q1.put("extended")
        assert q0.get(timeout=30) == "finish"
    finally:
        child.join()
    assert child.exitcode == 0


def _round_robin_child(rb, q0, q1):
    rb.extend(TensorDict({"a": torch.ones(10), "next": {"reward": torch.ones(10)}}, [10]))
    q0.put("extended")
    assert q1.get(timeout=30) == "extended"
    assert len(rb) == 21, len(rb)
    assert (rb["a"][:9] == 2).all()
    q0.put("finish")
    rb.storage.close()


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shared_here", "says"),
    [(False, "single writer.*shared=True"), (True, "shared writer.*shared=True")],
)
def test_a_single_writer_and_a_shared_one_cannot_both_write(where, shared_here, says):
    url, options = where
    storage = ZarrStorage(1000, url, storage_options=options, shared=shared_here)
    if not shared_here:  # a single writer makes its store, and takes it, at its first write
        storage.set(torch.arange(1), TensorDict({"a": torch.zeros(1)}, [1]))
    try:
        kind, message = _open_elsewhere(url, options, shared=not shared_here)
    finally:
        storage.close()
    assert kind == "MixedWritersError"
    assert re.search(says, message)


def _open_elsewhere(url, options, *, shared):
    """Open the store in another process; what it raised (type name, message)."""
    results = SPAWN.Queue()
    process = SPAWN.Process(target=_open, args=(url, options, shared, results))
    process.start()
    outcome = results.get(timeout=60)
    process.join(30)
    return outcome


def _open(url, options, shared, results):
    try:
        ZarrStorage(1000, url, storage_options=options, shared=shared).close()
        results.put(("ok", ""))
    except Exception as err:  # any error is reported, not waited for
        results.put((type(err).__name__, str(err)))


def test_writers_of_one_shared_store_must_agree_on_the_schema(store_path):
    one = ZarrStorage(640, store_path, shared=True)
    two = ZarrStorage(640, store_path, shared=True)
    try:
        one.set(torch.arange(4), TensorDict({"obs": torch.zeros(4, 3)}, [4]))
        with pytest.raises(SchemaMismatchError, match="same keys"):
            two.set(torch.arange(4), TensorDict({"obs": torch.zeros(4, 5)}, [4]))
        with pytest.raises(NotSupportedError, match="fixed by the first write"):
            one.set(
                torch.arange(4), TensorDict({"obs": torch.zeros(4, 3), "x": torch.ones(4)}, [4])
            )
    finally:
        one.close()
        two.close()


def test_a_filesystem_without_locks_is_refused_with_what_to_do(store_path, monkeypatch):
    ZarrStorage(100, store_path).close()
    real = fcntl.flock

    def no_locks(fd, operation):
        if operation & fcntl.LOCK_SH:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(LocksUnsupportedError, match=r"no working file locks.*nolock"):
        ZarrStorage(100, store_path, shared=True)


def test_a_pickled_storage_whose_store_vanished_says_what_to_do(store_path):
    storage = ZarrStorage(100, store_path, shared=True)
    storage.set(torch.arange(2), TensorDict({"x": torch.ones(2)}, [2]))
    handle = pickle.dumps(storage)
    storage.close()
    shutil.rmtree(store_path)
    with pytest.raises(StoreNotFoundError, match=r"pickled from.*is gone"):
        pickle.loads(handle)


def test_a_single_writer_storage_sent_elsewhere_without_multiprocessing_says_shared(store_path):
    storage = ZarrStorage(100, store_path)
    handle = pickle.dumps(storage)  # as Ray or a queue would: not to a child being spawned
    results = SPAWN.Queue()
    process = SPAWN.Process(target=_unpickle, args=(handle, results))
    process.start()
    kind, message = results.get(timeout=60)
    process.join(30)
    storage.close()
    assert kind == "LockedError"
    assert "shared=True" in message


def _unpickle(handle, results):
    try:
        pickle.loads(handle).close()
        results.put(("ok", ""))
    except Exception as err:  # any error is reported, not waited for
        results.put((type(err).__name__, str(err)))


def test_more_writers_than_blocks_each_write_and_the_ring_keeps_the_last_rows(store_path):
    # A ring of 2 blocks of 2 rows, 3 writers: each appends into a slot of its own (the
    # arrays have more slots than the ring has blocks), and the ring holds the 4 rows
    # committed last, in the order they were committed, as LazyTensorStorage would.
    compression = zarr_rb.Compression(block_rows=2)
    storages = [ZarrStorage(4, store_path, shared=True, compression=compression)]
    storages += [ZarrStorage(4, store_path, shared=True) for _ in range(2)]
    twin = LazyTensorStorage(4)
    cursor = 0
    try:
        for step in range(9):
            data = TensorDict({"x": torch.full((1,), float(step))}, [1])
            index = torch.arange(1)
            storages[step % 3].set(index, data)
            assert int(index) == cursor  # where the row went, as the writer's index says
            twin.set(torch.tensor([cursor]), data)
            cursor = (cursor + 1) % 4
            for storage in storages:
                assert len(storage) == min(step + 1, 4)
                got = storage.get(torch.arange(len(storage)))["x"]
                assert torch.equal(got, twin.get(torch.arange(len(storage)))["x"])
    finally:
        for storage in storages:
            storage.close()


# --- stores of earlier formats ----------------------------------------------------------------


def test_a_store_shared_under_format_2_takes_runs_when_a_writer_joins(store_path):
    # A format-2 shared record: blocks held in ring order, the rows of a held block
    # withdrawn (a hole). Joining maps the readable rows where they are (no copy); the hole
    # stays unreadable until written over, and writers go on from the cursor.
    compression = Compression(block_rows=4)
    storage = ZarrStorage(16, store_path, compression=compression)
    storage.set(torch.arange(10), stamped(0, 0, 10))
    storage.close()
    root = store_path / "zarr.json"
    document = json.loads(root.read_text())
    record = document["attributes"]["zarr_rb"]
    record["format"] = 2
    record["commit"].update(
        holes=[[8, 10]], ring={"taken": 3, "held": [[2, "0123456789abcdef"]], "rewrites": 0}
    )
    root.write_text(json.dumps(document))
    reader = ZarrStorage(path=store_path, read_only=True)
    assert torch.equal(reader.get(torch.arange(8))["stamp"], torch.arange(8))
    writer = ZarrStorage(path=store_path, mode="r+", shared=True)
    try:
        assert len(writer) == 10
        assert torch.equal(writer.get(torch.arange(8))["stamp"], torch.arange(8))
        assert writer._store.unreadable_rows().tolist() == [8, 9]
        writer.set(torch.arange(8), stamped(1, 0, 8))  # positions 10-15, then 0-1
        assert len(writer) == 16
        got = writer.get(torch.arange(2, 8))["stamp"]
        assert torch.equal(got, torch.arange(2, 8))
        assert torch.equal(
            writer.get(torch.arange(10, 16))["stamp"], WRITER_STRIDE + torch.arange(6)
        )
        record = json.loads(root.read_text())["attributes"]["zarr_rb"]
        assert record["format"] == 3
        assert "runs" in record["commit"]
    finally:
        writer.close()
        reader.close()


def test_a_version_kept_before_the_store_became_shared_keeps_its_rows(store_path):
    # Tagged while one writer wrote it (its rows pinned in their slots), then shared:
    # shared writers take only slots no kept save refers to, so the version reads back as
    # saved however much they write.
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(16, store_path, compression=Compression(block_rows=4)),
        batch_size=4,
    )
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    for buffer in (rb, twin):
        buffer.extend(stamped(0, 0, 20))  # wrapped: blocks moved to other slots
    zarr_rb.save(rb, tag="before")
    rb.storage.close()
    writers = [ZarrStorage(path=store_path, mode="r+", shared=True) for _ in range(2)]
    try:
        for step in range(12):  # the ring turns over several times
            writers[step % 2].set(torch.arange(7), stamped(1 + step % 2, 7 * step, 7))
    finally:
        for writer in writers:
            writer.close()
    kept = zarr_rb.load(store_path, version="before", read_only=True)
    try:
        assert torch.equal(kept[:]["stamp"], twin[:]["stamp"])
    finally:
        kept.storage.close()
    # Loaded by a writer: the buffer goes back to the version's rows and goes on from them.
    loaded = zarr_rb.load(store_path, version="before")
    try:
        assert torch.equal(loaded[:]["stamp"], twin[:]["stamp"])
        for buffer in (loaded, twin):
            buffer.extend(stamped(3, 0, 5))
        assert torch.equal(loaded[:]["stamp"], twin[:]["stamp"])
    finally:
        loaded.storage.close()
