"""A block filled by an extend is written while the next rows come (see
``docs/design/block-writes.md``): the write is started by that extend and finished by the
next call that needs it. Writes here land only when waited for (``writes_held_back``), so
that a crash finds a block in flight not on disk at all, as a SIGKILL in the middle of its
write would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import assert_identical, writes_held_back
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage
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
