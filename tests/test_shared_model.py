"""Model-based test of the many-writer protocol: random interleavings of several shared
writers of one store (in one process, each its own writer) against a model of what each
must see.

The model is what TorchRL's buffer guarantees a consumer when nothing is evicted: every
row an extend wrote is in the buffer once, whole, for every writer, as soon as the extend
returns. A small ring evicts too: then every row still there is whole, is one of the rows
written, and a writer's rows that remain are its newest (the oldest blocks go first).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from shared_workers import WRITER_STRIDE, stamped, torn

from zarr_rb import Compression, ZarrStorage

WRITERS = 3


class SharedWriters(RuleBasedStateMachine):
    @initialize(rows=st.sampled_from([48, 4096]), block_rows=st.sampled_from([2, 4, 8]))
    def setup(self, rows: int, block_rows: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zarr_rb-shared-model-"))
        self.url = str(self.dir / "buffer.zarr")
        self.rows = rows
        compression = Compression(block_rows=block_rows, chunk_rows=2)
        self.writers = [
            ZarrStorage(rows, self.url, shared=True, compression=compression)
            for _ in range(WRITERS)
        ]
        self.written = [0] * WRITERS
        self.lengths = [0] * WRITERS
        self.evicts = False

    @rule(writer=st.integers(0, WRITERS - 1), count=st.integers(1, 13))
    def extend(self, writer: int, count: int) -> None:
        index = torch.arange(count)
        self.writers[writer].set(index, stamped(writer, self.written[writer], count))
        self.written[writer] += count
        if sum(self.written) > self.rows - WRITERS * 8:  # blocks held may hold tails
            self.evicts = True
        # Where they went, as rb.extend returns it: they read back from any writer.
        reader = self.writers[(writer + 1) % WRITERS]
        got = reader.get(index)["stamp"]
        first = self.written[writer] - count
        assert torch.equal(got, writer * WRITER_STRIDE + torch.arange(first, first + count))

    @rule(writer=st.integers(0, WRITERS - 1))
    def reopen(self, writer: int) -> None:
        """A writer leaves (its block is given back) and a new one joins."""
        self.writers[writer].close()
        self.writers[writer] = ZarrStorage(path=self.url, mode="r+", shared=True)

    @invariant()
    def every_writer_sees_every_row_whole(self) -> None:
        if not hasattr(self, "writers"):
            return
        seen = None
        for i, storage in enumerate(self.writers):
            n = len(storage)
            assert n >= self.lengths[i]  # the length never shrinks
            self.lengths[i] = n
            if not storage.initialized:
                continue
            rows = np.setdiff1d(np.arange(n), storage._store.unreadable_rows())
            data = storage.get(torch.from_numpy(rows))
            assert torn(data) == 0
            stamps = data["stamp"]
            assert stamps.unique().numel() == stamps.numel()
            mine = sorted(stamps.tolist())
            assert seen is None or mine == seen  # every writer sees the same rows
            seen = mine
        if seen is None:
            return
        stamps = torch.tensor(seen, dtype=torch.long)
        for writer in range(WRITERS):
            kept = (stamps[stamps // WRITER_STRIDE == writer] % WRITER_STRIDE).sort().values
            if not self.evicts:
                assert torch.equal(kept, torch.arange(self.written[writer]))
            elif kept.numel():  # its newest rows, or rows of its newest blocks
                assert int(kept.max()) == self.written[writer] - 1

    def teardown(self) -> None:
        for storage in getattr(self, "writers", []):
            storage.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)


TestSharedWriters = SharedWriters.TestCase
TestSharedWriters.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
