"""A block filled by an extend is written while the next rows come (see
``docs/design/block-writes.md``): the write is started by that extend and finished by the
next call that needs it. Writes here land only when waited for (``writes_held_back``), so
that a crash finds a block in flight not on disk at all, as a SIGKILL in the middle of its
write would.
"""

from __future__ import annotations

import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import assert_identical, fail_at_row_write, writes_held_back
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, StoreWriteError, ZarrStorage
from zarr_rb.testing import simulate_crash


def rows_of(steps: torch.Tensor) -> TensorDict:
    obs = (steps[:, None, None] * 7 + torch.arange(32 * 32).view(32, 32)) % 251
    return TensorDict({"step": steps, "obs": obs.to(torch.uint8)}, [steps.numel()])


def buffer(path: Path, **kwargs) -> TensorDictReplayBuffer:
    storage = ZarrStorage(
        16, path, compression=Compression(block_rows=4), ram_bytes=kwargs.pop("ram_bytes", 0)
    )
    return TensorDictReplayBuffer(storage=storage, batch_size=4)


def extend_by_two(rb: TensorDictReplayBuffer, twin: TensorDictReplayBuffer, steps: range) -> None:
    for start in steps[::2]:
        data = rows_of(torch.arange(start, start + 2))
        rb.extend(data)
        twin.extend(data)


def test_a_commit_made_while_a_moved_block_is_written_names_its_old_slot(tmp_path):
    """The ring wraps: a full block over committed rows is written to a new slot while the
    next rows come. A commit made meanwhile must name the block's old slot, whose rows are
    whole: a crash before the write lands reopens with the rows committed before it."""
    path = tmp_path / "rb.zarr"
    with writes_held_back() as held:
        rb = buffer(path)
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        extend_by_two(rb, twin, range(16))
        rb.storage.flush()
        committed = twin.storage.get(torch.arange(16)).exclude("index").clone()
        extend_by_two(rb, twin, range(100, 104))  # block 0 again, full: written behind
        assert rb.storage._store.write_cache.writing is not None
        # Every row reads as written, block 0 from the write buffer.
        every = torch.arange(16)
        assert_identical(
            rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
        )
        held.drop()
        simulate_crash(rb.storage)
    with ZarrStorage(path=path, read_only=True) as reader:
        assert len(reader) == 16
        got = reader.get(torch.arange(16))
        assert reader._store.unreadable_rows().size == 0
        # Block 0 holds the rows committed before the wrap, whole.
        assert_identical(got.exclude("index"), committed)


def test_the_block_written_behind_is_declared_once_it_lands(tmp_path):
    """Rows of a block in flight are not committed; the call that finishes the write (here
    a flush) commits them."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = buffer(path)
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        extend_by_two(rb, twin, range(4))
        assert rb.storage._store.write_cache.writing is not None
        with ZarrStorage(path=path, read_only=True) as reader:
            assert len(reader) == 0
        rb.storage.flush()
        assert rb.storage._store.write_cache.writing is None
        with ZarrStorage(path=path, read_only=True) as reader:
            assert len(reader) == 4
            assert_identical(
                reader.get(torch.arange(4))["obs"], twin.storage.get(torch.arange(4))["obs"]
            )
        rb.storage.close()


def test_a_write_into_the_block_in_flight_waits_for_it(tmp_path):
    """An overwrite of a row of the block being written finishes that write first: the
    block's memory is not written into while its write reads it."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = buffer(path, ram_bytes="auto")
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        extend_by_two(rb, twin, range(4))
        assert rb.storage._store.write_cache.writing is not None
        for b in (rb, twin):
            b[torch.tensor([1])] = rows_of(torch.tensor([50]))
        assert rb.storage._store.write_cache.writing is None
        rb.storage.flush()
        every = torch.arange(4)
        assert_identical(
            rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
        )
        rb.storage.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        assert reader.get(torch.arange(4))["step"].tolist() == [0, 50, 2, 3]


