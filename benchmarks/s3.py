"""A buffer on S3 against the same buffer on local disk, in one run, on real Pong frames.

    python benchmarks/s3.py                      # SeaweedFS on loopback, 4,096 transitions
    python benchmarks/s3.py --rows 20000 --json benchmarks/s3.json
    python benchmarks/s3.py --endpoint http://host:9000 --key K --secret S --bucket B
    python benchmarks/s3.py --frames off         # every leaf as stacks (Compression(frames=False))

It starts a SeaweedFS server on free loopback ports (``weed`` from the test extra)
unless ``--endpoint`` names one. For each location it measures, on the same frames:

- extend: rows written per second (whole shards, then a commit), in MB/s of raw rows;
- open: ``ZarrStorage(path=url)`` of the closed store (reads the commit record);
- cold sample(256): the first ``TensorDictReplayBuffer.sample`` of a newly opened store
  (an empty chunk cache), a new store for each repeat;
- warm sample(256): once the chunks are cached (the cache holds the whole buffer here);
- and TorchRL's ``LazyMemmapStorage`` sample(256) on the same frames, as the reference.

Figures are medians; the ratios S3 / local disk come from the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

import zarr_rb

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import run  # benchmarks/run.py: the cached Atari frames

BATCH = 256


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def sample_times(rb: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        rb.sample()
        out.append(time.perf_counter() - start)
    return out


def bench_location(
    url: str,
    options: dict[str, Any] | None,
    data: TensorDict,
    repeats: int,
    compression: zarr_rb.Compression | None = None,
) -> dict[str, float]:
    rows = data.shape[0]
    raw_mb = sum(v.numel() * v.element_size() for v in data.values(True, True)) / 1e6
    storage = zarr_rb.ZarrStorage(rows, url, storage_options=options, compression=compression)
    start = time.perf_counter()
    for first in range(0, rows, BATCH):
        storage.set(torch.arange(first, min(rows, first + BATCH)), data[first : first + BATCH])
    storage.flush()
    extend_s = time.perf_counter() - start
    storage.close()

    opens = []
    for _ in range(repeats):
        start = time.perf_counter()
        zarr_rb.ZarrStorage(path=url, read_only=True, storage_options=options).close()
        opens.append(time.perf_counter() - start)

    cold = []
    for _ in range(repeats):
        reader = zarr_rb.ZarrStorage(path=url, read_only=True, storage_options=options)
        rb = TensorDictReplayBuffer(storage=reader, batch_size=BATCH)
        cold.extend(sample_times(rb, 1))
        reader.close()

    reader = zarr_rb.ZarrStorage(path=url, read_only=True, storage_options=options)
    rb = TensorDictReplayBuffer(storage=reader, batch_size=BATCH)
    for first in range(0, rows, 1024):  # one pass over every row: the cache fills
        reader.get(torch.arange(first, min(rows, first + 1024)))
    warm = sample_times(rb, 3 * repeats)
    stored_mb = reader._store.engine.nbytes() / 1e6
    reader.close()
    return {
        "extend_mb_s": raw_mb / extend_s,
        "open_ms": median_ms(opens),
        "cold_sample_ms": median_ms(cold),
        "warm_sample_ms": median_ms(warm),
        "stored_mb": stored_mb,
        "raw_mb": raw_mb,
    }


def bench_memmap(data: TensorDict, where: Path, repeats: int) -> float:
    storage = LazyMemmapStorage(data.shape[0], scratch_dir=where / "memmap")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    rb.extend(data)
    sample_times(rb, 3)
    return median_ms(sample_times(rb, 3 * repeats))


def report(results: dict[str, Any]) -> str:
    local, s3 = results["local"], results["s3"]
    lines = [
        f"{results['rows']} {results['dataset']} transitions ({local['raw_mb']:.0f} MB raw; "
        f"{s3['stored_mb']:.1f} MB stored), sample batch {BATCH}, medians:",
        "",
        "| | local disk | S3 (loopback SeaweedFS) | S3 / local |",
        "| --- | --- | --- | --- |",
    ]
    rows = [
        ("extend (MB/s of raw rows)", "extend_mb_s", 1),
        ("open a closed store (ms)", "open_ms", 1),
        ("cold first sample(256) (ms)", "cold_sample_ms", 1),
        ("warm sample(256) (ms)", "warm_sample_ms", 1),
    ]
    for label, key, digits in rows:
        ratio = s3[key] / local[key]
        lines.append(f"| {label} | {local[key]:.{digits}f} | {s3[key]:.{digits}f} | {ratio:.2f}x |")
    lines.append(f"| LazyMemmapStorage sample(256) (ms) | {results['memmap_sample_ms']:.1f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument(
        "--dataset",
        default="pong",
        choices=["pong", "breakout", "random"],
        help="real frames, or random ones that no codec shrinks",
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of SeaweedFS")
    parser.add_argument("--key")
    parser.add_argument("--secret")
    parser.add_argument("--bucket", default="zarr-rb-test")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--frames",
        choices=list(run.FRAMES_SETTINGS),
        default="auto",
        help="Compression(frames=...): auto (None, the default), on, off (stacks)",
    )
    args = parser.parse_args(argv)
    compression = zarr_rb.Compression(frames=run.FRAMES_SETTINGS[args.frames])

    data = run.dataset(args.dataset, args.rows)
    work = Path(tempfile.mkdtemp(prefix="zarr_rb-s3-bench-"))
    server = None
    try:
        if args.endpoint:
            options = {"endpoint_url": args.endpoint, "key": args.key, "secret": args.secret}
        else:
            from s3_server import start_server

            server = start_server(work / "server")
            options = server.storage_options()
        url = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}.zarr"
        results: dict[str, Any] = {
            "rows": args.rows,
            "dataset": args.dataset,
            "frames": args.frames,
            "machine": f"{platform.machine()}, {platform.python_version()}",
            "local": bench_location(
                str(work / "local.zarr"), None, data, args.repeats, compression
            ),
            "s3": bench_location(url, options, data, args.repeats, compression),
            "memmap_sample_ms": bench_memmap(data, work, args.repeats),
        }
    finally:
        if server is not None:
            from s3_server import stop_server

            stop_server(server)
        shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
