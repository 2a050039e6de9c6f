"""PrioritizedSampler state at 1M capacity: zarr_rb.save/load vs. TorchRL's dumps/loads.

Both run in one process on the same buffer (1M capacity, every priority set). zarr_rb's
figures cover the whole buffer save (sampler, writer, generator; the data rows are
already on disk) and the whole buffer load; TorchRL's cover the sampler alone.

    python benchmarks/prioritized_state.py --capacity 1000000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.data import PrioritizedSampler, TensorDictPrioritizedReplayBuffer

import zarr_rb


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.capacity
    with tempfile.TemporaryDirectory() as tmp:
        storage = zarr_rb.ZarrStorage(n, Path(tmp) / "rb.zarr")
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=256)
        rb.extend(TensorDict({"x": torch.zeros(n, dtype=torch.uint8)}, batch_size=[n]))
        rb.update_priority(torch.arange(n), torch.rand(n) + 0.01)

        def touch_and_save() -> None:
            # A training step's worth of priority updates between two saves.
            rb.update_priority(torch.randint(0, n, (256,)), torch.rand(256) + 0.01)
            zarr_rb.save(rb)

        first_save = timed(lambda: zarr_rb.save(rb), 1)
        saves = timed(touch_and_save, args.repeats)
        loads = timed(lambda: zarr_rb.load(storage.path), args.repeats)

        sampler: PrioritizedSampler = rb.sampler
        torchrl_dir = Path(tmp) / "torchrl"
        torchrl_dumps = timed(lambda: sampler.dumps(torchrl_dir), max(1, args.repeats // 2))
        # A fresh sampler each time: TorchRL's loads fails when called twice on one sampler.
        samplers = [PrioritizedSampler(n, 0.7, 0.5) for _ in range(max(1, args.repeats // 2))]
        torchrl_loads = timed(lambda: samplers.pop().loads(torchrl_dir), len(samplers))

    med = statistics.median
    print(f"capacity={n}")
    print("| operation | median s |")
    print("|---|---|")
    print(f"| zarr_rb.save, first (whole buffer state) | {first_save[0]:.3f} |")
    print(f"| zarr_rb.save, after 256 priority updates | {med(saves):.3f} |")
    print(f"| zarr_rb.load (whole buffer) | {med(loads):.3f} |")
    print(f"| TorchRL PrioritizedSampler.dumps | {med(torchrl_dumps):.3f} |")
    print(f"| TorchRL PrioritizedSampler.loads | {med(torchrl_loads):.3f} |")


if __name__ == "__main__":
    main()
