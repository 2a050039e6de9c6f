"""A reader process sees only committed rows, never a torn transition, while a writer extends."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torchrl.data import ReplayBuffer

import zarr_rb
from zarr_rb import RowsNotCommittedError, ZarrStorage

CAPACITY = 96
BATCH = 10
BATCHES = 40  # four times around the ring

WRITER = textwrap.dedent(
    f"""
    import sys, time, torch
    from tensordict import TensorDict
    from zarr_rb import Compression, ZarrStorage

    storage = ZarrStorage({CAPACITY}, sys.argv[1], compression=Compression(block_rows=16))
    cursor = 0
    for batch in range({BATCHES}):
        stamp = torch.arange(batch * {BATCH}, (batch + 1) * {BATCH})
        obs = (stamp % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 4, 16, 16).clone()
        data = TensorDict(
            {{"stamp": stamp, "obs": obs, "next": {{"obs": obs + 1}}}}, batch_size=[{BATCH}]
        )
        storage.set((torch.arange({BATCH}) + cursor) % {CAPACITY}, data)
        cursor = (cursor + {BATCH}) % {CAPACITY}
        if batch % 7 == 6:
            storage.flush()
        time.sleep(0.01)
    storage.close()
    """
)


def check_rows(data, rows: torch.Tensor) -> None:
    """Every leaf of every row comes from the same transition, at the right slot."""
    stamp = data["stamp"]
    assert torch.equal(stamp % CAPACITY, rows), "a row holds another slot's transition"
    expected = (stamp % 251).to(torch.uint8).view(-1, 1, 1, 1)
    assert (data["obs"] == expected).all(), "obs torn from stamp"
    assert (data["next", "obs"] == expected + 1).all(), "next/obs torn from stamp"


@pytest.fixture(params=["local", "s3"])
def shared_store(request, store_path):
    """Where the writer and reader processes meet: a directory, or an S3 prefix (the
    writer subprocess finds its credentials in the AWS_* environment variables)."""
    if request.param == "local":
        return str(store_path), None, None
    server = request.getfixturevalue("s3_server")
    url = request.getfixturevalue("s3_url")
    return url, server.storage_options(), {**os.environ, **server.env()}


def test_reader_sees_only_committed_rows_while_writer_extends(shared_store):
    path, options, env = shared_store
    # The store first (a store is made at its first write: a save of the empty buffer).
    empty = ReplayBuffer(storage=ZarrStorage(CAPACITY, path, storage_options=options))
    zarr_rb.save(empty)
    empty.storage.close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], env=env)
    reader = ZarrStorage(path=path, read_only=True, storage_options=options)
    g = torch.Generator().manual_seed(0)
    lengths, reads, withheld = [], 0, 0
    try:
        while writer.poll() is None or reads == 0:
            if writer.poll() not in (None, 0):
                break  # the writer failed: reported below
            reader.refresh()
            n = len(reader)
            lengths.append(n)
            if n == 0:
                time.sleep(0.005)
                continue
            rows = torch.randint(0, n, (16,), generator=g)
            try:
                data = reader.get(rows)
            except RowsNotCommittedError:
                withheld += 1  # rows being rewritten are withdrawn, never served torn
                continue
            check_rows(data, rows)
            reads += 1
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert reads > 5
    # Length never shrinks and never passes capacity.
    assert all(a <= b for a, b in itertools.pairwise(lengths))
    assert max(lengths) <= CAPACITY

    reader.refresh()
    assert len(reader) == CAPACITY
    everything = reader.get(torch.arange(CAPACITY))
    check_rows(everything, torch.arange(CAPACITY))
    newest = set(range((BATCHES * BATCH) - CAPACITY, BATCHES * BATCH))
    assert set(everything["stamp"].tolist()) == newest


def test_reader_does_not_see_rows_held_in_ram(store_path):
    writer = ZarrStorage(1000, store_path)
    writer.set(torch.arange(5), torch.arange(5.0).unsqueeze(-1))
    reader = ZarrStorage(path=store_path, read_only=True)
    assert len(reader) == 0
    writer.flush()
    reader.refresh()
    assert len(reader) == 5
    assert torch.equal(reader.get(torch.arange(5)), torch.arange(5.0).unsqueeze(-1))
    with pytest.raises(IndexError):
        reader.get(np.array([5]))
