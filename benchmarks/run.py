"""zarr_rb against TorchRL's storages, side by side, on real Atari frames.

One command runs every part on the same data and prints every table of the
documentation's Performance page, ``docs/performance.md`` (``--parts`` picks some)::

    python benchmarks/run.py                       # every part: about 5 minutes on 2 cores
    python benchmarks/run.py --parts datasets --scale 4   # four times the rows
    python benchmarks/run.py --parts beyond-ram --memory-limit 2G   # only the cgroup rows
    python benchmarks/run.py --out-of-core --rows 1000000   # ZarrStorage far beyond RAM

Parts: ``beyond-ram`` (ZarrStorage and LazyMemmapStorage, each in a child process in a
memory cgroup, on a buffer bigger than the limit: :mod:`beyond_ram`), ``datasets`` (every
storage in this process, in RAM: ``ZarrStorage``, by default (its rows in RAM, each frame
once) and with ``ram_bytes=0`` (every row decoded from the store), TorchRL's
``LazyMemmapStorage`` and ``LazyTensorStorage``, and tensordict's own Zarr backend,
``TensorDict.to_zarr``, as the naive Zarr reference; saving and loading on Pong),
``prefetch`` (a training loop with a simulated 10 ms learner step, with and without
TorchRL's ``prefetch``), ``prioritized`` (a PrioritizedSampler's state) and ``capacity``
(commits of a store of 1M and of 100M rows holding few: :mod:`capacity`). Data: real ALE
frames (Pong, Breakout, and the busier screens of Ms. Pac-Man and Space Invaders; 84x84
grayscale, 4-frame stacks; obs and next/obs, action, reward, done, episode ids) generated
with a seeded random policy and cached under ``benchmarks/.cache``, plus random uint8 frames
that no codec can compress. Figures are medians and 95th percentiles; the same figures are
written as JSON (``--json``). The storages of a dataset are measured in turn, so that the
machine's noise falls on all of them alike: each is filled afresh three times
(``--extend-rounds``), then their sample() calls alternate.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import beyond_ram  # next to this file: on the path when run as a script
import capacity
import numpy as np
import torch
from _memory import peak_rss_bytes
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    SliceSampler,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import zarr_rb

CACHE = Path(__file__).parent / ".cache"
GAMES = {
    "pong": "ALE/Pong-v5",
    "breakout": "ALE/Breakout-v5",
    # Busier screens: more moving sprites, a maze, rows of invaders.
    "mspacman": "ALE/MsPacman-v5",
    "spaceinvaders": "ALE/SpaceInvaders-v5",
}
PARTS = ("beyond-ram", "datasets", "prefetch", "prioritized", "capacity")
BATCH = 1024
SAMPLE = 256
SLICE_LEN = 32
LEARNER_STEP_S = 0.010
"""The simulated learner step of the prefetch rows."""
POOL_ROWS = 16_384
"""Distinct Pong transitions cycled through by the out-of-core run."""


# --- data ------------------------------------------------------------------------------------


def atari_episode_frames(game: str, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows + 1`` stacked frames and the episode id of each, cached on disk."""
    path = CACHE / f"{game}-{rows}-{seed}.npz"
    if path.exists():
        cached = np.load(path)
        return cached["frames"], cached["episodes"]
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make(GAMES[game], frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    env = gym.wrappers.FrameStackObservation(env, 4)
    rng = np.random.default_rng(seed)
    frames = np.empty((rows + 1, 4, 84, 84), dtype=np.uint8)
    episodes = np.zeros(rows + 1, dtype=np.int64)
    obs, _ = env.reset(seed=seed)
    frames[0], episode = obs, 0
    for i in range(1, rows + 1):
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            obs, _ = env.reset()
            episode += 1
        frames[i], episodes[i] = obs, episode
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(path, frames=frames, episodes=episodes)
    return frames, episodes


def dataset(name: str, rows: int) -> TensorDict:
    if name == "random":
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 256, (rows + 1, 4, 84, 84), dtype=np.uint8)
        episodes = np.arange(rows + 1) // 500
    else:
        frames, episodes = atari_episode_frames(name, rows, seed=0)
    frames_t = torch.from_numpy(frames)
    episode = torch.from_numpy(episodes[:-1])
    done = torch.from_numpy(episodes[1:] != episodes[:-1]).unsqueeze(-1)
    return TensorDict(
        {
            "observation": frames_t[:-1],
            "action": torch.randint(0, 6, (rows,), generator=torch.Generator().manual_seed(0)),
            "episode": episode,
            "next": {
                "observation": frames_t[1:],
                "reward": torch.zeros(rows, 1),
                "done": done,
            },
        },
        batch_size=[rows],
    )


