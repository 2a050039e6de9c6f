"""Model-based test of the many-writer protocol: random interleavings of several shared
writers of one store (in one process, each its own writer) against TorchRL's own
``LazyTensorStorage`` given the same writes in the order they were committed.

After every step, every writer sees exactly the twin's rows: ``len`` equal, every position
of ``[0, len)`` readable and holding the same whole row (no hole, no torn row), and the
index an extend returns names where its rows went. Writers extend, write given positions,
leave and join, and crash (dropped as a killed process would be: nothing flushed, its
lock released) in the middle of an extend, before or after its rows are written.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from shared_workers import stamped, torn
from torchrl.data import LazyTensorStorage

from zarr_rb import Compression, RowsNotCommittedError, ZarrStorage
from zarr_rb.core.arrays import StoreArrays

WRITERS = 3


class SharedWriters(RuleBasedStateMachine):
    frames = False
    """Whether the store keeps its frames leaves as frames on disk (``obs`` and its twin
    ``("next", "obs")``: a frame per row, each once per block)."""

    @initialize(rows=st.sampled_from([12, 48, 4096]), block_rows=st.sampled_from([2, 4, 8]))
    def setup(self, rows: int, block_rows: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-shared-model-"))
        self.url = str(self.dir / "buffer.zarr")
        self.rows = rows
        compression = Compression(block_rows=block_rows, chunk_rows=2)
        if self.frames:
            compression = Compression(
                block_rows=block_rows, chunk_rows=2, frames=True, large_row_bytes=64
            )
        self.writers = [
            ZarrStorage(rows, self.url, shared=True, compression=compression)
            for _ in range(WRITERS)
        ]
        self.twin = LazyTensorStorage(rows)
        self.cursor = 0
        self.stamp = 1  # stamp 0: a row of zeros, as positions never written read

    def _rows(self, writer: int, count: int):
        data = stamped(writer, self.stamp, count)
        self.stamp += count
        return data

    def _twin_extend(self, data) -> torch.Tensor:
        index = (self.cursor + torch.arange(data.shape[0])) % self.rows
        self.twin.set(index, data)
        self.cursor = (self.cursor + data.shape[0]) % self.rows
        return index

    @rule(writer=st.integers(0, WRITERS - 1), count=st.integers(1, 13))
    def extend(self, writer: int, count: int) -> None:
        count = min(count, self.rows)
        data = self._rows(writer, count)
        index = torch.arange(count)
        # "index" as TorchRL's TensorDict writers set it: the positions the write is given
        self.writers[writer].set(index, data.clone().set("index", index.clone()))
        placed = (self.cursor + torch.arange(count)) % self.rows
        expected = self._twin_extend(data.set("index", placed))
        assert torch.equal(index, expected)  # the index extend returns: where they went

    @rule(writer=st.integers(0, WRITERS - 1), picks=st.lists(st.integers(0, 4095), max_size=5))
    def write_given_rows(self, writer: int, picks: list[int]) -> None:
        # Some past the length too (the length stays, as in TorchRL).
        reach = min(self.rows, len(self.twin) + 3)
        index = torch.tensor(sorted({p % reach for p in picks}), dtype=torch.long)
        if not index.numel():
            return
        data = self._rows(writer, index.numel()).set("index", index)
        self.writers[writer].set(index, data, set_cursor=False)
        self.twin.set(index, data, set_cursor=False)

    @rule(writer=st.integers(0, WRITERS - 1))
    def reopen(self, writer: int) -> None:
        """A writer leaves (its open slot is given back) and a new one joins."""
        self.writers[writer].close()
        self.writers[writer] = ZarrStorage(path=self.url, mode="r+", shared=True)

    @rule(
        writer=st.integers(0, WRITERS - 1),
        count=st.integers(1, 13),
        after_write=st.booleans(),
    )
    def crash_in_extend(self, writer: int, count: int, after_write: bool) -> None:
        """A writer killed in the middle of an extend: before its rows are written, or
        after, before their commit. Its rows are lost; nobody else's."""
        count = min(count, self.rows)
        storage = self.writers[writer]
        store = storage._store
        original = StoreArrays.write_rows

        def killed(self_: StoreArrays, writes, *, physical: bool = False) -> None:
            if self_.store is store and after_write:
                original(self_, writes, physical=physical)
            if self_.store is store:
                raise _KilledError

        StoreArrays.write_rows = killed  # type: ignore[method-assign]
        try:
            data = self._rows(writer, count).set("index", torch.arange(count))
            storage.set(torch.arange(count), data)
        except _KilledError:
            pass
        finally:
            StoreArrays.write_rows = original  # type: ignore[method-assign]
        store.lifetime.abandon()
        self.writers[writer] = ZarrStorage(path=self.url, mode="r+", shared=True)

    @rule(
        writer=st.integers(0, WRITERS - 1),
        picks=st.lists(st.integers(0, 4095), min_size=1, max_size=6),
        others=st.lists(st.tuples(st.integers(0, WRITERS - 1), st.integers(1, 13)), max_size=6),
    )
    def sample_while_others_commit(
        self, writer: int, picks: list[int], others: list[tuple[int, int]]
    ) -> None:
        """A writer's sample: it draws (reading rows, as a slice sampler does), other writers
        commit, then it gathers the rows drawn. Both reads are of the commit it drew from,
        or the gather raises (another writer took their slots again)."""
        length = len(self.twin)
        if not length:
            return
        storage = self.writers[writer]
        index = torch.tensor([p % length for p in picks])
        expected = self.twin.get(index)
        storage.begin_sample()
        try:
            with storage.drawing():
                assert len(storage) == length
                drawn = storage.get(index)  # (a read while drawing ends nothing)
            assert torch.equal(drawn["stamp"], expected["stamp"])
            for other, count in others:
                if other != writer:
                    self.extend(other, count)
            try:
                gathered = storage.get(index)  # (the gather ends the sample)
            except RowsNotCommittedError:
                event("a gather raised: its slots were taken again")
            else:
                assert torch.equal(gathered["stamp"], expected["stamp"])
                assert torch.equal(gathered["index"], expected["index"])
        finally:
            storage.end_sample()

    @invariant()
    def every_writer_sees_the_twins_rows(self) -> None:
        if not hasattr(self, "writers"):
            return
        length = len(self.twin)
        for storage in self.writers:
            assert len(storage) == length
            if not length:
                continue
            data = storage.get(torch.arange(length))
            assert torn(data[data["stamp"] != 0]) == 0
            expected = self.twin.get(torch.arange(length))
            assert torch.equal(data["stamp"], expected["stamp"])
            assert torch.equal(data["index"], expected["index"])
            assert not storage._store.unreadable_rows().size  # no hole

    def teardown(self) -> None:
        for storage in getattr(self, "writers", []):
            storage.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)


class _KilledError(Exception):
    pass


class SharedWritersOfFrames(SharedWriters):
    """The same, with the frames of ``obs`` and ``("next", "obs")`` stored once per block
    (``Compression(frames=True)``): each writer's blocks take their cells from their own
    regions, and every row reads back bit for bit."""

    frames = True


TestSharedWriters = SharedWriters.TestCase
TestSharedWritersOfFrames = SharedWritersOfFrames.TestCase
for _case in (TestSharedWriters, TestSharedWritersOfFrames):
    _case.settings = settings(
        max_examples=25,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
del _case  # (else pytest collects the last case twice, under this name)
