"""ZarrStorage inside TorchRL replay buffers, unchanged.

Every test builds the same buffer twice, once on ``LazyTensorStorage`` (the reference) and
once on ``ZarrStorage``, drives both through the same operations with the same seeds, and
asserts that everything observable is identical: lengths, returned write indices, sampled
data, sample info (indices, priority weights), ``rb[idx]`` and ``storage[:]``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass, tensorclass
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.samplers import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
)
from torchrl.data.replay_buffers.storages import Storage
from torchrl.data.replay_buffers.writers import (
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictRoundRobinWriter,
)

import zarr_rb
from zarr_rb import Compression, ZarrStorage

MAX_SIZE = 64
BATCH = 8
OBS = 3
IMG = (2, 8, 8)
TRAJ_KEY = ("collector", "traj_ids")
DONE_KEY = ("next", "done")
REWARD_KEY = ("next", "reward")
# Store layouts. The default puts all 64 rows in one block, so rows mostly wait in RAM until
# the block is full; small blocks (and a sharded image leaf) mix rows on disk and in RAM.
LAYOUTS = {
    "one_block": None,
    "small_blocks": Compression(chunk_rows=2, block_rows=8, large_row_bytes=64),
    "tiny_blocks_raw": Compression(codec="none", chunk_rows=1, block_rows=3, large_row_bytes=1),
}
SMALL_BLOCKS = LAYOUTS["small_blocks"]
# Trajectory lengths cycled through by ``episodes`` (2..12 steps, some shorter than a slice).
LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11)


# --- data ------------------------------------------------------------------------------------


@tensorclass
class Step:
    obs: torch.Tensor
    img: torch.Tensor
    reward: torch.Tensor


def transitions(
    n: int, start: int = 0, lengths: Sequence[int] | None = None, *, last_done: bool = True
) -> TensorDict:
    """``n`` transitions with globally unique contents (step ``start + i`` in row ``i``).

    ``lengths`` splits them into trajectories (ids starting at ``start``); one trajectory
    by default. ``last_done=False`` leaves the last trajectory unfinished (a collector
    batch that stops mid-episode).
    """
    lengths = [n] if lengths is None else list(lengths)
    assert sum(lengths) == n
    step = torch.arange(start, start + n)
    gen = torch.Generator().manual_seed(start)
    pattern = torch.arange(IMG[0] * IMG[1] * IMG[2]).view(*IMG)
    traj = torch.repeat_interleave(
        torch.arange(start, start + len(lengths)), torch.tensor(lengths, dtype=torch.long)
    )
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[torch.tensor(list(accumulate(lengths))) - 1] = True
    done[-1] = last_done
    return TensorDict(
        {
            "obs": step[:, None].float() + torch.linspace(0.0, 0.5, OBS),
            "img": ((step[:, None, None, None] * 7 + pattern) % 256).to(torch.uint8),
            "action": step % 4,
            "episode": traj.clone(),
            TRAJ_KEY: traj,
            ("next", "obs"): step[:, None].float() + 1.0,
            REWARD_KEY: torch.randn(n, 1, generator=gen),
            DONE_KEY: done,
        },
        batch_size=[n],
    )


def episodes(count: int, start: int = 0, offset: int = 0, *, last_done: bool = True) -> TensorDict:
    """``count`` trajectories of varying length (``LENGTHS`` cycled from ``offset``)."""
    lengths = [LENGTHS[(offset + i) % len(LENGTHS)] for i in range(count)]
    return transitions(sum(lengths), start=start, lengths=lengths, last_done=last_done)


def content(kind: str, n: int, start: int = 0) -> Any:
    """``n`` rows of data of one kind: a bare tensor, a TensorDict or a tensorclass."""
    td = transitions(n, start)
    if kind == "tensor":
        return torch.cat([td["obs"], td["next", "obs"], td[REWARD_KEY]], dim=-1)
    if kind == "tensordict":
        return td
    assert kind == "tensorclass"
    return Step(obs=td["obs"], img=td["img"], reward=td[REWARD_KEY], batch_size=[n])


def vectorized(t: int, n_envs: int, start: int = 0) -> TensorDict:
    """Collector-shaped data: batch ``[n_envs, t]`` (time is dim 1)."""
    return transitions(t * n_envs, start).reshape(n_envs, t)


# --- comparisons -----------------------------------------------------------------------------


def _leaves(data: Any) -> dict[Any, torch.Tensor]:
    if is_tensorclass(data):
        data = data._tensordict
    return dict(data.items(include_nested=True, leaves_only=True))


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Exact equality of tensors, tensor collections and containers of them."""
    if is_tensor_collection(expected):
        assert is_tensor_collection(actual), f"{where}: got {type(actual).__name__}"
        assert is_tensorclass(actual) == is_tensorclass(expected), where
        if is_tensorclass(expected):
            assert type(actual) is type(expected), where
        assert actual.batch_size == expected.batch_size, where
        got, want = _leaves(actual), _leaves(expected)
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for key, value in want.items():
            assert_same(got[key], value, f"{where}[{key}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: got {type(actual).__name__}"
        assert not is_tensor_collection(actual), where
        torch.testing.assert_close(
            torch.as_tensor(actual).clone(), expected, rtol=0, atol=0, msg=where or None
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert sorted(actual) == sorted(expected), where
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def seed_all(seed: int) -> None:
    """Seed every RNG the samplers draw from (PrioritizedSampler uses NumPy's)."""
    torch.manual_seed(seed)
    np.random.seed(seed)


def clone(data: Any) -> Any:
    """A private copy: writers may add keys (``"index"``) to what they are handed."""
    return data.clone()


class Twin:
    """The same buffer on LazyTensorStorage (``ref``) and on ZarrStorage (``zarr``)."""

    def __init__(
        self,
        make: Callable[[Storage], ReplayBuffer],
        path: Path | None,
        *,
        max_size: int = MAX_SIZE,
        ndim: int = 1,
        compression: Compression | None = SMALL_BLOCKS,
    ) -> None:
        self.ref = make(LazyTensorStorage(max_size, ndim=ndim))
        self.zarr = make(ZarrStorage(max_size, path, ndim=ndim, compression=compression))

    @property
    def buffers(self) -> tuple[ReplayBuffer, ReplayBuffer]:
        return self.ref, self.zarr

    def both(self, op: Callable[[ReplayBuffer], Any], where: str) -> Any:
        """Run ``op`` on each buffer (the reference first) and check the results match."""
        expected = op(self.ref)
        actual = op(self.zarr)
        assert_same(actual, expected, where)
        return actual

    def extend(self, data: Any) -> Any:
        return self.both(lambda rb: rb.extend(clone(data)), "extend")

    def add(self, data: Any) -> Any:
        return self.both(lambda rb: rb.add(clone(data)), "add")

    def sample(self, seed: int, **kwargs: Any) -> Any:
        def op(rb: ReplayBuffer) -> Any:
            seed_all(seed)
            return rb.sample(**kwargs)

        return self.both(op, f"sample(seed={seed})")

    def check(self, flush: bool = False) -> None:
        """Same length and same stored rows (after writing every RAM-held row if ``flush``)."""
        if flush:
            self.zarr.storage.flush()
        assert len(self.zarr) == len(self.ref)
        assert len(self.zarr.storage) == len(self.ref.storage)
        if len(self.ref):
            assert_same(self.zarr.storage[:], self.ref.storage[:], "storage[:]")


def priorities(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 4 + 0.05


def _sampler(name: str, max_size: int = MAX_SIZE) -> Any:
    if name == "random":
        return RandomSampler()
    if name == "without_replacement":
        return SamplerWithoutReplacement()
    assert name == "prioritized"
    return PrioritizedSampler(max_size, alpha=0.7, beta=0.5)


SAMPLERS = ["random", "without_replacement", "prioritized"]


# --- ReplayBuffer: tensors, TensorDicts, tensorclasses ---------------------------------------


@pytest.mark.filterwarnings("ignore:Got conflicting batch_sizes")
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("kind", ["tensor", "tensordict", "tensorclass"])
def test_replay_buffer(tmp_path: Path, kind: str, sampler: str) -> None:
    twin = Twin(
        lambda s: ReplayBuffer(storage=s, sampler=_sampler(sampler), batch_size=BATCH),
        tmp_path / "rb.zarr",
    )
    twin.extend(content(kind, 40, start=0))
    for i in range(3):
        twin.add(content(kind, 1, start=100 + i)[0])
    twin.check()
    for seed in range(3):
        data, info = twin.sample(seed, return_info=True)
        if sampler == "prioritized":
            twin.both(
                lambda rb, info=info, seed=seed: rb.update_priority(
                    info["index"], priorities(BATCH, seed)
                ),
                "update_priority",
            )
    # wrap around: 43 + 50 > MAX_SIZE
    twin.extend(content(kind, 50, start=1000))
    twin.check()
    assert len(twin.zarr) == MAX_SIZE
    for seed in range(3, 6):
        data, info = twin.sample(seed, return_info=True)
    if kind == "tensor":
        assert data.shape == (BATCH, OBS + 2)
    for index in (5, -1, slice(3, 20, 2), [0, 63, 7, 7], torch.tensor([9, 2, 40])):
        twin.both(lambda rb, index=index: rb[index], f"rb[{index}]")
    twin.sample(99, batch_size=3)


# --- store layouts: rows in RAM, on disk, or both ------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "prioritized"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_workload(tmp_path: Path, layout: str, sampler: str) -> None:
    """Writes of random sizes (extend and add), flushes, samples and indexing, interleaved."""
    twin = Twin(
        lambda s: TensorDictReplayBuffer(storage=s, sampler=_sampler(sampler), batch_size=BATCH),
        tmp_path / "rb.zarr",
        compression=LAYOUTS[layout],
    )
    gen = torch.Generator().manual_seed(5)
    for step in range(10):
        n = int(torch.randint(1, 30, (), generator=gen))
        data = transitions(n, start=1000 * step)
        if step % 4 == 3:
            for i in range(min(n, 5)):
                twin.add(data[i])
        else:
            twin.extend(data)
        twin.check(flush=step % 5 == 4)
        batch = twin.sample(step)
        if sampler == "prioritized":
            twin.both(
                lambda rb, b=batch, s=step: rb.update_priority(b["index"], priorities(BATCH, s)),
                "update_priority",
            )
        index = torch.randint(len(twin.ref), (6,), generator=gen)
        twin.both(lambda rb, i=index: rb[i], f"rb[{index.tolist()}]")
    assert len(twin.zarr) == MAX_SIZE


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_extend_larger_than_capacity(tmp_path: Path, layout: str) -> None:
    """One extend of more rows than the capacity: the last write to a row wins."""
    twin = Twin(
        lambda s: TensorDictReplayBuffer(storage=s, batch_size=BATCH),
        tmp_path / "rb.zarr",
        compression=LAYOUTS[layout],
    )
    twin.extend(transitions(10))
    data = transitions(150, start=1000)
    twin.extend(data)  # rows 10.., wrapping twice; ends at row (10 + 150) % 64 = 32
    assert len(twin.zarr) == MAX_SIZE
    stored = twin.zarr.storage[:]
    # row r was last written by data element i with (10 + i) % 64 == r, i the largest such
    last = torch.tensor([max(i for i in range(150) if (10 + i) % MAX_SIZE == r) for r in range(64)])
    assert_same(stored.exclude("index"), data[last].exclude("index"), "storage[:]")
    # (The twin keeps the last write only on one torch thread: see conftest._one_torch_thread.)
    assert_same(twin.ref.storage[:].exclude("index"), data[last].exclude("index"), "reference")
    twin.check(flush=True)
    for seed in range(3):
        twin.sample(seed)


# --- TensorDictReplayBuffer x writers x samplers ---------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("writer", [RoundRobinWriter, TensorDictRoundRobinWriter])
def test_tensordict_replay_buffer(tmp_path: Path, writer: type, sampler: str) -> None:
    twin = Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s, sampler=_sampler(sampler), writer=writer(), batch_size=BATCH
        ),
        tmp_path / "rb.zarr",
    )
    twin.extend(transitions(30))
    twin.add(transitions(1, start=500)[0])
    twin.extend(transitions(25, start=600))
    twin.check()
    for seed in range(4):
        batch = twin.sample(seed)
        assert batch.batch_size == (BATCH,)
        if sampler == "prioritized":
            batch.set("td_error", priorities(BATCH, seed))
            twin.both(
                lambda rb, batch=batch: rb.update_tensordict_priority(batch.clone()),
                "update_tensordict_priority",
            )
    for start in (2000, 3000):  # two passes over the capacity
        twin.extend(transitions(45, start=start))
        twin.check()
        for seed in range(10, 13):
            twin.sample(seed + start)
    assert len(twin.zarr) == MAX_SIZE
    for index in (0, -3, slice(None, 10), [63, 0, 31], torch.tensor([[1, 2], [3, 4]])):
        twin.both(lambda rb, index=index: rb[index], f"rb[{index}]")


def test_tensordict_prioritized_replay_buffer(tmp_path: Path) -> None:
    twin = Twin(
        lambda s: TensorDictPrioritizedReplayBuffer(
            alpha=0.8, beta=0.4, storage=s, batch_size=BATCH
        ),
        tmp_path / "rb.zarr",
    )
    twin.extend(transitions(40))
    for seed in range(4):
        batch = twin.sample(seed)
        assert "priority_weight" in batch
        batch.set("td_error", priorities(BATCH, seed))
        twin.both(lambda rb, b=batch: rb.update_tensordict_priority(b.clone()), "update_td_prio")
    twin.add(transitions(1, start=300)[0])
    twin.extend(transitions(50, start=400))  # wraps around
    twin.check()
    index = torch.tensor([0, 5, 17, 63])
    twin.both(lambda rb: rb.update_priority(index, torch.tensor([9.0, 0.1, 3.0, 7.0])), "update")
    for seed in range(10, 15):
        twin.sample(seed)
    twin.check()


def test_prioritized_buffer_priorities_from_data(tmp_path: Path) -> None:
    """Priorities written with the data (``td_error`` in the extended TensorDict)."""
    twin = Twin(
        lambda s: TensorDictPrioritizedReplayBuffer(
            alpha=1.0, beta=1.0, storage=s, batch_size=BATCH
        ),
        tmp_path / "rb.zarr",
    )
    for start in (0, 100, 200):
        data = transitions(30, start=start)
        data.set("td_error", priorities(30, start))
        twin.extend(data)
        for seed in range(3):
            twin.sample(seed + start)
    twin.check()


# --- TensorDictMaxValueWriter ---------------------------------------------------------------


def _max_value_twin(path: Path) -> Twin:
    return Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s,
            writer=TensorDictMaxValueWriter(rank_key=REWARD_KEY),
            sampler=RandomSampler(),
            batch_size=BATCH,
        ),
        path,
    )


