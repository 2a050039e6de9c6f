"""A writer reopened after a crash appends after the last committed row: the commit
record's cursor always matches the rows it publishes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage
from zarr_rb._io import observe_io
from zarr_rb.testing import simulate_crash


class Crash(BaseException):
    """The process dies here."""


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
    child = subprocess.run([sys.executable, "-c", script], timeout=300, check=False)
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
    [(24, 16), (32, 8)],  # the ring's first wrap; a full ring
    ids=["first-wrap", "full-ring"],
)
def test_a_crash_while_rows_are_rewritten_reopens_before_them(tmp_path, committed, extended):
    """Rows are withdrawn by a commit before they are rewritten: a crash right then leaves
    them withdrawn, and the reopened writer must write them (or the rows never written)
    first, not committed rows after them."""
    path = tmp_path / "rb.zarr"
    compression = Compression(block_rows=8)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(32, path, compression=compression))
    rb.extend(steps(0, committed))
    rb.storage.flush()
    published = []

    def crash_at_the_first_row_write_after_a_commit(kind: str, where: object) -> None:
        if kind == "publish":
            published.append(where)
        elif kind == "write" and published and "data" in str(where):
            raise Crash

    with observe_io(crash_at_the_first_row_write_after_a_commit), pytest.raises(Crash):
        rb.extend(steps(committed, committed + extended))
    simulate_crash(rb.storage)
    storage = ZarrStorage(path=path, compression=compression)
    unreadable = set(storage._store.unreadable_rows().tolist())
    rb = TensorDictReplayBuffer(storage=storage)
    expected_cursor = committed % 32
    assert storage.cursor == expected_cursor
    rb.extend(steps(100, 108))
    rewritten = {(expected_cursor + i) % 32 for i in range(8)}
    rows = [row for row in range(len(rb)) if row in rewritten or row not in unreadable]
    stored = dict(zip(rows, rb.storage.get(torch.tensor(rows))["step"].tolist(), strict=True))
    for row in rows:
        if row in rewritten:
            assert stored[row] == 100 + (row - expected_cursor) % 32
        else:
            assert stored[row] == row  # committed rows never written over
    rb.storage.close()