# --- measuring -------------------------------------------------------------------------------


def timings(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median_p95(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p95_ms": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3,
    }


def torch_gather(rows: int, repeats: int) -> dict[str, float]:
    """A batch of 256 Pong-sized stacks gathered from a tensor in RAM, as TorchRL's storages
    gather (``tensor[index]``) and with ``index_select``: the two differ by several times on
    some CPUs, and every in-RAM figure of TorchRL's storages follows the first."""
    frames = torch.zeros((rows, 4, 84, 84), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    indexes = [torch.randint(0, rows, (SAMPLE,), generator=g) for _ in range(repeats)]

    def median_ms(gather: Callable[[torch.Tensor], torch.Tensor]) -> float:
        batches = iter(indexes)
        return median_p95(timings(lambda: gather(next(batches)), repeats))["median_ms"]

    return {
        "indexing_ms": median_ms(lambda index: frames[index]),
        "index_select_ms": median_ms(lambda index: frames.index_select(0, index)),
    }


def cpu_model() -> str:
    """The CPU's name, as the kernel reports it (``platform.processor()`` is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def peak_rss_gb() -> float:
    return peak_rss_bytes() / 1e9


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


DECODING = "ZarrStorage, ram_bytes=0"
"""ZarrStorage keeping only its small entries in RAM: every frame is decoded from the store."""


def make_storage(
    kind: str,
    rows: int,
    where: Path,
    compression: zarr_rb.Compression | None = None,
    ram_bytes: int | str = "auto",
) -> Any:
    if kind in ("ZarrStorage", DECODING):
        return zarr_rb.ZarrStorage(
            rows, where / "rb.zarr", compression=compression, ram_bytes=ram_bytes
        )
    if kind == "LazyMemmapStorage":
        return LazyMemmapStorage(rows, scratch_dir=where / "memmap")
    return LazyTensorStorage(rows)


EXTEND_ROUNDS = 3
"""Fresh fills of each storage per dataset by default, interleaved: the extend figure is
their median (``--extend-rounds``)."""

TORCHRL_KINDS = ("ZarrStorage", DECODING, "LazyMemmapStorage", "LazyTensorStorage")


def fill(
    kind: str,
    data: TensorDict,
    where: Path,
    compression: zarr_rb.Compression | None = None,
) -> tuple[Any, float]:
    """A new storage of ``kind`` in ``where`` filled with ``data`` by a buffer's ``extend``
    (batches of :data:`BATCH`, then a flush: the rows are committed), and the seconds it
    took."""
    rows = data.shape[0]
    ram_bytes = 0 if kind == DECODING else "auto"
    storage = make_storage(kind, rows, where, compression, ram_bytes=ram_bytes)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=SAMPLE)
    start = time.perf_counter()
    for begin in range(0, rows, BATCH):
        rb.extend(data[begin : begin + BATCH])
    if isinstance(storage, zarr_rb.ZarrStorage):
        storage.flush()
    return storage, time.perf_counter() - start


def bench_torchrl_storages(
    data: TensorDict,
    work: Path,
    samples: int,
    compression: zarr_rb.Compression | None = None,
    rounds: int = EXTEND_ROUNDS,
) -> dict[str, dict[str, Any]]:
    """Every storage of :data:`TORCHRL_KINDS` on ``data``, measured in turn so that the
    machine's noise falls on all of them alike: ``rounds`` fills of each (interleaved, in a
    rotating order), then sample() calls taking turns among the last fills."""
    raw = data.bytes()
    extend_s: dict[str, list[float]] = {kind: [] for kind in TORCHRL_KINDS}
    storages: dict[str, Any] = {}
    for round_ in range(rounds):
        turn = round_ % len(TORCHRL_KINDS)
        for kind in TORCHRL_KINDS[turn:] + TORCHRL_KINDS[:turn]:
            where = work / f"{kind}-{round_}"
            where.mkdir()
            storage, seconds = fill(kind, data, where, compression)
            extend_s[kind].append(seconds)
            previous = storages.pop(kind, None)
            if previous is not None:
                drop(previous)
            storages[kind] = (storage, where)
    sampled: dict[str, dict[str, list[float]]] = {}
    for name, sampler in (
        ("sample_random", RandomSampler),
        (
            "sample_slices",
            lambda: SliceSampler(slice_len=SLICE_LEN, traj_key="episode", strict_length=False),
        ),
    ):
        buffers = {
            kind: TensorDictReplayBuffer(storage=storage, sampler=sampler(), batch_size=SAMPLE)
            for kind, (storage, _) in storages.items()
        }
        sampled[name] = {kind: [] for kind in TORCHRL_KINDS}
        for _ in range(samples):
            for kind, rb in buffers.items():
                sampled[name][kind] += timings(rb.sample, 1)
    out = {}
    for kind in TORCHRL_KINDS:
        storage, where = storages[kind]
        seconds = statistics.median(extend_s[kind])
        out[kind] = {
            "extend_gbps": raw / seconds / 1e9,
            "extend_s": extend_s[kind],
            "sample_random": median_p95(sampled["sample_random"][kind]),
            "sample_slices": median_p95(sampled["sample_slices"][kind]),
            "raw_bytes": raw,
            "disk_bytes": None if kind == "LazyTensorStorage" else disk_bytes(where),
        }
        drop((storage, where))
    return out


def drop(entry: tuple[Any, Path]) -> None:
    """Close a storage and delete its files."""
    storage, where = entry
    if isinstance(storage, zarr_rb.ZarrStorage):
        storage.close()
    gc.collect()
    shutil.rmtree(where)


def bench_tensordict_zarr(data: TensorDict, where: Path, samples: int) -> dict[str, Any]:
    """tensordict's own Zarr backend: one uncompressed chunk per leaf, zarr-python I/O.

    It has no append, so "extend" is its best case: one bulk ``to_zarr`` of all rows.
    """
    rows = data.shape[0]
    path = where / "td.zarr"
    start = time.perf_counter()
    ptd = data.to_zarr(path)
    extend_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)

    def sample() -> None:
        index = torch.randint(0, rows, (SAMPLE,), generator=g).sort().values
        ptd[index].to_tensordict()

    random = timings(sample, max(3, samples // 10))
    result = {
        "extend_gbps": data.bytes() / extend_s / 1e9,
        "sample_random": median_p95(random),
        "sample_slices": None,
        "raw_bytes": data.bytes(),
        "disk_bytes": disk_bytes(path),
    }
    ptd.close()
    return result


def bench_save_load(data: TensorDict, where: Path) -> dict[str, Any]:
    """In-place save and load at two buffer sizes, zarr_rb against LazyMemmapStorage."""
    out: dict[str, Any] = {}
    for rows in (data.shape[0] // 4, data.shape[0]):
        part = data[:rows]
        zdir, mdir = where / f"z{rows}", where / f"m{rows}"
        zdir.mkdir()
        mdir.mkdir()
        zrb = TensorDictReplayBuffer(
            storage=zarr_rb.ZarrStorage(rows, zdir / "rb.zarr"), batch_size=SAMPLE
        )
        mrb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(rows, scratch_dir=mdir / "scratch"), batch_size=SAMPLE
        )
        for rb in (zrb, mrb):
            for start in range(0, rows, BATCH):
                rb.extend(part[start : start + BATCH])
        zrb.extend(part[:7])  # a few rows still in RAM, as during training
        zsave = timings(lambda rb=zrb: zarr_rb.save(rb), 3)
        zdumps = timings(lambda rb=zrb, d=zdir: rb.dumps(d / "rb.zarr"), 3)
        zrb.storage.close()  # one writer per store: loading below opens it again

        def zarr_load(d: Path = zdir) -> None:
            zarr_rb.load(d / "rb.zarr").storage.close()

        zload = timings(zarr_load, 3)

        def zarr_loads(d: Path = zdir, n: int = rows) -> None:
            storage = zarr_rb.ZarrStorage(n, d / "rb.zarr")
            TensorDictReplayBuffer(storage=storage, batch_size=SAMPLE).loads(d / "rb.zarr")
            storage.close()

        zloads = timings(zarr_loads, 3)
        msave = timings(lambda rb=mrb, d=mdir: rb.dumps(d / "dump"), 1)

        def memmap_load(d: Path = mdir, n: int = rows) -> None:
            TensorDictReplayBuffer(
                storage=LazyMemmapStorage(n, scratch_dir=d / "load"), batch_size=SAMPLE
            ).loads(d / "dump")

        mload = timings(memmap_load, 1)
        out[str(rows)] = {
            "raw_gb": part.bytes() / 1e9,
            "zarr_save_s": statistics.median(zsave),
            "zarr_load_s": statistics.median(zload),
            "zarr_rb_dumps_s": statistics.median(zdumps),
            "zarr_rb_loads_s": statistics.median(zloads),
            "memmap_dumps_s": msave[0],
            "memmap_loads_s": mload[0],
        }
    return out


def bench_prefetch(data: TensorDict, where: Path, steps: int) -> dict[str, Any]:
    """A training loop (sample, then a simulated 10 ms learner step) with and without
    TorchRL's ``prefetch``: batches per second, and how long each ``sample()`` waited."""
    out: dict[str, Any] = {}
    rows = data.shape[0]
    for kind in ("ZarrStorage", "LazyMemmapStorage"):
        storage = make_storage(kind, rows, where / kind)
        for start in range(0, rows, BATCH):
            storage.set(torch.arange(start, min(start + BATCH, rows)), data[start : start + BATCH])
        for prefetch in (None, 4):
            rb = TensorDictReplayBuffer(storage=storage, batch_size=SAMPLE, prefetch=prefetch)
            for _ in range(5):
                rb.sample()
            waits = []
            start = time.perf_counter()
            for _ in range(steps):
                began = time.perf_counter()
                rb.sample()
                waits.append(time.perf_counter() - began)
                time.sleep(LEARNER_STEP_S)
            elapsed = time.perf_counter() - start
            out[f"{kind} prefetch={prefetch or 0}"] = {
                "batches_per_s": steps / elapsed,
                "sample_wait": median_p95(waits),
            }
        if isinstance(storage, zarr_rb.ZarrStorage):
            storage.close()
    return out


def bench_prioritized(capacity: int, where: Path) -> dict[str, float]:
    storage = zarr_rb.ZarrStorage(capacity, where / "prio.zarr")
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=256)
    rb.extend(TensorDict({"x": torch.zeros(capacity, dtype=torch.uint8)}, [capacity]))
    rb.update_priority(torch.arange(capacity), torch.rand(capacity) + 0.01)
    zarr_rb.save(rb)

    def touch_and_save() -> None:
        rb.update_priority(torch.randint(0, capacity, (256,)), torch.rand(256) + 0.01)
        zarr_rb.save(rb)

    saves = timings(touch_and_save, 3)
    storage.close()  # one writer per store: loading below opens it again
    loads = timings(lambda: zarr_rb.load(storage.path).storage.close(), 3)
    sampler: PrioritizedSampler = rb.sampler
    dumps = timings(lambda: sampler.dumps(where / "prio-torchrl"), 1)
    fresh = PrioritizedSampler(capacity, 0.7, 0.5)
    loads_t = timings(lambda: fresh.loads(where / "prio-torchrl"), 1)
    storage.close()
    return {
        "zarr_save_s": statistics.median(saves),
        "zarr_load_s": statistics.median(loads),
        "torchrl_dumps_s": dumps[0],
        "torchrl_loads_s": loads_t[0],
    }


