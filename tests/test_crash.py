"""kill -9 a writer that extends (wrapping around), updates priorities, flushes and saves;
the store must reopen at its last commit with every committed row intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.testing import (
    CrashWorkload,
    forkserver_context,
    kill_at_each_operation_of_a_save,
    kill_randomly,
)

WORKLOAD = CrashWorkload()


@pytest.fixture(scope="module")
def context():
    return forkserver_context()


def random_kills(tmp_path, context, seeds) -> None:
    saved = 0
    for seed in seeds:
        where = tmp_path / f"seed-{seed}"
        where.mkdir()
        # Killed after its first save returned (waited for), but for one seed in ten:
        # load must then restore a save.
        check = kill_randomly(where, seed, WORKLOAD, context, after_a_save=True)
        saved += check.saved is not None
    assert saved >= len(seeds) // 2


def test_random_kills(tmp_path, context):
    random_kills(tmp_path, context, range(8))


@pytest.mark.parametrize("seed", range(3))
def test_every_commit_of_the_workload_is_a_state_a_crash_may_leave(tmp_path, seed):
    """The random kills' workload, unkilled: after each of its steps, a reader of the store
    (what a crash at that instant leaves) finds every row of ``[0, len)`` readable and
    holding its own slot's newest committed transition. A kill lands on such a state only
    by luck; this visits each one."""
    path = tmp_path / "rb.zarr"
    rb = WORKLOAD.buffer(path)
    rng = np.random.default_rng(seed)
    cap = WORKLOAD.capacity

    def check(when: str, total: int) -> None:
        reader = ZarrStorage(path=path, read_only=True)
        assert reader._store.unreadable_rows().size == 0, f"{when}: a hole"
        rows = torch.arange(len(reader))
        got = reader.get(rows)["step"]
        assert torch.equal(got % cap, rows), f"{when}: rows of other slots"
        assert bool((got < total).all()), f"{when}: a row never written"
        reader.close()

    for step in range(1, 40):
        total = WORKLOAD.step(rb, rng)
        check(f"step {step}", total)
        if step % WORKLOAD.save_every == 0:
            zarr_rb.save(rb, progress=False)
            check(f"the save after step {step}", total)
        elif step % WORKLOAD.flush_every == 0:
            rb.storage.flush()
            check(f"the flush after step {step}", total)
    rb.storage.close()


@pytest.mark.slow
def test_many_random_kills(tmp_path, context):
    random_kills(tmp_path, context, range(100, 160))


def kills_during_a_save(tmp_path, context, stride: int) -> tuple[list[int | None], int]:
    """The write count ``load`` restores after a kill at each chosen operation of a save."""
    outcomes, operations = [], 0
    for _, operations, check in kill_at_each_operation_of_a_save(  # noqa: B007
        tmp_path, WORKLOAD, context, stride=stride
    ):
        outcomes.append(check.saved)
    assert operations > 20
    # Killed before the publish, load() restores the previous save; after it, the new one.
    previous, new = outcomes[0], check.written
    assert previous is not None
    assert set(outcomes) <= {previous, new}
    assert outcomes == sorted(outcomes, key=lambda saved: saved == new)  # one switch
    return outcomes, new


def test_kill_at_some_operations_of_a_save(tmp_path, context):
    kills_during_a_save(tmp_path, context, stride=7)


@pytest.mark.slow
def test_kill_at_every_operation_of_a_save(tmp_path, context):
    outcomes, new = kills_during_a_save(tmp_path, context, stride=1)
    assert outcomes[-1] == new  # the last operation is the fsync after the publish
