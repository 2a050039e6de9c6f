"""Leaves stored as frames on S3 (SeaweedFS), where every data object is created once: the
cells and frame ids of a block are made whole from the rows written (the rows a moved block
keeps copied by value), never written over, and every row reads back bit for bit as
TorchRL's storage has it, through the writer and through readers."""

from __future__ import annotations

import collections
import random

import torch
from conftest import assert_identical
from s3_proxy import S3Proxy
from tensordict import TensorDict
from test_frames_on_disk import episodes
from test_s3_create_once import overwrites, prefix_of
from torchrl.data import LazyTensorStorage, RoundRobinWriter, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage

CAPACITY = 40
FRAMES = Compression(frames=True, block_rows=8, large_row_bytes=256)


def twin() -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY), writer=RoundRobinWriter(), batch_size=8
    )


def check_rows(storage: ZarrStorage, model: TensorDictReplayBuffer) -> None:
    """Every row of ``[0, len)`` as the model has it."""
    assert len(storage) == len(model.storage)
    rows = torch.arange(len(storage))
    assert_identical(storage.get(rows).exclude("index"), model.storage.get(rows).exclude("index"))


def frames_objects(proxy: S3Proxy, prefix: str) -> dict[str, list[tuple[str, int, bool]]]:
    """Per object of the frames leaves (cells under ``data/``, ids under ``frame_ids/``)
    and of the others: the PUTs and DELETEs that reached the server, in order."""
    out: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for method, key, status, conditional in proxy.log:
        stored = key.startswith((prefix + "data/", prefix + "frame_ids/"))
        if stored and not key.endswith("zarr.json") and method in ("PUT", "DELETE"):
            out[key].append((method, status, conditional))
    return out


def assert_created_once(proxy: S3Proxy, url: str) -> None:
    history = frames_objects(proxy, prefix_of(url))
    ids = [key for key in history if "/frame_ids/" in f"/{key}"]
    assert ids, "no object of frame ids was written"
    puts = [r for requests in history.values() for r in requests if r[0] == "PUT"]
    assert all(conditional for _, _, conditional in puts)  # every PUT a conditional create
    assert overwrites(history) == []


def test_one_writer_creates_every_object_of_the_frames_once(s3_url, options, proxy):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=options, compression=FRAMES),
        batch_size=8,
    )
    model = twin()
    for buffer in (rb, model):
        buffer.extend(episodes(0, 5))
    rb.storage.flush()  # (the store is made at the first write)
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    draw = random.Random(1)
    step = 5
    for turn in range(24):  # the ring wraps several times; blocks filled in several writes
        n = draw.choice([1, 3, 8, 13, 21])
        rb.extend(episodes(step, n))
        model.extend(episodes(step, n))
        step += n
        if draw.random() < 0.5:
            rb.storage.flush()
            check_rows(rb.storage, model)
            reader.refresh()
            check_rows(reader, model)
        if turn == 12:
            zarr_rb.save(rb, progress=False)  # collects the slots no record refers to
    assert rb.storage._store.lifetime.creates_once
    assert rb.storage._store.schema.frames
    rb.storage.close()
    reopened = ZarrStorage(path=s3_url, storage_options=options)
    check_rows(reopened, model)
    reopened.close()
    reader.close()
    assert_created_once(proxy, s3_url)
    assert zarr_rb.verify(s3_url, storage_options=options).ok


def test_shared_writers_create_every_object_of_the_frames_once(s3_url, options, proxy):
    first = ZarrStorage(CAPACITY, s3_url, storage_options=options, compression=FRAMES, shared=True)
    writers = [first, ZarrStorage(path=s3_url, storage_options=options, shared=True)]
    buffers = [TensorDictReplayBuffer(storage=storage, batch_size=8) for storage in writers]
    model = twin()
    draw = random.Random(2)
    step = 0
    for _ in range(16):
        rb = draw.choice(buffers)
        n = draw.choice([1, 3, 8, 13])
        assert torch.equal(rb.extend(episodes(step, n)), model.extend(episodes(step, n)))
        step += n
        if len(model) >= 3 and draw.random() < 0.3:  # given rows, of obs alone (the rest kept)
            rows = torch.tensor(sorted(draw.sample(range(len(model)), 3)))
            patch = TensorDict({"obs": episodes(step, 3)["obs"]}, batch_size=[3])
            draw.choice(writers)[rows] = patch
            model.storage[rows] = patch
            step += 3
    for storage in writers:
        storage.refresh()
        check_rows(storage, model)
    assert writers[1]._store.lifetime.creates_once
    for storage in writers:
        storage.close()
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    check_rows(reader, model)
    reader.close()
    assert_created_once(proxy, s3_url)
