"""A crash workload and its checker: a writer whose every row is a function of its step
number, run in a process that is killed, and the check of the store it leaves."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zarr_rb.locations import is_remote, open_location
from zarr_rb.locations.base import is_temporary
from zarr_rb.testing.faults import ALL_KINDS, FaultInjector
from zarr_rb.torchrl import compat
from zarr_rb.util.io import observe_io


@dataclasses.dataclass(frozen=True)
class CrashWorkload:
    """A prioritized buffer extended with wrap-around, its priorities updated, flushed and
    saved in a loop. Every row's content is a function of its step number ``t`` (the
    ``t``-th transition ever written), so any mix of rows, keys or generations shows."""

    capacity: int = 96
    block_rows: int = 8
    max_batch: int = 13
    save_every: int = 5
    flush_every: int = 7
    alpha: float = 1.0  # priorities stored exactly (no pow rounding), compared bit for bit
    beta: float = 0.5
    frames: bool = False
    """Frames stored once on disk (``Compression(frames=True)``), and observations that are
    stacks of a run of frames, as an Atari agent's (``next/obs[t]`` is ``obs[t + 1]``)."""

    def rows(self, steps: torch.Tensor, capacity: int) -> Any:
        from tensordict import TensorDict

        t = steps.to(torch.int64)
        pattern = torch.arange(1024, dtype=torch.int64)
        if self.frames:  # frame f of the run: ((f * 31 + pixel) % 251), 4 to a stack
            frames = (t[:, None, None] + torch.arange(5)[:, None]) * 31 + pattern[:256]
            stacks = (frames % 251).to(torch.uint8).view(-1, 5, 16, 16)
            obs, nxt = stacks[:, :4], stacks[:, 1:]
        else:
            obs = ((t[:, None] * 31 + pattern) % 251).to(torch.uint8).view(-1, 4, 16, 16)
            nxt = ((t[:, None] * 31 + pattern + 7) % 251).to(torch.uint8).view(-1, 4, 16, 16)
        return TensorDict(
            {
                "step": t,
                "slot": t % capacity,
                "obs": obs.contiguous(),
                "reward": t.to(torch.float32) * 0.5,
                "next": {"obs": nxt.contiguous()},
            },
            batch_size=[t.numel()],
        )

    @staticmethod
    def priority(steps: torch.Tensor) -> torch.Tensor:
        return 1.0 + (steps % 97).to(torch.float32) / 8.0

    def buffer(self, path: Path | str, storage_options: dict[str, Any] | None = None) -> Any:
        from torchrl.data import TensorDictPrioritizedReplayBuffer

        from zarr_rb.engine.layout import Compression
        from zarr_rb.torchrl.storage import ZarrStorage

        storage = ZarrStorage(
            self.capacity,
            path,
            compression=Compression(block_rows=self.block_rows, frames=self.frames),
            storage_options=storage_options,
        )
        return TensorDictPrioritizedReplayBuffer(
            alpha=self.alpha, beta=self.beta, storage=storage, batch_size=8
        )

    def step(self, rb: Any, rng: np.random.Generator, log: Any = None) -> int:
        """Extend by a random number of rows and set their priorities; the new total."""
        start = int(compat.get(rb.writer, "_write_count"))
        n = int(rng.integers(1, self.max_batch + 1))
        if log is not None:
            log("extending", start + n)
        steps = torch.arange(start, start + n)
        index = rb.extend(self.rows(steps, self.capacity))
        rb.update_priority(index, self.priority(steps))
        return start + n