def test_max_value_writer_extend(tmp_path: Path) -> None:
    twin = _max_value_twin(tmp_path / "rb.zarr")
    written = []
    for start in (0, 1000, 2000, 3000):
        data = transitions(40, start=start)
        written.append(data[REWARD_KEY])
        twin.extend(data)
        twin.check()
        for seed in range(2):
            twin.sample(seed + start)
    assert len(twin.zarr) == MAX_SIZE
    top = torch.cat(written).flatten().topk(MAX_SIZE).values.sort().values
    kept = twin.zarr.storage[:][REWARD_KEY].flatten().sort().values
    torch.testing.assert_close(kept, top, rtol=0, atol=0)


def test_max_value_writer_add(tmp_path: Path) -> None:
    twin = _max_value_twin(tmp_path / "rb.zarr")
    data = transitions(100)
    for i in range(100):
        twin.add(data[i])
    twin.check()
    for seed in range(3):
        twin.sample(seed)
    kept = twin.zarr.storage[:][REWARD_KEY].flatten().sort().values
    top = data[REWARD_KEY].flatten().topk(MAX_SIZE).values.sort().values
    torch.testing.assert_close(kept, top, rtol=0, atol=0)


def test_max_value_writer_extend_then_add(tmp_path: Path) -> None:
    """Mixing ``extend`` and ``add`` on a max-value writer grows a column, as in TorchRL.

    TorchRL's ``TensorDictMaxValueWriter`` sets an ``"index"`` entry on ``add`` but not on
    ``extend``, so the second kind of write carries a key the first did not: the store grows
    a column, in which the rows written before read as zeros (as in LazyTensorStorage), and
    writes without the key keep its values.
    """
    twin = _max_value_twin(tmp_path / "rb.zarr")
    twin.extend(transitions(40))
    for i in range(30):
        twin.add(
            transitions(1, start=1000 + i)[0].apply(
                lambda x: x + 100 if x.is_floating_point() else x
            )
        )
    twin.check()
    assert ("index",) in {leaf.key for leaf in twin.zarr.storage.schema.leaves}
    twin.extend(transitions(40, start=2000))
    twin.check(flush=True)
    for seed in range(3):
        twin.sample(seed)


