"""Tools to break a store on purpose: fault injection, a durability recorder, and a
crash workload with its checker.

They drive zarr_rb's own reliability tests (``tests/test_reliability.py``,
``tests/test_crash.py``) and the long crash run (``benchmarks/crash.py``), and
can check a deployment the same way.

Everything here works on the file operations the engine announces (see
:func:`zarr_rb.util.io.observe_io`): every write, removal, fsync and commit publish
of a store goes through it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from zarr_rb.locations import is_remote, open_location
from zarr_rb.locations.base import LEASE_KEY, NOT_DATA, is_temporary
from zarr_rb.torchrl import compat
from zarr_rb.util.io import IOKind, observe_io

__all__ = [
    "ALL_KINDS",
    "CrashCheck",
    "CrashWorkload",
    "DurabilityRecorder",
    "FaultInjector",
    "check_crashed_store",
    "count_fault_points",
    "expected_rows",
    "inject_io_fault",
    "observe_io",
    "run_crash_writer",
]

ALL_KINDS: tuple[IOKind, ...] = ("write", "remove", "fsync", "publish")


class FaultInjector:
    """An I/O observer that fails or kills the process at the ``at``-th operation.

    Args:
        at: 1-based number of the operation (counting only ``kinds``) to break; ``None``
            only counts.
        kinds: the operations counted.
        error: the ``errno`` of the injected ``OSError`` (``ENOSPC``, ``EIO``, ...).
        persistent: fail every operation from the ``at``-th on (a disk that stays full),
            rather than only that one.
        kill: SIGKILL the process instead of raising (a crash at that exact point).
        under: count only the operations on files below this directory (one store), not
            those of other stores of the process (one closed by the garbage collector
            meanwhile would move the count).

    Renewals of an S3 writer's lease are not counted: a clock times them, so counting them
    would make the operations of one workload differ from run to run.
    """

    def __init__(
        self,
        *,
        at: int | None = None,
        kinds: tuple[IOKind, ...] = ("write", "publish"),
        error: int = errno.ENOSPC,
        persistent: bool = False,
        kill: bool = False,
        under: Path | None = None,
    ) -> None:
        self.at = at
        self.under = None if under is None else Path(under).absolute()
        self.kinds = kinds
        self.error = error
        self.persistent = persistent
        self.kill = kill
        self.count = 0
        self.fired = 0
        self.events: list[tuple[IOKind, PurePath]] = []

    def __call__(self, kind: IOKind, path: PurePath) -> None:
        if kind not in self.kinds or PurePath(path).name == LEASE_KEY:
            return
        if self.under is not None and not Path(path).absolute().is_relative_to(self.under):
            return
        self.count += 1
        self.events.append((kind, path))
        if self.at is None or self.count < self.at:
            return
        if self.count > self.at and not self.persistent:
            return
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        self.fired += 1
        raise OSError(
            self.error, f"{os.strerror(self.error)} (injected at {kind} #{self.count})", str(path)
        )


def _entry_state(path: Path) -> tuple[Any, ...] | None:
    """What must be durable about a file (its inode and content stamp) or a directory (its
    entries and their inodes)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if path.is_dir():
        entries = frozenset(
            (p.name, p.stat().st_ino)
            for p in path.iterdir()
            if not is_temporary(p.name) and p.name not in NOT_DATA
        )
        return ("dir", st.st_ino, entries)
    return ("file", st.st_ino, st.st_size, st.st_mtime_ns)


def _tree_state(root: Path) -> dict[Path, tuple[Any, ...]]:
    state: dict[Path, tuple[Any, ...]] = {}
    for dirpath, _, filenames in os.walk(root):
        directory = Path(dirpath)
        entry = _entry_state(directory)
        if entry is not None:
            state[directory] = entry
        for name in filenames:
            path = directory / name
            if is_temporary(path.name) or name in NOT_DATA:
                continue
            entry = _entry_state(path)
            if entry is not None:
                state[path] = entry
    return state


