"""Kept versions: ``zarr_rb.save(rb, tag=...)`` and ``zarr_rb.load(path, version=...)``
cost the same at 10 MB and at 10 GB, and ten versions of a buffer whose ring turned over
once hold about two rings of disk, not ten.

For each size (raw bytes of the rows one ring holds), a buffer of Pong transitions (real
ALE frames, 4x84x84 stacks for ``observation`` and ``("next", "observation")``: 56 KB a
row) is filled once and flushed; then ten times ``capacity / 10`` new rows are extended
and the buffer flushed and saved with a tag, so that the ten versions between them cover one whole
turn of the ring. The frames repeat a few thousand real ones (rows stay distinct: each
carries its step), as a long run of one game would. Reported: each save's time (median,
max), ``load(path, version=...)`` of the oldest and of the newest version (median of 3),
the store's disk after the first fill and with the ten versions, and the bound of the
design (one ring plus the blocks the ten versions changed: two rings here)::

    python benchmarks/versions.py                      # 10 MB and 10 GB, ~5 min
    python benchmarks/versions.py --sizes-mb 10 200    # quicker
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VERSIONS = 10
BATCH = 500
FRAMES = 2048  # real frames generated once, then repeated


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(size_mb: float, where: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import torch
    from _sizes import pong_frames  # next to this file
    from torchrl.data import TensorDictReplayBuffer

    import zarr_rb

    frames, row_bytes = pong_frames(FRAMES)
    capacity = int(size_mb * 1e6 // row_bytes)
    batch_rows = max(1, min(BATCH, capacity // VERSIONS))
    capacity = capacity // (batch_rows * VERSIONS) * batch_rows * VERSIONS
    path = where / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=zarr_rb.ZarrStorage(capacity, path), batch_size=256)
    step = 0

    def extend(rows: int) -> None:
        nonlocal step
        for _ in range(0, rows, batch_rows):
            at = torch.arange(step, step + batch_rows) % FRAMES
            batch = frames[at].clone()
            batch["step"] = torch.arange(step, step + batch_rows)
            rb.extend(batch)
            step += batch_rows

    start = time.perf_counter()
    extend(capacity)
    rb.storage.flush()
    fill_s = time.perf_counter() - start
    one_ring = disk_bytes(path)
    saves = []
    per_version = capacity // VERSIONS
    for i in range(VERSIONS):
        extend(per_version)
        rb.storage.flush()  # the rows still in RAM are written by any commit: not the save's
        start = time.perf_counter()
        zarr_rb.save(rb, tag=f"v{i}", progress=False)
        saves.append(time.perf_counter() - start)
    with_versions = disk_bytes(path)
    kept = zarr_rb.versions(path)
    assert [v.tag for v in kept if v.tag] == [f"v{i}" for i in range(VERSIONS)], kept

    def load_seconds(version: str) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            loaded = zarr_rb.load(path, version=version, progress=False, read_only=True)
            steps = loaded.storage.get(torch.arange(len(loaded) - 4, len(loaded)))["step"]
            times.append(time.perf_counter() - start)
            assert steps.numel() == 4
            loaded.storage.close()
        return statistics.median(times)

    oldest, newest = load_seconds("v0"), load_seconds(f"v{VERSIONS - 1}")
    rb.storage.close()
    return {
        "rows": capacity,
        "raw_gb": capacity * row_bytes / 1e9,
        "fill_s": fill_s,
        "save_median_ms": statistics.median(saves) * 1e3,
        "save_max_ms": max(saves) * 1e3,
        "load_oldest_ms": oldest * 1e3,
        "load_newest_ms": newest * 1e3,
        "disk_one_ring_mb": one_ring / 1e6,
        "disk_ten_versions_mb": with_versions / 1e6,
        "disk_ratio": with_versions / one_ring,
    }


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from _sizes import measure_sizes, size_arguments  # next to this file

    args = size_arguments(__doc__.split("\n\n")[0], HERE / "versions.json", argv)
    results = measure_sizes(measure, args, "zarr_rb-versions-")
    print("| raw | rows | save, median (max) ms | load(version=) oldest / newest ms "
          "| disk: one ring / ten versions MB | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results.values():
        print(
            f"| {r['raw_gb'] * 1e3:,.0f} MB | {r['rows']:,} | {r['save_median_ms']:.0f} "
            f"({r['save_max_ms']:.0f}) | {r['load_oldest_ms']:.0f} / {r['load_newest_ms']:.0f} "
            f"| {r['disk_one_ring_mb']:.1f} / {r['disk_ten_versions_mb']:.1f} "
            f"| {r['disk_ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
