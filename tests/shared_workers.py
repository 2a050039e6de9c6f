"""Process targets for the many-writer tests (spawned children import them by name).

Every row a worker writes is stamped: ``stamp = writer * 1_000_000 + step``, and every
other leaf is derived from the stamp, so a reader can tell a torn row (leaves of two
writes) from a whole one, and count each writer's rows.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict import TensorDict

from zarr_rb import RowsNotCommittedError, ZarrStorage

WRITER_STRIDE = 1_000_000


def stamped(writer: int, first: int, count: int) -> TensorDict:
    stamp = writer * WRITER_STRIDE + torch.arange(first, first + count)
    pixel = (stamp % 251).to(torch.uint8).view(-1, 1, 1).expand(-1, 8, 8).clone()
    return TensorDict(
        {
            "stamp": stamp,
            "obs": pixel,
            "reward": stamp.double() / 7,
            "next": {"obs": pixel + 1, "done": stamp % 5 == 0},
        },
        batch_size=[count],
    )


def torn(data: Any) -> int:
    """How many rows of ``data`` hold leaves of different writes."""
    stamp = data["stamp"]
    pixel = (stamp % 251).to(torch.uint8).view(-1, 1, 1)
    whole = (
        (data["obs"] == pixel).flatten(1).all(1)
        & (data["next", "obs"] == pixel + 1).flatten(1).all(1)
        & (data["reward"] == stamp.double() / 7)
        & (data["next", "done"] == (stamp % 5 == 0))
    )
    return int((~whole).sum())


def extend_buffer(
    rb: Any, writer: int, batches: int, batch: int, done: Any = None, go: Any = None
) -> None:
    """A child given the buffer itself (pickled as a handle): extend it, report each
    batch's returned index on ``done`` (a queue); with ``go`` (a queue), wait for a word
    there before each batch after the first."""
    for i in range(batches):
        if go is not None and i:
            go.get(timeout=60)
        index = rb.extend(stamped(writer, i * batch, batch))
        if done is not None:
            done.put((writer, i, index.tolist()))
    rb.storage.close()


def independent_writer(
    url: str, writer: int, batches: int, batch: int, options: Any, progress: Any, pause: float
) -> None:
    """A writer that opens the store itself (``shared=True``), as a Ray actor or another
    machine would; reports each batch written on ``progress``."""
    storage = ZarrStorage(path=url, mode="r+", shared=True, storage_options=options)
    progress.put(("pid", writer, os.getpid()))
    for i in range(batches):
        storage.set(torch.arange(batch), stamped(writer, i * batch, batch))
        progress.put(("batch", writer, i))
        time.sleep(pause)
    storage.close()
    progress.put(("done", writer, 0))


def sampling_reader(url: str, options: Any, seconds: float, results: Any) -> None:
    """A reader process sampling throughout; reports rows read and rows torn."""
    storage = ZarrStorage(path=url, read_only=True, storage_options=options, refresh_interval=0)
    g = torch.Generator().manual_seed(os.getpid())
    read = bad = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        n = len(storage)
        readable = sorted(set(range(n)) - set(storage._store.unreadable_rows().tolist()))
        if not readable:
            time.sleep(0.01)
            continue
        pick = torch.tensor(readable)[torch.randint(len(readable), (32,), generator=g)]
        try:
            data = storage.get(pick)
        except RowsNotCommittedError:  # rows withdrawn since the refresh: try again
            continue
        read += 32
        bad += torn(data)
    storage.close()
    results.put((read, bad))
