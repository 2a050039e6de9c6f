"""What next-observation and frame-stack dedup would buy a random batch, before building them.

A TorchRL transition stores ``obs`` and ``("next", "obs")``, and Atari observations are stacks
of the last 4 frames: inside an episode ``next/obs[i] == obs[i + 1]``, and a stack shares 3
frames with its neighbour. Storing each frame once would shrink the store 2x to 8x; whether it
makes a random batch cheaper depends on what a read of scattered rows costs. This measures it
on TensorStore arrays laid out as zarr_rb lays them out (sharded, zstd, CRC32C; at level 1,
zarr_rb's default when it was measured), each layout read for the same 256 random
transitions, in turn, so that noise falls on all alike::

    python benchmarks/dedup.py                     # Pong and Ms. Pac-Man, 60 rounds
    python benchmarks/dedup.py --games breakout --rounds 100

Layouts (every one rebuilds ``obs`` and ``next/obs`` of the batch, as uint8 tensors, with
``index_select``):

- ``stacked, two keys``: what zarr_rb stores (rows of 4 stacked frames, 2-row inner chunks);
- ``next/obs from obs[i + 1]``: one array of stacks, read at ``i`` and ``i + 1`` in one read;
- ``single frames``: one array of frames (8-frame inner chunks), read at ``i .. i + 4`` in one
  read, the two stacks of each row gathered from them.

Episode ends (where the shortcuts do not hold) are left out of the layouts: they would be a
few rows stored apart, and reading them is not what is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import run
import tensorstore as ts
import torch

SHARD_ROWS = 256


def _array(where: Path, data: np.ndarray, inner_rows: int) -> ts.TensorStore:
    """``data`` in a sharded zarr3 array with zarr_rb's codecs."""
    inner = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(where)},
        "metadata": {
            "shape": list(data.shape),
            "data_type": "uint8",
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [SHARD_ROWS * inner_rows, *data.shape[1:]]},
            },
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [inner_rows, *data.shape[1:]],
                        "codecs": [{"name": "bytes"}, inner, {"name": "crc32c"}],
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ],
        },
        "create": True,
        "delete_existing": True,
    }
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False})
    array = ts.open(spec, context=context).result()
    array.write(data).result()
    return array


def _disk_bytes(where: Path) -> int:
    return sum(p.stat().st_size for p in where.rglob("*") if p.is_file())


def layouts(frames: np.ndarray, work: Path) -> dict[str, tuple[Callable[[np.ndarray], Any], int]]:
    """Each layout: a function reading the batch of rows ``i``, and its bytes on disk."""
    rows = frames.shape[0] - 1
    obs = _array(work / "obs", frames[:-1], 2)
    next_obs = _array(work / "next-obs", frames[1:], 2)
    stacks = _array(work / "stacks", frames, 2)
    # Frame t of the run: the first stack's 4 frames, then the newest frame of each stack.
    singles = _array(work / "frames", np.concatenate([frames[0, :3], frames[:, 3]]), 8)

    def stacked(i: np.ndarray) -> Any:
        first, second = obs[i].read(), next_obs[i].read()
        return torch.from_numpy(first.result()), torch.from_numpy(second.result())

    def from_next_row(i: np.ndarray) -> Any:
        wanted, where = np.unique(np.concatenate([i, i + 1]), return_inverse=True)
        got = torch.from_numpy(stacks[wanted].read().result())
        where_t = torch.from_numpy(where)
        return got.index_select(0, where_t[: i.size]), got.index_select(0, where_t[i.size :])

    def from_frames(i: np.ndarray) -> Any:
        window = i[:, None] + np.arange(5)  # frames of obs[i] and next/obs[i]
        wanted, where = np.unique(window, return_inverse=True)
        got = torch.from_numpy(singles[wanted].read().result())
        where_t = torch.from_numpy(where.reshape(window.shape))
        shape = (i.size, 4, *got.shape[1:])
        return (
            got.index_select(0, where_t[:, :4].reshape(-1)).view(shape),
            got.index_select(0, where_t[:, 1:].reshape(-1)).view(shape),
        )

    # Sanity: every layout rebuilds the same transitions.
    check = np.arange(0, rows, 97)
    expected = stacked(check)
    for read in (from_next_row, from_frames):
        got = read(check)
        same = (got[0] == expected[0]).flatten(1).all(1) & (got[1] == expected[1]).flatten(1).all(1)
        assert bool(same.float().mean() > 0.9), read.__name__  # all but episode ends
    return {
        "stacked, two keys (zarr_rb today)": (
            stacked,
            _disk_bytes(work / "obs") + _disk_bytes(work / "next-obs"),
        ),
        "next/obs from obs[i + 1]": (from_next_row, _disk_bytes(work / "stacks")),
        "single frames": (from_frames, _disk_bytes(work / "frames")),
    }


def measure(game: str, rows: int, rounds: int, work: Path) -> dict[str, Any]:
    frames, _ = run.atari_episode_frames(game, rows, seed=0)
    candidates = layouts(frames, work)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        i = np.sort(rng.integers(0, rows, run.SAMPLE))
        for name, (read, _) in candidates.items():
            start = time.perf_counter()
            read(i)
            times[name].append(time.perf_counter() - start)
    raw = 2 * frames[:-1].nbytes
    return {
        name: {
            "median_ms": statistics.median(times[name]) * 1e3,
            "disk_bytes": disk,
            "raw_over_disk": raw / disk,
        }
        for name, (_, disk) in candidates.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", default="pong,mspacman")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "dedup.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for game in args.games.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            results[game] = measure(game, args.rows, args.rounds, Path(tmp))
    print("| layout | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for name in next(iter(results.values())):
        cells = [
            f"{r[name]['median_ms']:.1f} ms, 1/{r[name]['raw_over_disk']:.0f}"
            for r in results.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
