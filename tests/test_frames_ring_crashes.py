"""Extends of stacked frames of any size on a small ring (the RAM tier on: whole blocks
written at once, blocks filled in RAM written while the next rows come), then a crash: the
store reopens in a state the ring went through, and commits keep up with the extends.
Writes land as they are started, or only when waited for (``writes_held_back``), so that a
crash finds a block in flight not on disk at all, as a SIGKILL in the middle of its write
would. Every row is compared with LazyTensorStorage's.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import writes_held_back
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from test_lent_frames import BLOCK, ROWS, Episode, buffers, extend
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import ZarrStorage
from zarr_rb.testing import simulate_crash
from zarr_rb.util.io import observe_io


def rows_of(rb: TensorDictReplayBuffer) -> TensorDict | None:
    return rb.storage.get(torch.arange(len(rb))).exclude("index") if len(rb) else None


def replayed(data: TensorDict, rows: int) -> tuple[TensorDict | None, int]:
    """The rows and cursor of a LazyTensorStorage ring of ``ROWS`` that took the first
    ``rows`` rows of ``data`` in order."""
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=4)
    if rows:
        twin.extend(data[:rows])
    return rows_of(twin), int(twin._writer._cursor)


@pytest.mark.parametrize(("first", "each"), [(32, 32), (24, 24), (16, 16), (4, 16), (0, 12)])
def test_extends_over_the_rows_of_the_extend_before_keep_committing(tmp_path, first, each):
    """Extends over rows the extend before them wrote (a ring of four blocks written whole
    by each extend, as an on-policy buffer is, or half of it): a crash loses no row before
    the last blocks written (a version that wrote an extend's whole blocks behind made no
    commit at all here, found by review: staged, an extend's rows hid the rows they go over
    from the commits)."""
    sizes = [first, *[each] * 6] if first else [each] * 6
    assert_a_crash_keeps_the_rows_before_the_last_blocks(tmp_path / "rb.zarr", sizes, lands=False)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8), lands=st.booleans())
def test_a_crash_after_any_extends_keeps_the_rows_before_the_last_blocks(tmp_path, sizes, lands):
    """Extends of any size on a ring of four blocks (whole blocks written behind, partial
    ones staged, the ring wrapped), their writes landing as started or only when waited
    for; then a crash."""
    path = tmp_path / f"rb-{uuid.uuid4().hex}.zarr"
    assert_a_crash_keeps_the_rows_before_the_last_blocks(path, sizes, lands=lands)


def assert_a_crash_keeps_the_rows_before_the_last_blocks(
    path: Path, sizes: list[int], *, lands: bool
) -> None:
    """Extends of ``sizes`` rows, then a crash: the store reopens in the state of a ring that
    took the rows extended up to some point since the first block the last extend that
    filled a block wrote (the blocks it wrote may be in flight, and the rows after them
    wait in RAM; its write committed every row before them)."""
    data = Episode().rows(sum(sizes))
    with writes_held_back(lambda n: lands) as held:
        rbs = buffers(path)
        done = 0
        for size in sizes:
            extend_with(rbs, data[done : done + size])
            done += size
        held.drop()
        simulate_crash(rbs[0].storage)
    with ZarrStorage(path=path) as reopened:
        rb = TensorDictReplayBuffer(storage=reopened)
        got, cursor = rows_of(rb), int(rb._writer._cursor)
    least, before = 0, 0
    for size in sizes:
        if (before + size) // BLOCK > before // BLOCK:  # (it filled a block)
            least = before - before % BLOCK
        before += size
    for p in range(least, done + 1):
        rows, at = replayed(data, p)
        if at != cursor or (got is None) != (rows is None):
            continue
        if got is None or (got.shape == rows.shape and (got == rows).all()):
            return
    raise AssertionError(f"reopened with {len(rb)} rows, cursor {cursor}: no state since {least}")


def test_the_files_of_a_write_behind_are_synced_before_a_commit_declares_them(tmp_path):
    """The commit after a write behind does not fsync its files again: the landing thread
    did, each of them (the durability recorder takes the commit's word for it)."""
    from zarr_rb.locations import local

    synced: set[Path] = set()
    landed: set[Path] = set()
    together = local._fsync_together

    def recorded(paths: list[Path], *, announced: bool = True) -> list[bool]:
        if not announced:  # (the landing thread's)
            synced.update(paths)
        return together(paths, announced=announced)

    def observe(kind: str, where: object) -> None:
        if kind == "landed":
            landed.add(Path(str(where)))

    with mock.patch.object(local, "_fsync_together", recorded), observe_io(observe):
        rbs = buffers(tmp_path / "rb.zarr")
        episode = Episode()
        for _ in range(8):
            extend(rbs, episode, 3)  # a block filled in RAM now and then: written behind
        rbs[0].storage.flush()
    assert landed
    assert landed <= synced
    rbs[0].storage.close()


def extend_with(rbs: tuple[TensorDictReplayBuffer, ...], data: TensorDict) -> None:
    for rb in rbs:
        rb.extend(data)