def out_of_core(rows: int, samples: int, where: Path) -> dict[str, Any]:
    """Fill a ZarrStorage far beyond RAM with cycled Pong frames, then sample from it."""
    pool = dataset("pong", POOL_ROWS)
    storage = zarr_rb.ZarrStorage(rows, where / "big.zarr")
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=SAMPLE)
    start = time.perf_counter()
    for begin in range(0, rows, min(BATCH, pool.shape[0])):
        size = min(BATCH, rows - begin, pool.shape[0])
        offset = begin % (pool.shape[0] - size + 1)
        batch = pool[offset : offset + size].clone()
        batch["episode"] += begin  # distinct episodes across cycles
        rb.extend(batch)
    storage.flush()
    fill_s = time.perf_counter() - start
    sample_times = timings(rb.sample, samples)
    raw = storage.nbytes_raw()
    disk = storage.nbytes_on_disk()
    storage.close()
    return {
        "rows": rows,
        "raw_gb": raw / 1e9,
        "disk_gb": disk / 1e9,
        "fill_s": fill_s,
        "fill_gbps": raw / fill_s / 1e9,
        "sample_random": median_p95(sample_times),
        "peak_rss_gb": peak_rss_gb(),
    }


# --- report ----------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratios_to_memmap(per_storage: dict[str, Any], zarr: str = "ZarrStorage") -> dict[str, float]:
    """ZarrStorage's figures (those of the storage named ``zarr``) divided by
    LazyMemmapStorage's, measured in the same run."""
    z, m = per_storage[zarr], per_storage["LazyMemmapStorage"]
    return {
        "extend": z["extend_gbps"] / m["extend_gbps"],
        "sample_random": z["sample_random"]["median_ms"] / m["sample_random"]["median_ms"],
        "sample_slices": z["sample_slices"]["median_ms"] / m["sample_slices"]["median_ms"],
        "disk": z["disk_bytes"] / m["disk_bytes"],
    }


