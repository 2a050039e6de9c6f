"""What an archive costs: the same Pong transitions through a ring of a tenth of them, with
``archive=True`` and without, in turns, in this process::

    python benchmarks/archive.py --json benchmarks/archive.json     # 20k rows, ring of 2k

Figures per kind (medians over the rounds): extend rows/s, the commit record's size
(``zarr.json``, which a commit rewrites), the runs of the history, the disk the store
holds, and, for the archive, the time to open the history and list its episodes (every
one, across the ring's rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import run  # next to this file
import torch
from torchrl.data import TensorDictReplayBuffer

import zarr_rb

BATCH = 250


def measure(data: Any, rows: int, where: Path, *, archive: bool) -> dict[str, Any]:
    capacity = rows // 10
    path = where / "rb.zarr"
    storage = zarr_rb.ZarrStorage(capacity, path, archive=archive)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=256)
    start = time.perf_counter()
    for begin in range(0, rows, BATCH):
        rb.extend(data[begin : begin + BATCH])
    storage.flush()
    seconds = time.perf_counter() - start
    storage.close()
    record = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    out: dict[str, Any] = {
        "extend_rows_per_s": rows / seconds,
        "record_kb": (path / "zarr.json").stat().st_size / 1e3,
        "history_runs": record["commit"].get("history", {}).get("runs", 0),
        "disk_mb": run.disk_bytes(where) / 1e6,
    }
    if archive:
        start = time.perf_counter()
        history = zarr_rb.open(path, history=True, episode_key="episode")
        episodes = len(history.episodes)
        out["history_episodes_s"] = time.perf_counter() - start
        assert len(history) == rows
        assert episodes == int(torch.unique(data["episode"][:rows]).numel())
        history.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = run.dataset("pong", args.rows)
    results: dict[str, list[dict[str, Any]]] = {"archive": [], "ring only": []}
    for _ in range(args.rounds):
        for kind in results:
            with tempfile.TemporaryDirectory(prefix="zarr_rb-archive-bench-") as where:
                results[kind].append(
                    measure(data, args.rows, Path(where), archive=kind == "archive")
                )
    summary = {
        kind: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for kind, rounds in results.items()
    }
    print(f"{args.rows} Pong transitions through a ring of {args.rows // 10}, batches of {BATCH}")
    print("| | " + " | ".join(summary["archive"]) + " |")
    for kind, figures in summary.items():
        print(f"| {kind} | " + " | ".join(f"{value:.3g}" for value in figures.values()) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": args.rows, "results": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
