"""More ways a writer that stalled past its lease on S3 could reach what another writer
committed with writes that land late (tests/test_s3_fencing.py has the ones the slot
reservations cover), and the bounds of those reservations: the objects and the slots that
writers opening a store on S3 again and again leave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from test_s3 import batch, run_python
from test_s3_fencing import (
    BLOCK_ROWS,
    CAPACITY,
    late_write_rows,
    new_writer,
    rows_of,
    stall,
)
from torchrl.data import (
    LazyTensorStorage,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import zarr_rb
import zarr_rb.api
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.saves import StoreSaves
from zarr_rb.engine.rows import RowArray
from zarr_rb.errors import FencedError, StoreWriteError, ZarrRBError
from zarr_rb.format.commit import Commit, LeaseFloor, max_ring_capacity
from zarr_rb.format.record import StoreMeta
from zarr_rb.format.ring import SPARE_FACTOR, max_slots

WAIT_FOR_LEASE = """
import time
from zarr_rb import Compression, ZarrStorage
from zarr_rb.errors import LockedError
from test_s3 import batch

def open_when_free(**kwargs):
    deadline = time.monotonic() + 60
    while True:
        try:
            return ZarrStorage(**kwargs)
        except LockedError:
            assert time.monotonic() < deadline, "the stalled writer's lease never expired"
            time.sleep(0.05)
"""


def in_child(code: str) -> None:
    """Another process ("machine") runs ``code`` once the stalled writer's lease expired."""
    child = run_python(WAIT_FOR_LEASE + textwrap.dedent(code))
    assert child.returncode == 0, child.stderr[-3000:]


@pytest.mark.parametrize(
    ("filled", "stalled_rows"),
    [(BLOCK_ROWS, BLOCK_ROWS), (CAPACITY, 10)],
    ids=["a whole block written in its slot", "the ring coming around"],
)
def test_a_writer_starting_over_with_mode_w_never_takes_the_stalled_writers_slots(
    s3_url, s3_options, filled, stalled_rows
):
    """A store emptied and made again (mode='w') by the writer that took over: the slots
    the stalled writer reserved or wrote in stay out of the new writer's reach all the
    same (their keys are the same in the new arrays)."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage, rb = new_writer(s3_url, options)
    rb.extend(batch(0, filled))
    storage.flush()
    committed: list[TensorDict] = []

    def start_over() -> None:
        in_child(
            f"""
            storage = open_when_free(max_size={CAPACITY}, path={s3_url!r}, mode="w",
                                     storage_options={options!r},
                                     compression=Compression(block_rows={BLOCK_ROWS}))
            from torchrl.data import TensorDictReplayBuffer
            TensorDictReplayBuffer(storage=storage).extend(batch(500, {2 * BLOCK_ROWS}))
            storage.close()
            """
        )
        committed.append(rows_of(s3_url, s3_options))

    late_write_rows(storage, then=start_over)
    try:
        with pytest.raises(FencedError):  # noqa: PT012
            rb.extend(batch(1000, stalled_rows))
            storage.flush()
        assert_identical(committed[0], batch(500, 2 * BLOCK_ROWS))
        assert_identical(rows_of(s3_url, s3_options), committed[0])
    finally:
        storage._store.lifetime.abandon()


def test_a_stalled_writers_late_state_writes_never_reach_the_new_writers_save(
    s3_url, s3_options, monkeypatch
):
    """The stalled writer was saving: its state writes land late, or go on when it wakes
    (nothing checks its lease between them); the writer that took over saves too: its
    save loads as it made it."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage = ZarrStorage(
        CAPACITY, s3_url, storage_options=options, compression=Compression(block_rows=BLOCK_ROWS)
    )
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
    rb.extend(batch(0, 20))
    zarr_rb.save(rb, progress=False)
    save_buffer = zarr_rb.api.save_buffer

    def stalled_save(*args, **kwargs):
        monkeypatch.setattr(zarr_rb.api, "save_buffer", save_buffer)
        stall(storage)
        in_child(
            f"""
            import torch
            import zarr_rb
            from torchrl.data import TensorDictPrioritizedReplayBuffer
            storage = open_when_free(path={s3_url!r}, storage_options={options!r})
            rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
            rb.extend(batch(500, 10))
            rb.update_priority(torch.arange(len(rb)), torch.full((len(rb),), 7.0))
            zarr_rb.save(rb, progress=False)
            storage.close()
            """
        )
        return save_buffer(*args, **kwargs)  # its PUTs land now

    monkeypatch.setattr(zarr_rb.api, "save_buffer", stalled_save)
    rb.update_priority(torch.arange(len(rb)), torch.full((len(rb),), 3.0))
    try:
        with pytest.raises(FencedError):
            zarr_rb.save(rb, progress=False)
        loaded = zarr_rb.load(s3_url, storage_options=s3_options, read_only=True, progress=False)
        try:
            assert len(loaded) == 30
            tree = loaded.sampler._sum_tree
            assert [tree[i] for i in range(30)] == [7.0] * 30
        finally:
            loaded.storage.close()
    finally:
        storage._store.lifetime.abandon()