class DurabilityRecorder:
    """An I/O observer that checks, at every commit publish, that each file and directory
    changed since the previous publish was fsynced after its last change.

    It looks at the filesystem itself (inodes, sizes, modification times, directory
    entries), not at what the engine says it wrote, so a write the engine forgot to
    announce is caught too. Files written atomically (temporary file, fsync, rename)
    count as fsynced through their temporary name.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.publishes = 0
        self.fsyncs = 0
        self.writes = 0
        self.checked = 0
        self.violations: list[str] = []
        self._last = _tree_state(self.root) if self.root.exists() else {}
        self._synced_dirs: dict[Path, tuple[Any, ...] | None] = {}
        self._synced_files: set[tuple[Any, ...]] = set()

    def __call__(self, kind: IOKind, announced: PurePath) -> None:
        path = Path(announced)
        if kind == "fsync":
            self.fsyncs += 1
            state = _entry_state(path)
            if state is not None and state[0] == "dir":
                self._synced_dirs[path] = state
            elif state is not None:
                self._synced_files.add(state[1:])
        elif kind == "write":
            self.writes += 1
        elif kind == "publish":
            self._check()

    def _check(self) -> None:
        self.publishes += 1
        now = _tree_state(self.root)
        for path, state in now.items():
            if self._last.get(path) == state:
                continue
            self.checked += 1
            synced = (
                self._synced_dirs.get(path) == state
                if state[0] == "dir"
                else state[1:] in self._synced_files
            )
            if not synced:
                what = "directory" if state[0] == "dir" else "file"
                self.violations.append(
                    f"publish #{self.publishes}: {what} {path.relative_to(self.root)} changed "
                    "since the previous commit and was not fsynced after its last change",
                )
        self._last = now


# --- the crash workload --------------------------------------------------------------------


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

    @staticmethod
    def rows(steps: torch.Tensor, capacity: int) -> Any:
        from tensordict import TensorDict

        t = steps.to(torch.int64)
        pattern = torch.arange(1024, dtype=torch.int64)
        obs = ((t[:, None] * 31 + pattern) % 251).to(torch.uint8).view(-1, 4, 16, 16)
        return TensorDict(
            {
                "step": t,
                "slot": t % capacity,
                "obs": obs,
                "reward": t.to(torch.float32) * 0.5,
                "next": {
                    "obs": ((t[:, None] * 31 + pattern + 7) % 251)
                    .to(torch.uint8)
                    .view(-1, 4, 16, 16)
                },
            },
            batch_size=[t.numel()],
        )

    @staticmethod
    def priority(steps: torch.Tensor) -> torch.Tensor:
        return 1.0 + (steps % 97).to(torch.float32) / 8.0

    def buffer(self, path: Path | str, storage_options: dict[str, Any] | None = None) -> Any:
        from torchrl.data import TensorDictPrioritizedReplayBuffer

        from zarr_rb.core.layout import Compression
        from zarr_rb.torchrl.storage import ZarrStorage

        storage = ZarrStorage(
            self.capacity,
            path,
            compression=Compression(block_rows=self.block_rows),
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
    import zarr_rb

    log = _Log(Path(log_path))
    rng = np.random.default_rng(seed)
    rb = workload.buffer(path if is_remote(path) else Path(path), storage_options)
    log("ready")
    total = 0
    for step in range(1, steps + 1):
        total = workload.step(rb, rng, log)
        if kill_at is not None and step >= kill_after_steps:
            injector = FaultInjector(at=kill_at or None, kinds=ALL_KINDS, kill=True)
            log("saving", total)
            with observe_io(injector):
                zarr_rb.save(rb, progress=False)
            log("saved", total)
            log("events", injector.count)
            return
        if step % workload.save_every == 0:
            log("saving", total)
            zarr_rb.save(rb, progress=False)
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


def _log_values(log_path: Path) -> dict[str, list[int]]:
    values: dict[str, list[int]] = {}
    for line in log_path.read_text().splitlines():
        word, *rest = line.split()
        values.setdefault(word, []).extend(int(v) for v in rest)
    return values


def _fail(message: str) -> None:
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

    import zarr_rb
    from zarr_rb.torchrl.storage import ZarrStorage

    cap = workload.capacity
    log = _log_values(log_path)
    written = max(log.get("extending", [0]))
    durable = max(log.get("flushed", []) + log.get("saved", []) + [0])
    location = open_location(path, storage_options)
    temporaries = sum(1 for key in location.list() if is_temporary(key))
    raw = location.read("zarr.json")
    document = json.loads(raw) if raw is not None else None
    if document is None:  # killed before the store existed
        if log.get("saved") or log.get("flushed"):
            _fail("rows were extended but no store exists")
        return CrashCheck(0, 0, 0, 0, None, temporaries)
    meta = document["attributes"]["zarr_rb"]
    commit = meta["commit"]

    # Readers open it as it is (temporaries ignored), at exactly the last commit.
    reader = ZarrStorage(path=path, read_only=True, storage_options=storage_options)
    if len(reader) != commit["length"]:
        _fail(f"reopened length {len(reader)} != committed length {commit['length']}")
    holes = sum(b - a for a, b in commit["holes"])
    if holes:
        _fail(f"holes {commit['holes']} in [0, {commit['length']}): every row must be readable")
    length = len(reader)
    if length:
        readable = np.ones(length, bool)
        for a, b in commit["holes"]:
            readable[a:b] = False
        rows = torch.from_numpy(np.flatnonzero(readable))
        got = reader.get(rows)
        steps = got["step"]
        if not torch.equal(steps % cap, rows):
            _fail(f"rows hold transitions of other slots: {rows[steps % cap != rows][:8]}")
        expected = workload.rows(steps, cap)
        for key in expected.keys(include_nested=True, leaves_only=True):
            if not torch.equal(got[key], expected[key]):
                bad = (got[key] != expected[key]).reshape(rows.numel(), -1).any(-1)
                _fail(f"key {key}: rows {rows[bad][:8].tolist()} torn from their step")
        frontier = int(steps.max()) + 1
        if frontier > written:
            _fail(f"a row from step {frontier - 1} but only {written} were written")
        # A row may hold an older version than the newest written (the newest may still
        # have been in RAM), but never one older than what a returned flush or save wrote.
        for t in range(max(0, durable - cap), durable):
            slot = t % cap
            if slot < length and readable[slot] and int(got["step"][rows == slot]) < t:
                _fail(f"row {slot}: step {t} was flushed, but an older step is readable")
    if length < min(durable, cap):
        _fail(f"length {length} lost rows: {durable} were flushed or saved")
    reader.close()

    saved = meta.get("saved")
    saved_count = None
    if saved is not None:
        rb = zarr_rb.load(path, read_only=True, storage_options=storage_options)
        saved_count = int(compat.get(rb.writer, "_write_count"))
        if saved_count not in log.get("saving", []):
            _fail(f"loaded write count {saved_count} is not one the writer saved")
        if len(rb) != min(saved_count, cap) or rb.storage.cursor != saved_count % cap:
            _fail(f"saved length/cursor {len(rb)}/{rb.storage.cursor} != {saved_count}")
        if int(compat.get(rb.writer, "_cursor")) != saved_count % cap:
            cursor = compat.get(rb.writer, "_cursor")
            _fail(f"writer cursor {cursor} != {saved_count % cap}")
        n = min(saved_count, cap)
        index = torch.arange(n)
        latest = saved_count - 1 - ((saved_count - 1 - index) % cap)
        reference = PrioritizedSampler(cap, workload.alpha, workload.beta)
        reference.update_priority(index, workload.priority(latest))
        for tree in ("_sum_tree", "_min_tree"):
            ours = torch.as_tensor(getattr(rb.sampler, tree)[index])
            want = torch.as_tensor(getattr(reference, tree)[index])
            if not torch.equal(ours, want):
                _fail(f"sampler {tree} does not match the save of write count {saved_count}")
        _check_sampling_avoids_holes(rb, commit["holes"])
        rb.storage.close()

    # The writer reopens (clearing temporaries), samples, and goes on from the last save.
    rb = _when_unlocked(
        lambda: (
            zarr_rb.load(path, storage_options=storage_options)
            if saved is not None
            else workload.buffer(path, storage_options)
        )
    )
    if len(rb):
        _check_sampling_avoids_holes(rb, commit["holes"])
    workload.step(rb, np.random.default_rng(0))
    zarr_rb.save(rb, progress=False)
    rb.storage.close()
    left = [key for key in location.list() if is_temporary(key)]
    if left:
        _fail(f"temporaries left after the writer reopened: {left[:4]}")
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
            _fail(f"sampled withdrawn rows {sorted(drawn & withdrawn)[:8]}")


# --- I/O faults ----------------------------------------------------------------------------


def expected_rows(workload: CrashWorkload, total: int) -> Any:
    """The rows a workload buffer holds after ``total`` sequential writes (slot order)."""
    cap = workload.capacity
    index = torch.arange(min(total, cap))
    return workload.rows(total - 1 - ((total - 1 - index) % cap), cap)


def _faulted_workload(workload: CrashWorkload, path: Path, opened: list[Any]) -> None:
    """Two extends (the second wraps around), each followed by a save."""
    import zarr_rb

    rb = workload.buffer(path)
    opened.append(rb)
    for start, n in ((0, workload.capacity // 2 + 6), (workload.capacity // 2 + 6, 37)):
        steps = torch.arange(start, start + n)
        index = rb.extend(workload.rows(steps, workload.capacity))
        rb.update_priority(index, workload.priority(steps))
        zarr_rb.save(rb, progress=False)


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
    import zarr_rb
    from zarr_rb.errors import StoreWriteError
    from zarr_rb.torchrl.storage import ZarrStorage

    injector = FaultInjector(at=at, error=error, persistent=persistent, under=path)
    opened: list[Any] = []
    try:
        with observe_io(injector):
            _faulted_workload(workload, path, opened)
    except StoreWriteError as err:
        if err.errno != error or str(path) not in str(err) or "last commit" not in str(err):
            _fail(f"fault {at}: unexpected error {err!r}")
    else:
        _fail(f"fault {at}: the injected error was swallowed")
    if injector.fired < 1:
        _fail(f"fault {at}: nothing was injected")
    if (path / "zarr.json").exists():
        commit = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]["commit"]
        reader = ZarrStorage(path=path, read_only=True)
        if len(reader) != commit["length"]:
            _fail(f"fault {at}: reopened length {len(reader)} != committed {commit['length']}")
        readable = np.ones(len(reader), bool)
        for a, b in commit["holes"]:
            readable[a:b] = False
        if readable.any():
            rows = torch.from_numpy(np.flatnonzero(readable))
            got = reader.get(rows).exclude("index")
            want = workload.rows(got["step"], workload.capacity)
            if not (torch.equal(got["step"] % workload.capacity, rows) and (got == want).all()):
                _fail(f"fault {at}: committed rows are not intact")
        reader.close()
    if not opened or not opened[0].storage.initialized:
        # The fault hit before the store had its arrays (creating them): no row could be
        # kept, so the retry is the workload itself, on the same store.
        if opened:
            opened.pop().storage.close()
        _faulted_workload(workload, path, opened)
    rb = opened[0]
    zarr_rb.save(rb, progress=False)  # the retry
    total = int(compat.get(rb.writer, "_write_count"))
    rb.storage.close()
    loaded = zarr_rb.load(path)
    got = loaded.storage.get(torch.arange(len(loaded))).exclude("index")
    if (
        int(compat.get(loaded.writer, "_write_count")) != total
        or not (got == expected_rows(workload, total)).all()
    ):
        _fail(f"fault {at}: after the retry the store does not hold the {total} rows written")
    loaded.storage.close()


def forkserver_context() -> Any:
    """A multiprocessing context whose children start in milliseconds, with torch, TorchRL
    and zarr_rb already imported (a fresh interpreter takes seconds to import them)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["zarr_rb.testing", "torchrl.data", "tensordict"])
    return context


