"""Model-based test: random operation sequences on ZarrStorage and LazyTensorStorage agree."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from conftest import assert_identical
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

from zarr_rb import Compression, ZarrStorage

MAX_SIZE = 24


def make_batch(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            # 1 KiB rows: a large leaf (sharded, mirrored in RAM only within ram_bytes).
            "obs": torch.randint(0, 255, (n, 4, 16, 16), generator=g, dtype=torch.uint8),
            "reward": torch.randn(n, 1, generator=g),
            "next": {"done": torch.randint(0, 2, (n, 1), generator=g).bool()},
            "step": torch.arange(seed * 100, seed * 100 + n),
        },
        batch_size=[n],
    )


class StorageMachine(RuleBasedStateMachine):
    """ZarrStorage under extend/set/get/sample/empty/reopen vs. LazyTensorStorage."""

    @initialize(
        block_rows=st.sampled_from([4, 8, 32]),
        # None kept in RAM but small leaves; all of them until 12 rows are reached; all.
        ram_bytes=st.sampled_from([0, 12 * (1024 + 13), 2**20]),
    )
    def setup(self, block_rows: int, ram_bytes: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-model-"))
        self.path = self.dir / "model.zarr"
        self.compression = Compression(block_rows=block_rows)
        self.ram_bytes = ram_bytes
        self.zarr = self._open()
        self.model = LazyTensorStorage(MAX_SIZE)
        self.cursor = 0
        self.seed = 0

    def teardown(self) -> None:
        self.zarr.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(n=st.integers(1, 2 * MAX_SIZE // 3))
    def extend(self, n: int) -> None:
        self.seed += 1
        data = make_batch(n, self.seed)
        index = (torch.arange(n) + self.cursor) % MAX_SIZE
        self.cursor = (self.cursor + n) % MAX_SIZE
        for storage in (self.zarr, self.model):
            storage.set(index, data)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        rows = data.draw(
            st.lists(st.integers(0, len(self.model) - 1), min_size=1, max_size=6, unique=True)
        )
        self.seed += 1
        batch = make_batch(len(rows), self.seed)
        for storage in (self.zarr, self.model):
            storage.set(torch.tensor(rows), batch, set_cursor=False)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        n = len(self.model)
        index = data.draw(
            st.one_of(
                st.integers(-n, n - 1),
                st.lists(st.integers(0, n - 1), min_size=1, max_size=10).map(torch.tensor),
                st.tuples(st.integers(0, n), st.integers(0, n)).map(lambda t: slice(*sorted(t))),
            )
        )
        assert_identical(self.zarr.get(index), self.model.get(index))

    @precondition(lambda self: len(self.model) > 0)
    @rule(seed=st.integers(0, 2**16))
    def sample(self, seed: int) -> None:
        index = torch.randint(
            0, len(self.model), (5,), generator=torch.Generator().manual_seed(seed)
        )
        assert_identical(self.zarr.get(index), self.model.get(index))

    @rule()
    def empty(self) -> None:
        for storage in (self.zarr, self.model):
            storage._empty()
        self.cursor = 0

    @rule()
    def flush(self) -> None:
        self.zarr.flush()

    @rule()
    def reopen(self) -> None:
        self.zarr.close()
        self.zarr = self._open()

    def _open(self) -> ZarrStorage:
        return ZarrStorage(
            MAX_SIZE, self.path, compression=self.compression, ram_bytes=self.ram_bytes
        )

    @invariant()
    def same_length(self) -> None:
        if hasattr(self, "zarr"):
            assert len(self.zarr) == len(self.model)


StorageMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStorageMachine = StorageMachine.TestCase