def stored_slots(url: str, options: dict) -> int:
    reader = ZarrStorage(path=url, read_only=True, storage_options=options)
    try:
        return len(reader._store.arrays.get(("obs",)).stored_chunks())
    finally:
        reader.close()


def test_reopening_a_store_on_s3_to_write_keeps_its_objects_bounded(s3_url, s3_options):
    """A writer opened, a ring written, closed, again and again (a collector that runs now
    and then): the store keeps no more objects than a store on a disk does (the rows a
    record refers to and the spare slots the ring reuses), without a save."""
    for run in range(4):
        storage, rb = new_writer(s3_url, s3_options)
        rb.extend(batch(run * CAPACITY, CAPACITY))
        storage.close()
    assert_identical(rows_of(s3_url, s3_options), batch(3 * CAPACITY, CAPACITY))
    blocks = CAPACITY // BLOCK_ROWS
    assert stored_slots(s3_url, s3_options) <= SPARE_FACTOR * blocks


def meta_of(url: str, options: dict) -> StoreMeta:
    """The record as a reader opened now reads it."""
    reader = ZarrStorage(path=url, read_only=True, storage_options=options)
    try:
        return reader._store.meta
    finally:
        reader.close()


def commit_of(url: str, options: dict) -> Commit:
    return meta_of(url, options).commit


def slots_of(commit: Commit) -> int:
    return CAPACITY // BLOCK_ROWS if commit.slots is None else commit.slots.capacity


def test_a_writer_that_closed_cleanly_leaves_its_slots_to_the_next(s3_url, s3_options):
    """Writers opened, a ring written, closed, again and again: the slots of one that
    closed cleanly go to the next (none of its writes can land late), so the arrays stop
    growing. One that was killed keeps its slots from the next writer, whose record then
    starts past them (the killed one's writes in flight land in slots no one takes)."""
    capacities = []
    for run in range(5):
        storage, rb = new_writer(s3_url, s3_options)
        rb.extend(batch(run * CAPACITY, CAPACITY))
        storage.close()
        commit = commit_of(s3_url, s3_options)
        assert getattr(commit.lease, "held", None) is False  # released
        capacities.append(slots_of(commit))
    assert capacities[1:] == [capacities[1]] * 4, capacities
    assert capacities[1] <= SPARE_FACTOR * CAPACITY // BLOCK_ROWS
    assert_identical(rows_of(s3_url, s3_options), batch(4 * CAPACITY, CAPACITY))

    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(5 * CAPACITY, BLOCK_ROWS))
    storage.flush()
    killed = commit_of(s3_url, s3_options)
    assert getattr(killed.lease, "held", None) is True
    storage._store.lifetime.abandon()  # killed: its lease is free, its record says it held slots
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(6 * CAPACITY, BLOCK_ROWS))
    storage.flush()
    taken_over = commit_of(s3_url, s3_options)
    assert taken_over.lease is not None
    assert (taken_over.lease.floor, taken_over.lease.held) == (slots_of(killed), True)
    storage.close()
    expected = torch.cat([batch(5 * CAPACITY, BLOCK_ROWS), batch(6 * CAPACITY, BLOCK_ROWS)])
    assert_identical(rows_of(s3_url, s3_options)[: 2 * BLOCK_ROWS], expected)


def with_slots(url: str, options: dict, capacity: int) -> None:
    """A store of one writer holding a ring, whose record names ``capacity`` slots: as
    after many writers opened it on S3 (each reserves its own slots past the last one's),
    made here at once."""
    storage, rb = new_writer(url, options)
    rb.extend(batch(0, CAPACITY))
    storage.flush()
    store = storage._store
    for key in store.leaves:
        store.arrays.get(key).grow_rows(capacity * BLOCK_ROWS)
    solo = store.commits
    solo.positions = solo.block_map.with_capacity(capacity)
    solo.publish(dataclasses.replace(store.committed, slots=solo.positions.copy()))
    storage.close()


