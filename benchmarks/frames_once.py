"""What a fill would take with each frame stored once on disk, before building it.

ZarrStorage writes ``obs`` and ``("next", "obs")`` as stacks: 8 frames per Atari transition,
of which about one is new, all encoded and synced. ``benchmarks/dedup.py`` shows that the
durable write of single frames is 6-10 times as fast. This measures a whole fill the way
``docs/design/frames-on-disk.md`` lays it out, against the fills of ``LazyMemmapStorage``
and of ZarrStorage as it is, in turn (``run.py``'s data and extends: 8,192 rows, extends of
1,024 rows, blocks of 256 rows)::

    python benchmarks/frames_once.py                        # Ms. Pac-Man, 3 rounds
    python benchmarks/frames_once.py --datasets pong,random --rounds 5

The prototype fill, per block: finds the new frames of the block with the RAM tier's
comparisons (:func:`zarr_rb.core.frame_plans.plan_frames`, with no row before the block),
copies them into the block's cells and into a pool (the RAM tier's copy), and writes the
cells (8 to a row, one row per inner chunk) and the ids of each row's frames through
TensorStore with zarr_rb's codecs (zstd -1, CRC32C, one shard per block); each extend waits
for its writes, every file synced, then syncs a record. It leaves out the small keys
(action, reward, done: a few kB a block) and TorchRL's own work in ``extend``, which the
other two fills include: it bounds what the design can reach, it does not measure a build
of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import run
import tensorstore as ts
import torch

from zarr_rb.core.frame_plans import FrameKeys, copy_frames, frame_bytes, plan_frames
from zarr_rb.core.mirror import zeros

HERE = Path(__file__).resolve().parent
BLOCK = 256
"""Rows per block of a ZarrStorage of 8,192 rows."""
CELLS = 8
"""Frame cells per row of the frames array: a block holds up to 8 new frames per row."""


def _array(where: Path, shape: tuple[int, ...], block: int, inner: int, dtype: str) -> Any:
    """A sharded zarr3 array with zarr_rb's codecs; TensorStore syncs every file it writes."""
    codecs = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": -1, "checksum": False}},
        {"name": "crc32c"},
    ]
    sharding = {
        "chunk_shape": [inner, *shape[1:]],
        "codecs": codecs,
        "index_codecs": [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c"},
        ],
    }
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(where)},
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [block, *shape[1:]]},
            },
            "codecs": [{"name": "sharding_indexed", "configuration": sharding}],
        },
        "create": True,
        "delete_existing": True,
    }
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True})
    return ts.open(spec, context=context).result()


