"""A writer that stalled past its hold on S3 cannot change a row of the writer that took
over, even with the writes it had already started (PUTs that land late).

S3 has no fencing token: a PUT sent before the stall lands whenever the stalled process
goes on. The store is safe because a writer only ever writes into slots it reserved for
itself in a commit (one writer) or took in the record (shared writers), and a slot one
writer reserved is never given to another. The tests let the stalled writer's writes run
after the new writer committed (as a PUT that lands late does), then check every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from test_s3 import batch, run_python
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage
from zarr_rb.errors import FencedError

CAPACITY = 64
BLOCK_ROWS = 16


def new_writer(url: str, options: dict) -> tuple[ZarrStorage, TensorDictReplayBuffer]:
    storage = ZarrStorage(
        CAPACITY, url, storage_options=options, compression=Compression(block_rows=BLOCK_ROWS)
    )
    return storage, TensorDictReplayBuffer(storage=storage)


def stall(storage: ZarrStorage) -> None:
    """The writer stalls right after its last check of its hold: it stops renewing its
    lease, and what it does next runs as if the check had passed just before the stall."""
    lease = storage._store.lifetime._lock
    lease._lost = "stopped renewing for the test"
    lease.check = lambda: None


def take_over_and_extend(url: str, options: dict, start: int, n: int) -> None:
    """Another process waits for the stalled writer's lease to expire (it opens the store
    as soon as the store lets it), then extends and commits ``n`` rows."""
    child = run_python(
        f"""
        import time
        from zarr_rb import ZarrStorage
        from zarr_rb.errors import LockedError
        from torchrl.data import TensorDictReplayBuffer
        from test_s3 import batch
        deadline = time.monotonic() + 60
        while True:
            try:
                storage = ZarrStorage(path={url!r}, storage_options={options!r})
                break
            except LockedError:
                assert time.monotonic() < deadline, "the stalled writer's lease never expired"
                time.sleep(0.05)
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(batch({start}, {n}))
        storage.close()
        """
    )
    assert child.returncode == 0, child.stderr[-3000:]


def rows_of(url: str, options: dict) -> TensorDict:
    """Every row a reader sees, read now (a view of the store would be read when used)."""
    reader = ZarrStorage(path=url, read_only=True, storage_options=options)
    try:
        return reader.get(torch.arange(len(reader))).exclude("index").to_tensordict()
    finally:
        reader.close()


def late_write_rows(storage: ZarrStorage, then: Callable[[], None]) -> None:
    """The writer's next row writes stall after it chose their slots and before its PUTs
    land: ``then()`` runs first."""
    store = storage._store
    write_rows = store.arrays.write_rows

    def stalled(*args: Any, **kwargs: Any) -> None:
        store.arrays.write_rows = write_rows  # type: ignore[method-assign]
        stall(storage)
        then()
        write_rows(*args, **kwargs)

    store.arrays.write_rows = stalled  # type: ignore[method-assign]


@pytest.mark.parametrize("in_flight", [False, True], ids=["stalled before", "PUTs in flight"])
@pytest.mark.parametrize(
    "filled",
    [10, CAPACITY],
    ids=["appending into a block of committed rows", "the ring coming around"],
)
def test_a_stalled_writers_late_writes_never_reach_the_new_writers_rows(
    s3_url, s3_options, filled, in_flight
):
    options = {**s3_options, "lease_seconds": 1.0}
    storage, rb = new_writer(s3_url, options)
    rb.extend(batch(0, filled))
    storage.flush()
    committed: list[TensorDict] = []

    def take_over() -> None:
        take_over_and_extend(s3_url, options, start=500, n=10)
        committed.append(rows_of(s3_url, s3_options))

    if in_flight:
        late_write_rows(storage, then=take_over)
    else:
        stall(storage)
        take_over()
    try:
        # The stalled writer goes on: its rows reach the store, its commit is refused.
        with pytest.raises(FencedError):  # noqa: PT012
            rb.extend(batch(1000, 10))
            storage.flush()
        assert_identical(rows_of(s3_url, s3_options), committed[0])
        at = filled % CAPACITY
        assert_identical(committed[0][at : at + 10], batch(500, 10))
    finally:
        storage._store.lifetime.abandon()


def test_shared_writers_that_take_over_a_stalled_writer_never_take_its_slots(s3_url, s3_options):
    """A store of one writer, opened by shared writers once that writer's lease expired:
    the slots it had stay its own (it may be writing into them)."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage, rb = new_writer(s3_url, options)
    rb.extend(batch(0, CAPACITY))
    storage.flush()
    committed: list[TensorDict] = []

    def take_over() -> None:
        child = run_python(
            f"""
            import time
            from zarr_rb import ZarrStorage
            from zarr_rb.errors import LockedError
            from torchrl.data import TensorDictReplayBuffer
            from test_s3 import batch
            deadline = time.monotonic() + 60
            while True:
                try:
                    storage = ZarrStorage(path={s3_url!r}, storage_options={options!r},
                                          shared=True)
                    break
                except LockedError:
                    assert time.monotonic() < deadline, "the stalled writer's lease never expired"
                    time.sleep(0.05)
            rb = TensorDictReplayBuffer(storage=storage)
            rb.extend(batch(500, 20))
            storage.close()
            """
        )
        assert child.returncode == 0, child.stderr[-3000:]
        committed.append(rows_of(s3_url, s3_options))

    late_write_rows(storage, then=take_over)  # it moves block 0 into a slot it reserved
    try:
        with pytest.raises(FencedError):  # noqa: PT012
            rb.extend(batch(1000, 10))
            storage.flush()
        assert_identical(committed[0][:20], batch(500, 20))
        assert_identical(rows_of(s3_url, s3_options), committed[0])
    finally:
        storage._store.lifetime.abandon()


def test_a_stalled_shared_writers_late_rows_never_reach_another_writers_slot(s3_url, s3_options):
    """A shared writer taken for gone (its lease expired) loses the slot it took; the slot
    is never given to another writer, so the rows the stalled one writes there land
    nowhere anyone reads."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage = ZarrStorage(
        CAPACITY,
        s3_url,
        storage_options=options,
        shared=True,
        compression=Compression(block_rows=BLOCK_ROWS),
    )
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(batch(0, BLOCK_ROWS))  # its first slot, full
    writer = storage._store.commits.writer
    committed: list[TensorDict] = []

    def take_over() -> None:
        """Once the stalled writer's lease expired, another takes slots and commits."""
        child = run_python(
            f"""
            import time
            from zarr_rb import ZarrStorage
            from torchrl.data import TensorDictReplayBuffer
            from test_s3 import batch
            storage = ZarrStorage(path={s3_url!r}, storage_options={options!r}, shared=True)
            location = storage._store.engine.location
            deadline = time.monotonic() + 60
            while location.writer_alive({writer!r}):
                assert time.monotonic() < deadline, "the stalled writer's lease never expired"
                time.sleep(0.05)
            rb = TensorDictReplayBuffer(storage=storage)
            rb.extend(batch(500, 20))
            storage.close()
            """
        )
        assert child.returncode == 0, child.stderr[-3000:]
        committed.append(rows_of(s3_url, s3_options))

    late_write_rows(storage, then=take_over)  # it took a slot for its next rows
    try:
        with pytest.raises(FencedError):
            rb.extend(batch(1000, 8))
        assert len(committed[0]) == BLOCK_ROWS + 20
        assert_identical(rows_of(s3_url, s3_options), committed[0])
    finally:
        storage._store.lifetime.abandon()