def report(results: dict[str, Any]) -> str:
    lines = [f"machine: {results['machine']}", ""]
    if "beyond_ram" in results:
        lines += beyond_ram.report(results["beyond_ram"])
    if "torch_gather" in results:
        g = results["torch_gather"]
        lines += [
            "torch on this machine, 256 stacks of 4x84x84 bytes from a tensor in RAM: "
            f"tensor[index] {g['indexing_ms']:.1f} ms, index_select {g['index_select_ms']:.1f} ms",
            "",
        ]
    for name, per_storage in results.get("datasets", {}).items():
        lines += [
            f"### {name} ({results['rows']} transitions, "
            f"{per_storage['ZarrStorage']['raw_bytes'] / 1e9:.2f} GB raw)",
            "",
            "| storage | extend GB/s | sample random median / p95 ms "
            "| sample slices median / p95 ms | disk MB |",
            "|---|---|---|---|---|",
        ]
        for storage, r in per_storage.items():
            slices = r["sample_slices"]
            lines.append(
                f"| {storage} | {fmt(r['extend_gbps'])} "
                f"| {fmt(r['sample_random']['median_ms'], 1)} / "
                f"{fmt(r['sample_random']['p95_ms'], 1)} "
                f"| {fmt(slices and slices['median_ms'], 1)} / "
                f"{fmt(slices and slices['p95_ms'], 1)} "
                f"| {fmt(r['disk_bytes'] and r['disk_bytes'] / 1e6, 1)} |"
            )
        lines.append("")
        for zarr in ("ZarrStorage", DECODING):
            ratios = ratios_to_memmap(per_storage, zarr)
            lines.append(
                f"{zarr} / LazyMemmapStorage: "
                f"extend {ratios['extend']:.2f}x, sample random {ratios['sample_random']:.2f}x, "
                f"sample slices {ratios['sample_slices']:.2f}x, disk 1/{1 / ratios['disk']:.0f}"
            )
        lines.append("")
    if "save_load" in results:
        lines += [
            "### save in place and load (pong)",
            "",
            "| rows | raw GB | zarr_rb.save s | zarr_rb.load s | Zarr rb.dumps s | Zarr rb.loads s "
            "| LazyMemmap rb.dumps s | LazyMemmap rb.loads s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for rows, r in results["save_load"].items():
            lines.append(
                f"| {rows} | {r['raw_gb']:.2f} | {r['zarr_save_s']:.3f} | {r['zarr_load_s']:.3f} "
                f"| {r['zarr_rb_dumps_s']:.3f} | {r['zarr_rb_loads_s']:.3f} "
                f"| {r['memmap_dumps_s']:.3f} | {r['memmap_loads_s']:.3f} |"
            )
        lines.append("")
    if "prioritized" in results:
        p = results["prioritized"]
        lines += [
            f"### PrioritizedSampler state, capacity {results['prioritized_capacity']}",
            "",
            "| zarr_rb.save s | zarr_rb.load s | TorchRL dumps s | TorchRL loads s |",
            "|---|---|---|---|",
            f"| {p['zarr_save_s']:.3f} | {p['zarr_load_s']:.3f} "
            f"| {p['torchrl_dumps_s']:.3f} | {p['torchrl_loads_s']:.3f} |",
            "",
        ]
    if "prefetch" in results:
        lines += [
            f"### prefetch: sample(256) then a {LEARNER_STEP_S * 1e3:.0f} ms step (pong)",
            "",
            "| storage | batches/s | sample() wait median / p95 ms |",
            "|---|---|---|",
        ]
        for name, r in results["prefetch"].items():
            wait = r["sample_wait"]
            lines.append(
                f"| {name} | {r['batches_per_s']:.1f} "
                f"| {wait['median_ms']:.1f} / {wait['p95_ms']:.1f} |"
            )
        lines.append("")
    if "capacity" in results:
        lines += capacity.report(results["capacity"])
    if "out_of_core" in results:
        o = results["out_of_core"]
        lines += [
            "### out of core (ZarrStorage only)",
            "",
            f"{o['rows']} Pong transitions, {o['raw_gb']:.1f} GB raw, {o['disk_gb']:.2f} GB on "
            f"disk; filled in {o['fill_s']:.0f} s ({o['fill_gbps']:.2f} GB/s); sample(256) "
            f"median {o['sample_random']['median_ms']:.1f} ms, p95 "
            f"{o['sample_random']['p95_ms']:.1f} ms; peak RSS {o['peak_rss_gb']:.2f} GB",
            "",
        ]
    lines.append(f"peak RSS of the benchmark process: {results['peak_rss_gb']:.2f} GB")
    return "\n".join(lines)


def bench_dataset(
    name: str,
    rows: int,
    samples: int,
    work: Path,
    results: dict[str, Any],
    compression: zarr_rb.Compression | None = None,
    rounds: int = EXTEND_ROUNDS,
) -> None:
    """Every storage on one dataset (and saving and loading, on Pong)."""
    data = dataset(name, rows)
    where = work / name
    where.mkdir()
    per_storage = bench_torchrl_storages(data, where, samples, compression, rounds)
    shutil.rmtree(where)
    where = work / f"{name}-tdzarr"
    where.mkdir()
    per_storage["TensorDict.to_zarr"] = bench_tensordict_zarr(data, where, samples)
    shutil.rmtree(where)
    results["datasets"][name] = per_storage
    results.setdefault("ratios_to_memmap", {})[name] = ratios_to_memmap(per_storage)
    results.setdefault("ratios_to_memmap_ram_bytes_0", {})[name] = ratios_to_memmap(
        per_storage, DECODING
    )
    if name == "pong":
        where = work / "save-load"
        where.mkdir()
        results["save_load"] = bench_save_load(data, where)
        shutil.rmtree(where)
    del data
    gc.collect()


FRAMES_SETTINGS = {"auto": None, "on": True, "off": False}
"""``--frames``: ZarrStorage's ``Compression(frames=...)``."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="transitions per dataset")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply --rows")
    parser.add_argument("--samples", type=int, default=60, help="sample() calls per measurement")
    parser.add_argument("--datasets", default="pong,breakout,mspacman,spaceinvaders,random")
    parser.add_argument(
        "--extend-rounds",
        type=int,
        default=EXTEND_ROUNDS,
        help="datasets: fresh fills of each storage (the extend figure is their median)",
    )
    parser.add_argument("--prioritized-capacity", type=int, default=1_000_000)
    parser.add_argument(
        "--capacities",
        default="1000000,100000000",
        help="max_size values for the commit-at-any-capacity rows ('' to skip them)",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"what to run, of {','.join(PARTS)} (all by default)",
    )
    parser.add_argument(
        "--memory-limit",
        type=beyond_ram.parse_bytes,
        default="2G",
        help="beyond-ram: the memory cgroup each storage runs in (2G, 512M)",
    )
    parser.add_argument(
        "--times-limit", type=float, default=2.5, help="beyond-ram: raw buffer size / limit"
    )
    parser.add_argument("--codec", choices=["zstd", "lz4", "none"], default=None)
    parser.add_argument("--level", type=int, default=None, help="the codec's level")
    parser.add_argument("--chunk-rows", type=int, default=None, help="rows per inner chunk")
    parser.add_argument(
        "--frames",
        choices=list(FRAMES_SETTINGS),
        default="auto",
        help="ZarrStorage's Compression(frames=...): auto (None, the default), on, off",
    )
    parser.add_argument("--out-of-core", action="store_true", help="only the out-of-core run")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results.json"))
    parser.add_argument("--workdir", type=Path, default=None, help="where stores are written")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(",")) - {""}
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")
    rows = int(args.rows * args.scale)
    settings = {
        "codec": args.codec,
        "level": args.level,
        "chunk_rows": args.chunk_rows,
        "frames": FRAMES_SETTINGS[args.frames],
    }
    compression = zarr_rb.Compression(**{k: v for k, v in settings.items() if v is not None})
    results: dict[str, Any] = {
        "machine": f"{cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads",
        "rows": rows,
        "compression": compression.to_json(),
    }
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        if args.out_of_core:
            results["out_of_core"] = out_of_core(rows, args.samples, work)
            parts = set()
        if "beyond-ram" in parts:
            try:
                results["beyond_ram"] = beyond_ram.side_by_side(
                    args.memory_limit, args.times_limit, args.samples, work, compression
                )
            except beyond_ram.CgroupUnavailableError as err:
                print(f"beyond-ram skipped: {err}")
        if "datasets" in parts:
            results["torch_gather"] = torch_gather(rows, args.samples)
            results["datasets"] = {}
            for name in args.datasets.split(","):
                bench_dataset(
                    name, rows, args.samples, work, results, compression, args.extend_rounds
                )
        if "prefetch" in parts:
            where = work / "prefetch"
            where.mkdir()
            results["prefetch"] = bench_prefetch(dataset("pong", rows), where, args.samples)
            shutil.rmtree(where)
        if "prioritized" in parts:
            results["prioritized_capacity"] = args.prioritized_capacity
            results["prioritized"] = bench_prioritized(args.prioritized_capacity, work)
        if "capacity" in parts and args.capacities:
            capacities = [int(c) for c in args.capacities.split(",")]
            results["capacity"] = capacity.at_capacities(capacities, work)
    results["peak_rss_gb"] = peak_rss_gb()
    print(report(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