def kill_randomly(
    where: Path,
    seed: int,
    workload: CrashWorkload,
    context: Any,
    *,
    max_delay: float = 1.0,
    after_a_save: bool = False,
    store: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CrashCheck:
    """Start a crash writer, SIGKILL it at a random moment (seeded), check its store (at
    ``store``, a URL, or in ``where``).

    The kill comes a random delay after the writer is ready, or, with ``after_a_save``,
    after its first save returned (waited for, however slow the machine: then ``load``
    must find a save). One kill in ten (seeded) comes early, while the store is being
    made.
    """
    rng = np.random.default_rng(seed)
    path: Path | str = where / "rb.zarr" if store is None else store
    log_path = where / "writer.log"
    child = context.Process(
        target=run_crash_writer,
        args=(str(path), str(log_path), seed, workload),
        kwargs={"storage_options": storage_options},
    )
    child.start()
    early = rng.random() < 0.1  # sometimes while the store is being created
    event = "saved" if after_a_save else "ready"
    if not early:
        _wait_for_line(log_path, event, child)
    time.sleep(float(rng.uniform(0, 0.3 if early else max_delay)))
    if child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
    child.join()
    if child.exitcode != -signal.SIGKILL:
        _fail(f"the writer exited with code {child.exitcode} before it was killed")
    check = check_crashed_store(path, log_path, workload, storage_options)
    if after_a_save and not early and check.saved is None:
        _fail("the writer was killed after a save returned, and load found no save")
    return check


def _wait_for_line(log_path: Path, word: str, child: Any, seconds: float = 300) -> None:
    """Wait until the writer logged a line starting with ``word`` (it died: fail). The
    bound is only there so that a writer stuck for good fails the test instead of
    hanging it."""
    deadline = time.monotonic() + seconds
    while not (log_path.exists() and _logged(log_path.read_text(), word)):
        if not child.is_alive():
            _fail(f"the writer died (exit code {child.exitcode}) before it logged {word!r}")
        if time.monotonic() > deadline:
            _fail(f"the writer logged no {word!r} line within {seconds:.0f} s")
        time.sleep(0.005)


def _logged(text: str, word: str) -> bool:
    return any(line.split(" ", 1)[0] == word for line in text.splitlines())


def kill_at_each_operation_of_a_save(
    where: Path,
    workload: CrashWorkload,
    context: Any,
    *,
    after_steps: int = 23,
    stride: int = 1,
    store: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[tuple[int, int, CrashCheck]]:
    """Kill a writer at the 1st, 2nd, ... store operation of one save (a save after
    ``after_steps`` steps, which wrapped the ring and saved before); check each store
    (in ``where``, or below the URL ``store``).

    Yields:
        ``(n, operations_of_the_save, check)`` for each kill point ``n``.
    """

    def store_at(name: str) -> str:
        return str(where / name / "rb.zarr") if store is None else f"{store}/{name}.zarr"

    count_dir = where / "count"
    count_dir.mkdir(parents=True)
    child = context.Process(
        target=run_crash_writer,
        args=(store_at("count"), str(count_dir / "log"), 0, workload),
        kwargs={
            "kill_at": 0,
            "kill_after_steps": after_steps,
            "storage_options": storage_options,
        },
    )
    child.start()
    child.join()
    operations = _log_values(count_dir / "log")["events"][0]
    for n in range(1, operations + 1, stride):
        run_dir = where / f"kill-{n}"
        run_dir.mkdir()
        child = context.Process(
            target=run_crash_writer,
            args=(store_at(f"kill-{n}"), str(run_dir / "log"), 0, workload),
            kwargs={
                "kill_at": n,
                "kill_after_steps": after_steps,
                "storage_options": storage_options,
            },
        )
        child.start()
        child.join()
        if child.exitcode != -signal.SIGKILL:
            _fail(f"kill point {n}: writer exited with {child.exitcode}, not SIGKILL")
        path = run_dir / "rb.zarr" if store is None else store_at(f"kill-{n}")
        yield n, operations, check_crashed_store(path, run_dir / "log", workload, storage_options)


def simulate_crash(storage: Any) -> None:
    """Drop ``storage`` as a process SIGKILLed at this instant would: the rows it holds in
    RAM are lost, nothing is flushed or committed, and its writer lock is released. The
    store on disk is left exactly as the crash would leave it (the process goes on, so the
    files it wrote are all there, as the OS keeps them after a process dies)."""
    storage._finalizer.detach()
    storage._store.abandon()
