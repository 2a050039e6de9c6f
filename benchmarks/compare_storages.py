"""Extend throughput and sample(256) latency: ZarrStorage vs. TorchRL's LazyMemmapStorage.

Runs both storages in one process on the same data: real ALE Pong frames (84x84
grayscale, 4-frame stacks, obs and next/obs) collected with a random policy, or
random uint8 frames with ``--random`` (incompressible).

    python benchmarks/compare_storages.py --rows 8192
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, RandomSampler, TensorDictReplayBuffer

from zarr_rb import ZarrStorage


def pong_frames(rows: int, seed: int) -> torch.Tensor:
    """``rows + 1`` stacked Pong observations from a random policy."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    env = gym.wrappers.FrameStackObservation(env, 4)
    obs, _ = env.reset(seed=seed)
    frames = np.empty((rows + 1, 4, 84, 84), dtype=np.uint8)
    frames[0] = obs
    rng = np.random.default_rng(seed)
    for i in range(1, rows + 1):
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            obs, _ = env.reset()
        frames[i] = obs
    return torch.from_numpy(frames)


def make_data(frames: torch.Tensor) -> TensorDict:
    n = frames.shape[0] - 1
    return TensorDict(
        {
            "observation": frames[:-1],
            "action": torch.randint(0, 6, (n,)),
            "next": {
                "observation": frames[1:],
                "reward": torch.zeros(n, 1),
                "done": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        batch_size=[n],
    )


def measure(name: str, storage, data: TensorDict, batch: int, samples: int) -> dict[str, float]:
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=256)
    n = data.shape[0]
    start = time.perf_counter()
    for i in range(0, n, batch):
        rb.extend(data[i : i + batch])
    if hasattr(storage, "flush"):
        storage.flush()
    extend_s = time.perf_counter() - start
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        rb.sample()
        times.append(time.perf_counter() - t0)
    raw = data.bytes()
    return {
        "name": name,
        "extend_gbps": raw / extend_s / 1e9,
        "sample_ms_median": statistics.median(times) * 1e3,
        "sample_ms_p95": sorted(times)[int(0.95 * len(times)) - 1] * 1e3,
        "raw_gb": raw / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--random", action="store_true", help="incompressible random frames")
    args = parser.parse_args()
    if args.random:
        frames = torch.randint(0, 256, (args.rows + 1, 4, 84, 84), dtype=torch.uint8)
    else:
        frames = pong_frames(args.rows, seed=0)
    data = make_data(frames)
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for name, storage in (
            ("LazyMemmapStorage", LazyMemmapStorage(args.rows, scratch_dir=Path(tmp) / "mm")),
            ("ZarrStorage", ZarrStorage(args.rows, Path(tmp) / "rb.zarr")),
        ):
            results.append(measure(name, storage, data, batch=1024, samples=args.samples))
            if isinstance(storage, ZarrStorage):
                results[-1]["disk_gb"] = storage.nbytes_on_disk() / 1e9
                storage.close()
        mm, zr = results
        print(
            f"rows={args.rows} data={'random' if args.random else 'pong'} raw={mm['raw_gb']:.2f} GB"
        )
        print("| storage | extend GB/s | sample(256) median ms | p95 ms |")
        print("|---|---|---|---|")
        for r in results:
            print(
                f"| {r['name']} | {r['extend_gbps']:.2f} | {r['sample_ms_median']:.1f} "
                f"| {r['sample_ms_p95']:.1f} |"
            )
        print(
            f"ratios zarr/memmap: extend {zr['extend_gbps'] / mm['extend_gbps']:.2f}x, "
            f"sample {zr['sample_ms_median'] / mm['sample_ms_median']:.2f}x; "
            f"zarr on disk {zr['disk_gb']:.3f} GB ({mm['raw_gb'] / zr['disk_gb']:.0f}x smaller)"
        )


if __name__ == "__main__":
    main()
