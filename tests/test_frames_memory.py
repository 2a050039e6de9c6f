"""The RAM tier's memory, measured in a child process: the pages its frames hold against
LazyTensorStorage's for the same rows, and the budget it is given."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap"
)

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from zarr_rb import ZarrStorage

    sys.path.insert(0, sys.argv[5])  # the tests
    from test_storage import resident_bytes as resident

    where, rows, ram_bytes, shared = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ram_bytes = ram_bytes if ram_bytes == "auto" else int(ram_bytes)
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 255, (rows + 4, 84, 84), dtype=torch.uint8, generator=g)
    if shared == "yes":  # an episode: each stack shifts by one frame
        obs = torch.stack([frames[t : t + 4] for t in range(rows)])
        nxt = torch.stack([frames[t + 1 : t + 5] for t in range(rows)])
    else:  # rows that share nothing
        obs = torch.randint(0, 255, (rows, 4, 84, 84), dtype=torch.uint8, generator=g)
        nxt = torch.randint(0, 255, (rows, 4, 84, 84), dtype=torch.uint8, generator=g)
    data = TensorDict({"obs": obs, "next": {"obs": nxt}}, [rows])
    zarr = ZarrStorage(rows, where, ram_bytes=ram_bytes)
    twin = LazyTensorStorage(rows)
    for rb in (TensorDictReplayBuffer(storage=zarr), TensorDictReplayBuffer(storage=twin)):
        for start in range(0, rows, 400):
            rb.extend(data[start : start + 400])
    tier = zarr._store.ram.frames
    pools = [pool.frames for pool in tier._pools.values()]
    ids = list(tier._ids.values())
    theirs = sum(resident(t) for t in twin._storage.values(True, True))
    print(json.dumps({
        "tier_pages": sum(resident(p) for p in pools)
        + sum(resident(torch.from_numpy(i)) for i in ids),
        "tier_nbytes": tier.nbytes,
        "lazy_tensor_pages": theirs,
        "resident_rows": int(tier.resident.sum()),
    }))
    zarr.close()
    """
)


def run_child(tmp_path: Path, rows: int, ram_bytes: str, shared: bool) -> dict[str, int]:
    arguments = [str(tmp_path / "rb.zarr"), str(rows), ram_bytes, "yes" if shared else "no"]
    arguments.append(str(Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *arguments],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_frames_of_an_episode_take_under_a_quarter_of_lazy_tensor_storage(tmp_path):
    """By default, 2,000 transitions of 4-frame stacks: the tier's pages (frames and ids)
    against the pages of LazyTensorStorage's tensors for the same rows."""
    got = run_child(tmp_path, 2000, "auto", shared=True)
    assert got["resident_rows"] == 2000
    assert got["tier_pages"] <= got["lazy_tensor_pages"] / 4, got


def test_the_budget_bounds_the_pages_of_the_tier(tmp_path):
    """Rows that share no frame, 8 frames each, in a budget of 8 MiB: the tier holds the
    newest rows that fit and never more pages than the budget."""
    budget = 8 * 2**20
    got = run_child(tmp_path, 2000, str(budget), shared=False)
    assert 0 < got["resident_rows"] < 2000
    assert got["tier_nbytes"] <= budget
    # Pages round up each of the tier's three mappings (frames, ids of obs and of next).
    assert got["tier_pages"] <= budget + 3 * 4096, got
