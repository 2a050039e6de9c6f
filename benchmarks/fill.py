"""How long a fill of a buffer takes, and how much CPU: fresh storages filled with the same
rows by ``extend`` (1,024 rows at a time, as ``run.py --parts datasets``; ZarrStorage's
fills end with ``flush()``), in turn, rounds alternating; medians of wall-clock seconds, of
the process's CPU seconds (every thread) and of the time of an ``extend()`` (the first of
each fill, which creates the arrays, left out). CPU counts what the fill takes from a busy
machine, where wall-clock times vary most::

    python benchmarks/fill.py                        # Breakout, 8,192 rows, 5 rounds
    python benchmarks/fill.py --dataset random --storages zarr,zarr-0
    python benchmarks/fill.py --storages memmap,zarr --levels 1,-1   # zstd levels, in turn
    python benchmarks/fill.py --dataset random --breakdown   # where ZarrStorage's time goes
    python benchmarks/fill.py --between 0.05   # a learner's 50 ms of work after each extend
    python benchmarks/fill.py --storages memmap,zarr-nested,zarr   # chunk names, before/now

To compare two versions of zarr_rb, run it from each checkout in turn.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STORAGES = ("memmap", "zarr", "zarr-0", "zarr-stacks", "zarr-nested")
"""``--storages`` choices: LazyMemmapStorage, ZarrStorage (default settings: stacks of frames
stored as frames, each once), ZarrStorage with ``ram_bytes=0``, ZarrStorage with every
leaf stored as stacks (``Compression(frames=False)``), and ZarrStorage whose arrays name
their chunks ``c/3/0/0`` as stores made before did (each chunk in directories of its own;
now ``c.3.0.0``, see ``docs/design/chunk-names.md``)."""
BATCH = 1024


def fill(
    kind: str, data: Any, where: Path, between: float = 0.0
) -> tuple[float, float, list[float]]:
    """Wall-clock and CPU seconds of one fresh fill of a ``kind`` storage with ``data``
    (``zarr`` or ``zarr-0`` and ``@level``: at that zstd level), and the seconds of each
    ``extend()`` but the first (which creates the arrays), unless it is the only one.
    ``between``: seconds of work on the filling thread after each extend (a learner's
    updates: matrix products)."""
    from zarr_rb import Compression

    kind, _, level = kind.partition("@")
    settings: dict[str, Any] = {"level": int(level)} if level else {}
    if kind == "zarr-stacks":
        settings["frames"] = False
    compression = Compression(**settings) if settings else None

    path = Path(tempfile.mkdtemp(dir=where))
    try:
        with chunk_names("/" if kind == "zarr-nested" else "."):
            return _fill(kind, data, path, compression, between)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def chunk_names(separator: str) -> Iterator[None]:
    """The arrays created meanwhile name their chunks with ``separator``."""
    from zarr_rb.engine import tensorstore

    before = tensorstore.CHUNK_KEY_ENCODING
    tensorstore.CHUNK_KEY_ENCODING = {"name": "default", "separator": separator}
    try:
        yield
    finally:
        tensorstore.CHUNK_KEY_ENCODING = before


def _fill(
    kind: str, data: Any, path: Path, compression: Any, between: float
) -> tuple[float, float, list[float]]:
    """:func:`fill` in ``path``."""
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    from zarr_rb import ZarrStorage

    rows = data.shape[0]
    if kind == "memmap":
        storage: Any = LazyMemmapStorage(rows, scratch_dir=path)
    else:
        storage = ZarrStorage(
            rows,
            path / "rb.zarr",
            ram_bytes=0 if kind == "zarr-0" else "auto",
            compression=compression,
        )
    rb = TensorDictReplayBuffer(storage=storage, batch_size=256)
    extends = []
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, rows, BATCH):
        began = time.perf_counter()
        rb.extend(data[start : start + BATCH])
        extends.append(time.perf_counter() - began)
        work(between)
    if kind != "memmap":
        storage.flush()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if kind != "memmap":
        storage.close()
    return wall, cpu, extends[1:] or extends  # (a fill of one extend: that one)


def work(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` with matrix products, as a learner's updates."""
    import torch

    x = torch.ones(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = (x @ x) * 1e-3


STEPS = {
    "frames into the RAM tier": ("zarr_rb.core.ram_rows", "RamRows", "update_frames"),
    "frames into the cells (frames on disk)": (
        "zarr_rb.core.frame_cells",
        "FrameCells",
        "row_writes",
    ),
    "waiting for TensorStore's write": ("zarr_rb.core.solo_writes", "SoloWrites", "_finish_write"),
    "commits": ("zarr_rb.core.solo", "SoloCommits", "_commit"),
}
"""What ``--breakdown`` times on the filling thread: the parts of ZarrStorage's extends."""


@contextlib.contextmanager
def breakdown(seconds: dict[str, float]) -> Iterator[None]:
    """Adds to ``seconds`` the time the calling thread spends in each of :data:`STEPS`, and
    in ``os.fsync`` (in the commits and elsewhere), while inside."""
    import importlib

    caller = threading.get_ident()
    patched = []

    def timed(label: str, function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != caller:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        return run

    for label, (module, cls, name) in STEPS.items():
        owner = getattr(importlib.import_module(module), cls)
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed(label, getattr(owner, name)))
    patched.append((os, "fsync", os.fsync))
    os.fsync = timed("fsync, on this thread", os.fsync)
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="breakout", help="as run.py's (or 'random')")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--storages",
        default=",".join(kind for kind in STORAGES if kind != "zarr-nested"),
        help=f"of {','.join(STORAGES)} (zarr-nested only when named)",
    )
    parser.add_argument(
        "--levels",
        default="",
        help="zstd levels to fill ZarrStorage at, in turn (default: its own)",
    )
    parser.add_argument(
        "--between",
        type=float,
        default=0.0,
        help="seconds of work on the filling thread after each extend (a learner's updates)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also print the median time of each part of ZarrStorage's fills",
    )
    args = parser.parse_args(argv)
    kinds = args.storages.split(",")
    unknown = set(kinds) - set(STORAGES)
    if unknown:
        parser.error(f"unknown storages {sorted(unknown)}: expected some of {STORAGES}")
    if args.levels:
        levels = [int(level) for level in args.levels.split(",")]
        kinds = [
            variant
            for kind in kinds
            for variant in ([kind] if kind == "memmap" else [f"{kind}@{n}" for n in levels])
        ]
    sys.path.insert(0, str(HERE))
    import run

    data = run.dataset(args.dataset, args.rows)
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    extends: dict[str, list[float]] = {kind: [] for kind in kinds}
    parts: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                seconds: dict[str, float] = collections.defaultdict(float)
                timing = breakdown(seconds) if args.breakdown else contextlib.nullcontext()
                with timing:
                    wall, cpu, each = fill(kind, data, Path(where), args.between)
                times[kind].append((wall, cpu))
                extends[kind].extend(each)
                parts[kind].append(seconds)
    gb = data.bytes() / 1e9
    print(f"{args.dataset}, {args.rows:,} rows ({gb:.2f} GB), medians of {args.rounds} fills")
    if args.between:
        print(f"{args.between:g} s of work on the filling thread after each extend")
    print("| storage | wall s | CPU s | GB/s | extend() ms |\n|---|---|---|---|---|")
    result: dict[str, Any] = {"dataset": args.dataset, "rows": args.rows, "gb": gb, "fills": {}}
    for kind, pairs in times.items():
        wall = statistics.median(w for w, _ in pairs)
        cpu = statistics.median(c for _, c in pairs)
        extend = 1e3 * statistics.median(extends[kind])
        print(f"| {kind} | {wall:.3f} | {cpu:.3f} | {gb / wall:.2f} | {extend:.1f} |")
        result["fills"][kind] = {"wall_s": wall, "cpu_s": cpu, "all": pairs, "extend_ms": extend}
    if args.breakdown:
        labels = [*STEPS, "fsync, on this thread"]
        print("\n| storage, filling thread s | " + " | ".join(labels) + " |")
        print("|---" * (len(labels) + 1) + "|")
        for kind, rounds in parts.items():
            if kind != "memmap":
                medians = [statistics.median(r[label] for r in rounds) for label in labels]
                print(f"| {kind} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
                result["fills"][kind]["breakdown_s"] = dict(zip(labels, medians, strict=True))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
