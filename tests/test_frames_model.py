"""Model-based test of the RAM tier of frames: a buffer on a ZarrStorage and its twin on a
LazyTensorStorage take the same episodes of stacked frames (``obs`` and ``("next", "obs")``
sharing frames as an Atari collector's do, with resets, truncations and rows that fit no
pattern), overwrites, wraps, empties, reopens, crashes, saves and loads, and a second
writer's rows; after every step, every row of ``[0, len)`` must be the twin's, bit for bit,
and the tier's frame counts must be exact.

Budgets: the automatic one (the rows already in the store are read into RAM behind the
buffer's back: the steps of the thread that does it are run here between the rules instead,
so that every run can be replayed), one so small that rows are evicted at every extend, and
one given explicitly (the rows already in the store are read into RAM when first needed).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import assert_identical
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core import ram_fill
from zarr_rb.core.ram_fill import TierFill
from zarr_rb.errors import SaveOverwrittenError
from zarr_rb.testing import simulate_crash

ROWS = 24
STACK = 4
SIDE = 16  # frames of 16x16 bytes: a row of obs is 1 KiB, a large leaf


def frame(episode: int, t: int) -> torch.Tensor:
    return (
        ((torch.arange(SIDE * SIDE) + episode * 131 + t * 7) % 251).to(torch.uint8).view(SIDE, SIDE)
    )


class Episodes:
    """Transitions of one environment: stacks of the last frames, a new frame per step."""

    def __init__(self, lane: int) -> None:
        self.episode = lane * 10_000
        self.t = 0
        self.stack: list[torch.Tensor] | None = None

    def rows(
        self, n: int, rng: random.Random, *, resets: float = 0.15, noise: float = 0.05
    ) -> tuple[torch.Tensor, torch.Tensor]:
        obs, nxt = [], []
        for _ in range(n):
            if self.stack is None or rng.random() < resets:  # a reset (or a truncation)
                self.episode += 1
                self.t = 0
                self.stack = [frame(self.episode, 0)] * STACK
            self.t += 1
            following = [*self.stack[1:], frame(self.episode, self.t)]
            if rng.random() < noise:  # a row that fits no pattern
                following = [frame(-self.episode, self.t + i) for i in range(STACK)]
            obs.append(torch.stack(self.stack))
            nxt.append(torch.stack(following))
            self.stack = following
        return torch.stack(obs), torch.stack(nxt)


class FramesMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.sampled_from(["auto", "small", "given", "none"]),
        envs=st.sampled_from([1, 1, 2]),
        shared=st.booleans(),
        on_disk=st.booleans(),
    )
    def setup(self, budget: str, envs: int, shared: bool, on_disk: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-model-"))
        self.path = self.dir / "rb.zarr"
        # "small": room for the frames of about 6 rows (each row 1 new frame at best, 8 at
        # worst), with the ids of every row. "none": every row read from the store.
        budgets = {"auto": "auto", "small": 8 * 1024 + 4_000, "given": 2**22, "none": 0}
        self.ram_bytes: Any = budgets[budget]
        # Frames stored once per block on disk (Compression(frames=True)), in blocks of 8
        # rows: rings written over, blocks moved and filled in several writes (a shared
        # writer's blocks: appended into slots it takes).
        self.compression = Compression(frames=True, block_rows=8) if on_disk else None
        self.behind = budget == "auto"
        if self.behind:  # the thread does nothing: the rule fill_behind runs its steps
            self.patched = (TierFill.__dict__["_run"], ram_fill.STEP_ROWS)
            TierFill._run = lambda self, done: None  # type: ignore[method-assign]
            ram_fill.STEP_ROWS = 5
        self.envs = envs
        self.ndim = 1 if envs == 1 else 2
        self.shared = shared and envs == 1
        self.lanes = [Episodes(lane) for lane in range(envs)]
        self.rng = random.Random(0)
        self.step = 0
        self.zarr = self._buffer(self._open())
        self.twin = self._buffer(LazyTensorStorage(ROWS * envs, ndim=self.ndim))
        self.saved: tuple[TensorDict, int] | None = None
        self.dumped: tuple[TensorDict, int] | None = None
        self.dump_path = self.dir / "dump"

    def teardown(self) -> None:
        if getattr(self, "behind", False):
            TierFill._run, ram_fill.STEP_ROWS = self.patched  # type: ignore[method-assign]
        if hasattr(self, "zarr"):
            self.zarr.storage.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _open(self) -> ZarrStorage:
        return ZarrStorage(
            ROWS * self.envs,
            self.path,
            ndim=self.ndim,
            ram_bytes=self.ram_bytes,
            shared=self.shared,
            compression=self.compression,
        )

    def _buffer(self, storage: Any) -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=storage, batch_size=4)

    def _batch(self, n: int) -> TensorDict:
        parts = [lane.rows(n, self.rng) for lane in self.lanes]
        obs = torch.stack([p[0] for p in parts])
        nxt = torch.stack([p[1] for p in parts])
        steps = torch.arange(self.step, self.step + n * self.envs).view(self.envs, n)
        self.step += n * self.envs
        data = TensorDict(
            {"obs": obs, "step": steps, "next": {"obs": nxt, "reward": steps.float()}},
            batch_size=[self.envs, n],
        )
        return data[0] if self.envs == 1 else data

    @property
    def length(self) -> int:
        return len(self.twin) // self.envs

    # --- rules ---------------------------------------------------------------------------

    @rule(n=st.integers(1, ROWS + 4), seed=st.integers(0, 2**16))
    def extend(self, n: int, seed: int) -> None:
        if self.envs > 1:
            n = max(n, 2)  # TorchRL's index of a one-step extend of [envs, 1] fails to broadcast
        self.rng.seed(seed)
        data = self._batch(n)
        self.zarr.extend(data.clone())
        # LazyTensorStorage writes an extend longer than the ring with one index_put_, whose
        # repeated indices are undefined: the twin takes it in two halves.
        along = -1 if self.envs > 1 else 0
        halves = [data] if n <= ROWS else list(data.split([n // 2, n - n // 2], dim=along))
        for half in halves:
            self.twin.extend(half.clone())

    @precondition(lambda self: self.length > 0 and self.envs == 1)
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        rows = data.draw(
            st.lists(st.integers(0, self.length - 1), min_size=1, max_size=6, unique=True)
        )
        batch = self._batch(len(rows))
        for rb in (self.zarr, self.twin):
            rb.storage.set(torch.tensor(rows), batch, set_cursor=False)

    @precondition(lambda self: self.length > 0 and self.shared)
    @rule(data=st.data())
    def another_writer(self, data: st.DataObject) -> None:
        rows = data.draw(
            st.lists(st.integers(0, self.length - 1), min_size=1, max_size=8, unique=True)
        )
        batch = self._batch(len(rows))
        other = ZarrStorage(path=self.path, mode="r+", shared=True)
        try:
            other.set(torch.tensor(rows), batch, set_cursor=False)
        finally:
            other.close()
        self.zarr.storage.refresh()
        self.twin.storage.set(torch.tensor(rows), batch, set_cursor=False)

    @rule()
    def empty(self) -> None:
        self.zarr.empty()
        self.twin.empty()
        self.saved = None  # an emptied buffer's save is dropped

    @rule()
    def reopen(self) -> None:
        self.zarr.storage.close()
        self._reopened()

    @rule()
    def crash_after_flush(self) -> None:
        self.zarr.storage.flush()
        simulate_crash(self.zarr.storage)
        self._reopened()

    def _reopened(self) -> None:
        cursor = int(self.twin._writer._cursor)
        self.zarr = self._buffer(self._open())
        self.zarr._writer._cursor = cursor  # TorchRL's writer state is not the storage's

    def _twin_state(self) -> tuple[TensorDict, int]:
        rows = self.twin.storage.get(torch.arange(self.length)).exclude("index")
        return rows.clone(), int(self.twin._writer._cursor)

    def _twin_at(self, state: tuple[TensorDict, int]) -> None:
        rows, cursor = state
        self.twin = self._buffer(LazyTensorStorage(ROWS * self.envs, ndim=self.ndim))
        if rows.numel():
            self.twin.extend(rows.transpose(0, 1) if self.envs > 1 else rows)
        self.twin._writer._cursor = cursor

    @precondition(lambda self: self.length > 0 and not self.shared)
    @rule()
    def save_close_and_load(self) -> None:
        """A save loaded in a new storage (with a given budget, its rows are read into RAM)."""
        zarr_rb.save(self.zarr)
        state = self._twin_state()
        self.zarr.storage.close()
        self.zarr = zarr_rb.load(self.path, ram_bytes=self.ram_bytes)
        self._twin_at(state)

    @precondition(lambda self: self.length > 0 and not self.shared)
    @rule()
    def dumps(self) -> None:
        self.zarr.dumps(self.dump_path)
        self.dumped = self._twin_state()

    @precondition(lambda self: self.dumped is not None and not self.shared)
    @rule()
    def loads(self) -> None:
        """The live buffer goes back to its dump (its tier forgets every row), or refuses
        once the dump's rows were written over, and stays as it was."""
        assert self.dumped is not None
        try:
            self.zarr.loads(self.dump_path)
        except SaveOverwrittenError:
            return
        self._twin_at(self.dumped)

    @precondition(lambda self: self.behind)
    @rule(steps=st.integers(1, 3))
    def fill_behind(self, steps: int) -> None:
        """Steps of the fill behind: rows of the store read into the tier between writes."""
        fill = self.zarr.storage._store.ram.fill
        for _ in range(steps):
            if not fill._step():
                return
            event("a step of the fill behind had more to read")

    @precondition(lambda self: self.length > 0)
    @rule(seed=st.integers(0, 2**16))
    def sample(self, seed: int) -> None:
        index = torch.randint(0, self.length, (7,), generator=torch.Generator().manual_seed(seed))
        assert_identical(
            self.zarr.storage.get(index).exclude("index"),
            self.twin.storage.get(index).exclude("index"),
        )

    # --- what must hold after every step -------------------------------------------------

    @invariant()
    def every_row_is_the_twins(self) -> None:
        if not hasattr(self, "zarr"):
            return
        assert len(self.zarr.storage) == len(self.twin.storage)
        if self.length:
            everything = torch.arange(self.length)
            assert_identical(
                self.zarr.storage.get(everything).exclude("index"),
                self.twin.storage.get(everything).exclude("index"),
            )

    @invariant()
    def frame_counts_are_exact(self) -> None:
        if not hasattr(self, "zarr"):
            return
        store = self.zarr.storage._store
        tier = store.ram.frames
        lent = store.write_cache.lent_rows() if store.write_cache is not None else []
        # Rows whose frames only the tier holds, for the write buffer, are held there.
        assert tier is not None or not len(lent)
        if tier is not None:
            tier.check()
            assert tier.resident[lent].all(), "a row lent its frames to a tier that let them go"
            if self.ram_bytes != "auto" and not isinstance(self.ram_bytes, str):
                assert tier.nbytes <= self.ram_bytes


FramesMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFramesMachine = FramesMachine.TestCase


def test_frames_of_an_atari_like_run_are_kept_once() -> None:
    """8 frames per row written, 1 new: the tier holds about one frame per row."""
    directory = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-"))
    try:
        storage = ZarrStorage(1000, directory / "rb.zarr", ram_bytes=2**26)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
        lane = Episodes(0)
        rng = random.Random(1)
        twin = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=32)
        for _ in range(5):
            obs, nxt = lane.rows(400, rng, resets=0.002, noise=0)
            data = TensorDict({"obs": obs, "next": {"obs": nxt}}, batch_size=[400])
            rb.extend(data)
            twin.extend(data)
        tier = storage._store.ram.frames
        assert tier is not None
        tier.check()
        assert bool(tier.resident.all())
        used = sum(pool.used for pool in tier._pools.values())
        assert used < 1000 * 1.1, used  # about a frame per row, not 8
        everything = torch.arange(1000)
        assert_identical(storage.get(everything), twin.storage.get(everything))
        storage.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_bytes_are_compared_not_values() -> None:
    """-0.0 and 0.0 are equal values and different bytes: a frame is shared only when its
    bytes are, so each row comes back as written."""
    directory = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-"))
    try:
        storage = ZarrStorage(8, directory / "rb.zarr", ram_bytes=2**22)
        zero = torch.zeros(8, 4, 16, 16)
        negative = zero.clone()
        negative[1::2] = -0.0
        storage.set(torch.arange(8), TensorDict({"obs": zero, "next": {"obs": negative}}, [8]))
        got = storage.get(torch.arange(8))
        assert torch.equal(torch.signbit(got["next", "obs"]), torch.signbit(negative))
        assert torch.equal(torch.signbit(got["obs"]), torch.signbit(zero))
        tier = storage._store.ram.frames
        assert tier is not None
        assert bool(tier.resident.all())
        storage.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_rows_past_the_budget_are_read_from_the_store() -> None:
    directory = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-"))
    try:
        storage = ZarrStorage(500, directory / "rb.zarr", ram_bytes=40 * 1024 + 500 * 32)
        twin = LazyTensorStorage(500)
        lane = Episodes(0)
        rng = random.Random(2)
        for start in range(0, 500, 100):
            obs, nxt = lane.rows(100, rng)
            data = TensorDict({"obs": obs, "next": {"obs": nxt}}, batch_size=[100])
            storage.set(torch.arange(start, start + 100), data)
            twin.set(torch.arange(start, start + 100), data)
        tier = storage._store.ram.frames
        assert tier is not None
        held = np.flatnonzero(tier.resident)
        assert 0 < held.size < 500
        assert held.min() > 400  # the newest rows
        everything = torch.arange(500)
        assert_identical(storage.get(everything), twin.get(everything))
        storage.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_budget_too_small_for_the_ids_of_every_row_keeps_no_tier() -> None:
    """Two leaves kept by the tier, and a budget that leaves one of them no frame: no row
    could be admitted, so there is no tier (and rows read from the store)."""
    directory = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-"))
    try:
        # Shares by bytes per row: 1/17 for obs (under the 16,000 bytes of its ids), 16/17
        # for depth (room for 19 frames).
        storage = ZarrStorage(1000, directory / "rb.zarr", ram_bytes=100_000)
        data = TensorDict(
            {
                "obs": torch.ones(4, 4, 16, 16, dtype=torch.uint8),
                "depth": torch.ones(4, 4, 64, 64, dtype=torch.uint8),
            },
            [4],
        )
        storage.set(torch.arange(4), data)
        assert storage._store.ram.frames is None
        assert_identical(storage.get(torch.arange(4)), data)
        storage.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_writing_other_keys_keeps_the_rows_frames_in_ram() -> None:
    """A write of some small keys (a column written back) leaves the frames as they are:
    the rows stay in the tier; a write of one frame key of a pair takes them out."""
    directory = Path(tempfile.mkdtemp(prefix="zarr_rb-frames-"))
    try:
        storage = ZarrStorage(100, directory / "rb.zarr", ram_bytes=2**22)
        twin = LazyTensorStorage(100)
        obs, nxt = Episodes(0).rows(100, random.Random(3))
        data = TensorDict(
            {"obs": obs, "reward": torch.zeros(100), "next": {"obs": nxt}}, batch_size=[100]
        )
        for s in (storage, twin):
            s.set(torch.arange(100), data)
        rows = torch.tensor([5, 50, 70])
        for s in (storage, twin):
            s.set(rows, TensorDict({"reward": torch.ones(3)}, [3]), set_cursor=False)
        tier = storage._store.ram.frames
        assert tier is not None
        assert bool(tier.resident.all())
        changed = TensorDict({"obs": torch.zeros(3, 4, SIDE, SIDE, dtype=torch.uint8)}, [3])
        for s in (storage, twin):
            s.set(rows, changed, set_cursor=False)
        assert not tier.resident[rows.numpy()].any()
        tier.check()
        everything = torch.arange(100)
        assert_identical(storage.get(everything), twin.get(everything))
        storage.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