class _Log:
    """Lines appended to a file, one write each: they survive SIGKILL (page cache)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words: object) -> None:
        os.write(self._fd, (" ".join(str(w) for w in words) + "\n").encode())


def run_crash_writer(
    path: str,
    log_path: str,
    seed: int,
    workload: CrashWorkload,
    steps: int = 10**9,
    kill_at: int | None = None,
    kill_after_steps: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The writer side of a crash test (run it in a child process and kill it).

    Logs ``ready``, ``extending T`` (before the rows up to ``T`` are handed to ``extend``),
    ``flushing T``/``flushed T`` and ``saving T``/``saved T``.
    With ``kill_at``, the process SIGKILLs itself at the ``kill_at``-th store operation
    of the first save after ``kill_after_steps`` steps; with ``kill_at=0`` it logs
    ``events N``, the number of operations of that save, and exits.
    """
    log = _Log(Path(log_path))  # first: a kill while the store is made finds the log
    rng = np.random.default_rng(seed)
    rb = workload.buffer(path if is_remote(path) else Path(path), storage_options)
    log("ready")
    total = 0
    for step in range(1, steps + 1):
        total = workload.step(rb, rng, log)
        if kill_at is not None and step >= kill_after_steps:
            injector = FaultInjector(at=kill_at or None, kinds=ALL_KINDS, kill=True)
            log("saving", total)
            from zarr_rb import api  # at the first save: the log is written before imports

            with observe_io(injector):
                api.save(rb, progress=False)
            log("saved", total)
            log("events", injector.count)
            return
        if step % workload.save_every == 0:
            log("saving", total)
            from zarr_rb import api

            api.save(rb, progress=False)
            log("saved", total)
        elif step % workload.flush_every == 0:
            log("flushing", total)
            rb.storage.flush()
            log("flushed", total)


@dataclasses.dataclass(frozen=True)
class CrashCheck:
    """What :func:`check_crashed_store` found in a store after its writer was killed."""

    length: int
    holes: int
    written: int
    """Rows the writer had handed to ``extend`` when it died (from its log)."""
    durable: int
    """Rows covered by the last flush or save that returned."""
    saved: int | None
    """Write count of the save that ``zarr_rb.load`` restores (``None``: no save yet)."""
    temporaries: int
    """Files of interrupted writes found after the kill (all removed on reopening)."""


def logged_values(log_path: Path) -> dict[str, list[int]]:
    values: dict[str, list[int]] = {}
    for line in log_path.read_text().splitlines():
        word, *rest = line.split()
        values.setdefault(word, []).extend(int(v) for v in rest)
    return values


def check_failed(message: str) -> None:
    raise AssertionError(message)