# --- slice samplers -------------------------------------------------------------------------


SLICE_SAMPLERS: dict[str, Callable[[], Any]] = {
    "traj_key-num_slices": lambda: SliceSampler(num_slices=4, traj_key=TRAJ_KEY),
    "episode-slice_len": lambda: SliceSampler(slice_len=4, traj_key="episode"),
    "end_key": lambda: SliceSampler(num_slices=4, end_key=DONE_KEY),
    "end_key-not_strict": lambda: SliceSampler(slice_len=4, end_key=DONE_KEY, strict_length=False),
    "traj_key-cached": lambda: SliceSampler(num_slices=4, traj_key=TRAJ_KEY, cache_values=True),
    "without_replacement": lambda: SliceSamplerWithoutReplacement(num_slices=4, traj_key=TRAJ_KEY),
    "prioritized": lambda: PrioritizedSliceSampler(
        MAX_SIZE, alpha=0.7, beta=0.5, num_slices=4, traj_key=TRAJ_KEY
    ),
    "prioritized-end_key": lambda: PrioritizedSliceSampler(
        MAX_SIZE, alpha=0.7, beta=0.5, slice_len=4, end_key=DONE_KEY
    ),
}


# Samplers whose batches may be short: non-strict slices, and the last batch of an epoch.
VARIABLE_BATCH = {"end_key-not_strict", "without_replacement"}


