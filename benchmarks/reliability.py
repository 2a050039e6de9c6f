"""The long reliability run: many kills, every fault point, long fuzzing; prints the figures.

    python benchmarks/reliability.py                 # about 10 minutes on 2 cores
    python benchmarks/reliability.py --kills 20 --fuzz 0

Every check is the one the test suite runs (``zarr_rb.testing``, ``tests/test_fuzz.py``);
this runs more of them and counts. The figures go to stdout as markdown and to
``benchmarks/reliability.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import zarr_rb
from zarr_rb.testing import (
    CrashWorkload,
    DurabilityRecorder,
    count_fault_points,
    forkserver_context,
    inject_io_fault,
    kill_at_each_operation_of_a_save,
    kill_randomly,
    observe_io,
)

HERE = Path(__file__).parent
FUZZ_TESTS = "tests/test_fuzz.py"


def random_kills(where: Path, count: int, context: Any) -> dict[str, Any]:
    workload = CrashWorkload()
    checks = []
    for seed in range(1000, 1000 + count):
        run = where / f"kill-{seed}"
        run.mkdir()
        checks.append(kill_randomly(run, seed, workload, context))
    return {
        "kills": count,
        "survived": len(checks),  # kill_randomly raises on any broken promise
        "with_a_save": sum(c.saved is not None for c in checks),
        "mean_rows_written": float(np.mean([c.written for c in checks])),
        "rows_lost_after_a_returned_flush_or_save": 0,
        "withdrawn_rows_total": sum(c.holes for c in checks),
        "temporaries_found": sum(c.temporaries for c in checks),
        "temporaries_left_after_reopen": 0,
    }


def kills_in_a_save(where: Path, context: Any) -> dict[str, Any]:
    outcomes = []
    operations = 0
    for _, operations, check in kill_at_each_operation_of_a_save(  # noqa: B007
        where / "run", CrashWorkload(), context
    ):
        outcomes.append(check.saved)
    previous, new = outcomes[0], check.written
    return {
        "operations_of_the_save": operations,
        "kills": len(outcomes),
        "load_restores_previous_save": outcomes.count(previous),
        "load_restores_new_save": outcomes.count(new),
    }


def io_faults(where: Path) -> dict[str, Any]:
    workload = CrashWorkload(capacity=48, block_rows=8)
    points = count_fault_points(workload, where / "count.zarr")
    variants = {"ENOSPC once": (errno.ENOSPC, False), "EIO once": (errno.EIO, False)}
    variants["ENOSPC from then on"] = (errno.ENOSPC, True)
    injected = {}
    for name, (error, persistent) in variants.items():
        for n in range(1, points + 1):
            path = where / f"{name.replace(' ', '-')}-{n}.zarr"
            inject_io_fault(workload, path, at=n, error=error, persistent=persistent)
        injected[name] = points
    return {"fault_points": points, "injected": injected, "total": sum(injected.values())}


def durability(where: Path) -> dict[str, Any]:
    workload = CrashWorkload(capacity=48, block_rows=8)
    path = where / "rb.zarr"
    recorder = DurabilityRecorder(path)
    rng = np.random.default_rng(0)
    with observe_io(recorder):
        rb = workload.buffer(path)
        for step in range(1, 200):
            workload.step(rb, rng)
            if step % 6 == 0:
                zarr_rb.save(rb, progress=False)
            elif step % 5 == 0:
                rb.storage.flush()
        rb.storage.close()
    assert not recorder.violations, recorder.violations[:5]
    return {
        "commits_published": recorder.publishes,
        "changed_files_and_directories_checked": recorder.checked,
        "fsyncs": recorder.fsyncs,
        "violations": len(recorder.violations),
    }


def fuzz(examples: int) -> dict[str, Any]:
    env = {**os.environ, "ZARR_RB_FUZZ_EXAMPLES": str(examples)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow", FUZZ_TESTS],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"fuzzing failed (exit {done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
        )
    return {
        "hypothesis_examples": examples,
        "huge_number_cases": "every value of 6 metadata files x 4 numbers",
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="random SIGKILLs")
    parser.add_argument("--fuzz", type=int, default=600, help="hypothesis examples (0: none)")
    parser.add_argument("--json", type=Path, default=HERE / "reliability.json")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    context = forkserver_context()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        for name, run in (
            ("random_kills", lambda d: random_kills(d, args.kills, context)),
            ("kills_in_a_save", lambda d: kills_in_a_save(d, context)),
            ("io_faults", io_faults),
            ("durability", durability),
        ):
            start = time.perf_counter()
            (where / name).mkdir()
            results[name] = run(where / name)
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.fuzz:
        results["fuzz"] = fuzz(args.fuzz)
        print(f"fuzz: {json.dumps(results['fuzz'])}", flush=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
