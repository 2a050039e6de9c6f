"""What a random read costs under each codec and inner-chunk height, and what it stores.

One ZarrStorage per setting and a LazyMemmapStorage, all holding the same Atari
transitions; every round reads the same 256 random rows from each, in turn, so that the
machine's noise falls on all of them alike::

    python benchmarks/compression.py                     # Pong and Ms. Pac-Man, 60 rounds
    python benchmarks/compression.py --games breakout --rounds 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import run
import torch
from torchrl.data import LazyMemmapStorage

import zarr_rb

SETTINGS: dict[str, dict[str, Any]] = {
    "zstd, 2-row chunks (default)": {"codec": "zstd", "chunk_rows": 2},
    "zstd, 1-row chunks": {"codec": "zstd", "chunk_rows": 1},
    "lz4, 2-row chunks": {"codec": "lz4", "chunk_rows": 2},
    "lz4, 1-row chunks": {"codec": "lz4", "chunk_rows": 1},
}


def measure(game: str, rows: int, rounds: int, work: Path) -> dict[str, Any]:
    data = run.dataset(game, rows)
    stores: dict[str, Any] = {}
    for name, settings in SETTINGS.items():
        where = work / f"{game}-{len(stores)}"
        compression = zarr_rb.Compression(**settings)
        # ram_bytes=0: rows decoded from the store, not gathered from the writer's RAM tier.
        storage = zarr_rb.ZarrStorage(rows, where / "rb.zarr", compression=compression, ram_bytes=0)
        stores[name] = (storage, where)
    memmap_dir = work / f"{game}-memmap"
    stores["LazyMemmapStorage"] = (LazyMemmapStorage(rows, scratch_dir=memmap_dir), memmap_dir)
    for storage, _ in stores.values():
        for start in range(0, rows, run.BATCH):
            stop = min(start + run.BATCH, rows)
            storage.set(torch.arange(start, stop), data[start:stop])
        if isinstance(storage, zarr_rb.ZarrStorage):
            storage.flush()
    times: dict[str, list[float]] = {name: [] for name in stores}
    g = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        index = torch.randint(0, rows, (run.SAMPLE,), generator=g)
        for name, (storage, _) in stores.items():
            start = time.perf_counter()
            storage.get(index)
            times[name].append(time.perf_counter() - start)
    memmap_ms = statistics.median(times["LazyMemmapStorage"]) * 1e3
    out: dict[str, Any] = {}
    for name, (storage, where) in stores.items():
        stats = run.median_p95(times[name])
        out[name] = {
            **stats,
            "ratio_to_memmap": stats["median_ms"] / memmap_ms,
            "disk_ratio": data.bytes() / run.disk_bytes(where),
        }
        if isinstance(storage, zarr_rb.ZarrStorage):
            storage.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", default="pong,mspacman")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/compression.json"))
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"rows": args.rows, "rounds": args.rounds, "games": {}}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for game in args.games.split(","):
            results["games"][game] = measure(game, args.rows, args.rounds, Path(tmp))
    lines = [
        f"get({run.SAMPLE}) of random rows, {args.rows} transitions, {args.rounds} rounds",
        "",
        "| game | setting | median / p95 ms | / LazyMemmapStorage | disk |",
        "|---|---|---|---|---|",
    ]
    for game, per_setting in results["games"].items():
        for name, r in per_setting.items():
            lines.append(
                f"| {game} | {name} | {r['median_ms']:.1f} / {r['p95_ms']:.1f} "
                f"| {r['ratio_to_memmap']:.2f}x | 1/{r['disk_ratio']:.0f} |"
            )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