@pytest.mark.parametrize("name", list(SLICE_SAMPLERS))
def test_slice_samplers(tmp_path: Path, name: str) -> None:
    twin = Twin(
        lambda s: TensorDictReplayBuffer(storage=s, sampler=SLICE_SAMPLERS[name](), batch_size=16),
        tmp_path / "rb.zarr",
    )
    start, offset = 0, 0
    for count in (6, 5, 7, 6, 8):  # 34-48 steps each: wraps around the 64 rows twice
        data = episodes(count, start=start, offset=offset)
        twin.extend(data)
        start, offset = start + len(data), offset + count
        twin.check()
        for seed in range(2):
            batch = twin.sample(seed + start)
            assert batch.numel() == 16 or name in VARIABLE_BATCH
            if name.startswith("prioritized"):
                twin.both(
                    lambda rb, b=batch, s=seed: rb.update_priority(b["index"], priorities(16, s)),
                    "update_priority",
                )
    # each sampled slice is a run of consecutive steps of one trajectory
    batch = twin.sample(1234)
    if name not in VARIABLE_BATCH:
        traj = batch[TRAJ_KEY].view(4, -1)
        assert (traj == traj[:, :1]).all()
        obs = batch["obs"][:, 0].view(4, -1)
        assert (obs.diff(dim=-1) == 1).all()


def test_slice_sampler_traj_key_ndim2(tmp_path: Path) -> None:
    """A SliceSampler over a ``[time, n_envs]`` storage (trajectories along time)."""
    n_envs = 4

    def data(t: int, start: int) -> TensorDict:
        td = vectorized(t, n_envs, start)
        td[TRAJ_KEY] = (td[TRAJ_KEY] * 0 + torch.arange(n_envs)[:, None]) + start
        td[DONE_KEY] = torch.zeros_like(td[DONE_KEY])
        td[DONE_KEY][:, -1] = True
        return td

    twin = Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s, sampler=SliceSampler(slice_len=4, traj_key=TRAJ_KEY), batch_size=16
        ),
        tmp_path / "rb.zarr",
        ndim=2,
    )
    for start in (0, 100, 200):
        twin.extend(data(7, start))
        twin.check()
        for seed in range(3):
            twin.sample(seed + start)