@pytest.mark.slow  # (records of 2**24 slots: ten seconds each)
def test_a_writer_never_publishes_more_slots_than_a_record_may_name(s3_url, s3_options):
    """A store whose writers reopened it so often that its record names as many slots as a
    record may (each writer that opens it on S3 reserves its own past the last one's: about
    2**24 / blocks reopens; made here at once): the next writer's rows are refused with a
    typed error, or written, but the store stays readable."""
    with_slots(s3_url, s3_options, max_slots(CAPACITY // BLOCK_ROWS))
    storage, rb = new_writer(s3_url, s3_options)
    try:
        rb.extend(batch(CAPACITY, 10))
        storage.flush()
    except ZarrRBError:
        storage._store.lifetime.abandon()
    else:
        storage.close()
    rows = rows_of(s3_url, s3_options)  # the record parses
    assert_identical(rows[10:], batch(10, CAPACITY - 10))


def test_slots_whose_reservation_failed_to_publish_are_reserved_before_they_are_written(
    s3_url, s3_options
):
    """The commit reserving the slots the writer grew the arrays for failed (a request to
    S3 failed); the write is retried by the next flush, which stalls with its PUTs on the
    wire: the slots it writes were reserved all the same, so the writer that took over
    takes others."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage, rb = new_writer(s3_url, options)
    rb.extend(batch(0, CAPACITY))
    storage.flush()
    engine = storage._store.engine
    write_root_attributes = engine.write_root_attributes

    def failing(attributes):
        engine.write_root_attributes = write_root_attributes
        raise OSError("the request timed out")

    engine.write_root_attributes = failing
    with pytest.raises(StoreWriteError):  # noqa: PT012
        rb.extend(batch(1000, 10))  # block 0 moves: the arrays grow, the reservation fails
        storage.flush()
    committed: list[TensorDict] = []

    def take_over() -> None:
        in_child(
            f"""
            from torchrl.data import TensorDictReplayBuffer
            storage = open_when_free(path={s3_url!r}, storage_options={options!r})
            TensorDictReplayBuffer(storage=storage).extend(batch(500, 10))
            storage.close()
            """
        )
        committed.append(rows_of(s3_url, s3_options))

    late_write_rows(storage, then=take_over)
    try:
        with pytest.raises(FencedError):
            storage.flush()  # the rows kept for a retry
        assert_identical(committed[0][:10], batch(500, 10))
        assert_identical(rows_of(s3_url, s3_options), committed[0])
    finally:
        storage._store.lifetime.abandon()


@pytest.mark.slow  # (records of 2**24 slots: ten seconds each)
def test_shared_writers_joining_a_store_of_many_slots_leave_it_readable(s3_url, s3_options):
    """A store of one writer whose record names as many slots as such a record may, joined
    by a shared writer: the record it publishes (the store as runs) reads back."""
    with_slots(s3_url, s3_options, max_slots(CAPACITY // BLOCK_ROWS))
    try:
        storage = ZarrStorage(path=s3_url, storage_options=s3_options, shared=True)
    except ZarrRBError:
        pass  # refused, with a typed error
    else:
        storage.close()
    assert_identical(rows_of(s3_url, s3_options), batch(0, CAPACITY))


def test_a_writer_that_only_drops_a_version_holds_the_slots_it_empties(
    s3_url, s3_options, monkeypatch
):
    """A writer that writes no row but drops a version (or replaces a save) deletes the
    objects of the slots that version kept, which a record released by a clean close lets
    the next writer take: it says it holds them first, so that when its DELETEs stall and
    land after another writer took the store over and wrote there, they reach nothing that
    writer committed."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage, rb = new_writer(s3_url, options)
    for run, tag in enumerate(["v1", "v2", "v3", None]):
        rb.extend(batch(run * CAPACITY, CAPACITY))  # (each ring moves every block)
        zarr_rb.save(rb, tag=tag, progress=False)
    storage.close()  # a clean close: the next writer may take the slots the record frees
    opened: list[SimpleNamespace] = []  # the store dropping the version (as stall takes it)
    drop_version = StoreSaves.drop_version

    def dropping_version(saves, tag):
        opened.append(SimpleNamespace(_store=saves.store))
        drop_version(saves, tag)

    stalled = []
    drop_chunks = RowArray.drop_chunks
    committed: list[TensorDict] = []

    def dropping(array, chunks):
        if not stalled:
            stall(opened[0])
            stalled.append(True)
            in_child(
                f"""
                from torchrl.data import TensorDictReplayBuffer
                storage = open_when_free(path={s3_url!r}, storage_options={options!r})
                TensorDictReplayBuffer(storage=storage).extend(batch(500, {BLOCK_ROWS}))
                storage.close()
                """
            )
            committed.append(rows_of(s3_url, s3_options))
        drop_chunks(array, chunks)  # its DELETEs land now

    monkeypatch.setattr(StoreSaves, "drop_version", dropping_version)
    monkeypatch.setattr(RowArray, "drop_chunks", dropping)
    with contextlib.suppress(FencedError):
        zarr_rb.drop_version(s3_url, "v3", storage_options=options)
    assert stalled, "the version's slots were never emptied"
    monkeypatch.undo()
    assert_identical(committed[0][:BLOCK_ROWS], batch(500, BLOCK_ROWS))
    assert_identical(rows_of(s3_url, s3_options), committed[0])


def test_a_reader_never_sees_a_new_key_before_its_zeros_are_written(
    s3_url, s3_options, monkeypatch
):
    """The first write of a writer on a lease adds a key to a store holding rows: the
    record it publishes to say it holds its slots (before it writes zeros into the new
    key's cells of those rows) does not name the key yet, so a reader of that record reads
    the rows as they were, not cells that hold nothing."""
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(0, 20))
    storage.close()
    storage, rb = new_writer(s3_url, s3_options)
    seen: list[TensorDict] = []
    write_rows = RowArray.write_rows

    def writing(array, rows, values):
        if not seen:
            seen.append(rows_of(s3_url, s3_options))
        return write_rows(array, rows, values)

    monkeypatch.setattr(RowArray, "write_rows", writing)
    data = batch(100, 5)
    data["extra"] = torch.ones(5, 3)
    rb.extend(data)
    monkeypatch.undo()
    storage.close()
    assert_identical(seen[0], batch(0, 20))
    expected = torch.cat([batch(0, 20), batch(100, 5)])
    expected["extra"] = torch.cat([torch.zeros(20, 3), torch.ones(5, 3)])
    assert_identical(rows_of(s3_url, s3_options), expected)


@pytest.mark.parametrize("floor", [5000, max_ring_capacity(CAPACITY)], ids=["far", "too far"])
def test_a_lease_floor_past_the_slots_of_the_record_is_reached_at_once(s3_url, s3_options, floor):
    """A record whose writer's slots start far past the slots it names (one a writer
    starting over with mode='w' leaves after a store of many slots, or a hostile one): the
    next writer grows the arrays past that floor at once, or gets a typed error when no
    record may name so many slots; the rows stay readable."""
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(0, CAPACITY))
    storage.flush()
    store = storage._store
    store.commits._lease = LeaseFloor(floor=floor, held=False)
    store.commits.publish(store.committed, rows=False)
    store.lifetime.abandon()
    storage, rb = new_writer(s3_url, s3_options)
    try:
        rb.extend(batch(CAPACITY, 10))
        storage.flush()
    except ZarrRBError:
        storage._store.lifetime.abandon()
        assert_identical(rows_of(s3_url, s3_options), batch(0, CAPACITY))
    else:
        storage.close()
        assert_identical(rows_of(s3_url, s3_options)[:10], batch(CAPACITY, 10))
    assert_identical(rows_of(s3_url, s3_options)[10:], batch(10, CAPACITY - 10))