def test_published_rows_of_a_block_moved_since_the_last_commit_stay_declared(tmp_path):
    """A write of some keys moves a block of published rows to a new slot without a
    commit; the extend that fills the block then writes it in place there. A commit made
    while that write ran would withdraw the published rows (holes inside the length), so
    the block is written at once: readers, and the store after a crash, find every row."""
    path = tmp_path / "rb.zarr"
    rb = buffer(path)
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    extend_by_two(rb, twin, range(16))
    rb.storage.flush()
    extend_by_two(rb, twin, range(100, 102))  # rows 0, 1: the ring wrapped
    patch = TensorDict({"step": torch.tensor([900, 901])}, [2])
    for b in (rb, twin):
        b.storage.set(torch.tensor([2, 3]), patch, set_cursor=False)
    extend_by_two(rb, twin, range(102, 104))  # block 0 full
    with ZarrStorage(path=path, read_only=True) as reader:
        assert reader._store.committed.holes == ()
    simulate_crash(rb.storage)
    with ZarrStorage(path=path, read_only=True) as reader:
        assert len(reader) == 16
        assert reader._store.unreadable_rows().size == 0
        reader.get(torch.arange(16))  # every row readable


@pytest.mark.parametrize("call", ["overwrite", "extend"])
def test_a_call_that_finds_the_block_write_failed_keeps_its_own_rows(tmp_path, call):
    """The write of the block in flight fails when a later call waits for it: that call
    raises, and its own rows are kept as well as the block's (read back, and written by
    the next flush)."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = buffer(path)
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        extend_by_two(rb, twin, range(16))
        rb.storage.flush()
        extend_by_two(rb, twin, range(100, 104))  # block 0 again: in flight

        def write(b: TensorDictReplayBuffer) -> None:
            if call == "overwrite":
                b[torch.tensor([1, 9])] = rows_of(torch.tensor([500, 501]))
            else:
                b.extend(rows_of(torch.arange(200, 214)))  # it wraps onto block 0

        with fail_at_row_write(1, 100), pytest.raises(StoreWriteError):
            write(rb)
        write(twin)
        every = torch.arange(16)
        for _ in range(2):  # before the flush and after it
            assert_identical(
                rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
            )
            rb.storage.flush()
        rb.storage.close()


@pytest.mark.parametrize("kept", [True, False])
def test_a_block_written_behind_takes_other_rows_only_once_tensorstore_let_go(tmp_path, kept):
    """TensorStore writes a block in flight from the block's own memory, without a copy,
    and may keep a reference to it after the write: that memory takes the next rows only
    once TensorStore let go of it (``kept``: it does not, here). Which block's memory a
    new block takes depends on when each write lands; that one does is what is checked."""
    from zarr_rb.core.write_cache import WriteBuffer
    from zarr_rb.engine.rows import RowArray

    held = []
    lent: set[int] = set()  # the memory of blocks written behind
    taken: list[bool] = []  # the memory of each new block: lent before, or not
    start_write_rows = RowArray.start_write_rows
    new_block = WriteBuffer._new_block

    def keeping(self, rows, values, *, behind=False):
        if behind:
            lent.add(values.ctypes.data)
            if kept:
                held.append(values)  # as TensorStore may
        return start_write_rows(self, rows, values, behind=behind)

    def taking(self, index):
        block = new_block(self, index)
        taken.extend(value.data_ptr() in lent for value in block.values.values())
        return block

    rb = buffer(tmp_path / "rb.zarr")
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    with (
        mock.patch.object(RowArray, "start_write_rows", keeping),
        mock.patch.object(WriteBuffer, "_new_block", taking),
    ):
        extend_by_two(rb, twin, range(12))  # blocks 0, 1 and 2 written behind in turn
        rb.storage.flush()
    assert len(taken) == 3 * len(rb.storage._store.leaves)
    reused = any(taken)
    assert reused is not kept
    every = torch.arange(12)
    assert_identical(
        rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
    )


def test_a_commit_made_while_the_block_ending_a_whole_ring_is_written(tmp_path):
    """Four extends of 2 rows fill an 8-row ring; the last one fills block 1, written while
    the next rows come. The commit made then declares rows 0-3 and must record the cursor
    after them: the writer's cursor is back at 0 after exactly one ring, which read as no
    row extended since the last commit (found by review: it recorded cursor 0, a state
    the buffer never was in, and the next extend after a crash left rows 4-5 unreadable)."""
    path = tmp_path / "rb.zarr"
    with writes_held_back() as held:
        storage = ZarrStorage(8, path, compression=Compression(block_rows=4), ram_bytes=0)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        for start in range(0, 8, 2):
            rb.extend(rows_of(torch.arange(start, start + 2)))
        held.drop()
        simulate_crash(rb.storage)
    with ZarrStorage(path=path) as reopened:
        rb = TensorDictReplayBuffer(storage=reopened, batch_size=2)
        assert (len(rb), int(rb._writer._cursor)) in {(4, 4), (8, 0)}
        rb.extend(rows_of(torch.tensor([50, 51])))
        assert reopened._store.unreadable_rows().size == 0
        every = torch.arange(len(reopened))
        assert reopened.get(every)["step"].tolist()[:6] == [0, 1, 2, 3, 50, 51]


def test_a_mirrored_leaf_read_whole_while_a_moved_block_is_written(tmp_path):
    """Found by the crash machine: after ``empty()``, a full block over rows that held data
    is written to a new slot while the next rows come, and the first read then copies the
    small leaves (the mirror) whole. The block's rows must come from the write buffer: its
    new slot holds nothing until the write lands (read from there, a missing chunk)."""
    path = tmp_path / "rb.zarr"
    with writes_held_back():
        rb = buffer(path, ram_bytes="auto")
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        try:
            extend_by_two(rb, twin, range(6))
            rb.storage.flush()
            for b in (rb, twin):
                b.empty()
            extend_by_two(rb, twin, range(100, 104))  # block 0 again: to a new slot, behind
            assert rb.storage._store.write_cache.writing is not None
            every = torch.arange(4)
            assert_identical(
                rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
            )
        finally:
            rb.storage.close()


def test_a_block_write_that_landed_gives_its_memory_to_the_next_block(tmp_path):
    """Once a block written behind has landed (and TensorStore let go of its memory), the
    next extend finishes it, and the block that extend starts takes that memory: a writer
    holds the block it fills and one more, not a third kept until the next block write
    (found measuring the RAM of TorchRL's DQN loop: three 58 MB blocks of Atari rows)."""
    import threading
    import weakref

    with writes_held_back(lands_now=lambda n: True) as held:
        rb = buffer(tmp_path / "rb.zarr")
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
        extend_by_two(rb, twin, range(4))  # block 0 full: written behind, lands on its own
        cache = rb.storage._store.write_cache
        written = cache.writing
        assert written is not None
        memory = {key: value.data_ptr() for key, value in written.values.items()}
        held.landing[-1].result()
        # TensorStore lets go of the arrays it wrote from: wait for each to be freed.
        let_go = []
        for lent in rb.storage._store.commits._in_flight.pending.lent:
            array = lent()
            if array is not None:
                let_go.append(threading.Event())
                weakref.finalize(array, let_go[-1].set)
            del array
        assert all(event.wait(60) for event in let_go)
        extend_by_two(rb, twin, range(4, 6))
        assert cache.writing is None
        (filling,) = list(cache)
        assert {key: value.data_ptr() for key, value in filling.values.items()} == memory
        extend_by_two(rb, twin, range(6, 12))
        rb.storage.flush()
    every = torch.arange(12)
    assert_identical(
        rb.storage.get(every).exclude("index"), twin.storage.get(every).exclude("index")
    )


def test_a_store_closes_from_inside_the_threading_modules_bookkeeping(tmp_path):
    """A storage dropped without close() is closed by its finalizer, at a garbage collection
    that may run inside threading's own bookkeeping, under its lock of threads that ended
    (as a thread starts). Closing joined the thread that lands block writes, which takes
    that lock again: the process hung (found by CI, a test's landing thread never started).
    """
    rb = buffer(tmp_path / "rb.zarr")
    rb.extend(rows_of(torch.arange(2)))
    rb.extend(rows_of(torch.arange(2, 4)))  # a full block: written by the landing thread
    rb.storage.flush()
    assert rb.storage._store.arrays._landing is not None
    closed = threading.Event()

    def close_there() -> None:
        with threading._shutdown_locks_lock:  # as threading._maintain_shutdown_locks holds it
            rb.storage.close()
        closed.set()

    closer = threading.Thread(target=close_there, daemon=True)
    closer.start()
    assert closed.wait(60), "close() waited for a lock its own thread holds"


def test_the_write_buffer_counts_the_ram_of_the_blocks_it_holds(tmp_path):
    rb = buffer(tmp_path / "rb.zarr")
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    extend_by_two(rb, twin, range(2))  # half a block: staged
    cache = rb.storage._store.write_cache
    (filling,) = list(cache.held())
    block_bytes = sum(v.untyped_storage().nbytes() for v in filling.values.values())
    assert block_bytes >= 4 * (32 * 32 + 8)  # 4 rows of obs and step
    assert cache.nbytes == block_bytes
    rb.storage.close()
