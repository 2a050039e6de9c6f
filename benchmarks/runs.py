"""The position map of shared stores (row runs, ``zarr_rb/format/runs.py``) at 10^6 and 10^8
positions: its size in the commit record, and what a commit and a read spend on it.

A full ring is laid out as its writers leave it: with one writer, a run per slot (slots
taken out of order break runs); with 8 writers extending 50 rows each in turn, a run per
extend. Each figure is the median of ``--repeat`` runs.

A commit of one extend of 50 rows is measured both ways a record can hold the map, in the
same run: inline (the whole map in the record: what every commit writes and every writer
parses) and in pieces of ``SPAN`` positions (the record names them; a commit writes the
pieces it changed, a reader reads those and reuses the others it decoded). ``commit``:
the map's part of a commit (assign, encode, the record's JSON); ``refresh``: a reader
picking the commit up (parse, the changed pieces read from memory here).

    python benchmarks/runs.py [--json benchmarks/runs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zarr_rb.core.pieces import store_pieces
from zarr_rb.format import pieces as pieces_module
from zarr_rb.format import runs as runs_module
from zarr_rb.format.pieces import parse_map
from zarr_rb.format.runs import RunMap

BLOCK_ROWS = 64
EXTEND = 50


def full_ring(rows: int, writers: int, rng: np.random.Generator) -> RunMap:
    """The map of a full ring of ``rows`` positions as ``writers`` writers leave it."""
    if writers == 1:
        count = -(-rows // BLOCK_ROWS)
        slots = rng.permutation(2 * count)[:count]  # reused slots: anywhere in the arrays
        starts = np.arange(count, dtype=np.int64) * BLOCK_ROWS
        counts = np.minimum(BLOCK_ROWS, rows - starts)
        return RunMap(np.stack([starts, slots * BLOCK_ROWS, counts], axis=1))
    count = -(-rows // EXTEND)
    starts = np.arange(count, dtype=np.int64) * EXTEND
    counts = np.minimum(EXTEND, rows - starts)
    writer = np.arange(count) % writers
    # Each writer's rows follow each other in its own region of the arrays.
    firsts = (writer * (rows // writers + BLOCK_ROWS)) + (np.arange(count) // writers) * EXTEND
    return RunMap(np.stack([starts, firsts, counts], axis=1))


def timed(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Objects(dict[str, bytes]):
    """Piece objects, in memory (what a commit writes is counted, not its I/O)."""

    def read(self, key: str) -> bytes | None:
        return self.get(key)

    def identity(self) -> tuple[str, ...]:
        return ("objects", str(id(self)))


def measure(rows: int, writers: int, repeat: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    runs = full_ring(rows, writers, rng)
    cursor = rows // 3
    positions = np.arange(cursor, cursor + EXTEND, dtype=np.int64)
    physical = np.arange(10 * rows, 10 * rows + EXTEND, dtype=np.int64)
    sample = rng.integers(0, rows, 256)
    capacity = 2 * -(-rows // BLOCK_ROWS) + 64
    out: dict[str, Any] = {
        "positions": rows,
        "writers": writers,
        "runs": len(runs),
        "raw_bytes": len(runs) * 24,
        "assign_ms": 1e3 * timed(lambda: runs.assign(positions, physical), repeat),
        "free_slots_ms": 1e3 * timed(lambda: runs.used_slots(BLOCK_ROWS, capacity), repeat),
        "lookup_256_us": 1e6 * timed(lambda: runs.physical(sample), repeat),
    }
    # Inline: the whole map in every record.
    inline_limit = runs_module.INLINE_RUNS
    runs_module.INLINE_RUNS = 2**62
    try:
        text = json.dumps(runs.assign(positions, physical).to_json())

        def inline_commit() -> None:
            json.dumps(runs.assign(positions, physical).to_json())

        def inline_refresh() -> None:
            runs_module._KNOWN.clear()
            runs_module._decoded.cache_clear()
            parse_map(json.loads(text), rows=rows, pieces=None)

        out["inline"] = {
            "record_bytes": len(text),
            "commit_ms": 1e3 * timed(inline_commit, repeat),
            "refresh_ms": 1e3 * timed(inline_refresh, repeat),
        }
    finally:
        runs_module.INLINE_RUNS = inline_limit
    # In pieces: the record names them; a commit writes the ones it changed.
    objects = Objects()
    base = RunMap(runs.runs)
    store_pieces([base], objects.__setitem__)
    parse_map(base.to_json(), rows=rows, pieces=objects)  # a reader that decoded them all
    written: list[int] = []
    records: list[str] = []

    def pieces_commit() -> None:
        new = base.assign(positions, physical)
        keys = store_pieces([new], objects.__setitem__)
        written.append(sum(len(objects[key]) for key in keys))
        records.append(json.dumps(new.to_json()))

    def pieces_refresh() -> None:
        pieces_module._ASSEMBLED.clear()  # (the changed pieces were never decoded)
        parse_map(json.loads(records.pop()), rows=rows, pieces=objects)

    out["pieces"] = {"commit_ms": 1e3 * timed(pieces_commit, repeat)}
    out["pieces"]["record_bytes"] = len(records[-1])
    out["pieces"]["piece_bytes_written"] = statistics.median(written)
    out["pieces"]["refresh_ms"] = 1e3 * timed(pieces_refresh, repeat)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results there")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="1000000,100000000")
    args = parser.parse_args()
    results = [
        measure(int(rows), writers, args.repeat)
        for rows in args.sizes.split(",")
        for writers in (1, 8)
    ]
    print(
        "| positions | writers | runs | record inline / pieces | commit inline / pieces | "
        "refresh inline / pieces | pieces written | lookup 256 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        inline, pieces = r["inline"], r["pieces"]
        print(
            f"| {r['positions']:,} | {r['writers']} | {r['runs']:,} | "
            f"{inline['record_bytes'] / 2**20:.2f} / {pieces['record_bytes'] / 2**20:.3f} MiB | "
            f"{inline['commit_ms']:.1f} / {pieces['commit_ms']:.1f} ms | "
            f"{inline['refresh_ms']:.1f} / {pieces['refresh_ms']:.1f} ms | "
            f"{pieces['piece_bytes_written'] / 2**10:.0f} KiB | {r['lookup_256_us']:.0f} us |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
