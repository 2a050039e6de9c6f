"""Writers killed with SIGKILL at random moments, or at each file operation of a save, in
processes of a forkserver context."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zarr_rb.testing.crash import (
    CrashCheck,
    CrashWorkload,
    check_crashed_store,
    check_failed,
    logged_values,
    run_crash_writer,
)


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
        check_failed(f"the writer exited with code {child.exitcode} before it was killed")
    check = check_crashed_store(path, log_path, workload, storage_options)
    if after_a_save and not early and check.saved is None:
        check_failed("the writer was killed after a save returned, and load found no save")
    return check


def _wait_for_line(log_path: Path, word: str, child: Any, seconds: float = 300) -> None:
    """Wait until the writer logged a line starting with ``word`` (it died: fail). The
    bound is only there so that a writer stuck for good fails the test instead of
    hanging it."""
    deadline = time.monotonic() + seconds
    while not (log_path.exists() and _logged(log_path.read_text(), word)):
        if not child.is_alive():
            check_failed(f"the writer died (exit code {child.exitcode}) before it logged {word!r}")
        if time.monotonic() > deadline:
            check_failed(f"the writer logged no {word!r} line within {seconds:.0f} s")
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
    operations = logged_values(count_dir / "log")["events"][0]
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
            check_failed(f"kill point {n}: writer exited with {child.exitcode}, not SIGKILL")
        path = run_dir / "rb.zarr" if store is None else store_at(f"kill-{n}")
        yield n, operations, check_crashed_store(path, run_dir / "log", workload, storage_options)
