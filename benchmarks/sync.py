"""How long a commit's fsyncs take: the files of one commit (by default 77 files of 750 kB,
the arrays' objects of a block of 1,024 random-frame rows), fsynced one by one, against the
same with the write-back of every file started first (``sync_file_range``, what zarr_rb's
local stores do). Rounds alternate between the two; medians::

    python benchmarks/sync.py                      # 77 files of 750 kB, 7 rounds
    python benchmarks/sync.py --files 20 --kb 64   # a commit of a few small blocks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from zarr_rb.locations import local

HERE = Path(__file__).resolve().parent


def one_round(where: Path, files: int, size: int, *, writeback: bool) -> float:
    """Seconds to sync ``files`` new files of ``size`` bytes in ``where``."""
    payload = os.urandom(size)
    paths = []
    for i in range(files):
        path = where / f"{i}"
        path.write_bytes(payload)
        paths.append(path)
    kept = local._SYNC_FILE_RANGE
    local._SYNC_FILE_RANGE = kept if writeback else None
    try:
        start = time.perf_counter()
        local._fsync_together(paths)
        return time.perf_counter() - start
    finally:
        local._SYNC_FILE_RANGE = kept
        for path in paths:
            path.unlink()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=77)
    parser.add_argument("--kb", type=int, default=750)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=HERE, help="where the files go (a disk)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if local._SYNC_FILE_RANGE is None:
        print("no sync_file_range here: both rows below fsync one by one")
    seconds: dict[str, list[float]] = {"fsync": [], "write-back, then fsync": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for round_ in range(args.rounds):
            order = list(seconds) if round_ % 2 == 0 else list(seconds)[::-1]
            for kind in order:
                writeback = kind != "fsync"
                seconds[kind].append(
                    one_round(Path(where), args.files, args.kb * 1024, writeback=writeback)
                )
    result = {
        "files": args.files,
        "kb": args.kb,
        "median_ms": {kind: statistics.median(s) * 1000 for kind, s in seconds.items()},
    }
    for kind, ms in result["median_ms"].items():
        print(f"{args.files} files of {args.kb} kB, {kind}: {ms:.1f} ms (median of {args.rounds})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