def check_crashed_store(
    path: Path | str,
    log_path: Path,
    workload: CrashWorkload,
    storage_options: dict[str, Any] | None = None,
) -> CrashCheck:
    """Check every promise a killed writer's store makes, then reopen it and write on (on
    an object store, once the dead writer's lease has expired).

    Raises:
        AssertionError: a promise is broken (with what and where).
    """
    from torchrl.data import PrioritizedSampler

    from zarr_rb import api
    from zarr_rb.torchrl.storage import ZarrStorage

    cap = workload.capacity
    log = logged_values(log_path)
    written = max(log.get("extending", [0]))
    durable = max(log.get("flushed", []) + log.get("saved", []) + [0])
    location = open_location(path, storage_options)
    temporaries = sum(1 for key in location.list() if is_temporary(key))
    raw = location.read("zarr.json")
    document = json.loads(raw) if raw is not None else None
    if document is None:  # killed before the store existed
        if log.get("saved") or log.get("flushed"):
            check_failed("rows were extended but no store exists")
        return CrashCheck(0, 0, 0, 0, None, temporaries)
    meta = document["attributes"]["zarr_rb"]
    commit = meta["commit"]

    # Readers open it as it is (temporaries ignored), at exactly the last commit.
    reader = ZarrStorage(path=path, read_only=True, storage_options=storage_options)
    if len(reader) != commit["length"]:
        check_failed(f"reopened length {len(reader)} != committed length {commit['length']}")
    holes = sum(b - a for a, b in commit["holes"])
    if holes:
        check_failed(
            f"holes {commit['holes']} in [0, {commit['length']}): every row must be readable"
        )
    length = len(reader)
    if length:
        readable = np.ones(length, bool)
        for a, b in commit["holes"]:
            readable[a:b] = False
        rows = torch.from_numpy(np.flatnonzero(readable))
        got = reader.get(rows)
        steps = got["step"]
        if not torch.equal(steps % cap, rows):
            check_failed(f"rows hold transitions of other slots: {rows[steps % cap != rows][:8]}")
        expected = workload.rows(steps, cap)
        for key in expected.keys(include_nested=True, leaves_only=True):
            if not torch.equal(got[key], expected[key]):
                bad = (got[key] != expected[key]).reshape(rows.numel(), -1).any(-1)
                check_failed(f"key {key}: rows {rows[bad][:8].tolist()} torn from their step")
        frontier = int(steps.max()) + 1
        if frontier > written:
            check_failed(f"a row from step {frontier - 1} but only {written} were written")
        # A row may hold an older version than the newest written (the newest may still
        # have been in RAM), but never one older than what a returned flush or save wrote.
        for t in range(max(0, durable - cap), durable):
            slot = t % cap
            if slot < length and readable[slot] and int(got["step"][rows == slot]) < t:
                check_failed(f"row {slot}: step {t} was flushed, but an older step is readable")
    if length < min(durable, cap):
        check_failed(f"length {length} lost rows: {durable} were flushed or saved")
    reader.close()

    saved = meta.get("saved")
    saved_count = None
    if saved is not None:
        rb = api.load(path, read_only=True, storage_options=storage_options)
        saved_count = int(compat.get(rb.writer, "_write_count"))
        if saved_count not in log.get("saving", []):
            check_failed(f"loaded write count {saved_count} is not one the writer saved")
        if len(rb) != min(saved_count, cap) or rb.storage.cursor != saved_count % cap:
            check_failed(f"saved length/cursor {len(rb)}/{rb.storage.cursor} != {saved_count}")
        if int(compat.get(rb.writer, "_cursor")) != saved_count % cap:
            cursor = compat.get(rb.writer, "_cursor")
            check_failed(f"writer cursor {cursor} != {saved_count % cap}")
        n = min(saved_count, cap)
        index = torch.arange(n)
        latest = saved_count - 1 - ((saved_count - 1 - index) % cap)
        reference = PrioritizedSampler(cap, workload.alpha, workload.beta)
        reference.update_priority(index, workload.priority(latest))
        for tree in ("_sum_tree", "_min_tree"):
            ours = torch.as_tensor(getattr(rb.sampler, tree)[index])
            want = torch.as_tensor(getattr(reference, tree)[index])
            if not torch.equal(ours, want):
                check_failed(f"sampler {tree} does not match the save of write count {saved_count}")
        _check_sampling_avoids_holes(rb, commit["holes"])
        rb.storage.close()

    # The writer reopens (clearing temporaries), samples, and goes on from the last save.
    rb = _when_unlocked(
        lambda: (
            api.load(path, storage_options=storage_options)
            if saved is not None
            else workload.buffer(path, storage_options)
        )
    )
    if len(rb):
        _check_sampling_avoids_holes(rb, commit["holes"])
    workload.step(rb, np.random.default_rng(0))
    api.save(rb, progress=False)
    rb.storage.close()
    left = [key for key in location.list() if is_temporary(key)]
    if left:
        check_failed(f"temporaries left after the writer reopened: {left[:4]}")
    return CrashCheck(length, holes, written, durable, saved_count, temporaries)


def _when_unlocked(open_writer: Any, *, seconds: float = 40.0) -> Any:
    """``open_writer()``, retried while a dead writer's lease has not expired yet."""
    from zarr_rb.errors import LockedError

    deadline = time.monotonic() + seconds
    while True:
        try:
            return open_writer()
        except LockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _check_sampling_avoids_holes(rb: Any, holes: list[list[int]]) -> None:
    """A buffer on a crashed store samples without error, never from a withdrawn row."""
    withdrawn = {row for start, stop in holes for row in range(start, stop)}
    for _ in range(5):
        _, info = rb.sample(return_info=True)
        drawn = set(torch.as_tensor(info["index"]).reshape(-1).tolist())
        if drawn & withdrawn:
            check_failed(f"sampled withdrawn rows {sorted(drawn & withdrawn)[:8]}")


def expected_rows(workload: CrashWorkload, total: int) -> Any:
    """The rows a workload buffer holds after ``total`` sequential writes (slot order)."""
    cap = workload.capacity
    index = torch.arange(min(total, cap))
    return workload.rows(total - 1 - ((total - 1 - index) % cap), cap)