# --- iteration ------------------------------------------------------------------------------


def test_iterate_without_replacement(tmp_path: Path) -> None:
    twin = Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s, sampler=SamplerWithoutReplacement(), batch_size=10
        ),
        tmp_path / "rb.zarr",
    )
    twin.extend(transitions(50))
    twin.extend(transitions(30, start=100))  # 80 > 64: wraps around

    def epoch(rb: ReplayBuffer) -> list[TensorDict]:
        seed_all(7)
        return list(rb)

    for _ in range(2):  # the second epoch starts from a fresh permutation
        batches = twin.both(epoch, "iteration")
        assert len(batches) == 7  # 64 rows in batches of 10, last one short
        seen = torch.cat([b["index"] for b in batches])
        assert sorted(seen.tolist()) == list(range(MAX_SIZE))
        obs = torch.cat([b["obs"] for b in batches])
        torch.testing.assert_close(obs, twin.zarr.storage[seen]["obs"], rtol=0, atol=0)


def test_iterate_slices_without_replacement(tmp_path: Path) -> None:
    twin = Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s,
            sampler=SliceSamplerWithoutReplacement(slice_len=2, end_key=DONE_KEY),
            batch_size=8,
        ),
        tmp_path / "rb.zarr",
    )
    twin.extend(episodes(9))

    def epoch(rb: ReplayBuffer) -> list[TensorDict]:
        seed_all(3)
        return list(rb)

    batches = twin.both(epoch, "iteration")
    assert len(batches) >= 2


# --- empty ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_empty(tmp_path: Path, sampler: str) -> None:
    twin = Twin(
        lambda s: TensorDictReplayBuffer(storage=s, sampler=_sampler(sampler), batch_size=BATCH),
        tmp_path / "rb.zarr",
    )
    twin.extend(transitions(50))
    twin.extend(transitions(30, start=100))
    twin.sample(0)
    for rb in twin.buffers:
        rb.empty()
    assert len(twin.zarr) == len(twin.ref) == 0
    assert len(twin.zarr.storage) == 0
    twin.extend(transitions(20, start=5000))
    twin.check()
    assert len(twin.zarr) == 20
    torch.testing.assert_close(
        twin.zarr.storage[:]["obs"], transitions(20, start=5000)["obs"], rtol=0, atol=0
    )
    for seed in range(3):
        batch = twin.sample(seed)
        assert (batch["obs"][:, 0] >= 5000).all()
    twin.add(transitions(1, start=9000)[0])
    twin.check()
    assert len(twin.zarr) == 21


# --- indexing -------------------------------------------------------------------------------


INDICES = [
    0,
    17,
    -1,
    -64,
    slice(None),
    slice(5, 50, 3),
    slice(-10, None),
    [3, 3, 1, 60],
    torch.tensor([63, 0, 12, 12]),
    torch.tensor(7),
    torch.arange(MAX_SIZE) % 3 == 0,
    torch.tensor([[0, 1], [62, 63]]),
]


@pytest.mark.parametrize("kind", ["tensor", "tensordict"])
def test_indexing(tmp_path: Path, kind: str) -> None:
    make: Callable[..., ReplayBuffer] = ReplayBuffer if kind == "tensor" else TensorDictReplayBuffer
    twin = Twin(lambda s: make(storage=s, batch_size=BATCH), tmp_path / "rb.zarr")
    twin.extend(content(kind, 50))
    twin.extend(content(kind, 30, start=500))  # wraps: rows 0..15 are the newest
    for index in INDICES:
        got = twin.both(lambda rb, index=index: rb[index], f"rb[{index}]")
        twin.both(lambda rb, index=index: rb.storage[index], f"storage[{index}]")
        if isinstance(index, int):
            row = index % MAX_SIZE
            expected_start = 514 + row if row < 16 else 450 + row if row >= 50 else row
            if kind == "tensordict":
                got = got["obs"]
            assert int(got[0]) == expected_start


