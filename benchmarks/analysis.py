"""Analysis: opening a store, finding its episodes, a dask reduction over its frames and a
DataLoader epoch, in one run.

* ``--rows`` rows of small leaves (done flag, reward, trajectory id), episodes of about 1,000
  rows: the median time of ``zarr_rb.open`` and of ``view.episodes`` (a fresh view each
  time, so every run reads the flags).
* ``--frames`` rows of real ALE Pong transitions (4x84x84 uint8 frame stacks, tiled from
  ``--collect`` collected ones): the mean frame through dask (time, and the growth of the
  peak RSS of a fresh process against the frames' raw size), and one DataLoader epoch
  (``batch_size=256, shuffle=True, collate_fn=torch.stack``, the second epoch of persistent
  workers) over a ReplayDataset and over TorchRL's LazyMemmapStorage holding the same rows,
  used as a map-style dataset the same way, with 0 and 2 workers.

    python benchmarks/analysis.py --json benchmarks/analysis.json   # --workers 0,2 by default
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

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage

_MEAN_FRAME = """
import json, sys, threading, time
import zarr_rb

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

peak, done = [0], threading.Event()
def watch():
    while not done.wait(0.002):
        peak[0] = max(peak[0], rss())

frames = zarr_rb.open(sys.argv[1]).to_dask()[sys.argv[2]]
before = rss()
watcher = threading.Thread(target=watch)
watcher.start()
t0 = time.perf_counter()
mean = frames.mean(axis=0).compute(scheduler="threads", num_workers=2)
seconds = time.perf_counter() - t0
done.set()
watcher.join()
print(json.dumps({
    "seconds": seconds, "rss_growth_bytes": max(0, peak[0] - before), "mean": float(mean.mean())
}))
"""


def mean_frame(path: Path, key: str) -> dict[str, Any]:
    """The mean frame of ``key`` through dask, in a fresh process: its time, how far the
    process's RSS rose above where it was before (sampled every 2 ms) and the mean."""
    out = subprocess.run(
        [sys.executable, "-c", _MEAN_FRAME, str(path), key],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def small_store(path: Path, rows: int) -> None:
    storage = ZarrStorage(rows, path)
    generator = torch.Generator().manual_seed(0)
    step = 1_000_000
    for start in range(0, rows, step):
        n = min(step, rows - start)
        done = torch.rand(n, 1, generator=generator) < 0.001
        traj = torch.cumsum(done.view(-1).long(), 0) + int(start)
        data = TensorDict(
            {
                ("next", "done"): done,
                ("next", "reward"): torch.randn(n, 1, generator=generator),
                "step": traj,
            },
            batch_size=[n],
        )
        storage.set(torch.arange(start, start + n), data)
    storage.close()


def time_open_and_episodes(path: Path) -> dict[str, Any]:
    opens, episodes = [], []
    count = 0
    for _ in range(5):
        t0 = time.perf_counter()
        view = zarr_rb.open(path)
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        count = len(view.episodes)
        episodes.append(time.perf_counter() - t0)
        view.close()
    return {
        "open_ms_median": statistics.median(opens) * 1e3,
        "episodes_s_median": statistics.median(episodes),
        "episodes": count,
    }


def pong_rows(collect_steps: int, rows: int) -> TensorDict:
    from zarr_rb.demo import collect, make_env

    parts: list[TensorDict] = []

    class Keep:
        def extend(self, td: TensorDict) -> None:
            parts.append(td.select("observation", ("next", "reward"), ("next", "done")))

    env = make_env("pong")
    collect(Keep(), env, collect_steps, progress=False)
    env.close()
    collected = torch.cat(parts)
    return torch.cat([collected] * -(-rows // collect_steps))[:rows]


def frame_stores(root: Path, data: TensorDict) -> tuple[Path, LazyMemmapStorage]:
    zarr_path = root / "frames.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(len(data), zarr_path))
    memmap = LazyMemmapStorage(len(data), scratch_dir=root / "memmap")
    baseline = TensorDictReplayBuffer(storage=memmap)
    for start in range(0, len(data), 4096):
        rb.extend(data[start : start + 4096])
        baseline.extend(data[start : start + 4096])
    rb.storage.close()
    return zarr_path, memmap


def epoch_rows_per_s(dataset: Any, workers: int) -> float:
    """Rows per second of a second epoch (workers started and kept by the first)."""
    loader = DataLoader(
        dataset,
        batch_size=256,
        shuffle=True,
        num_workers=workers,
        collate_fn=torch.stack,
        persistent_workers=workers > 0,
    )
    sum(len(batch) for batch in loader)
    t0 = time.perf_counter()
    rows = sum(len(batch) for batch in loader)
    return rows / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--frames", type=int, default=16_384)
    parser.add_argument("--collect", type=int, default=4_096)
    parser.add_argument("--workers", default="0,2", help="DataLoader worker counts to run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="zarr_rb-analysis-"))
    try:
        small = root / "small.zarr"
        small_store(small, args.rows)
        results: dict[str, Any] = {"rows": args.rows, "frames": args.frames}
        results["small"] = time_open_and_episodes(small)
        shutil.rmtree(small)
        data = pong_rows(args.collect, args.frames)
        zarr_path, memmap = frame_stores(root, data)
        mean = mean_frame(zarr_path, "observation")
        mean["raw_bytes"] = args.frames * 4 * 84 * 84
        results["mean_frame"] = mean
        dataset = zarr_rb.open(zarr_path).dataset()  # every key, as the memmap rows hold
        results["epoch_rows_per_s"] = {
            f"{name} workers={workers}": epoch_rows_per_s(source, workers)
            for workers in (int(n) for n in args.workers.split(","))
            for name, source in (("ReplayDataset", dataset), ("LazyMemmapStorage", memmap))
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
