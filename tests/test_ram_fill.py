"""The rows already in a store are read into the RAM tier behind the buffer's back, with the
default budget: after a reopen and after a loaded save, a thread of the store reads them
a few at a time, each step holding the store's lock.

The tests wait for the fill to end (``TierFill.wait``), never for time to pass; those that
need steps between writes drive them one by one, with the thread doing nothing
(:func:`manual_steps`). The state machine of the tier (``tests/test_frames_model.py``)
also drives steps between its rules.
"""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from test_frames_model import Episodes
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
import zarr_rb.torchrl.storage
from zarr_rb import ZarrStorage
from zarr_rb.core import ram_fill
from zarr_rb.core.frames import FrameTier
from zarr_rb.core.ram_fill import TierFill

ROWS = 300
ROWS_OF_FRAMES = 1000


def episodes(rows: int, seed: int) -> TensorDict:
    obs, nxt = Episodes(0).rows(rows, random.Random(seed), resets=0.02, noise=0.02)
    steps = torch.arange(rows)
    return TensorDict({"obs": obs, "step": steps, "next": {"obs": nxt}}, batch_size=[rows])


def written(path: Path, data: TensorDict, capacity: int = ROWS) -> None:
    storage = ZarrStorage(capacity, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=8)
    for start in range(0, data.shape[0], 64):
        rb.extend(data[start : start + 64])
    storage.close()


def reopened(path: Path, seed: int) -> tuple[TensorDict, ZarrStorage, FrameTier]:
    """A store of episodes, written and opened again, and the tier of the new storage."""
    data = episodes(ROWS, seed=seed)
    written(path, data)
    storage = ZarrStorage(ROWS, path)
    tier = storage._store.ram.frames
    assert tier is not None
    return data, storage, tier