# --- ndim=2 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "prioritized"])
def test_ndim2(tmp_path: Path, sampler: str) -> None:
    n_envs = 4
    twin = Twin(
        lambda s: ReplayBuffer(storage=s, sampler=_sampler(sampler, MAX_SIZE), batch_size=BATCH),
        tmp_path / "rb.zarr",
        ndim=2,
    )
    twin.extend(vectorized(6, n_envs, start=0))
    twin.check()
    assert twin.zarr.storage.shape == (6, n_envs)
    for seed in range(3):
        data, info = twin.sample(seed, return_info=True)
        assert isinstance(info["index"], tuple)
        assert len(info["index"]) == 2
        if sampler == "prioritized":
            twin.both(
                lambda rb, i=info, s=seed: rb.update_priority(i["index"], priorities(BATCH, s)),
                "update_priority",
            )
    for start in (100, 200, 300):  # 16 rows of 4 envs; writes of 7 rows wrap around
        twin.extend(vectorized(7, n_envs, start=start))
        twin.check()
        for seed in range(3):
            data, info = twin.sample(seed + start, return_info=True)
            assert data.batch_size == (BATCH,)
            # sampled data is the stored element at the returned (time, env) coordinates
            assert_same(data, twin.zarr.storage[info["index"]], "data vs storage[index]")
    assert len(twin.zarr) == MAX_SIZE
    assert twin.zarr.storage.shape == (MAX_SIZE // n_envs, n_envs)
    for index in (
        slice(2, 5),
        (slice(None), 1),
        (torch.tensor([0, 15, 3]), torch.tensor([3, 0, 1])),
    ):
        twin.both(lambda rb, index=index: rb.storage[index], f"storage[{index}]")
    twin.both(lambda rb: rb[2:6], "rb[2:6]")
    # reopened: same [time, n_envs] shape and rows
    twin.zarr.storage.close()
    storage = ZarrStorage(MAX_SIZE, tmp_path / "rb.zarr", ndim=2)
    assert len(storage) == MAX_SIZE
    assert storage.shape == (MAX_SIZE // n_envs, n_envs)
    assert_same(storage[:], twin.ref.storage[:], "reopened storage[:]")
    storage.close()


# --- generator ------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "prioritized", "without_replacement", "slice"])
def test_generator(tmp_path: Path, sampler: str) -> None:
    """Determinism through the buffer's ``generator=`` (no global seeding)."""

    def make(s: Storage) -> ReplayBuffer:
        smp = (
            SliceSampler(num_slices=2, traj_key=TRAJ_KEY)
            if sampler == "slice"
            else _sampler(sampler)
        )
        return TensorDictReplayBuffer(
            storage=s, sampler=smp, batch_size=BATCH, generator=torch.Generator().manual_seed(11)
        )

    twin = Twin(make, tmp_path / "rb.zarr")
    twin.extend(episodes(10))
    twin.extend(episodes(8, start=500, offset=3))
    samples = [twin.both(lambda rb: rb.sample(), "sample") for _ in range(6)]
    # the generator advances: not every batch is the same
    assert any((s["index"] != samples[0]["index"]).any() for s in samples[1:])


# --- reopen ---------------------------------------------------------------------------------


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "tensordict", "tensorclass"])
def test_reopen(tmp_path: Path, kind: str, read_only: bool) -> None:
    path = tmp_path / "rb.zarr"
    twin = Twin(lambda s: ReplayBuffer(storage=s, batch_size=BATCH), path)
    twin.extend(content(kind, 50))
    twin.add(content(kind, 1, start=300)[0])
    twin.extend(content(kind, 40, start=500))  # wraps around
    twin.check()
    expected = twin.ref.storage[:]
    twin.zarr.storage.close()
    del twin

    storage = ZarrStorage(MAX_SIZE, path, read_only=read_only)
    rb = ReplayBuffer(storage=storage, batch_size=BATCH)
    assert len(rb) == len(storage) == MAX_SIZE
    assert_same(storage[:], expected, "reopened storage[:]")
    assert_same(rb[[5, 0, 63]], expected[[5, 0, 63]], "reopened rb[idx]")
    data, info = rb.sample(return_info=True)
    assert_same(data, expected[info["index"]], "reopened sample")
    storage.close()


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("name", ["end_key", "traj_key-num_slices", "prioritized"])
def test_reopen_then_sample_like_reference(tmp_path: Path, name: str, read_only: bool) -> None:
    """A reopened store samples exactly like a buffer that was never closed.

    End-key slicing needs the storage's last write position (the boundary between the
    newest and the oldest trajectory), which the reopened store must restore.
    """
    path = tmp_path / "rb.zarr"

    def make(s: Storage) -> ReplayBuffer:
        return TensorDictReplayBuffer(storage=s, sampler=SLICE_SAMPLERS[name](), batch_size=16)

    twin = Twin(make, path)
    twin.extend(episodes(8, start=0))
    # 56 + 38 rows: wraps around, overwrites part of an old trajectory and stops mid-episode,
    # so only the write cursor separates the newest steps from the older ones after them
    twin.extend(episodes(6, start=100, offset=8, last_done=False))
    twin.check()
    ref = twin.ref
    twin.zarr.storage.close()

    storage = ZarrStorage(MAX_SIZE, path, read_only=read_only)
    reopened = make(storage)
    assert len(reopened) == len(ref)
    assert_same(storage[:], ref.storage[:], "reopened storage[:]")
    for seed in range(4):
        seed_all(seed)
        expected = ref.sample()
        seed_all(seed)
        assert_same(reopened.sample(), expected, f"sample(seed={seed})")
    storage.close()


