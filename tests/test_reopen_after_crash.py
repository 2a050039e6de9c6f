"""A writer reopened after a crash appends after the last committed row: the commit
record's cursor always matches the rows it publishes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import Crash, crash_at_row_write
from sample_runner import python_c
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage
from zarr_rb.testing import simulate_crash


def steps(start: int, stop: int) -> TensorDict:
    return TensorDict({"step": torch.arange(start, stop)}, [stop - start])


def test_a_writer_killed_mid_extend_reopens_after_its_last_committed_row(tmp_path):
    path = tmp_path / "rb.zarr"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from tensordict import TensorDict
        from torchrl.data import TensorDictReplayBuffer
        from zarr_rb import Compression, ZarrStorage
        storage = ZarrStorage(1000, {str(path)!r}, compression=Compression(block_rows=8))
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(TensorDict({{"step": torch.arange(0, 20)}}, [20]))
        rb.storage.flush()
        rb.extend(TensorDict({{"step": torch.arange(20, 70)}}, [50]))  # blocks commit as they fill
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    child = python_c(script, cwd=tmp_path, timeout=300)
    assert child.returncode == -9
    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=path))
    committed = len(rb)
    assert committed == 64  # the full blocks; rows 64-69 waited in RAM
    assert rb.storage.cursor == committed
    rb.extend(steps(1000, 1010))
    assert len(rb) == committed + 10
    expected = torch.cat([torch.arange(0, committed), torch.arange(1000, 1010)])
    assert torch.equal(rb[:]["step"], expected)
    rb.storage.close()


def test_a_crash_in_a_wrapped_ring_reopens_at_its_oldest_row(tmp_path):
    """A full ring: the reopened writer overwrites the oldest committed row, as the writer
    that crashed would have, and never one it had just written."""
    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=8)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(40, path, compression=compression))
    model = TensorDictReplayBuffer(storage=LazyTensorStorage(40))
    for buffer in (rb, model):
        buffer.extend(steps(0, 44))  # wrapped: rows 0-3 hold steps 40-43
    rb.storage.flush()
    for buffer in (rb, model):
        buffer.extend(steps(44, 62))  # rows 4-21; blocks up to row 15 commit as they fill
    simulate_crash(rb.storage)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=path, compression=compression))
    assert len(rb) == 40
    assert rb.storage.cursor == 16
    stored = rb[:]["step"]
    assert torch.equal(stored[:16], torch.arange(40, 56))
    assert torch.equal(stored[16:], torch.arange(16, 40))  # rows 16-21 as last committed
    rb.extend(steps(100, 110))
    assert torch.equal(rb[:]["step"][16:26], torch.arange(100, 110))
    assert torch.equal(rb[:]["step"][:16], torch.arange(40, 56))
    rb.storage.close()


@pytest.mark.parametrize(
    ("committed", "extended"),
    [(24, 16), (32, 8), (32, 20)],  # the ring's first wrap; a full ring; past a block
    ids=["first-wrap", "full-ring", "full-ring-two-blocks"],
)
@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_crash_while_rows_are_rewritten_leaves_every_row_whole(
    tmp_path, committed, extended, crash_at
):
    """Rows are written over by copy-on-write: a crash at any write of the rewrite leaves
    every position of ``[0, len)`` readable, holding its last committed row, and the
    reopened writer goes on after the rows it committed."""
    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=8)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(32, path, compression=compression))
    rb.extend(steps(0, committed))
    rb.storage.flush()
    with crash_at_row_write(crash_at), pytest.raises(Crash):
        rb.extend(steps(committed, committed + extended))
    simulate_crash(rb.storage)
    storage = ZarrStorage(path=path, compression=compression)
    assert storage._store.unreadable_rows().size == 0
    rb = TensorDictReplayBuffer(storage=storage)
    cursor = storage.cursor
    # The writer got through some whole blocks of the extend (committed), not the rest.
    done = (cursor - committed) % 32
    assert done % 8 == 0
    assert done < extended
    model = list(range(committed)) + [None] * (32 - committed)
    for i in range(done):
        model[(committed + i) % 32] = committed + i
    length = sum(row is not None for row in model)
    assert len(rb) == length
    assert rb.storage.get(torch.arange(length))["step"].tolist() == model[:length]
    rb.extend(steps(100, 108))
    assert torch.equal(
        rb.storage.get(torch.arange(cursor, cursor + 8) % 32)["step"], torch.arange(100, 108)
    )
    rb.storage.close()


@pytest.mark.parametrize("reader", [False, True], ids=["reopened", "read-only-reader"])
def test_a_row_left_in_ram_by_an_earlier_extend_is_written_before_later_rows_commit(
    tmp_path, reader
):
    """A flush in the middle of a block, then an extend of the block's last row (it waits
    in RAM) and one of the next whole block (written at once, and committed): the commit
    never declares the rows after the one in RAM without it. Every commit covers a prefix
    of the ring, so a crash at any instant leaves no hole."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(96, path, compression=Compression(block_rows=8))
    )
    rb.extend(steps(0, 7))
    rb.storage.flush()
    rb.extend(steps(7, 8))  # row 7 completes block 0 in RAM
    rb.extend(steps(8, 16))  # block 1, whole: written at once
    if reader:
        other = ZarrStorage(path=path, read_only=True)
        assert other._store.unreadable_rows().size == 0
        assert torch.equal(other.get(torch.arange(len(other)))["step"], torch.arange(len(other)))
        other.close()
    simulate_crash(rb.storage)
    storage = ZarrStorage(path=path)
    assert storage._store.unreadable_rows().size == 0
    length = len(storage)
    assert length in (7, 16)  # at most the rows not committed are lost
    assert torch.equal(storage.get(torch.arange(length))["step"], torch.arange(length))
    assert storage.cursor == length
    storage.close()


def test_rows_written_past_rows_never_written_are_committed_after_them(tmp_path):
    """Rows set past a gap of rows never written (TorchRL counts them in ``len``, reading
    whatever the gap holds) are committed with the gap as holes: a store reopened after a
    crash has the buffer's length, the gap's rows unreadable, every other row whole."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(96, path, compression=Compression(block_rows=8))
    storage.set(torch.arange(0, 12), steps(0, 12))
    scattered = torch.cat([torch.arange(16, 24), torch.tensor([40])])  # rows 12-15 never set
    storage.set(scattered, TensorDict({"step": scattered}, [scattered.numel()]))
    length = len(storage)
    assert length == 21  # TorchRL's count: 12 rows, then 9
    simulate_crash(storage)
    storage = ZarrStorage(path=path)
    assert len(storage) == length
    assert storage._store.unreadable_rows().tolist() == [12, 13, 14, 15]
    readable = torch.tensor([row for row in range(length) if not 12 <= row < 16])
    assert torch.equal(storage.get(readable)["step"], readable)
    storage.close()