def frames_once_fill(data: Any, where: Path) -> tuple[float, float]:
    """Seconds of the prototype fill (see the module's docstring), and new frames per row."""
    rows = data.shape[0]
    obs, nxt = data["observation"], data["next", "observation"]
    stack, frame_shape = obs.shape[1], tuple(obs.shape[2:])
    frame = int(np.prod(frame_shape))
    spec = FrameKeys(
        key=("observation",),
        next_key=("next", "observation"),
        element_shape=tuple(obs.shape[1:]),
        lanes=1,
        stack=stack,
        frame_shape=frame_shape,
        dtype=obs.dtype,
    )
    start = time.perf_counter()
    cells_array = _array(where / "frames", (rows, CELLS, *frame_shape), BLOCK, 1, "uint8")
    ids_array = _array(where / "ids", (rows, 2, stack), BLOCK, BLOCK, "int16")
    pool = zeros((rows * 2 * stack, frame), torch.uint8).numpy()  # the RAM tier's frames
    pooled = 0
    for begin in range(0, rows, run.BATCH):
        futures = []
        for first in range(begin, min(rows, begin + run.BATCH), BLOCK):
            stop = first + BLOCK
            values = {spec.key: obs[first:stop], spec.next_key: nxt[first:stop]}
            plan = plan_frames(spec, values, None)
            fresh = plan.fresh_count
            cells = zeros((-(-fresh // CELLS) * CELLS, frame), torch.uint8).numpy()
            ids = np.empty(plan.links.size, dtype=np.int64)
            ids[plan.fresh_slots] = np.arange(fresh)
            ids = ids[plan.links]
            per_key = plan.slots_per_key
            for i, key in enumerate(spec.keys):
                chosen = plan.fresh_slots[
                    (plan.fresh_slots >= i * per_key) & (plan.fresh_slots < (i + 1) * per_key)
                ]
                source = frame_bytes(values[key].reshape(-1, *frame_shape))
                copy_frames(cells, ids[chosen], source, chosen - i * per_key)
            pool[pooled : pooled + fresh] = cells[:fresh]
            pooled += fresh
            row_ids = ids.reshape(2, -1, stack).transpose(1, 0, 2).astype(np.int16)
            region = cells.reshape(-1, CELLS, *frame_shape)
            futures.append(cells_array[first : first + region.shape[0]].write(region))
            futures.append(ids_array[first : first + row_ids.shape[0]].write(row_ids))
        for future in futures:
            future.result()
        record = os.open(where / "record", os.O_CREAT | os.O_WRONLY)
        try:
            os.write(record, b"\0" * 512)
            os.fsync(record)
        finally:
            os.close(record)
    seconds = time.perf_counter() - start
    _check(data, cells_array, ids_array)
    return seconds, pooled / rows


def _check(data: Any, cells_array: Any, ids_array: Any) -> None:
    """Every 97th row rebuilt from the cells and ids written equals the row given (so the
    fill timed wrote what a store would hold)."""
    rows = np.arange(0, data.shape[0], 97)
    ids = ids_array[rows].read().result().astype(np.int64)  # [n, 2, S]: cells of the block
    cells = (rows - rows % BLOCK)[:, None, None] * CELLS + ids
    wanted, where = np.unique(cells // CELLS, return_inverse=True)  # rows of cells to read
    frames = cells_array[wanted].read().result()
    rebuilt = torch.from_numpy(frames[where.reshape(cells.shape), cells % CELLS])
    assert torch.equal(rebuilt[:, 0], data["observation"][rows]), "obs rebuilt wrong"
    assert torch.equal(rebuilt[:, 1], data["next", "observation"][rows]), "next rebuilt wrong"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="mspacman", help="as run.py's (or 'random')")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--json", type=Path, default=HERE / "frames_once.json")
    args = parser.parse_args(argv)
    kinds = ("LazyMemmapStorage", "ZarrStorage", "frames once (prototype)")
    results: dict[str, Any] = {}
    for name in args.datasets.split(","):
        data = run.dataset(name, args.rows)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        per_row = 0.0
        work = Path(tempfile.mkdtemp(dir=args.dir))
        try:
            for turn in range(args.rounds):
                for kind in kinds:
                    where = work / f"{turn}-{kinds.index(kind)}"
                    where.mkdir()
                    if kind == "frames once (prototype)":
                        seconds, per_row = frames_once_fill(data, where)
                    else:
                        storage, seconds = run.fill(kind, data, where)
                        if kind == "ZarrStorage":
                            storage.close()
                    times[kind].append(seconds)
                    shutil.rmtree(where)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        raw = 2 * data["observation"].numel() * data["observation"].element_size()
        results[name] = {
            kind: {"median_s": statistics.median(t), "gb_per_s": raw / statistics.median(t) / 1e9}
            for kind, t in times.items()
        }
        results[name]["new_frames_per_row"] = per_row
    print("| fill of 8,192 rows: median s (GB/s of obs and next/obs) | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name, result in results.items():
        cells = [f"{result[k]['median_s']:.3f} ({result[k]['gb_per_s']:.2f})" for k in kinds]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("new frames per row:", {n: round(r["new_frames_per_row"], 2) for n, r in results.items()})
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