def test_reopen_tensordict_buffer_partial(tmp_path: Path) -> None:
    """A store that is not full reopens with its length; rows past it are not sampled."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(MAX_SIZE, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    data = transitions(23)
    rb.extend(data.clone())
    storage.close()

    storage = ZarrStorage(MAX_SIZE, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    assert len(rb) == 23
    stored = storage[:]
    assert stored.batch_size == (23,)
    expected = data.clone()
    expected["index"] = torch.arange(23)
    assert_same(stored, expected, "storage[:]")
    for seed in range(3):
        seed_all(seed)
        batch = rb.sample()
        assert (batch["index"] < 23).all()
        assert_same(batch.exclude("index"), data[batch["index"]], "sample")
    storage.close()


# --- buffer APIs that write through the storage's ``_storage`` -------------------------------


def test_update_if_present(tmp_path: Path) -> None:
    """``rb.update_if_present`` patches live records in place (generation-tracking writer)."""
    twin = Twin(
        lambda s: TensorDictReplayBuffer(
            storage=s, writer=TensorDictRoundRobinWriter(track_generations=True), batch_size=4
        ),
        tmp_path / "rb.zarr",
    )
    twin.extend(transitions(40))
    batch = twin.sample(0)
    patch = {"obs": torch.full((4, OBS), -1.0)}

    def update(rb: ReplayBuffer) -> Any:
        result = rb.update_if_present(
            index=batch["index"], generation=batch["index_generation"], patch=patch
        )
        return result.updated_count

    assert twin.both(update, "update_if_present") == 4
    rows = twin.zarr[batch["index"]]["obs"]
    torch.testing.assert_close(rows, patch["obs"], rtol=0, atol=0)
    twin.check(flush=True)


@pytest.mark.parametrize("destination", ["zarr_dump", "new_zarr", "filled_zarr"])
def test_dumps_loads(tmp_path: Path, destination: str) -> None:
    """``rb.dumps`` / ``rb.loads`` (TorchRL's route) to and from ZarrStorage.

    ``zarr_dump``: a ZarrStorage buffer dumped elsewhere (a zarr_rb snapshot) and loaded
    into a new ZarrStorage; the others load TorchRL's own memory-mapped dump.
    """
    source = Twin(lambda s: TensorDictReplayBuffer(storage=s, batch_size=BATCH), tmp_path / "a")
    source.extend(transitions(50))
    source.extend(transitions(30, start=500))  # wraps around
    dumped = tmp_path / "dump"
    (source.zarr if destination == "zarr_dump" else source.ref).dumps(dumped)

    storage: Storage = ZarrStorage(MAX_SIZE, tmp_path / "b")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    if destination == "filled_zarr":
        rb.extend(transitions(10, start=9000))
    rb.loads(dumped)
    assert len(rb) == MAX_SIZE
    assert_same(rb.storage[:], source.ref.storage[:], "loaded storage[:]")
    for seed in range(2):
        seed_all(seed)
        expected = source.ref.sample()
        seed_all(seed)
        assert_same(rb.sample(), expected, f"sample(seed={seed})")


def test_a_prioritized_buffer_from_zarr_rb_load_takes_a_torchrl_dump(tmp_path: Path) -> None:
    """``zarr_rb.load`` gives the sampler its running maximum as TorchRL keeps it (tensors):
    TorchRL's ``rb.loads`` copies into it, and fails half way on anything else."""

    def buffer(storage: Storage) -> TensorDictReplayBuffer:
        sampler = PrioritizedSampler(50, alpha=0.7, beta=0.5)
        return TensorDictReplayBuffer(
            storage=storage, sampler=sampler, batch_size=4, priority_key="td_error"
        )

    def rows(start: int, priorities: list[float]) -> TensorDict:
        n = len(priorities)
        obs = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1)
        return TensorDict({"obs": obs, "td_error": torch.tensor(priorities)}, [n])

    theirs, ours = buffer(LazyTensorStorage(50)), buffer(ZarrStorage(50, tmp_path / "rb.zarr"))
    dumped = tmp_path / "dump"
    for rb in (theirs, ours):
        rb.extend(rows(0, [1.0, 2.0, 3.0]))
    ours.dumps(dumped)
    zarr_rb.save(ours)
    ours.extend(rows(3, [1.0, 1.0]))
    zarr_rb.save(ours)
    ours.storage.close()
    loaded = zarr_rb.load(tmp_path / "rb.zarr")
    value, where = loaded._sampler._max_priority
    assert isinstance(value, torch.Tensor)
    assert isinstance(where, torch.Tensor)
    loaded.loads(dumped)
    assert len(loaded) == 3
    assert_same(loaded.storage[:], theirs.storage[:], "rows of the dump")
    for rb in (theirs, loaded):
        rb.extend(rows(10, [5.0]))  # a new maximum, as TorchRL keeps it
    assert torch.equal(loaded._sampler._max_priority[0], theirs._sampler._max_priority[0])
    assert int(loaded._sampler._max_priority[1]) == int(theirs._sampler._max_priority[1])