def simulate_crash(storage: Any) -> None:
    """Drop ``storage`` as a process SIGKILLed at this instant would: the rows it holds in
    RAM are lost, nothing is flushed or committed, and its writer lock is released. The
    store on disk is left exactly as the crash would leave it (the process goes on, so the
    files it wrote are all there, as the OS keeps them after a process dies)."""
    storage.abandon()


def _faulted_workload(workload: CrashWorkload, path: Path, opened: list[Any]) -> None:
    """Two extends (the second wraps around), each followed by a save."""
    from zarr_rb import api

    rb = workload.buffer(path)
    opened.append(rb)
    for start, n in ((0, workload.capacity // 2 + 6), (workload.capacity // 2 + 6, 37)):
        steps = torch.arange(start, start + n)
        index = rb.extend(workload.rows(steps, workload.capacity))
        rb.update_priority(index, workload.priority(steps))
        api.save(rb, progress=False)


def count_fault_points(workload: CrashWorkload, path: Path) -> int:
    """Store writes and commit publishes of the faulted workload (the points to break)."""
    injector = FaultInjector(under=path)
    opened: list[Any] = []
    with observe_io(injector):
        _faulted_workload(workload, path, opened)
    opened[0].storage.close()
    return injector.count


def inject_io_fault(
    workload: CrashWorkload, path: Path, *, at: int, error: int, persistent: bool
) -> None:
    """Fail the ``at``-th store write or publish of the faulted workload with ``error``
    (once, or from then on), then check the promises:

    * the error is a :class:`~zarr_rb.StoreWriteError` with that errno, naming the store;
    * the store reopens (read-only, next to the failed writer) at its last commit, every
      readable row intact;
    * a retry after the fault, ``zarr_rb.save`` on the same buffer, succeeds, and the
      store then loads with every row the buffer was given.
    """
    from zarr_rb import api
    from zarr_rb.errors import StoreWriteError
    from zarr_rb.torchrl.storage import ZarrStorage

    injector = FaultInjector(at=at, error=error, persistent=persistent, under=path)
    opened: list[Any] = []
    try:
        with observe_io(injector):
            _faulted_workload(workload, path, opened)
    except StoreWriteError as err:
        if err.errno != error or str(path) not in str(err) or "last commit" not in str(err):
            check_failed(f"fault {at}: unexpected error {err!r}")
    else:
        check_failed(f"fault {at}: the injected error was swallowed")
    if injector.fired < 1:
        check_failed(f"fault {at}: nothing was injected")
    if (path / "zarr.json").exists():
        commit = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]["commit"]
        reader = ZarrStorage(path=path, read_only=True)
        if len(reader) != commit["length"]:
            check_failed(
                f"fault {at}: reopened length {len(reader)} != committed {commit['length']}"
            )
        readable = np.ones(len(reader), bool)
        for a, b in commit["holes"]:
            readable[a:b] = False
        if readable.any():
            rows = torch.from_numpy(np.flatnonzero(readable))
            got = reader.get(rows).exclude("index")
            want = workload.rows(got["step"], workload.capacity)
            if not (torch.equal(got["step"] % workload.capacity, rows) and (got == want).all()):
                check_failed(f"fault {at}: committed rows are not intact")
        reader.close()
    if not opened or not opened[0].storage.initialized:
        # The fault hit before the store had its arrays (creating them): no row could be
        # kept, so the retry is the workload itself, on the same store.
        if opened:
            opened.pop().storage.close()
        _faulted_workload(workload, path, opened)
    rb = opened[0]
    api.save(rb, progress=False)  # the retry
    total = int(compat.get(rb.writer, "_write_count"))
    rb.storage.close()
    loaded = api.load(path)
    got = loaded.storage.get(torch.arange(len(loaded))).exclude("index")
    if (
        int(compat.get(loaded.writer, "_write_count")) != total
        or not (got == expected_rows(workload, total)).all()
    ):
        check_failed(
            f"fault {at}: after the retry the store does not hold the {total} rows written"
        )
    loaded.storage.close()