def test_the_record_saying_a_writer_holds_its_slots_keeps_the_cursor_it_was_moved_to(
    s3_url, s3_options
):
    """A writer on a lease whose first write comes after the buffer's cursor was moved (a
    TorchRL state loaded into a store holding rows): the record it publishes to hold its
    slots leaves the rows written since where they are, so the commit after records the
    cursor loaded, as TorchRL's storage does (reopened, it appends where the twin does)."""
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(0, 40))
    storage.close()
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    twin.extend(batch(100, 10))
    storage, rb = new_writer(s3_url, s3_options)
    storage.load_state_dict(twin.storage.state_dict())
    storage.close()
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(200, 5))
    twin.extend(batch(200, 5))
    storage.close()
    assert_identical(rows_of(s3_url, s3_options), twin[:].exclude("index"))


def test_saves_stay_out_of_the_groups_of_every_writer_that_may_still_save_late(s3_url, s3_options):
    """Writers on S3 taken over one after the other while each was saving (killed or
    stalled, the record says they held the store): each one's next state group is where
    its late writes land, and no save of a writer after it, two holders later or more,
    writes there. A writer that closed cleanly leaves nothing in flight."""
    pending: list[int] = []
    for step in range(3):
        storage, rb = new_writer(s3_url, s3_options)
        rb.extend(batch(step * 10, 10))
        store = storage._store
        assert store.saves.take_slot() not in pending
        zarr_rb.save(rb, progress=False)  # a save it made, which the record names
        pending.append(store.saves.take_slot())  # the next one starts: it stalls there
        store.lifetime.abandon()  # (the record says it holds the store)
    storage, rb = new_writer(s3_url, s3_options)
    rb.extend(batch(30, 10))
    zarr_rb.save(rb, progress=False)
    saved = meta_of(s3_url, s3_options).saved
    assert saved is not None
    assert saved.slot not in pending
    storage.close()  # a clean close: the next writer avoids the same groups, no more
    storage, _ = new_writer(s3_url, s3_options)
    assert storage._store.commits._avoided_saves >= set(pending[1::2])
    storage.close()
