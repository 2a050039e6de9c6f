"""ZarrStorage and LazyMemmapStorage side by side on a buffer bigger than the memory they get.

Each storage runs in a child process of its own, confined by a memory cgroup (v1
``memory.limit_in_bytes`` or v2 ``memory.max``; the page cache of the files it maps or
writes is charged to it too), and fills the same buffer of cycled Pong transitions, then
samples from it::

    python benchmarks/run.py --memory-limit 2G                 # a buffer 2.5 times the limit
    python benchmarks/run.py --memory-limit 2G --times-limit 3
    python benchmarks/run.py --parts beyond-ram --frames off   # ZarrStorage with stacks on disk

Creating a cgroup takes root (or a delegated cgroup); without one the run stops with a
message that says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _memory import peak_rss_bytes
from torchrl.data import RandomSampler, SliceSampler, TensorDictReplayBuffer

import zarr_rb

STORAGES = ("ZarrStorage", "LazyMemmapStorage")
POOL_ROWS = 4096
"""Distinct Pong transitions cycled through (116 MB of frames, in each child's memory)."""
ROW_BYTES = 2 * 4 * 84 * 84
"""Raw bytes of a transition's two observations (the rest is a few bytes)."""
SAMPLE_SECONDS = 60.0
"""How long each kind of sampling may take at most (a memory map paging from disk is slow)."""


class CgroupUnavailableError(RuntimeError):
    """No memory cgroup could be made for the child processes."""


def parse_bytes(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"1.5G"`` or a number of bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


# --- memory cgroups ---------------------------------------------------------------------------


class MemoryCgroup:
    """A memory cgroup below this process's own: its limit, its members, its peak."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    @contextmanager
    def made(cls, name: str, limit: int) -> Iterator[MemoryCgroup]:
        """A new cgroup limited to ``limit`` bytes, removed on exit (its members gone)."""
        parent, version = _own_memory_cgroup()
        path = parent / name
        try:
            path.mkdir(exist_ok=True)
            cgroup = cls(path, version)
            cgroup._write("memory.limit_in_bytes" if version == 1 else "memory.max", limit)
            if version == 2:
                cgroup._write("memory.swap.max", 0, missing_ok=True)
        except OSError as err:
            raise CgroupUnavailableError(
                f"cannot make a memory cgroup in {parent}: {err}; run as root (or in a "
                "cgroup delegated to you) to confine the storages"
            ) from err
        try:
            yield cgroup
        finally:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)  # its last member is still exiting

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The most memory the cgroup held (page cache included) since it was made."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def _write(self, name: str, value: int, missing_ok: bool = False) -> None:
        try:
            (self.path / name).write_text(str(value))
        except FileNotFoundError:
            if not missing_ok:
                raise


def _own_memory_cgroup() -> tuple[Path, int]:
    """This process's memory cgroup directory and the cgroup version it is under."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            root = Path("/sys/fs/cgroup")
            if "memory" in (root / "cgroup.controllers").read_text(errors="replace").split():
                return root / line[3:].lstrip("/"), 2
    raise CgroupUnavailableError("this machine has no memory cgroup controller mounted")


# --- one storage, in its child --------------------------------------------------------------


def timings_within(fn: Callable[[], Any], repeats: int, seconds: float) -> list[float]:
    """Up to ``repeats`` timed calls, fewer (at least three) once ``seconds`` have passed."""
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(out) < repeats and (len(out) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def fill_and_sample(
    kind: str, rows: int, samples: int, where: Path, compression: zarr_rb.Compression | None = None
) -> dict[str, Any]:
    """Fill one storage with ``rows`` cycled Pong transitions, then sample from it
    (``compression``: ZarrStorage's settings)."""
    import run  # not at the top: run.py imports this module

    pool = run.dataset("pong", POOL_ROWS)
    if kind == "ZarrStorage":
        storage: Any = zarr_rb.ZarrStorage(rows, where / "rb.zarr", compression=compression)
    else:
        storage = run.LazyMemmapStorage(rows, scratch_dir=where / "memmap")
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=run.SAMPLE)
    start = time.perf_counter()
    for begin in range(0, rows, run.BATCH):
        size = min(run.BATCH, rows - begin)
        offset = begin % (POOL_ROWS - size + 1)
        batch = pool[offset : offset + size].clone()
        batch["episode"] += begin  # distinct episodes across cycles
        rb.extend(batch)
    if isinstance(storage, zarr_rb.ZarrStorage):
        storage.flush()
    fill_s = time.perf_counter() - start
    del pool
    random = timings_within(rb.sample, samples, SAMPLE_SECONDS)
    slices = TensorDictReplayBuffer(
        storage=storage,
        sampler=SliceSampler(slice_len=run.SLICE_LEN, traj_key="episode", strict_length=False),
        batch_size=run.SAMPLE,
    )
    slice_times = timings_within(slices.sample, samples, SAMPLE_SECONDS)
    result = {
        "rows": rows,
        "fill_s": fill_s,
        "extend_gbps": rows * ROW_BYTES / fill_s / 1e9,
        "sample_random": run.median_p95(random),
        "sample_slices": run.median_p95(slice_times),
        "samples": [len(random), len(slice_times)],
        "peak_rss_gb": peak_rss_bytes() / 1e9,
        "disk_bytes": run.disk_bytes(where),
    }
    if isinstance(storage, zarr_rb.ZarrStorage):
        storage.close()
    return result


# --- the parent ---------------------------------------------------------------------------------


def side_by_side(
    limit: int,
    times_limit: float,
    samples: int,
    work: Path,
    compression: zarr_rb.Compression | None = None,
) -> dict[str, Any]:
    """Each storage in a child confined to ``limit`` bytes, on a buffer of ``times_limit``
    times that many raw bytes (``compression``: ZarrStorage's settings)."""
    settings = json.dumps((compression or zarr_rb.Compression()).to_json())
    rows = int(limit * times_limit / ROW_BYTES)
    out: dict[str, Any] = {
        "limit_bytes": limit,
        "rows": rows,
        "raw_gb": rows * ROW_BYTES / 1e9,
        "storages": {},
    }
    for kind in STORAGES:
        where = work / f"beyond-ram-{kind}"
        where.mkdir()
        with MemoryCgroup.made(f"zarr-rb-bench-{os.getpid()}-{kind}", limit) as cgroup:
            child = subprocess.run(
                [sys.executable, __file__, kind, str(rows), str(samples), str(where), settings],
                preexec_fn=cgroup.join,
                stdout=subprocess.PIPE,
                text=True,
                check=False,
            )
            peak = cgroup.peak_bytes()
        if child.returncode != 0:
            raise RuntimeError(
                f"{kind} in a {limit / 2**30:.1f} GiB cgroup exited with {child.returncode} "
                "(a negative code is the signal: -9 is the kernel's OOM killer)"
            )
        result = json.loads(child.stdout.strip().splitlines()[-1])
        result["cgroup_peak_gb"] = None if peak is None else peak / 1e9
        out["storages"][kind] = result
        shutil.rmtree(where, ignore_errors=True)
    import run  # not at the top: run.py imports this module

    out["ratios_to_memmap"] = run.ratios_to_memmap(out["storages"])
    return out


def report(result: dict[str, Any]) -> list[str]:
    limit = result["limit_bytes"] / 2**30
    lines = [
        f"### bigger than RAM: {result['rows']} Pong transitions, {result['raw_gb']:.1f} GB raw, "
        f"each storage in a {limit:.1f} GiB memory cgroup",
        "",
        "| storage | extend GB/s | sample random median / p95 ms "
        "| sample slices median / p95 ms | peak RSS GB | cgroup peak GB | disk GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, r in result["storages"].items():
        peak = r["cgroup_peak_gb"]
        lines.append(
            f"| {kind} | {r['extend_gbps']:.2f} "
            f"| {r['sample_random']['median_ms']:.1f} / {r['sample_random']['p95_ms']:.1f} "
            f"| {r['sample_slices']['median_ms']:.1f} / {r['sample_slices']['p95_ms']:.1f} "
            f"| {r['peak_rss_gb']:.2f} | {'-' if peak is None else f'{peak:.2f}'} "
            f"| {r['disk_bytes'] / 1e9:.2f} |"
        )
    ratios = result["ratios_to_memmap"]
    lines += [
        "",
        "ZarrStorage / LazyMemmapStorage: "
        f"extend {ratios['extend']:.2f}x, sample random {ratios['sample_random']:.4f}x, "
        f"sample slices {ratios['sample_slices']:.4f}x, disk 1/{1 / ratios['disk']:.0f}",
        "",
    ]
    return lines


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    kind, rows, samples, where, settings = sys.argv[1:6]
    compression = zarr_rb.Compression.from_json(json.loads(settings))
    print(json.dumps(fill_and_sample(kind, int(rows), int(samples), Path(where), compression)))
