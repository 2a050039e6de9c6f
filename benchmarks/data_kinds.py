"""Rows of different lengths, and saving a buffer held in RAM: zarr_rb against TorchRL's own
storages, in the same run, on the same data.

    python benchmarks/data_kinds.py                 # 100k LLM rows, a 1 GB buffer: ~10 min
    python benchmarks/data_kinds.py --rows 10000 --save-gb 0.2     # a quick look

Variable-length rows: ``--rows`` rows of int32 token ids of lengths drawn uniformly in
16-4096 (random ids below 50,257, as a GPT-2 vocabulary), a float reward and a prompt
string each, extended in lazy stacks of 1,000 rows into ``ZarrStorage`` (flushed to disk
at the end) and into ``LazyStackStorage`` (RAM), then ``sample(64)`` timed on both, and
the bytes on disk. Saving: a ``LazyTensorStorage`` buffer of about ``--save-gb`` GB of
Pong transitions (benchmarks/run.py's cached frames, cycled), saved by ``zarr_rb.save``
into a new store and by TorchRL's ``rb.dumps`` into a directory, alternately, with the
peak memory each adds. Medians; figures go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

import zarr_rb

sys.path.insert(0, str(Path(__file__).parent))
import run  # benchmarks/run.py: the cached Atari frames

BLOCK = 1000
SAMPLE = 64
VOCABULARY = 50_257


def token_block(start: int, n: int, lengths: torch.Tensor) -> Any:
    g = torch.Generator().manual_seed(start)
    return lazy_stack(
        [
            TensorDict(
                {
                    "tokens": torch.randint(0, VOCABULARY, (int(lengths[i]),), generator=g,
                                            dtype=torch.int32),
                    "reward": torch.rand((), generator=g),
                    "prompt": NonTensorData(f"question {start + i}: how long is this row?"),
                }
            )
            for i in range(start, start + n)
        ]
    )  # fmt: skip


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@contextmanager
def peak_rss_above_start() -> Iterator[dict[str, int]]:
    """The most resident memory the block adds, sampled every 5 ms."""
    out = {"peak": 0}
    start, done = rss_bytes(), threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            out["peak"] = max(out["peak"], rss_bytes() - start)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield out
    finally:
        done.set()
        watcher.join()
        out["peak"] = max(out["peak"], rss_bytes() - start)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ragged(rows: int, samples: int, where: Path) -> dict[str, Any]:
    lengths = torch.randint(16, 4097, (rows,), generator=torch.Generator().manual_seed(0))
    blocks = [token_block(s, min(BLOCK, rows - s), lengths) for s in range(0, rows, BLOCK)]
    out: dict[str, Any] = {"rows": rows, "token_bytes": int(lengths.sum()) * 4}
    for name in ("ZarrStorage", "LazyStackStorage"):
        if name == "ZarrStorage":
            storage: Any = zarr_rb.ZarrStorage(rows, where / "tokens.zarr")
        else:
            storage = LazyStackStorage(rows)
        rb = ReplayBuffer(storage=storage, batch_size=SAMPLE)

        def extend(rb: ReplayBuffer = rb, storage: Any = storage) -> None:
            for block in blocks:
                rb.extend(block)
            if isinstance(storage, zarr_rb.ZarrStorage):
                storage.flush()

        seconds = timed(extend)
        rb.set_rng(torch.Generator().manual_seed(1))
        for _ in range(5):  # warm up
            rb.sample()
        times = [timed(rb.sample) for _ in range(samples)]
        out[name] = {
            "extend_s": seconds,
            "extend_rows_per_s": rows / seconds,
            "sample_64_median_ms": statistics.median(times) * 1e3,
            "sample_64_p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3,
        }
        if name == "ZarrStorage":
            out[name]["disk_bytes"] = disk_bytes(where / "tokens.zarr")
            storage.close()
            reopened = zarr_rb.ZarrStorage(path=where / "tokens.zarr", read_only=True)
            index = torch.randint(0, rows, (SAMPLE,), generator=torch.Generator().manual_seed(2))
            read = reopened.get(index)
            assert [len(row["tokens"]) for row in read.unbind(0)] == lengths[index].tolist()
            reopened.close()
        del rb, storage
    out["sample_ratio_zarr_to_lazystack"] = (
        out["ZarrStorage"]["sample_64_median_ms"] / out["LazyStackStorage"]["sample_64_median_ms"]
    )
    out["extend_ratio_zarr_to_lazystack"] = (
        out["ZarrStorage"]["extend_s"] / out["LazyStackStorage"]["extend_s"]
    )
    return out


def strings(rows: int, samples: int, where: Path) -> dict[str, Any]:
    """One string per row (10-400 characters) as zarr_rb stores it (UTF-8 bytes padded per
    row, plus lengths) and as zarr-python's variable-length UTF-8 arrays (chunks of 1,000
    strings): write, read 64 random rows, bytes on disk."""
    import numpy as np
    import zarr

    rng = np.random.default_rng(0)
    texts = [f"question {i}: " + "x" * int(rng.integers(10, 400)) for i in range(rows)]
    parts = [texts[s : s + BLOCK] for s in range(0, rows, BLOCK)]
    blocks = [TensorDict({"prompt": NonTensorStack.from_list(p)}, [len(p)]) for p in parts]
    storage = zarr_rb.ZarrStorage(rows, where / "strings.zarr")
    rb = ReplayBuffer(storage=storage)

    def write_ours() -> None:
        for block in blocks:
            rb.extend(block)
        storage.flush()

    def write_zarr() -> Any:
        array = zarr.create_array(where / "vlen.zarr", shape=(rows,), chunks=(BLOCK,), dtype=str)
        array[:] = np.array(texts, dtype=object)
        return array

    out: dict[str, Any] = {"rows": rows, "text_bytes": sum(len(t) for t in texts)}
    ours_write = timed(write_ours)
    start = time.perf_counter()
    array = write_zarr()
    zarr_write = time.perf_counter() - start
    picks = [np.sort(rng.choice(rows, SAMPLE, replace=False)) for _ in range(samples)]
    assert list(storage.get(torch.from_numpy(picks[0]))["prompt"]) == list(array.oindex[picks[0]])
    ours_read = [timed(lambda p=p: storage.get(torch.from_numpy(p))["prompt"]) for p in picks]
    zarr_read = [timed(lambda p=p: array.oindex[p]) for p in picks]
    out["zarr_rb"] = {
        "write_s": ours_write,
        "read_64_median_ms": statistics.median(ours_read) * 1e3,
        "disk_bytes": disk_bytes(where / "strings.zarr"),
    }
    out["zarr vlen-utf8"] = {
        "write_s": zarr_write,
        "read_64_median_ms": statistics.median(zarr_read) * 1e3,
        "disk_bytes": disk_bytes(where / "vlen.zarr"),
    }
    storage.close()
    return out


def ram_buffer(gb: float) -> TensorDictReplayBuffer:
    pong = run.dataset("pong", 8192)
    rows = max(64, int(gb * 1e9 // (pong[:1].bytes())))
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(rows), batch_size=256)
    written = 0
    while written < rows:
        n = min(len(pong), rows - written)
        rb.extend(pong[:n])
        written += n
    return rb


def save(gb: float, repeats: int, where: Path) -> dict[str, Any]:
    rb = ram_buffer(gb)
    out: dict[str, Any] = {"rows": len(rb), "buffer_bytes": rb.storage[: len(rb)].bytes()}
    runs: dict[str, list[float]] = {"zarr_rb.save": [], "rb.dumps": []}
    peaks: dict[str, list[int]] = {"zarr_rb.save": [], "rb.dumps": []}
    for i in range(repeats):
        for name in runs:
            target = where / f"{name}-{i}"
            with peak_rss_above_start() as peak:
                if name == "zarr_rb.save":
                    seconds = timed(lambda t=target: zarr_rb.save(rb, t, progress=False))
                else:
                    seconds = timed(lambda t=target: rb.dumps(t))
            runs[name].append(seconds)
            peaks[name].append(peak["peak"])
            out.setdefault(name, {})["disk_bytes"] = disk_bytes(target)
            shutil.rmtree(target)
    for name in runs:
        out[name]["median_s"] = statistics.median(runs[name])
        out[name]["runs_s"] = runs[name]
        out[name]["peak_rss_added_mb"] = max(peaks[name]) / 1e6
    out["ratio_save_to_dumps"] = out["zarr_rb.save"]["median_s"] / out["rb.dumps"]["median_s"]
    return out


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table under its title."""
    return [
        title,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def report(results: dict[str, Any]) -> str:
    r, s, t = results.get("ragged"), results.get("save"), results.get("strings")
    lines = []
    if r:
        lines += _table(
            f"Variable-length rows: {r['rows']:,} rows of 16-4096 int32 tokens "
            f"({r['token_bytes'] / 1e9:.2f} GB of tokens)",
            ["storage", "extend (rows/s)", "sample(64) median (ms)", "p95 (ms)", "on disk (GB)"],
            [
                [
                    name,
                    f"{m['extend_rows_per_s']:,.0f}",
                    f"{m['sample_64_median_ms']:.2f}",
                    f"{m['sample_64_p95_ms']:.2f}",
                    f"{m['disk_bytes'] / 1e9:.2f}" if "disk_bytes" in m else "(RAM)",
                ]
                for name, m in ((n, r[n]) for n in ("ZarrStorage", "LazyStackStorage"))
            ],
        )
    if t:
        lines += _table(
            f"Strings: {t['rows']:,} rows of 10-400 characters",
            ["layout", "write (s)", "read 64 random rows median (ms)", "on disk (MB)"],
            [
                [
                    name,
                    f"{m['write_s']:.2f}",
                    f"{m['read_64_median_ms']:.2f}",
                    f"{m['disk_bytes'] / 1e6:.1f}",
                ]
                for name, m in ((n, t[n]) for n in ("zarr_rb", "zarr vlen-utf8"))
            ],
        )
    if s:
        lines += _table(
            f"Saving a LazyTensorStorage buffer of {s['buffer_bytes'] / 1e9:.2f} GB "
            f"({s['rows']:,} Pong transitions)",
            ["route", "median (s)", "on disk (GB)", "peak memory added (MB)"],
            [
                [
                    name,
                    f"{m['median_s']:.2f}",
                    f"{m['disk_bytes'] / 1e9:.2f}",
                    f"{m['peak_rss_added_mb']:.0f}",
                ]
                for name, m in ((n, s[n]) for n in ("zarr_rb.save", "rb.dumps"))
            ],
        )
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="variable-length rows")
    parser.add_argument("--samples", type=int, default=200, help="sample(64) calls timed")
    parser.add_argument("--save-gb", type=float, default=1.0, help="size of the RAM buffer")
    parser.add_argument("--repeats", type=int, default=3, help="saves timed per route")
    parser.add_argument("--only", choices=["ragged", "strings", "save"], default=None)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/data_kinds.json"))
    parser.add_argument("--workdir", type=Path, default=None, help="where stores are written")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        "command": "python benchmarks/data_kinds.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
    }
    where = Path(tempfile.mkdtemp(prefix="zarr_rb-kinds-", dir=args.workdir))
    try:
        if args.only in (None, "ragged"):
            results["ragged"] = ragged(args.rows, args.samples, where)
        if args.only in (None, "strings"):
            results["strings"] = strings(args.rows, args.samples, where)
        if args.only in (None, "save"):
            results["save"] = save(args.save_gb, args.repeats, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(report(results))
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