@pytest.fixture
def manual_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fills behind start a thread that does nothing: the test runs their steps."""
    monkeypatch.setattr(TierFill, "_run", lambda self, done: None)
    monkeypatch.setattr(ram_fill, "STEP_ROWS", 37)


def steps(storage: ZarrStorage) -> Iterator[None]:
    fill = storage._store.ram.fill
    while fill._step():
        yield


def test_a_reopened_store_is_read_into_ram_behind_the_reads(tmp_path: Path) -> None:
    data, storage, tier = reopened(tmp_path / "rb.zarr", seed=1)
    assert not tier.resident.any()  # nothing read at the open
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb.sample()  # the first read starts the fill, and does not wait for it
    assert storage._store.ram.fill.wait(timeout=120)
    assert bool(tier.resident.all())
    tier.check()
    used = sum(pool.used for pool in tier._pools.values())
    assert used < 2 * ROWS  # the rows' frames once each, as when the writer wrote them
    assert_identical(storage.get(torch.arange(ROWS)).exclude("index"), data)
    storage.close()


def test_a_loaded_save_is_read_into_ram(tmp_path: Path, manual_steps: None) -> None:
    data = episodes(ROWS, seed=2)
    storage = ZarrStorage(ROWS, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb.extend(data[:200])
    zarr_rb.save(rb)
    rb.extend(data[200:])
    storage.close()
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    tier = loaded.storage._store.ram.frames
    assert tier is not None
    loaded.sample()
    assert not tier.resident.any()  # the steps are this test's
    list(steps(loaded.storage))
    assert bool(tier.resident[:200].all())
    assert_identical(loaded.storage.get(torch.arange(200)).exclude("index"), data[:200])
    loaded.storage.close()


def test_rows_written_between_steps_keep_their_new_frames(
    tmp_path: Path, manual_steps: None
) -> None:
    """Steps read the store's rows oldest last; rows the buffer writes meanwhile, ahead of
    the fill or behind it, are the new ones when read, and the fill never brings back
    their old frames."""
    data = episodes(ROWS, seed=3)
    written(tmp_path / "rb.zarr", data)
    storage = ZarrStorage(ROWS, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb._writer._cursor = len(storage) % ROWS
    twin = LazyTensorStorage(ROWS)
    twin.set(torch.arange(ROWS), data)
    rb.sample()
    new = episodes(3 * ROWS, seed=4)
    taken = cursor = 0
    for step, _ in enumerate(steps(storage)):
        batch = new[taken : taken + 23]
        taken += 23
        if step % 2:
            rows = torch.arange(cursor, cursor + 23) % ROWS
            cursor += 23
            rb.extend(batch)
        else:  # written where the fill has not been yet, and where it was
            rows = torch.tensor([5 + step, ROWS - 1 - step, 100])
            batch = batch[:3]
            storage.set(rows, batch, set_cursor=False)
        twin.set(rows, batch)
        everything = torch.arange(ROWS)
        assert_identical(storage.get(everything).exclude("index"), twin.get(everything))
    tier = storage._store.ram.frames
    assert tier is not None
    tier.check()
    assert taken  # steps did run
    storage.close()
    reopened = ZarrStorage(ROWS, tmp_path / "rb.zarr", read_only=True)
    everything = torch.arange(ROWS)
    assert_identical(reopened.get(everything).exclude("index"), twin.get(everything))
    reopened.close()


def test_a_full_tier_stops_the_fill_at_the_newest_rows_that_fit(
    tmp_path: Path, manual_steps: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = episodes(ROWS, seed=5)
    written(tmp_path / "rb.zarr", data)
    # The small leaves, the frame ids of every row, and about 60 frames of 256 bytes.
    monkeypatch.setattr(zarr_rb.torchrl.storage, "auto_ram_bytes", lambda: 12_000 + 60 * 256)
    storage = ZarrStorage(ROWS, tmp_path / "rb.zarr")
    store = storage._store
    storage.get(torch.arange(3))
    list(steps(storage))
    tier = store.ram.frames
    assert tier is not None
    held = np.flatnonzero(tier.resident)
    assert 0 < held.size < ROWS
    assert held.min() > ROWS // 2  # the newest rows
    assert_identical(storage.get(torch.arange(ROWS)).exclude("index"), data)
    storage.close()


def test_closing_stops_a_fill_under_way(tmp_path: Path, manual_steps: None) -> None:
    data = episodes(ROWS, seed=6)
    written(tmp_path / "rb.zarr", data)
    storage = ZarrStorage(ROWS, tmp_path / "rb.zarr")
    fill = storage._store.ram.fill
    storage.get(torch.arange(3))
    assert fill._step()  # under way
    storage.close()
    assert not fill._step()  # the next step ends it, reading nothing


def test_a_fill_thread_ends_when_the_storage_is_closed_or_dropped(tmp_path: Path) -> None:
    data = episodes(ROWS, seed=7)
    written(tmp_path / "rb.zarr", data)
    for how in ("close", "drop"):
        storage = ZarrStorage(ROWS, tmp_path / "rb.zarr")
        fill = storage._store.ram.fill
        storage.get(torch.arange(3))
        if how == "close":
            storage.close()
        else:
            del storage
            gc.collect()
        assert fill.wait(timeout=120)
    reopened = ZarrStorage(ROWS, tmp_path / "rb.zarr", read_only=True)
    assert_identical(reopened.get(torch.arange(ROWS)).exclude("index"), data)
    reopened.close()


def test_a_process_that_exits_while_it_fills_exits_cleanly(tmp_path: Path) -> None:
    """The thread is a daemon: the process exits at once, and the finalizer that closes the
    store waits for the step under way (no abort, no traceback)."""
    frames = torch.randint(0, 256, (ROWS_OF_FRAMES, 4, 84, 84), dtype=torch.uint8)
    data = TensorDict({"obs": frames, "next": {"obs": frames.roll(1, 0)}}, [ROWS_OF_FRAMES])
    written(tmp_path / "rb.zarr", data, capacity=ROWS_OF_FRAMES)
    script = textwrap.dedent(
        f"""
        import torch
        from zarr_rb import ZarrStorage
        storage = ZarrStorage({ROWS_OF_FRAMES}, {str(tmp_path / "rb.zarr")!r})
        storage.get(torch.arange(3))
        print("filling")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "filling"
    assert "Traceback" not in done.stderr, done.stderr
    reopened = ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)
    assert_identical(reopened.get(torch.arange(ROWS_OF_FRAMES)).exclude("index"), data)
    reopened.close()


