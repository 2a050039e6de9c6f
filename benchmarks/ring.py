"""The copy-on-write ring against the code it replaced, on the same Pong frames.

Two versions of zarr_rb, this checkout and an earlier revision checked out beside it,
each run in child processes of their own, in turns (so that the machine's noise falls on
both alike), next to TorchRL's ``LazyMemmapStorage`` on the same data::

    git worktree add /tmp/zarr_rb-before <revision>
    python benchmarks/ring.py --before /tmp/zarr_rb-before            # 20k rows, 3 rounds

Each round fills a ring of half the rows with all of them (``extend`` in batches of 250,
then a flush), so the ring turns over once: the first half is written into empty blocks,
the second over committed rows (in place with holes before, by copy-on-write now). Then:
``sample(256)`` with a ``RandomSampler`` and with a ``SliceSampler`` (slices of 32 steps
of one episode), rewriting one scattered row (``rb[i] = row``, written and committed, then
``flush()``), and the disk the store holds. Figures are medians over the rounds (rows/s)
and over the calls of all rounds (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH = 250
SAMPLES = 40
COMMITS = 20


def measure(kind: str, rows: int, where: Path) -> dict[str, Any]:
    """One round of one storage kind, in this process."""
    import run  # next to this file
    import torch
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler, SliceSampler

    data = run.dataset("pong", rows)
    capacity = rows // 2
    if kind == "LazyMemmapStorage":
        storage: Any = LazyMemmapStorage(capacity, scratch_dir=where / "memmap")
    else:
        import zarr_rb

        storage = zarr_rb.ZarrStorage(capacity, where / "rb.zarr")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=256)
    seconds = []
    for half in (0, 1):
        start = time.perf_counter()
        for begin in range(half * capacity, (half + 1) * capacity, BATCH):
            rb.extend(data[begin : begin + BATCH])
        if hasattr(storage, "flush"):
            storage.flush()
        seconds.append(time.perf_counter() - start)
    out: dict[str, Any] = {
        "first_fill_rows_per_s": capacity / seconds[0],
        "written_over_rows_per_s": capacity / seconds[1],
    }
    for name, sampler in (
        ("random", RandomSampler()),
        ("slices", SliceSampler(slice_len=32, traj_key="episode", strict_length=False)),
    ):
        buffer = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=256)
        buffer.sample()  # warm
        times = []
        for _ in range(SAMPLES):
            start = time.perf_counter()
            buffer.sample()
            times.append(time.perf_counter() - start)
        out[f"sample_{name}_ms"] = times
    if hasattr(storage, "flush"):
        generator = torch.Generator().manual_seed(0)
        times = []
        for i in range(COMMITS):
            row = int(torch.randint(capacity, (1,), generator=generator))
            start = time.perf_counter()
            rb[torch.tensor([row])] = data[i : i + 1]  # written and committed
            storage.flush()
            times.append(time.perf_counter() - start)
        out["rewrite_commit_ms"] = times
    out["disk_mb"] = run.disk_bytes(where) / 1e6
    if hasattr(storage, "close"):
        storage.close()
    return out


def _run_child(kind: str, root: Path | None, rows: int) -> dict[str, Any]:
    """:func:`measure` in a fresh process importing zarr_rb from ``root``."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(root), str(HERE)])
    with tempfile.TemporaryDirectory(prefix="zarr_rb-ring-bench-") as where:
        result = subprocess.run(
            [sys.executable, __file__, "--child", kind, "--rows", str(rows), "--where", where],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--where", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.where)))
        return 0
    import run

    run.dataset("pong", args.rows)  # generated once, cached for the children
    kinds: dict[str, Path | None] = {"now": HERE.parent}
    if args.before is not None:
        kinds["before"] = args.before.resolve()
    kinds["LazyMemmapStorage"] = HERE.parent
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, root in kinds.items():
            child_kind = "LazyMemmapStorage" if kind == "LazyMemmapStorage" else "ZarrStorage"
            rounds[kind].append(_run_child(child_kind, root, args.rows))
    summary = {kind: _summary(results) for kind, results in rounds.items()}
    print(_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": args.rows, "results": summary}, indent=1))
    shutil.rmtree(HERE / "__pycache__", ignore_errors=True)
    return 0


def _summary(results: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in results[0]:
        values = [r[name] for r in results]
        if isinstance(values[0], list):  # per-call times: the median of all calls
            out[name] = 1000 * statistics.median(t for calls in values for t in calls)
        else:
            out[name] = statistics.median(values)
    return out


def _table(summary: dict[str, dict[str, float]]) -> str:
    names = [
        ("first_fill_rows_per_s", "extend, first fill (rows/s)"),
        ("written_over_rows_per_s", "extend, ring written over (rows/s)"),
        ("sample_random_ms", "sample(256), random (ms)"),
        ("sample_slices_ms", "sample(256), slices of 32 (ms)"),
        ("rewrite_commit_ms", "rb[i] = row, committed (ms)"),
        ("disk_mb", "disk (MB)"),
    ]
    kinds = list(summary)
    lines = ["| | " + " | ".join(kinds) + (" | now/before |" if "before" in kinds else " |")]
    lines.append("|---" * (len(kinds) + 1 + ("before" in kinds)) + "|")
    for key, label in names:
        cells = [summary[k].get(key) for k in kinds]
        row = f"| {label} | " + " | ".join("-" if c is None else f"{c:,.1f}" for c in cells)
        if "before" in kinds:
            now, before = summary["now"].get(key), summary["before"].get(key)
            row += f" | {now / before:.2f}" if now and before else " | -"
        lines.append(row + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
