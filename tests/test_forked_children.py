"""A process forked from one with a store open (a ``DataLoader`` worker, ``mp.Process`` with
the fork method): the store stays the parent's. The child's garbage collector dropping its
copy of a storage neither flushes, nor releases, nor deletes the parent's store, nor waits on
a lock a parent thread held at the fork; a call of the store in the child raises a typed
error instead of aborting the process (TensorStore's threads do not survive a fork)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_identical
from sample_runner import python_c
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import NotSupportedError, ZarrStorage

FORK = multiprocessing.get_context("fork")


def _rows(first: int, count: int) -> TensorDict:
    return TensorDict({"step": torch.arange(first, first + count)}, batch_size=[count])


def _in_child(task: Callable[[], Any]) -> Any:
    """Run ``task`` in a forked child: what it returned, or the error it raised as
    ``(type name, message)``. A child killed (by an abort) fails the test."""
    queue = FORK.Queue()

    def run() -> None:
        try:
            queue.put(("returned", task()))
        except Exception as err:
            queue.put(("raised", (type(err).__name__, str(err))))

    child = FORK.Process(target=run)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, f"the forked child ended with {child.exitcode}"
    return queue.get(timeout=10)


@pytest.fixture
def no_collection() -> Iterator[None]:
    """Garbage stays uncollected until the test collects it (in the child first)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _dropped_in_a_cycle(rb: TensorDictReplayBuffer) -> None:
    cycle: list[Any] = [rb]
    cycle.append(cycle)


def test_a_child_collecting_a_dropped_temporary_buffer_leaves_the_parents_store(
    no_collection: None,
) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100))
    rb.extend(_rows(0, 10))
    path = Path(rb.storage.path)
    _dropped_in_a_cycle(rb)
    del rb

    assert _in_child(gc.collect)[0] == "returned"
    assert path.exists()  # the child deleted the parent's temporary store before
    gc.collect()  # the parent's own collection closes it, and deletes it
    assert not path.exists()


def _committed(path: Path) -> int:
    """The length of the last commit of the store at ``path``, as another process sees it."""
    return len(zarr_rb.open(path))


def _another_process_opens_to_write(path: Path) -> str:
    code = (
        "import sys\nfrom zarr_rb import ZarrStorage\n"
        "try:\n    ZarrStorage(path=sys.argv[1]).close()\n    print('opened')\n"
        "except Exception as err:\n    print(type(err).__name__)\n"
    )
    out = python_c(code, str(path), cwd=path.parent, timeout=300)
    return out.stdout.strip() or out.stderr[-2000:]


def test_a_child_collecting_a_dropped_buffer_commits_and_releases_nothing(
    tmp_path: Path, no_collection: None
) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(1_000_000, path))  # rows wait in RAM
    rb.extend(_rows(0, 30))
    committed = _committed(path)
    assert committed < 30
    _dropped_in_a_cycle(rb)
    del rb

    assert _in_child(gc.collect)[0] == "returned"
    assert _committed(path) == committed  # the child committed the parent's rows before
    assert _another_process_opens_to_write(path) == "LockedError"  # (and released its lock)
    gc.collect()
    again = TensorDictReplayBuffer(storage=ZarrStorage(path=path, read_only=True))
    assert len(again) == 30
    assert_identical(again[:].exclude("index"), _rows(0, 30))


def test_a_child_collecting_a_buffer_does_not_wait_for_a_lock_a_parent_thread_held(
    no_collection: None,
) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100))
    rb.extend(_rows(0, 10))
    calls = rb.storage.store.calls
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with calls.mutex:  # a call under way in another thread at the fork
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    _dropped_in_a_cycle(rb)
    del rb
    try:
        assert _in_child(gc.collect)[0] == "returned"  # the child's lock is held for good
    finally:
        release.set()
        holder.join()
        gc.collect()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda rb: rb.extend(_rows(10, 5)), id="extend"),
        # (TorchRL's writer keeps its cursor in memory the child shares with the parent:
        # emptying it, then being refused, rewound the parent's writer.)
        pytest.param(lambda rb: rb.empty(), id="empty"),
        pytest.param(lambda rb: rb.storage.flush(), id="flush"),
        pytest.param(lambda rb: rb.storage.close(), id="close"),
        pytest.param(lambda rb: rb.storage.cleanup(), id="cleanup"),
        pytest.param(lambda rb: rb.sample(4), id="sample"),
        pytest.param(lambda rb: rb[3], id="index"),
    ],
)
def test_a_call_in_a_forked_child_is_a_typed_error_and_the_parent_goes_on(
    call: Callable[[TensorDictReplayBuffer], Any],
) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100))
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    for buffer in (rb, twin):
        buffer.extend(_rows(0, 10))
    path = Path(rb.storage.path)

    outcome, (kind, message) = _in_child(lambda: call(rb))

    assert (outcome, kind) == ("raised", NotSupportedError.__name__)
    assert str(path) in message
    assert "'spawn'" in message
    assert path.exists()
    for buffer in (rb, twin):
        buffer.extend(_rows(10, 5))
    assert_identical(rb[:], twin[:])
    rb.storage.cleanup()
    assert not path.exists()


_WRITER_WITH_A_CHILD = """
import multiprocessing, signal, sys
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from zarr_rb import ZarrStorage

rb = TensorDictReplayBuffer(storage=ZarrStorage(100, sys.argv[1], shared=sys.argv[2] == "shared"))
rb.extend(TensorDict({"step": torch.arange(10)}, [10]))
rb.storage.flush()
child = multiprocessing.get_context("fork").Process(target=signal.pause)  # uses no store
child.start()
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("kind", ["single", "shared"])
def test_a_writer_killed_while_a_child_it_forked_lives_leaves_the_store_unlocked(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "rb.zarr"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER_WITH_A_CHILD, str(path), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    child = int(writer.stdout.readline())
    try:
        writer.kill()
        writer.wait(timeout=60)
        assert Path(f"/proc/{child}").exists()  # the child lives on
        # The child's copies of the lock files kept the dead writer's locks before.
        storage = ZarrStorage(path=path)
        assert len(storage) == 10
        storage.close()
    finally:
        os.kill(child, signal.SIGKILL)
