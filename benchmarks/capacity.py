"""What a store's capacity costs when it holds few rows: commit, open, sample, memory.

A ZarrStorage of ``max_size`` 1M and one of 100M each get the same rows (small leaves: a
float32 vector, a reward, a done flag), in a fresh process each (so that peak memory is
the store's own), then flush 1,000 more rows at a time::

    python benchmarks/run.py --capacities 1000000,100000000
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch
from _memory import peak_rss_bytes, rss_bytes
from tensordict import TensorDict
from torchrl.data import RandomSampler, TensorDictReplayBuffer

import zarr_rb

ROWS = 10_000
"""Rows in the store before the flushes are timed."""
FLUSH_ROWS = 1_000
FLUSHES = 20


def small_rows(first: int, count: int) -> TensorDict:
    step = torch.arange(first, first + count)
    return TensorDict(
        {
            "observation": step.float().unsqueeze(-1).expand(-1, 8).clone(),
            "reward": step.float() / 7,
            "done": step % 100 == 0,
        },
        batch_size=[count],
    )


def measure(capacity: int, where: str) -> dict[str, Any]:
    """One capacity, in the calling process (a fresh one: see :func:`at_capacities`)."""
    import run  # not at the top: run.py imports this module

    path = Path(where) / f"capacity-{capacity}.zarr"
    # The modules a first store loads (TensorStore and what it needs; zarr_rb imports them
    # on first use) are the library's, not the store's: loaded before the baseline.
    zarr_rb.ZarrStorage(10, Path(where) / "warm-up.zarr").close()
    before = rss_bytes()
    storage = zarr_rb.ZarrStorage(capacity, path)
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=256)
    rb.extend(small_rows(0, ROWS))
    storage.flush()
    flushes = []
    for i in range(FLUSHES):
        rb.extend(small_rows(ROWS + i * FLUSH_ROWS, FLUSH_ROWS))
        start = time.perf_counter()
        storage.flush()
        flushes.append(time.perf_counter() - start)
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        rb.sample()
        samples.append(time.perf_counter() - start)
    held = rss_bytes() - before
    storage.close()
    opens = []
    for _ in range(5):
        start = time.perf_counter()
        zarr_rb.ZarrStorage(path=path).close()
        opens.append(time.perf_counter() - start)
    peak = peak_rss_bytes()
    flush = run.median_p95(flushes)
    return {
        "capacity": capacity,
        "flush_ms": flush["median_ms"],
        "flush_p95_ms": flush["p95_ms"],
        "open_ms": run.median_p95(opens)["median_ms"],
        "sample_ms": run.median_p95(samples)["median_ms"],
        "rss_held_mb": held / 1e6,
        "peak_rss_growth_mb": (peak - before) / 1e6,
    }


def _child(capacity: int, where: str, results: Any) -> None:
    results.put(measure(capacity, where))


def at_capacities(capacities: list[int], work: Path) -> dict[str, Any]:
    """:func:`measure` for each capacity, each in a spawned process."""
    context = mp.get_context("spawn")
    out: dict[str, Any] = {}
    for capacity in capacities:
        results = context.Queue()
        child = context.Process(target=_child, args=(capacity, str(work), results))
        child.start()
        out[str(capacity)] = results.get(timeout=600)
        child.join()
    return out


def report(results: dict[str, Any]) -> list[str]:
    lines = [
        f"### capacity: {ROWS} small rows, then flushes of {FLUSH_ROWS} (ZarrStorage)",
        "",
        "| max_size | flush median / p95 ms | open ms | sample(256) ms | RSS held MB "
        "| peak RSS growth MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['capacity']:,} | {r['flush_ms']:.1f} / {r['flush_p95_ms']:.1f} "
            f"| {r['open_ms']:.1f} | {r['sample_ms']:.2f} | {r['rss_held_mb']:.0f} "
            f"| {r['peak_rss_growth_mb']:.0f} |"
        )
    return [*lines, ""]
