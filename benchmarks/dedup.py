"""What next-observation and frame-stack dedup would buy a random batch and a fill, before
building them.

A TorchRL transition stores ``obs`` and ``("next", "obs")``, and Atari observations are stacks
of the last 4 frames: inside an episode ``next/obs[i] == obs[i + 1]``, and a stack shares 3
frames with its neighbour. Storing each frame once would shrink the store 2x to 8x; whether it
makes a random batch cheaper depends on what a read of scattered rows costs. This measures it
on TensorStore arrays laid out as zarr_rb lays them out (sharded, zstd at its default level
-1, CRC32C), each layout read for the same 256 random transitions, in turn, so that noise
falls on all alike. It also times a durable write of each layout (the encoding and the
``fsync`` of its files, as a commit makes them), in turn with a copy of the same transitions
into a file's page cache (what ``LazyMemmapStorage``'s extend does)::

    python benchmarks/dedup.py                     # Pong and Ms. Pac-Man, 60 rounds
    python benchmarks/dedup.py --games breakout --rounds 100

Layouts (every one rebuilds ``obs`` and ``next/obs`` of the batch, as uint8 tensors, with
``index_select``):

- ``stacked, two keys``: what zarr_rb stores (rows of 4 stacked frames, 2-row inner chunks);
- ``next/obs from obs[i + 1]``: one array of stacks, read at ``i`` and ``i + 1`` in one read;
- ``single frames``: one array of frames (8-frame inner chunks), read at ``i .. i + 4`` in one
  read, the two stacks of each row gathered from them;
- ``single frames, 8 to a row``: the same frames as rows of 8 (one row per inner chunk), read
  by row: a transition reads the one or two rows its 5 frames are in.

Episode ends (where the shortcuts do not hold) are left out of the layouts: they would be a
few rows stored apart, and reading them is not what is measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def _array(where: Path, data: np.ndarray, inner_rows: int) -> tuple[ts.TensorStore, float]:
    """``data`` in a sharded zarr3 array with zarr_rb's codecs, and the seconds its durable
    write took (every file fsynced)."""
    inner = {"name": "zstd", "configuration": {"level": -1, "checksum": False}}
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
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True})
    array = ts.open(spec, context=context).result()
    start = time.perf_counter()
    array.write(data).result()
    return array, time.perf_counter() - start


def _page_cache_copy(where: Path, data: np.ndarray) -> float:
    """Seconds to copy ``data`` into a new file's pages (a memory map, never synced)."""
    target = np.lib.format.open_memmap(where, mode="w+", dtype=data.dtype, shape=data.shape)
    start = time.perf_counter()
    target[...] = data
    seconds = time.perf_counter() - start
    del target
    return seconds


def _disk_bytes(where: Path) -> int:
    return sum(p.stat().st_size for p in where.rglob("*") if p.is_file())


def _singles(frames: np.ndarray) -> np.ndarray:
    """Frame t of the run: the first stack's 4 frames, then the newest frame of each stack."""
    return np.concatenate([frames[0, :3], frames[:, 3]])


def _packed(frames: np.ndarray) -> np.ndarray:
    """The single frames, 8 to a row (``[t // 8, t % 8]``; the last row padded)."""
    singles = _singles(frames)
    padded = np.zeros((-(-singles.shape[0] // 8) * 8, *singles.shape[1:]), singles.dtype)
    padded[: singles.shape[0]] = singles
    return padded.reshape(-1, 8, *singles.shape[1:])


def writes(frames: np.ndarray, work: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds of each layout's durable write, and of the page-cache copy, ``rounds`` times in
    turn (each into fresh files)."""
    singles, packed = _singles(frames), _packed(frames)
    times: dict[str, list[float]] = {
        "stacked, two keys (zarr_rb today)": [],
        "next/obs from obs[i + 1]": [],
        "single frames": [],
        "single frames, 8 to a row": [],
        "copy into the page cache (obs, next/obs)": [],
    }
    for turn in range(rounds):
        where = work / f"writes-{turn}"
        where.mkdir()
        times["stacked, two keys (zarr_rb today)"].append(
            _array(where / "obs", frames[:-1], 2)[1] + _array(where / "next", frames[1:], 2)[1]
        )
        times["next/obs from obs[i + 1]"].append(_array(where / "stacks", frames, 2)[1])
        times["single frames"].append(_array(where / "frames", singles, 8)[1])
        times["single frames, 8 to a row"].append(_array(where / "packed", packed, 1)[1])
        times["copy into the page cache (obs, next/obs)"].append(
            _page_cache_copy(where / "obs.npy", frames[:-1])
            + _page_cache_copy(where / "next.npy", frames[1:])
        )
        shutil.rmtree(where)
    return times


def layouts(frames: np.ndarray, work: Path) -> dict[str, tuple[Callable[[np.ndarray], Any], int]]:
    """Each layout: a function reading the batch of rows ``i``, and its bytes on disk."""
    rows = frames.shape[0] - 1
    obs, _ = _array(work / "obs", frames[:-1], 2)
    next_obs, _ = _array(work / "next-obs", frames[1:], 2)
    stacks, _ = _array(work / "stacks", frames, 2)
    singles, _ = _array(work / "frames", _singles(frames), 8)
    packed, _ = _array(work / "packed", _packed(frames), 1)

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

    def from_packed(i: np.ndarray) -> Any:
        window = i[:, None] + np.arange(5)  # frames of obs[i] and next/obs[i]
        wanted, where = np.unique(window // 8, return_inverse=True)  # rows of 8 frames
        got = torch.from_numpy(packed[wanted].read().result())
        got = got.view(-1, *got.shape[2:])
        at = torch.from_numpy(where.reshape(window.shape) * 8 + window % 8)
        shape = (i.size, 4, *got.shape[1:])
        return (
            got.index_select(0, at[:, :4].reshape(-1)).view(shape),
            got.index_select(0, at[:, 1:].reshape(-1)).view(shape),
        )

    # Sanity: every layout rebuilds the same transitions.
    check = np.arange(0, rows, 97)
    expected = stacked(check)
    for read in (from_next_row, from_frames, from_packed):
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
        "single frames, 8 to a row": (from_packed, _disk_bytes(work / "packed")),
    }


def measure(game: str, rows: int, rounds: int, write_rounds: int, work: Path) -> dict[str, Any]:
    frames, _ = run.atari_episode_frames(game, rows, seed=0)
    written = writes(frames, work, write_rounds)
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
    results: dict[str, Any] = {
        name: {
            "median_ms": statistics.median(times[name]) * 1e3,
            "disk_bytes": disk,
            "raw_over_disk": raw / disk,
        }
        for name, (_, disk) in candidates.items()
    }
    for name, seconds in written.items():
        # Throughput in GB of transitions (obs and next/obs) per second, as run.py's extend.
        results.setdefault(name, {})["write_gb_per_s"] = raw / statistics.median(seconds) / 1e9
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", default="pong,mspacman")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--write-rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "dedup.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for game in args.games.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            results[game] = measure(game, args.rows, args.rounds, args.write_rounds, Path(tmp))
    print("| layout: rebuild median ms, disk; durable write GB/s | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for name in next(iter(results.values())):
        cells = []
        for r in results.values():
            read = ""
            if "median_ms" in r[name]:
                read = f"{r[name]['median_ms']:.1f} ms, 1/{r[name]['raw_over_disk']:.0f}; "
            cells.append(f"{read}{r[name]['write_gb_per_s']:.2f} GB/s")
        print(f"| {name} | " + " | ".join(cells) + " |")
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
