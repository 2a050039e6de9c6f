"""What holes cost a sampler: ``sample()`` of a buffer of small rows without a hole, and with
rows no call wrote (TorchRL counted them: the same rows set twice), in the same run; and
the check for holes that every ``sample()`` makes, on its own.

Each figure is the median of ``--repeat`` timings of ``--samples`` calls::

    python benchmarks/holes.py [--rows 77000] [--json benchmarks/holes.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import ZarrStorage


def median_ms(call: Callable[[], object], samples: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(samples):
            call()
        times.append((time.perf_counter() - start) / samples * 1e3)
    return statistics.median(times)


def measure(rows: int, holes: int, samples: int, repeat: int, where: Path) -> dict[str, Any]:
    """A buffer of ``rows`` rows (with room for ``holes`` more), then ``holes`` rows set
    again, which leaves as many rows counted and never written at its end."""
    storage = ZarrStorage(rows + holes, where / f"rb-{holes}.zarr")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=256)
    for start in range(0, rows, 100_000):
        n = min(100_000, rows - start)
        step = torch.arange(start, start + n)
        rb.extend(TensorDict({"step": step, "obs": step.float()[:, None].expand(-1, 8)}, [n]))
    if holes:
        again = torch.arange(holes)
        storage.set(again, storage.get(again))
    storage.flush()
    assert storage.unreadable_rows().size == holes
    result = {
        "rows": len(storage),
        "holes": holes,
        "sample_ms": median_ms(rb.sample, samples, repeat),
        "check_ms": median_ms(storage.unreadable_rows, samples, repeat),
    }
    storage.close()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=77_000)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zarr_rb-holes-") as where:
        runs = [measure(args.rows, h, args.samples, args.repeat, Path(where)) for h in (0, 1)]
    print(f"{args.rows:,} rows, medians of {args.repeat} x {args.samples} calls")
    print("| holes | sample(256) ms | check for holes ms |")
    print("|---|---|---|")
    for run in runs:
        print(f"| {run['holes']} | {run['sample_ms']:.3f} | {run['check_ms']:.4f} |")
    result = {"runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
