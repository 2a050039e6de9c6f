"""Data objects created once on S3 (``docs/design/ring.md``, step 5), through a proxy that
sees every request: no data object is ever written over, a late PUT onto one is refused,
a lost response is retried into a refusal that counts as written, a server that ignores
the condition is written as before, and a reader's cache keeps what it fetched across
commits that delete nothing.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import tensorstore as ts
import torch
from conftest import assert_identical
from s3_proxy import S3Proxy
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RoundRobinWriter, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.metadata import read_root
from zarr_rb.locations.base import NO_VALUE

CAPACITY = 40
BLOCK = Compression(block_rows=8)


def batch(start: int, n: int) -> TensorDict:
    """Rows whose every key is a function of their step number."""
    t = torch.arange(start, start + n)
    return TensorDict(
        {
            # 1 KiB rows: sharded, and read from the store (not from a writer's RAM mirror).
            "obs": ((t[:, None] * 7 + torch.arange(1024)) % 251).to(torch.uint8).view(n, 4, 16, 16),
            "action": t % 5,
            # Blocks of zeros (the fill value): stored all the same.
            "done": (t % 10 == 9)[:, None],
        },
        batch_size=[n],
    )


def prefix_of(url: str) -> str:
    """The store's keys in the bucket, as the proxy names them."""
    return url.split("/", 3)[3].rstrip("/") + "/"


def writer(url: str, options: dict) -> TensorDictReplayBuffer:
    storage = ZarrStorage(CAPACITY, url, storage_options=options, compression=BLOCK)
    return TensorDictReplayBuffer(storage=storage, batch_size=8)


def twin() -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY), writer=RoundRobinWriter(), batch_size=8
    )


def started(
    url: str, options: dict, rows: int
) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer, ZarrStorage]:
    """A writer that committed ``rows`` rows, its model, and a reader of the store."""
    rb, model = writer(url, options), twin()
    rb.extend(batch(0, rows))
    model.extend(batch(0, rows))
    rb.storage.flush()
    return rb, model, ZarrStorage(path=url, read_only=True, storage_options=options)


def check_rows(storage, model) -> None:
    """Every row of ``[0, len)`` as the model has it."""
    assert len(storage) == len(model.storage)
    rows = torch.arange(len(storage))
    got = storage.get(rows)
    if "index" in got:  # TorchRL's TensorDict writers: each row's position
        assert torch.equal(got["index"], rows)
    assert_identical(got.exclude("index"), model.storage.get(rows).exclude("index"))


def object_history(proxy: S3Proxy, prefix: str) -> dict[str, list[tuple[str, int, bool]]]:
    """Per data object: the PUTs and DELETEs that reached the server, in order."""
    out: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for method, key, status, conditional in proxy.log:
        data = key.startswith(prefix + "data/") and not key.endswith("zarr.json")
        if data and method in ("PUT", "DELETE"):
            out[key].append((method, status, conditional))
    return out