def test_a_given_budget_still_fills_at_the_first_read(tmp_path: Path) -> None:
    data = episodes(ROWS, seed=9)
    written(tmp_path / "rb.zarr", data)
    storage = ZarrStorage(ROWS, tmp_path / "rb.zarr", ram_bytes=2**24)
    tier = storage._store.ram.frames
    assert tier is not None
    storage.get(torch.arange(3))
    assert bool(tier.resident.all())  # within the read, no thread
    assert storage._store.ram.fill.wait(0)
    storage.close()


def test_the_buffer_writes_and_reads_the_same_rows_while_its_store_is_read_into_ram(
    tmp_path: Path,
) -> None:
    """The fill's thread and the buffer's calls in whatever order they come: every row read
    is the twin's, and once the fill ended the tier's counts are exact."""
    data = episodes(2000, seed=10)
    written(tmp_path / "rb.zarr", data, capacity=2000)
    storage = ZarrStorage(2000, tmp_path / "rb.zarr")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), batch_size=32)
    twin.extend(data)
    rb._writer._cursor = twin._writer._cursor = 0
    fill = storage._store.ram.fill
    new = episodes(2000, seed=11)
    generator = torch.Generator().manual_seed(12)
    for turn in range(60):  # a turn takes about as long as a step of the fill
        batch = new[turn * 20 : (turn + 1) * 20]
        rb.extend(batch)
        twin.extend(batch)
        picked = torch.randint(0, 2000, (32,), generator=generator)
        assert_identical(
            storage.get(picked).exclude("index"), twin.storage.get(picked).exclude("index")
        )
    assert fill.wait(timeout=300)
    everything = torch.arange(2000)
    assert_identical(
        storage.get(everything).exclude("index"), twin.storage.get(everything).exclude("index")
    )
    tier = storage._store.ram.frames
    assert tier is not None
    assert bool(tier.resident.all())
    tier.check()
    storage.close()


def test_a_shared_writer_reads_other_writers_rows_in_between_their_commits(
    tmp_path: Path, manual_steps: None
) -> None:
    """Another writer commits rows between the steps: the rows read in are those of the
    record read, and rows the other writer moved since are read again, never served old."""
    path = tmp_path / "rb.zarr"
    other = ZarrStorage(ROWS, path, shared=True)
    data = episodes(ROWS, seed=13)
    other.set(torch.arange(ROWS), data)
    mine = ZarrStorage(path=path, mode="r+", shared=True)
    twin = LazyTensorStorage(ROWS)
    twin.set(torch.arange(ROWS), data)
    new = episodes(ROWS, seed=14)
    mine.get(torch.arange(3))  # starts the fill
    everything = torch.arange(ROWS)
    for step, _ in enumerate(steps(mine)):
        rows = torch.arange(7 * step, 7 * step + 5) % ROWS
        rows = torch.cat([rows, torch.tensor([ROWS - 1 - step])])  # behind the fill, ahead
        other.set(rows, new[rows], set_cursor=False)
        twin.set(rows, new[rows], set_cursor=False)
        mine.refresh()
        assert_identical(mine.get(everything).exclude("index"), twin.get(everything))
    tier = mine._store.ram.frames
    assert tier is not None
    assert tier.resident.any()
    tier.check()
    mine.close()
    other.close()


def test_wait_for_ram_starts_the_fill_and_waits_for_it(tmp_path: Path) -> None:
    _, storage, tier = reopened(tmp_path / "rb.zarr", seed=15)
    assert storage.wait_for_ram(timeout=120)  # no read before: it starts the fill
    assert bool(tier.resident.all())
    storage.close()
    for other in (
        ZarrStorage(ROWS, tmp_path / "rb.zarr", ram_bytes=0),
        ZarrStorage(path=tmp_path / "rb.zarr", read_only=True),
    ):
        assert other.wait_for_ram(timeout=0)  # nothing to read into RAM
        other.close()