@pytest.mark.parametrize("op", ["tolist", "numpy", "np.asarray", "torch.save"])
def test_storage_view_converts_like_a_tensor(tmp_path: Path, op: str) -> None:
    """``rb.storage[:]`` leaves convert to Python/NumPy and serialize like plain tensors."""
    convert: Callable[[torch.Tensor], Any] = {
        "tolist": lambda t: t.tolist(),
        "numpy": lambda t: t.numpy().tolist(),
        "np.asarray": lambda t: np.asarray(t).tolist(),
        "torch.save": lambda t: _save_load(t).tolist(),
    }[op]
    twin = Twin(lambda s: ReplayBuffer(storage=s, batch_size=BATCH), tmp_path / "rb.zarr")
    twin.extend(content("tensor", 20))
    twin.both(lambda rb: convert(rb.storage[:]), f"storage[:] {op}")
    twin = Twin(lambda s: TensorDictReplayBuffer(storage=s, batch_size=BATCH), tmp_path / "td")
    twin.extend(transitions(20))
    twin.both(lambda rb: convert(rb.storage[:][REWARD_KEY]), f"storage[:][key] {op}")


def _save_load(tensor: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("storage", ["zarr", "torchrl"])
def test_prefetching_threads_sample_whole_rows_while_the_buffer_is_extended(
    tmp_path: Path, storage: str
) -> None:
    # TorchRL's prefetch=N samples the next batches in threads while the caller goes on
    # (here: extending the buffer, so the ring wraps under the prefetching threads).
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    capacity = 300
    kept = (
        ZarrStorage(capacity, tmp_path / "rb.zarr")
        if storage == "zarr"
        else LazyTensorStorage(capacity)
    )
    rb = TensorDictReplayBuffer(storage=kept, batch_size=32, prefetch=3)

    def rows(first: int, count: int) -> TensorDict:
        stamp = torch.arange(first, first + count)
        return TensorDict(
            {"stamp": stamp, "obs": stamp.float().unsqueeze(-1).expand(-1, 64).clone()},
            batch_size=[count],
        )

    rb.extend(rows(0, 100))
    seen = 0
    for step in range(40):
        batch = rb.sample()
        assert batch.batch_size == torch.Size([32])
        assert torch.equal(batch["obs"], batch["stamp"].float().unsqueeze(-1).expand(-1, 64))
        assert torch.equal(batch["index"], batch["stamp"] % capacity)  # read where drawn
        seen += int(batch["stamp"].unique().numel())
        rb.extend(rows(100 + 25 * step, 25))
    assert seen > 40
    assert len(rb) == capacity
    if storage == "zarr":
        kept.close()


@pytest.mark.parametrize("storage", ["zarr", "torchrl"])
def test_prefetching_threads_drawing_the_same_rows_get_whole_batches(
    tmp_path: Path, storage: str
) -> None:
    # One row: every draw is the same index, so each prefetching thread gathers the rows
    # another one just gathered, while TorchRL adds "index" and the weights to the batch
    # that thread was handed. The kept gather must not be that batch.
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    kept = ZarrStorage(50, tmp_path / "rb.zarr") if storage == "zarr" else LazyTensorStorage(50)
    sampler = PrioritizedSampler(50, alpha=0.7, beta=0.5)
    rb = TensorDictReplayBuffer(storage=kept, sampler=sampler, batch_size=16, prefetch=3)
    frame = torch.arange(4 * 84 * 84, dtype=torch.uint8).view(1, 4, 84, 84)
    extra = {"a": torch.zeros(1), "b": torch.ones(1, 3), "c": {"d": torch.zeros(1, 2)}}
    rb.extend(TensorDict({"obs": frame.clone(), **extra}, [1]))
    for _ in range(300):
        batch = rb.sample()
        assert torch.equal(batch["index"], torch.zeros(16, dtype=batch["index"].dtype))
        assert torch.equal(batch["obs"], frame.expand(16, -1, -1, -1))
        assert torch.equal(batch["c", "d"], torch.zeros(16, 2))
    if storage == "zarr":
        kept.close()


def test_reads_under_inference_mode(tmp_path: Path) -> None:
    # Evaluation code samples inside torch.inference_mode(): its tensors keep no version
    # counter, which the gather kept for the next reader of the same rows relies on.
    twin = Twin(lambda s: TensorDictReplayBuffer(storage=s, batch_size=4), tmp_path)
    twin.extend(transitions(8))
    index = torch.tensor([2, 4, 4])
    with torch.inference_mode():
        for _ in range(2):  # (the second read of the same rows too)
            assert_same(twin.zarr.storage[index], twin.ref.storage[index], "storage[index]")
        assert twin.zarr.sample().batch_size == torch.Size([4])
    assert_same(twin.zarr.storage[index], twin.ref.storage[index], "storage[index] after")


def test_rows_read_again_come_from_the_store_whatever_the_caller_did_to_the_first(
    tmp_path: Path,
) -> None:
    # Changes through numpy or .data move no version counter: a second read of the same
    # rows must not be a copy of what the first caller was handed.
    twin = Twin(lambda s: TensorDictReplayBuffer(storage=s, batch_size=4), tmp_path)
    twin.extend(transitions(8))
    index = torch.tensor([1, 3, 5])
    for rb in twin.buffers:
        first = rb.storage[index]
        first["obs"].numpy()[:] = 0
        first.get(("next", "reward")).data.zero_()
    assert_same(twin.zarr.storage[index], twin.ref.storage[index], "read again")