def overwrites(history: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Objects a PUT replaced while they existed (created, not deleted since)."""
    found = []
    for key, requests in history.items():
        exists = False
        for method, status, _ in requests:
            if method == "DELETE":
                exists = False
            elif status < 300:
                if exists:
                    found.append(key)
                exists = True
    return found


def workload(
    rb: TensorDictReplayBuffer, model: TensorDictReplayBuffer, reader: ZarrStorage, seed: int
) -> None:
    """Extends of every size (the ring wraps several times), flushes and a save; after
    each flush every row checked through the writer and through a reader of the store."""
    draw = random.Random(seed)
    step = 0
    for _ in range(14):
        n = draw.choice([1, 3, 8, 13, 21])
        rb.extend(batch(step, n))
        model.extend(batch(step, n))
        step += n
        if draw.random() < 0.6:
            rb.storage.flush()
            check_rows(rb.storage, model)
            reader.refresh()
            check_rows(reader, model)
    zarr_rb.save(rb)  # collects the slots no record refers to
    check_rows(rb.storage, model)
    reader.refresh()
    check_rows(reader, model)


def test_no_data_object_is_ever_written_over(s3_url, options, proxy):
    rb, model, reader = started(s3_url, options, 5)
    workload(rb, model, reader, seed=1)
    assert rb.storage._store.lifetime.creates_once
    rb.storage.close()
    reopened = writer(s3_url, options)
    check_rows(reopened.storage, model)
    workload(reopened, model, reader, seed=2)
    reopened.storage.close()
    reader.close()

    history = object_history(proxy, prefix_of(s3_url))
    puts = [r for requests in history.values() for r in requests if r[0] == "PUT"]
    assert len(puts) > 50
    assert all(conditional for _, _, conditional in puts)  # every PUT a conditional create
    assert overwrites(history) == []
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()


@pytest.mark.slow  # (the default run checks the same fallback with shared writers)
def test_a_server_that_ignores_the_condition_is_written_as_before(s3_url, options, proxy):
    proxy.ignore_if_none_match = True
    rb, model, reader = started(s3_url, options, 5)
    workload(rb, model, reader, seed=3)
    reader.close()
    assert not rb.storage._store.lifetime.creates_once
    record = read_root(rb.storage._store.engine)
    assert "object_era" not in record["attributes"]["zarr_rb"]["commit"]
    rb.storage.close()
    history = object_history(proxy, prefix_of(s3_url))
    # Written as before: objects written over in place, which this check sees.
    assert overwrites(history) != []
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()


def test_a_late_put_onto_an_object_another_writer_created_is_refused(s3_url, options, proxy):
    rb, model = writer(s3_url, options), twin()
    rb.extend(batch(0, 24))
    model.extend(batch(0, 24))
    rb.storage.flush()
    key = next(k for k in object_history(proxy, prefix_of(s3_url)) if "/obs/" in k).removeprefix(
        prefix_of(s3_url)
    )
    # What a stalled writer's PUT in flight sends: a conditional create, other bytes.
    kvstore = ts.KvStore.open(rb.storage._store.engine.location.kvstore("")).result()
    before = kvstore.read(key).result().value
    result = kvstore.write(key, b"late bytes of a stalled writer", if_equal=NO_VALUE).result()
    assert not result.generation  # refused
    assert kvstore.read(key).result().value == before
    rb.storage.close()
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()


def test_a_lost_response_is_retried_into_a_refusal_that_counts_as_written(s3_url, options, proxy):
    prefix = prefix_of(s3_url)
    lost: list[str] = []

    def lose_the_first_data_put(method: str, key: str) -> bool:
        if method == "PUT" and key.startswith(prefix + "data/obs/c.") and not lost:
            lost.append(key)
            return True
        return False

    proxy.lose_response = lose_the_first_data_put
    rb, model = writer(s3_url, options), twin()
    rb.extend(batch(0, 16))
    model.extend(batch(0, 16))
    rb.storage.flush()
    assert lost
    requests = object_history(proxy, prefix)[lost[0]]
    assert requests[:2] == [("PUT", 200, True), ("PUT", 412, True)]  # landed, then refused
    assert all(method == "PUT" for method, _, _ in requests)  # and never deleted
    check_rows(rb.storage, model)
    rb.storage.close()


def check_the_next_commit_from_the_cache(
    reader: ZarrStorage, model: TensorDictReplayBuffer, proxy: S3Proxy, block_rows: int
) -> None:
    """The reader picks up the next commit: it lists slots created since, the rows of the
    other slots read from the reader's cache with no data request, and every row as the
    model has it."""
    prefix = prefix_of(reader.url)

    def data_gets() -> int:
        return sum(
            1
            for method, key, _, _ in proxy.log
            if method == "GET" and key.startswith(prefix + "data/")
        )

    before = reader._store.committed
    reader.refresh()
    commit = reader._store.committed
    created = commit.slots_created_since(before)
    assert created is not None
    assert len(created) > 0
    positions = torch.arange(len(reader))
    slots = commit.physical(positions.numpy()) // block_rows
    kept = positions[~torch.from_numpy(np.isin(slots, created))]
    assert kept.numel() > 0
    gets = data_gets()
    expected = model.storage.get(kept).exclude("index")
    assert_identical(reader.get(kept).exclude("index"), expected)
    assert data_gets() == gets  # from the cache: no revalidation
    check_rows(reader, model)  # and the new slots' rows as written


def test_a_readers_cache_refetches_only_the_objects_created_since(s3_url, options, proxy):
    rb, model, reader = started(s3_url, options, 32)
    check_rows(reader, model)  # fetched into its cache

    # The ring wraps, the writer saves (which deletes the objects no record names) and
    # takes slots again whose objects it deletes and creates anew: after each commit the
    # reader reads the rows of the other slots from its cache, without a request, and the
    # rows of the new slots as written.
    block_rows = rb.storage._store.meta.block_rows
    for start in range(32, 160, 8):
        rb.extend(batch(start, 8))
        model.extend(batch(start, 8))
        rb.storage.flush()
        if start % 24 == 0:
            zarr_rb.save(rb)
        check_the_next_commit_from_the_cache(reader, model, proxy, block_rows)
    reader.close()
    rb.storage.close()


@pytest.mark.parametrize("meanwhile", ["refresh", "read"])
def test_a_record_published_mid_write_leaves_no_slot_cached_stale(s3_url, options, meanwhile):
    """Writes of some keys wait for the next commit; a later one that needs more slots
    publishes a record reserving them (the same generation: no row committed) whose era
    lists the slots written so far. A reader that picks that record up (a refresh, or the
    check after any read) drops their cached objects then, not at the next generation."""
    rb, model = writer(s3_url, options), twin()
    reader = None
    step = 0
    for _ in range(3):  # the ring turns twice, each turn into five other slots
        rb.extend(batch(step, CAPACITY))
        model.extend(batch(step, CAPACITY))
        step += CAPACITY
        rb.storage.flush()
        reader = reader or ZarrStorage(path=s3_url, read_only=True, storage_options=options)
        reader.refresh()
        check_rows(reader, model)  # every slot named so far cached
    assert reader is not None
    # Slots of the first turn are free now (the writer keeps the two last commits' for
    # readers) and cached by the reader with older rows; writes of one key move each block
    # into one of them, uncommitted.
    generation = rb.storage._store.committed.generation
    for block in range(5):
        rows = torch.arange(block * 8, block * 8 + 8)
        patch = TensorDict({"action": torch.full((8,), 100 + block)}, batch_size=[8])
        rb.storage.set(rows, patch)
        model.storage.set(rows, patch)
    # No slot is free for block 0 again: the arrays grow, a record reserves the new slot.
    rows = torch.arange(0, 8)
    patch = TensorDict({"action": torch.full((8,), 200)}, batch_size=[8])
    rb.storage.set(rows, patch)
    model.storage.set(rows, patch)
    assert rb.storage._store.committed.generation == generation  # nothing committed yet
    if meanwhile == "refresh":
        reader.refresh()
    else:
        reader.get(torch.arange(8))
    era = reader._store.committed.object_era
    assert era is not None
    written = rb.storage._store.committed.object_era
    assert written is not None
    assert len(set(written.slots[-5:])) == 5
    assert set(era.slots[-5:]) == set(written.slots[-5:])  # the reserving record, picked up
    rb.storage.flush()
    reader.refresh()
    check_rows(rb.storage, model)
    check_rows(reader, model)
    reader.close()
    rb.storage.close()
