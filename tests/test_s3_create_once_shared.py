"""Shared writers on S3 create each data object once too (``docs/design/ring.md``, step 5):
every write of a shared writer goes into fresh slots, whose objects it creates by
conditional PUTs, so no object is ever written over; records carry the slots created, so a
reader keeps the rest of its cache without a request.

Through the proxy of ``test_s3_create_once`` that logs every request.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal

import pytest
import torch
from shared_workers import stamped, torn
from tensordict import TensorDict
from test_s3_create_once import (
    BLOCK,
    CAPACITY,
    batch,
    check_rows,
    check_the_next_commit_from_the_cache,
    object_history,
    overwrites,
    prefix_of,
    twin,
)
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.core.metadata import read_root
from zarr_rb.format import runs as runs_module


def first_writer(url: str, options: dict) -> TensorDictReplayBuffer:
    storage = ZarrStorage(CAPACITY, url, storage_options=options, compression=BLOCK, shared=True)
    return TensorDictReplayBuffer(storage=storage, batch_size=8)


def another_writer(url: str, options: dict) -> TensorDictReplayBuffer:
    storage = ZarrStorage(path=url, storage_options=options, shared=True)
    return TensorDictReplayBuffer(storage=storage, batch_size=8)


def record_of(rb: TensorDictReplayBuffer) -> dict:
    return read_root(rb.storage._store.engine)["attributes"]["zarr_rb"]["commit"]


def interleaved(
    writers: list[TensorDictReplayBuffer],
    model: TensorDictReplayBuffer,
    reader: ZarrStorage,
    *,
    step: int,
    seed: int,
    rounds: int,
) -> int:
    """Extends of every size by writers drawn at random (the ring wraps several times),
    each checked against the model's indices; now and then every row of ``[0, len)``
    checked through every writer and a reader. Returns the next step."""
    draw = random.Random(seed)
    for _ in range(rounds):
        rb = draw.choice(writers)
        n = draw.choice([1, 3, 8, 13, 21])
        got = rb.extend(batch(step, n))
        expected = model.extend(batch(step, n))
        assert torch.equal(got, expected)  # placed at commit time, as TorchRL would
        step += n
        if draw.random() < 0.4:
            for each in writers:
                each.storage.flush()  # (picks up the other writers' commits)
                check_rows(each.storage, model)
            reader.refresh()
            check_rows(reader, model)
    return step


def test_shared_writers_never_write_an_object_over(s3_url, options, proxy):
    a, model = first_writer(s3_url, options), twin()
    a.extend(batch(0, 5))
    model.extend(batch(0, 5))
    b = another_writer(s3_url, options)
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    step = interleaved([a, b], model, reader, step=5, seed=1, rounds=6)
    assert a.storage._store.lifetime.creates_once
    assert b.storage._store.lifetime.creates_once
    zarr_rb.save(a)  # collects the slots no record refers to
    step = interleaved([a, b], model, reader, step=step, seed=2, rounds=6)
    assert "object_era" in record_of(a)
    for rb in (a, b):
        rb.storage.close()
    reader.close()

    history = object_history(proxy, prefix_of(s3_url))
    puts = [r for requests in history.values() for r in requests if r[0] == "PUT"]
    assert len(puts) > 50
    assert all(conditional for _, _, conditional in puts)  # every PUT a conditional create
    assert overwrites(history) == []
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()


def test_writes_to_given_rows_by_shared_writers_create_objects_once(s3_url, options, proxy):
    a, model = first_writer(s3_url, options), twin()
    step = 0
    for start in range(0, 2 * CAPACITY, 13):
        a.extend(batch(start, 13))
        model.extend(batch(start, 13))
        step = start + 13
    b = another_writer(s3_url, options)
    draw = random.Random(3)
    for _ in range(10):
        rows = torch.tensor(sorted(draw.sample(range(CAPACITY), draw.choice([1, 5, 11]))))
        patch = TensorDict({"action": torch.full((rows.numel(),), step)}, batch_size=[len(rows)])
        draw.choice([a, b]).storage[rows] = patch  # keys left out keep their values
        model.storage[rows] = patch
        step += 1
    for rb in (a, b):
        rb.storage.flush()
        check_rows(rb.storage, model)
        rb.storage.close()
    assert overwrites(object_history(proxy, prefix_of(s3_url))) == []


@pytest.mark.slow  # (test_s3_create_once checks the cache by default; CI runs it)
def test_a_readers_cache_keeps_the_objects_of_slots_not_created_since(s3_url, options, proxy):
    a, model = first_writer(s3_url, options), twin()
    a.extend(batch(0, 32))
    model.extend(batch(0, 32))
    b = another_writer(s3_url, options)
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)  # fetched into its cache

    block_rows = a.storage._store.meta.block_rows
    for start in range(32, 160, 8):
        rb = a if start % 16 else b
        rb.extend(batch(start, 8))
        model.extend(batch(start, 8))
        if start % 40 == 0:
            zarr_rb.save(rb)
        check_the_next_commit_from_the_cache(reader, model, proxy, block_rows)
    reader.close()
    for rb in (a, b):
        rb.storage.close()


@pytest.mark.slow  # (a second S3 server; CI runs it)
def test_shared_writers_on_a_server_that_ignores_the_condition_write_as_before(
    s3_url, options, proxy
):
    proxy.ignore_if_none_match = True
    a, model = first_writer(s3_url, options), twin()
    a.extend(batch(0, 5))
    model.extend(batch(0, 5))
    b = another_writer(s3_url, options)
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    interleaved([a, b], model, reader, step=5, seed=4, rounds=6)
    assert not a.storage._store.lifetime.creates_once
    assert "object_era" not in record_of(a)
    for rb in (a, b):
        rb.storage.close()
    reader.close()
    # Written as before: open slots written over in place, which this check sees.
    assert overwrites(object_history(proxy, prefix_of(s3_url))) != []


def _extend_in_child(url: str, options: dict, writer: int, batches: int) -> None:
    storage = ZarrStorage(path=url, storage_options=options, shared=True)
    rb = TensorDictReplayBuffer(storage=storage)
    for i in range(batches):
        rb.extend(stamped(writer, i * 7, 7))
    storage.close()


@pytest.mark.slow  # (spawned writers; two writers in one process run by default; CI runs it)
def test_spawned_shared_writers_create_objects_once(s3_url, options, proxy):
    storage = ZarrStorage(400, s3_url, storage_options=options, compression=BLOCK, shared=True)
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(stamped(0, 0, 10))
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_extend_in_child, args=(s3_url, options, writer, 12))
        for writer in (1, 2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=300)
        assert child.exitcode == 0
    storage.flush()
    assert len(rb) == 10 + 2 * 12 * 7
    rows = rb[:]
    assert torn(rows) == 0
    stamps = sorted(rows["stamp"].tolist())
    expected = sorted(list(range(10)) + [w * 1_000_000 + s for w in (1, 2) for s in range(12 * 7)])
    assert stamps == expected
    storage.close()
    history = object_history(proxy, prefix_of(s3_url))
    assert all(c for requests in history.values() for m, _, c in requests if m == "PUT")
    assert overwrites(history) == []


@pytest.mark.parametrize("map_in", ["record", "pieces"])
def test_a_commit_whose_answer_was_lost_under_another_writers_commit_counts_once(
    s3_url, options, proxy, monkeypatch, map_in
):
    """The compare-and-swap of a writer's commit lands, its answer is lost, and another
    writer commits on top before the retry reads the record back: the commit was made,
    once (applying it again committed its rows twice, or failed on the slots it had
    released), and the pieces of the map it wrote stay (other records name them)."""
    if map_in == "pieces":
        monkeypatch.setattr(runs_module, "SPAN", 8)
        monkeypatch.setattr(runs_module, "INLINE_RUNS", 0)
    a, model = first_writer(s3_url, options), twin()
    a.extend(batch(0, 5))
    model.extend(batch(0, 5))
    b = another_writer(s3_url, options)
    b.extend(batch(100, 3))
    model.extend(batch(100, 3))
    root = prefix_of(s3_url) + "zarr.json"
    armed = [True]

    def lose_and_commit_on_top(method: str, key: str) -> bool:
        if armed[0] and method == "PUT" and key == root:
            armed[0] = False
            b.extend(batch(200, 4))  # before the retry of a's PUT is refused
            return True
        return False

    proxy.lose_response = lose_and_commit_on_top
    got = a.extend(batch(300, 6))
    assert not armed[0]
    assert torch.equal(got, model.extend(batch(300, 6)))  # a's landed first
    model.extend(batch(200, 4))
    for rb in (a, b):
        rb.storage.flush()
        check_rows(rb.storage, model)
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()
    a.extend(batch(400, 2))  # and a goes on
    model.extend(batch(400, 2))
    b.storage.flush()
    check_rows(b.storage, model)
    for rb in (a, b):
        rb.storage.close()


def _killed_between_deletions_and_creations(url: str, options: dict, start: int) -> None:
    """A shared writer's second extend: SIGKILLed once it deleted its slot's leftovers,
    before it created the objects."""
    from zarr_rb.engine import once

    rounds = once.Creation.steps

    def killed(self):
        for deletion in self._cleared:
            deletion.result()
        if self._cleared:
            os.kill(os.getpid(), signal.SIGKILL)
        yield from rounds(self)

    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=url, storage_options=options, shared=True))
    rb.extend(batch(start, 8))  # committed
    once.Creation.steps = killed  # type: ignore[method-assign]
    rb.extend(batch(start + 8, 8))


def _killed_between_creations_and_commit(url: str, options: dict, start: int) -> None:
    """A shared writer's second extend: SIGKILLed once its objects were created, before
    its commit."""
    from zarr_rb.core import sharing

    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=url, storage_options=options, shared=True))
    rb.extend(batch(start, 8))  # committed

    def killed(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    sharing.Sharing.commit_rows = killed
    rb.extend(batch(start + 8, 8))


@pytest.mark.slow  # (20 s each, a spawned child; CI runs both)
@pytest.mark.parametrize(
    "killed",
    [_killed_between_deletions_and_creations, _killed_between_creations_and_commit],
    ids=["after-deletions", "before-commit"],
)
def test_a_shared_writer_killed_mid_write_loses_only_that_write(s3_url, options, proxy, killed):
    """The other writers go on (the killed one's slots retired once its lease expired), a
    reader with a cache reads every committed row, and no object is written over."""
    options = {**options, "lease_seconds": 1.0}
    a, model = first_writer(s3_url, options), twin()
    step = 0
    for _ in range(8):  # the ring wraps: free slots hold objects
        a.extend(batch(step, 13))
        model.extend(batch(step, 13))
        step += 13
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    child = multiprocessing.get_context("spawn").Process(
        target=killed, args=(s3_url, options, 1000)
    )
    child.start()
    child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL
    model.extend(batch(1000, 8))  # its first extend, committed; the second lost
    b = another_writer(s3_url, options)
    for _ in range(4):
        for rb in (a, b):
            rb.extend(batch(step, 11))
            model.extend(batch(step, 11))
            step += 11
        reader.refresh()
        check_rows(reader, model)
    zarr_rb.save(b)
    for rb in (a, b):
        rb.storage.flush()
        check_rows(rb.storage, model)
        rb.storage.close()
    reader.refresh()
    check_rows(reader, model)
    reader.close()
    assert overwrites(object_history(proxy, prefix_of(s3_url))) == []
