"""Sampling a buffer reopened from its store, as a resumed training run does: how long a
``sample()`` takes while the writer reads the rows already in the store into RAM behind the
buffer's back (the default ``ram_bytes="auto"``), how long that takes, and how long a
``sample()`` takes then; against the same store with ``ram_bytes=0`` (every batch decoded
from the store) and a ``LazyMemmapStorage`` holding the same rows, in the same rounds::

    python benchmarks/reopen.py                     # Pong, 8,192 transitions, 3 rounds
    python benchmarks/reopen.py --rows 32768 --rounds 1

Medians over rounds of per-round medians. The physical floor of a batch is the bytes it
returns (``sample(256)`` of Pong: 256 rows of two 4x84x84 stacks, 14.5 MB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH = 256
AFTER = 40
"""``sample()`` calls timed once the rows are in RAM (and for the other storages)."""


def _samples(rb: Any, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        rb.sample()
        times.append(time.perf_counter() - start)
    return times


def one_round(data: Any, where: Path) -> dict[str, float]:
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    from zarr_rb import ZarrStorage

    rows = data.shape[0]
    path = where / "rb.zarr"
    storage = ZarrStorage(rows, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    for start in range(0, rows, 1024):
        rb.extend(data[start : start + 1024])
    storage.close()

    out: dict[str, float] = {}
    started = time.perf_counter()
    storage = ZarrStorage(rows, path)
    out["reopen_s"] = time.perf_counter() - started
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    during = _samples(rb, 1)  # the first read starts the fill
    started = time.perf_counter()
    while not storage.wait_for_ram(timeout=0):
        during += _samples(rb, 1)
    out["fill_s"] = time.perf_counter() - started
    out["during_ms"] = statistics.median(during) * 1e3
    out["samples_during"] = len(during)
    out["after_ms"] = statistics.median(_samples(rb, AFTER)) * 1e3
    storage.close()

    storage = ZarrStorage(rows, path, ram_bytes=0)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    out["decoded_ms"] = statistics.median(_samples(rb, AFTER)) * 1e3
    storage.close()

    memmap = LazyMemmapStorage(rows, scratch_dir=where / "memmap")
    rb = TensorDictReplayBuffer(storage=memmap, batch_size=BATCH)
    for start in range(0, rows, 1024):
        rb.extend(data[start : start + 1024])
    out["memmap_ms"] = statistics.median(_samples(rb, AFTER)) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="pong", help="as run.py's")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--json", type=Path, default=HERE / "reopen.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import run

    data = run.dataset(args.dataset, args.rows)
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir) as where:
            rounds.append(one_round(data, Path(where)))
    result = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    settings = {"dataset": args.dataset, "rows": args.rows, "rounds": args.rounds}
    args.json.write_text(json.dumps({"settings": settings, "result": result}, indent=1) + "\n")
    r = result
    print(
        f"{args.dataset}, {args.rows:,} transitions reopened, sample({BATCH}), medians of "
        f"{args.rounds} rounds"
    )
    print("| | ms |")
    print("|---|---|")
    print(f"| reopen | {r['reopen_s'] * 1e3:.0f} |")
    print(
        f"| sample() while the rows are read into RAM ({r['samples_during']:.0f} calls) "
        f"| {r['during_ms']:.1f} |"
    )
    print(f"| reading them into RAM, from the first sample() | {r['fill_s'] * 1e3:.0f} |")
    print(f"| sample() after | {r['after_ms']:.1f} |")
    print(f"| sample(), ram_bytes=0 (decoded from the store) | {r['decoded_ms']:.1f} |")
    print(f"| sample(), LazyMemmapStorage | {r['memmap_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
