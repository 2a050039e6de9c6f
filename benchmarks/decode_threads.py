"""Rows that are not in RAM decode on every core: random reads from a store whose
decoding is confined to one thread, against the same store decoded by all of them.

Reads from the store (not from the writer's RAM tier: the stores here are opened read-only)
decode one inner chunk per row and image key in TensorStore's pool of data-copy threads,
which zarr_rb sizes to the machine's cores. Both readers open the same store; every round
reads the same 256 random rows from each, in turn::

    python benchmarks/decode_threads.py                  # Pong, 8,192 transitions, 60 rounds
    python benchmarks/decode_threads.py --game mspacman --rounds 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import run
import tensorstore as ts
import torch

import zarr_rb
from zarr_rb.locations import local

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def decoding_threads(limit: int | None) -> Iterator[None]:
    """Stores opened inside decode with ``limit`` threads (``None``: as zarr_rb sets them
    up). TensorStore decodes a shard's inner chunks on the threads that read them from
    the file as well as on its data-copy threads: both are limited."""
    context = ts.Context

    def limited(spec: dict[str, Any], *args: Any, **kwargs: Any) -> ts.Context:
        if limit is not None:
            spec = {
                **spec,
                "data_copy_concurrency": {"limit": limit},
                "file_io_concurrency": {"limit": limit},
            }
        return context(spec, *args, **kwargs)

    local.ts.Context = limited  # type: ignore[misc]
    try:
        yield
    finally:
        local.ts.Context = context  # type: ignore[misc]


def measure(game: str, rows: int, rounds: int, where: Path) -> dict[str, Any]:
    data = run.dataset(game, rows)
    path = where / "rb.zarr"
    with zarr_rb.ZarrStorage(rows, path, ram_bytes=0) as storage:
        for start in range(0, rows, run.BATCH):
            storage.set(
                torch.arange(start, min(start + run.BATCH, rows)), data[start : start + run.BATCH]
            )
    readers = {}
    for threads, limit in (("1 thread", 1), ("zarr_rb's threads", None)):
        with decoding_threads(limit):
            readers[threads] = zarr_rb.ZarrStorage(path=path, read_only=True)
    times: dict[str, list[float]] = {threads: [] for threads in readers}
    cpu: dict[str, float] = dict.fromkeys(readers, 0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        index = torch.randint(0, rows, (run.SAMPLE,), generator=g)
        for threads, reader in readers.items():
            before, start = os.times(), time.perf_counter()
            reader.get(index)
            times[threads].append(time.perf_counter() - start)
            after = os.times()
            cpu[threads] += after.user + after.system - before.user - before.system
    for reader in readers.values():
        reader.close()
    one = statistics.median(times["1 thread"])
    return {
        threads: {
            "median_ms": statistics.median(t) * 1e3,
            "cpu_per_wall": cpu[threads] / sum(t),
            "speedup": one / statistics.median(t),
        }
        for threads, t in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--game", default="pong")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", type=Path, default=HERE / "decode_threads.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as where:
        results = measure(args.game, args.rows, args.rounds, Path(where))
    print(f"get({run.SAMPLE}) of {args.game} rows decoded from the store ({run.cpu_model()}):")
    for name, r in results.items():
        print(
            f"  {name}: median {r['median_ms']:.1f} ms, {r['speedup']:.2f}x one thread's speed, "
            f"{r['cpu_per_wall']:.2f} cores busy ({os.cpu_count()} cores)"
        )
    args.json.write_text(json.dumps({"game": args.game, "rows": args.rows, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
