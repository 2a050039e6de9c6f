"""TorchRL's own checkpoints (``torchrl.checkpoint.Checkpoint``) of a buffer: on
ZarrStorage a checkpoint keeps a version of the store and writes a pointer, on
LazyMemmapStorage it copies the rows. Time and bytes of a checkpoint and of its restore,
at 10 MB and at 10 GB, in a directory and in an archive; and the disk that rotating
checkpoints holds.

For each size (raw bytes of the rows one ring holds), both buffers are filled with the same
Pong transitions (real ALE frames, 4x84x84 stacks for ``observation`` and
``("next", "observation")``: 56 KB a row; a few thousand real frames repeated, each row
carrying its step), with a ``PrioritizedSampler``. Reported: the median of 3 checkpoints
(a few rows extended between them) and of 3 restores (``Checkpoint.load``, after more rows
were extended), the bytes of each checkpoint, the disk the store gained per checkpoint, and
for ZarrStorage the disk of the store after 10 checkpoints rotated by
``CheckpointRotation(keep_last=3)`` across one turn of the ring::

    python benchmarks/checkpoint.py                      # 10 MB and 10 GB, ~6 min
    python benchmarks/checkpoint.py --sizes-mb 10 200    # quicker
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH = 500
FRAMES = 2048  # real frames generated once, then repeated
ROUNDS = 3
ROTATED = 10


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_used(path: Path) -> int:
    """Bytes used on the filesystem of ``path`` (hard links and copies told apart)."""
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(size_mb: float, where: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import torch
    from _sizes import pong_frames  # next to this file
    from torchrl.checkpoint import Checkpoint, CheckpointRotation
    from torchrl.data import LazyMemmapStorage, PrioritizedSampler, TensorDictReplayBuffer

    import zarr_rb

    frames, row_bytes = pong_frames(FRAMES)
    wanted = max(1, int(size_mb * 1e6 // row_bytes))
    batch = min(BATCH, max(1, wanted // ROTATED))
    capacity = max(batch, wanted // batch * batch)
    out: dict[str, Any] = {"rows": capacity, "raw_gb": capacity * row_bytes / 1e9}
    storages = {
        "ZarrStorage": lambda: zarr_rb.ZarrStorage(capacity, where / "rb.zarr"),
        "LazyMemmapStorage": lambda: LazyMemmapStorage(capacity, scratch_dir=where / "memmap"),
    }
    for name, make in storages.items():
        rb = TensorDictReplayBuffer(
            storage=make(),
            sampler=PrioritizedSampler(capacity, alpha=0.7, beta=0.5),
            batch_size=256,
        )
        step = 0

        def extend(rows: int, rb: Any = rb) -> None:
            nonlocal step
            for _ in range(0, rows, batch):
                data = frames[torch.arange(step, step + batch) % FRAMES].clone()
                data["step"] = torch.arange(step, step + batch)
                rb.extend(data)
                step += batch

        extend(capacity)
        figures: dict[str, Any] = {}
        for form in ("directory", "archive"):
            saves, restores, sizes, gained = [], [], [], []
            for i in range(ROUNDS):
                extend(batch)
                path = where / f"{name}-{form}-{i}"
                before = disk_used(where)
                checkpoint = Checkpoint(buffer=rb, format=form)
                saves.append(timed(lambda c=checkpoint, p=path: c.save(p)))
                gained.append(disk_used(where) - before)
                sizes.append(tree_bytes(path))
            for i in range(ROUNDS):
                extend(batch)
                path = where / f"{name}-{form}-{i}"
                checkpoint = Checkpoint(buffer=rb, format=form)
                restores.append(timed(lambda c=checkpoint, p=path: c.load(p)))
                assert int(rb[len(rb) - 1]["step"]) >= 0
            for i in range(ROUNDS):
                shutil.rmtree(where / f"{name}-{form}-{i}", ignore_errors=True)
                (where / f"{name}-{form}-{i}").unlink(missing_ok=True)
            figures[form] = {
                "checkpoint_ms": statistics.median(saves) * 1e3,
                "restore_ms": statistics.median(restores) * 1e3,
                "checkpoint_bytes": statistics.median(sizes),
                "disk_gained_bytes": statistics.median(gained),
            }
        if name == "ZarrStorage":
            rb.storage.flush()
            one_ring = tree_bytes(where / "rb.zarr")
            rotation = CheckpointRotation(where / "rotated", keep_last=3)
            for i in range(ROTATED):
                extend(max(batch, capacity // ROTATED // batch * batch))
                rotation.save(Checkpoint(buffer=rb), step=i)
            rb.storage.flush()
            figures["rotated"] = {
                "store_one_ring_mb": one_ring / 1e6,
                "store_after_rotation_mb": tree_bytes(where / "rb.zarr") / 1e6,
                "versions_kept": len(zarr_rb.versions(where / "rb.zarr")),
                "checkpoints_kept": len(rotation.checkpoints()),
            }
            rb.storage.close()
        out[name] = figures
        del rb
        shutil.rmtree(where / "memmap", ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from _sizes import measure_sizes, size_arguments  # next to this file

    args = size_arguments(__doc__.split("\n\n")[0], HERE / "checkpoint.json", argv)
    results = measure_sizes(measure, args, "zarr_rb-checkpoint-")
    print(
        "| raw | storage | format | checkpoint ms | restore ms | checkpoint bytes "
        "| disk gained |\n|---|---|---|---|---|---|---|"
    )
    for size, r in results.items():
        for name in ("ZarrStorage", "LazyMemmapStorage"):
            for form in ("directory", "archive"):
                f = r[name][form]
                print(
                    f"| {r['raw_gb'] * 1e3:,.0f} MB | {name} | {form} | {f['checkpoint_ms']:,.0f} "
                    f"| {f['restore_ms']:,.0f} | {f['checkpoint_bytes']:,.0f} "
                    f"| {f['disk_gained_bytes'] / 1e6:,.1f} MB |"
                )
        rot = r["ZarrStorage"]["rotated"]
        print(
            f"\n{size}: store {rot['store_one_ring_mb']:.1f} MB after one ring, "
            f"{rot['store_after_rotation_mb']:.1f} MB after {ROTATED} rotated checkpoints "
            f"({rot['versions_kept']} versions, {rot['checkpoints_kept']} checkpoints kept)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
