"""The loop of the benchmarks that measure one thing at several buffer sizes: each size in a
scratch directory of its own, deleted after, its figures printed as they come and written
together into a JSON file."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def size_arguments(
    description: str, default_json: Path, argv: list[str] | None = None
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 10_000])
    parser.add_argument("--json", type=Path, default=default_json)
    parser.add_argument("--where", type=Path, default=None, help="a scratch directory")
    return parser.parse_args(argv)


def measure_sizes(
    measure: Callable[[float, Path], dict[str, Any]], args: argparse.Namespace, prefix: str
) -> dict[str, dict[str, Any]]:
    """``measure(size_mb, scratch)`` for each of ``args.sizes_mb``, written to ``args.json``."""
    results = {}
    for size in args.sizes_mb:
        where = Path(tempfile.mkdtemp(prefix=prefix, dir=args.where))
        try:
            results[f"{size:g} MB"] = measure(size, where)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        print(json.dumps({f"{size:g} MB": results[f"{size:g} MB"]}, indent=1), flush=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


def pong_frames(count: int) -> tuple[Any, int]:
    """``count`` real Pong transitions (generated once, cached by ``run.dataset``) and the
    bytes of one row."""
    import run  # next to this file

    frames = run.dataset("pong", count)
    row_bytes = sum(
        v[0].numel() * v.element_size()
        for v in frames.values(include_nested=True, leaves_only=True)
    )
    return frames, int(row_bytes)
