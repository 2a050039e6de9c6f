"""The position map of shared stores (row runs, ``zarr_rb/core/runs.py``) at 10^6 and 10^8
positions: its size in the commit record, and what a commit and a read spend on it.

A full ring is laid out as its writers leave it: with one writer, a run per slot (slots
taken out of order break runs); with 8 writers extending 50 rows each in turn, a run per
extend. Each figure is the median of ``--repeat`` runs. The record carries the map whole,
so its size is what every commit writes and every writer parses when it picks it up.

    python benchmarks/runs.py [--json benchmarks/runs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zarr_rb.core.runs import RunMap, parse_run_map

BLOCK_ROWS = 64
EXTEND = 50


def full_ring(rows: int, writers: int, rng: np.random.Generator) -> RunMap:
    """The map of a full ring of ``rows`` positions as ``writers`` writers leave it."""
    if writers == 1:
        count = -(-rows // BLOCK_ROWS)
        slots = rng.permutation(2 * count)[:count]  # reused slots: anywhere in the arrays
        starts = np.arange(count, dtype=np.int64) * BLOCK_ROWS
        counts = np.minimum(BLOCK_ROWS, rows - starts)
        return RunMap(np.stack([starts, slots * BLOCK_ROWS, counts], axis=1))
    count = -(-rows // EXTEND)
    starts = np.arange(count, dtype=np.int64) * EXTEND
    counts = np.minimum(EXTEND, rows - starts)
    writer = np.arange(count) % writers
    # Each writer's rows follow each other in its own region of the arrays.
    firsts = (writer * (rows // writers + BLOCK_ROWS)) + (np.arange(count) // writers) * EXTEND
    return RunMap(np.stack([starts, firsts, counts], axis=1))


def timed(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(rows: int, writers: int, repeat: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    runs = full_ring(rows, writers, rng)
    record = runs.to_json()
    text = json.dumps(record)
    cursor = rows // 3
    positions = np.arange(cursor, cursor + EXTEND, dtype=np.int64)
    physical = np.arange(10 * rows, 10 * rows + EXTEND, dtype=np.int64)
    sample = rng.integers(0, rows, 256)
    capacity = 2 * -(-rows // BLOCK_ROWS) + 64
    return {
        "positions": rows,
        "writers": writers,
        "runs": len(runs),
        "record_bytes": len(text),
        "raw_bytes": len(runs) * 24,
        "assign_ms": 1e3 * timed(lambda: runs.assign(positions, physical), repeat),
        "encode_ms": 1e3 * timed(runs.to_json, repeat),
        "parse_ms": 1e3 * timed(lambda: parse_run_map(json.loads(text), rows=rows), repeat),
        "free_slots_ms": 1e3 * timed(lambda: runs.used_slots(BLOCK_ROWS, capacity), repeat),
        "lookup_256_us": 1e6 * timed(lambda: runs.physical(sample), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results there")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1000000,100000000")
    args = parser.parse_args()
    results = [
        measure(int(rows), writers, args.repeat)
        for rows in args.sizes.split(",")
        for writers in (1, 8)
    ]
    header = (
        "| positions | writers | runs | record | assign | encode | parse | free slots | "
        "lookup 256 |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['positions']:,} | {r['writers']} | {r['runs']:,} | "
            f"{r['record_bytes'] / 2**20:.2f} MiB | {r['assign_ms']:.1f} ms | "
            f"{r['encode_ms']:.1f} ms | {r['parse_ms']:.1f} ms | {r['free_slots_ms']:.1f} ms | "
            f"{r['lookup_256_us']:.0f} us |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
