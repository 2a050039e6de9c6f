"""A writer training on S3 beside a reader, on real Pong frames: what creating each data
object once costs the writer, and what it saves the reader.

    python benchmarks/s3_live.py --json out.json
    PYTHONPATH=<another checkout> python benchmarks/s3_live.py --json before.json

A SeaweedFS server on loopback. A full ring of ``--capacity`` transitions takes extends of
``--batch`` transitions, each followed by a commit (``flush``), as a collector's writer
does; after each commit a reader in the same process picks it up (``refresh``) and samples
256 transitions. With ``--writers N``, N shared writers (``shared=True``, in one process)
extend in turns, each extend committing. Measured, medians over ``--steps`` steps:

- extend + commit: the writer's time per step;
- reader sample(256) after refresh;
- then, in a second run through a proxy that counts requests (``tests/s3_proxy.py``; it
  slows every request, so it times nothing): the reader's data GETs per step and the
  writer's data PUTs per step (with the mean of those refused, 412, and of its data
  DELETEs: objects a writer created once found in its way).

The import of ``zarr_rb`` decides which code is measured (``PYTHONPATH``): run the script of
this checkout against another checkout, in turns, and compare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torchrl.data import TensorDictReplayBuffer

import zarr_rb

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import run  # benchmarks/run.py: the cached Atari frames
from s3_proxy import S3Proxy
from s3_server import start_server, stop_server


def data_requests(
    proxy: S3Proxy, prefix: str, method: str, since: int, status: int | None = None
) -> int:
    return sum(
        1
        for m, key, answer, _ in proxy.log[since:]
        if m == method and key.startswith(prefix + "data/") and (status is None or answer == status)
    )


def bench(
    server: Any, capacity: int, batch: int, steps: int, *, counted: bool, writers: int
) -> dict[str, Any]:
    proxy = S3Proxy(server.endpoint, server.bucket)
    try:
        options = server.storage_options()
        if counted:
            options["endpoint_url"] = proxy.endpoint
        name = f"live-{uuid.uuid4().hex[:8]}.zarr"
        url, prefix = f"s3://{server.bucket}/{name}", name + "/"
        data = run.dataset("pong", capacity + steps * batch)
        shared = writers > 0
        writer = zarr_rb.ZarrStorage(capacity, url, storage_options=options, shared=shared)
        rb = TensorDictReplayBuffer(storage=writer, batch_size=256)
        rb.extend(data[:capacity])  # a full ring: every step writes over the oldest rows
        writer.flush()
        # Shared writers (in one process, in turns): each of their extends commits.
        others = [
            zarr_rb.ZarrStorage(path=url, storage_options=options, shared=True)
            for _ in range(writers - 1)
        ]
        buffers = [rb, *(TensorDictReplayBuffer(storage=other) for other in others)]
        reader = zarr_rb.ZarrStorage(path=url, read_only=True, storage_options=options)
        sampler = TensorDictReplayBuffer(storage=reader, batch_size=256)
        for first in range(0, capacity, 1024):  # the reader's cache holds the buffer
            reader.get(torch.arange(first, min(capacity, first + 1024)))
        extend_s, sample_s, gets, puts, refused, deletes = [], [], [], [], [], []
        for step in range(steps):
            rows = data[capacity + step * batch : capacity + (step + 1) * batch]
            mark = len(proxy.log)
            start = time.perf_counter()
            extending = buffers[step % len(buffers)]
            extending.extend(rows)
            extending.storage.flush()
            extend_s.append(time.perf_counter() - start)
            puts.append(data_requests(proxy, prefix, "PUT", mark))
            refused.append(data_requests(proxy, prefix, "PUT", mark, status=412))
            deletes.append(data_requests(proxy, prefix, "DELETE", mark))
            mark = len(proxy.log)
            start = time.perf_counter()
            reader.refresh()
            sampler.sample()
            sample_s.append(time.perf_counter() - start)
            gets.append(data_requests(proxy, prefix, "GET", mark))
        creates_once = bool(getattr(writer._store, "creates_once", False))
        reader.close()
        for other in others:
            other.close()
        writer.close()
    finally:
        proxy.close()
    if counted:
        return {
            "reader_data_gets_per_step": statistics.median(gets),
            "data_puts_per_step": statistics.median(puts),
            "data_puts_refused_per_step": statistics.mean(refused),
            "data_deletes_per_step": statistics.mean(deletes),
        }
    return {
        "creates_once": creates_once,
        "extend_commit_ms": statistics.median(extend_s) * 1e3,
        "reader_sample_ms": statistics.median(sample_s) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--counted-steps", type=int, default=10)
    parser.add_argument(
        "--writers",
        type=int,
        default=0,
        help="shared writers (shared=True) extending in turns; 0: a single writer",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="zarr_rb-s3-live-"))
    server = start_server(work / "server")
    try:
        result = {
            "capacity": args.capacity,
            "batch": args.batch,
            "steps": args.steps,
            "writers": args.writers,
        }
        for steps, counted in ((args.steps, False), (args.counted_steps, True)):
            result.update(
                bench(
                    server, args.capacity, args.batch, steps, counted=counted, writers=args.writers
                )
            )
    finally:
        stop_server(server)
        shutil.rmtree(work, ignore_errors=True)
    result["zarr_rb"] = str(Path(zarr_rb.__file__).parent.parent)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
