"""The replay loop of TorchRL's DQN Atari recipe, with the storage swapped: what a user
comparing storages on a workstation sees.

The loop has the recipe's shape (``sota-implementations/dqn``, ``config_atari.yaml``):
a collector's batch of 1,600 frames with a frame skip of 4 is one ``rb.extend`` of 400
transitions, then ``num_updates`` ``rb.sample()`` of 32 transitions each, into a buffer of
``buffer_size`` 1,000,000. It does not run the recipe: no environment, no network, nothing
fetched. The transitions are real Pong frames (4x84x84 stacks for ``observation`` and
``("next", "observation")``), a pool generated once and cycled, each row carrying its step.

Each storage runs in a child process of its own, so that its peak RSS is its own, and the
storages take turns for ``--rounds`` rounds, so that the machine's noise falls on all of
them. Reported: the mean of every ``extend()`` and of every ``sample()`` of a run (median
over rounds), and the peak RSS::

    python benchmarks/dqn_loop.py                       # 13 collector batches (5,200 rows)
    python benchmarks/dqn_loop.py --batches 50 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
POOL = 2048
STORAGES = {
    "memmap": "LazyMemmapStorage",
    "tensor": "LazyTensorStorage",
    "zarr": "ZarrStorage",
    "zarr-ram": "ZarrStorage, ram_bytes",
    "zarr-0": "ZarrStorage, ram_bytes=0",
    "zarr-stacks": "ZarrStorage, stacks on disk",
}
"""``--storages`` choices and the names the results give them."""


def _one_run(name: str, args: dict[str, Any], out: Any) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    from _memory import heap_kept_free_bytes, peak_rss_bytes, rss_bytes
    from _sizes import pong_frames
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

    import zarr_rb

    frames, row_bytes = pong_frames(args["pool"])
    pool = args["pool"]
    rows, capacity = args["rows_per_batch"], args["buffer_size"]
    before = rss_bytes()  # the frames of the pool and the libraries
    with tempfile.TemporaryDirectory(dir=args["where"]) as where:
        if name == "LazyMemmapStorage":
            storage: Any = LazyMemmapStorage(capacity, scratch_dir=where)
        elif name == "LazyTensorStorage":
            # Its capacity is allocated at once (pages taken as written): more than this
            # machine's RAM at the recipe's buffer_size, so only the rows the run writes.
            storage = LazyTensorStorage(min(capacity, args["batches"] * rows))
        elif name == "ZarrStorage":
            storage = zarr_rb.ZarrStorage(capacity, f"{where}/rb.zarr")
        elif name == "ZarrStorage, stacks on disk":
            stacks = zarr_rb.Compression(frames=False)
            storage = zarr_rb.ZarrStorage(capacity, f"{where}/rb.zarr", compression=stacks)
        elif name == "ZarrStorage, ram_bytes=0":
            storage = zarr_rb.ZarrStorage(capacity, f"{where}/rb.zarr", ram_bytes=0)
        else:
            room = args["batches"] * rows * row_bytes * 2
            storage = zarr_rb.ZarrStorage(capacity, f"{where}/rb.zarr", ram_bytes=room)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=args["batch_size"])
        extends, samples = [], []
        step = 0
        for _ in range(args["batches"]):
            batch = frames[torch.arange(step, step + rows) % pool].clone()
            batch["step"] = torch.arange(step, step + rows)
            step += rows
            start = time.perf_counter()
            rb.extend(batch)
            extends.append(time.perf_counter() - start)
            for _ in range(args["updates"]):
                start = time.perf_counter()
                sample = rb.sample()
                samples.append(time.perf_counter() - start)
                assert sample["observation"].shape[0] == args["batch_size"]
        out.put(
            {
                "extend_ms": statistics.fmean(extends) * 1e3,
                "sample_ms": statistics.fmean(samples) * 1e3,
                "peak_rss_gb": peak_rss_bytes() / 1e9,
                "rss_growth_gb": (peak_rss_bytes() - before) / 1e9,
                "raw_gb": min(step, capacity) * row_bytes / 1e9,
                # Where ZarrStorage's RAM goes (--breakdown): its tier's frames, and the
                # heap the C library keeps free after the run.
                "heap_free_gb": (heap_kept_free_bytes() or 0) / 1e9,
                "tier_frames_gb": _tier_frames_bytes(storage) / 1e9,
                "write_buffer_gb": _write_buffer_bytes(storage) / 1e9,
            }
        )


def _tier_frames_bytes(storage: Any) -> int:
    """RAM of the frames a ZarrStorage's tier holds (0 for other storages, or no tier)."""
    store = getattr(storage, "store", None)
    frames = None if store is None else store.ram.frames
    return 0 if frames is None else int(frames.frames_nbytes)


def _write_buffer_bytes(storage: Any) -> int:
    """RAM of a ZarrStorage's write buffer at the end of the run (0 for other storages): the
    blocks it holds (the one filling, whose rows lend their frames to the RAM tier, and the
    one being written if a write is in flight) and its spare, the memory of the last block
    written, kept for the next one."""
    store = getattr(storage, "store", None)
    return 0 if store is None else int(store.write_cache.nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=13, help="collector batches")
    parser.add_argument("--rows-per-batch", type=int, default=400)
    parser.add_argument("--updates", type=int, default=100, help="samples per batch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--buffer-size", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool", type=int, default=POOL, help="real transitions, cycled")
    parser.add_argument("--storages", default=",".join(STORAGES), help="of " + ",".join(STORAGES))
    parser.add_argument("--where", type=Path, default=None, help="a scratch directory")
    parser.add_argument("--json", type=Path, default=HERE / "dqn_loop.json")
    args = parser.parse_args(argv)
    settings = {
        "batches": args.batches,
        "rows_per_batch": args.rows_per_batch,
        "updates": args.updates,
        "batch_size": args.batch_size,
        "buffer_size": args.buffer_size,
        "pool": args.pool,
        "where": None if args.where is None else str(args.where),
    }
    names = [STORAGES[n.strip()] for n in args.storages.split(",") if n.strip()]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    context = multiprocessing.get_context("spawn")
    for _ in range(args.rounds):
        for name in names:
            out = context.Queue()
            child = context.Process(target=_one_run, args=(name, settings, out))
            child.start()
            result = out.get(timeout=3600)
            child.join()
            runs[name].append(result)
    results = {
        name: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for name, rounds in runs.items()
    }
    args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    base = results.get("LazyMemmapStorage")
    print(
        "| storage | extend() mean ms | sample() mean ms | peak RSS GB | RSS growth GB "
        "| / memmap: extend, sample |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = ""
        if base is not None:
            extend, sample = r["extend_ms"] / base["extend_ms"], r["sample_ms"] / base["sample_ms"]
            ratio = f"extend {extend:.2f}x, sample {sample:.2f}x"
        print(
            f"| {name} | {r['extend_ms']:.1f} | {r['sample_ms']:.2f} | {r['peak_rss_gb']:.2f} "
            f"| {r['rss_growth_gb']:.2f} | {ratio} |"
        )
    print("\n| storage | RSS growth GB | tier frames GB | write buffer GB | heap kept free GB |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['rss_growth_gb']:.3f} | {r['tier_frames_gb']:.3f} "
            f"| {r['write_buffer_gb']:.3f} | {r['heap_free_gb']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
