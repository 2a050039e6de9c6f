"""The ``"index"`` entry that TorchRL's TensorDict writers give each row holds its position,
read from any handle of a store of several writers, as ``LazyTensorStorage`` has it after the
same extends in the order they were placed.

Shared writers write a row before the commit that places it, and never write over an object,
so what they store there stands for the position, which readers put in.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.errors import UnsupportedDataError
from zarr_rb.format.index_key import POSITION_MARK


def rows(start: int, count: int) -> TensorDict:
    step = torch.arange(start, start + count)
    return TensorDict({"obs": step[:, None].expand(count, 3).float(), "step": step}, [count])


def two_writers(path, capacity: int) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer]:
    """Two buffers of TorchRL's TensorDict writers on one shared store (blocks of 4 rows)."""
    first = ZarrStorage(capacity, path, shared=True, compression=Compression(block_rows=4))
    second = ZarrStorage(path=path, shared=True)
    return TensorDictReplayBuffer(storage=first), TensorDictReplayBuffer(storage=second)


def test_index_of_rows_placed_by_shared_writers_is_their_position(tmp_path):
    path = tmp_path / "shared.zarr"
    a, b = two_writers(path, 24)
    model = TensorDictReplayBuffer(storage=LazyTensorStorage(24))
    step = 0
    for count, rb in [(5, a), (3, b), (7, a), (1, b), (6, a), (9, b), (2, a), (4, b)]:
        index = rb.extend(rows(step, count))
        assert torch.equal(index, model.extend(rows(step, count)))
        step += count
        for key in ("index", "step"):  # every row, as LazyTensorStorage has it
            got, expected = torch.as_tensor(rb[:][key]), model[:][key]
            assert torch.equal(got, expected), (step, key, got, expected)
        assert torch.equal(rb.storage[index]["index"], index)  # where extend said
    for rb in (a, b):
        rb.storage.refresh()
        got = rb.storage.get(torch.arange(len(rb)))
        assert torch.equal(got["index"], torch.arange(24))
        sample = rb.sample(32)
        assert torch.equal(rb.storage.get(sample["index"])["index"], sample["index"])
    view = zarr_rb.open(path)
    assert np.array_equal(np.asarray(view[:]["index"]), np.arange(24))
    for rb in (a, b):
        rb.storage.close()


def test_index_written_by_one_writer_then_shared_reads_as_positions(tmp_path):
    """A store a single writer started (its rows' "index" stored as written) that writers
    then share: every row's "index" is its position, before and after the turn."""
    path = tmp_path / "turned.zarr"
    solo = TensorDictReplayBuffer(
        storage=ZarrStorage(16, path, compression=Compression(block_rows=4))
    )
    solo.extend(rows(0, 6))
    solo.storage.close()
    a = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    b = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    b.extend(rows(6, 3))
    a.extend(rows(9, 12))  # wraps
    for rb in (a, b):
        assert len(rb) == 16
        assert torch.equal(torch.as_tensor(rb[:]["index"]), torch.arange(16))
    for rb in (a, b):
        rb.storage.close()
    reopened = TensorDictReplayBuffer(storage=ZarrStorage(path=path))
    assert torch.equal(torch.as_tensor(reopened[:]["index"]), torch.arange(16))
    reopened.storage.close()


def _extend_in_child(storage: ZarrStorage, start: int) -> None:
    rb = TensorDictReplayBuffer(storage=storage)
    for k in range(4):
        rb.extend(rows(start + 10 * k, 10))


def test_index_after_spawned_children_extend(tmp_path):
    path = tmp_path / "spawned.zarr"
    storage = ZarrStorage(64, path, compression=Compression(block_rows=8))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(rows(1000, 5))
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_extend_in_child, args=(storage, start)) for start in (0, 100)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    storage.refresh()
    assert len(rb) == 64  # 85 rows went into a ring of 64
    assert torch.equal(torch.as_tensor(rb[:]["index"]), torch.arange(64))
    view = zarr_rb.open(path)
    assert np.array_equal(np.asarray(view[:]["index"]), np.arange(64))
    storage.close()


def test_user_index_of_a_plain_buffer_is_kept(tmp_path):
    """A buffer whose writer leaves "index" alone keeps the values it was given."""
    path = tmp_path / "plain.zarr"
    a = ReplayBuffer(
        storage=ZarrStorage(16, path, shared=True, compression=Compression(block_rows=4))
    )
    b = ReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    for start, rb in [(0, a), (3, b), (5, a)]:
        data = rows(start, 3)
        data["index"] = torch.arange(start, start + 3) * 7 + 1
        rb.extend(data)
    got = a.storage.get(torch.arange(len(a)))
    assert torch.equal(got["index"], got["step"] * 7 + 1)
    for rb in (a, b):
        rb.storage.close()


@pytest.mark.parametrize("shared", [False, True])
def test_index_holding_the_mark_is_refused_at_the_write(tmp_path, shared):
    path = tmp_path / "marked.zarr"
    rb = ReplayBuffer(storage=ZarrStorage(16, path, shared=shared))
    first = rows(0, 3)
    first["index"] = torch.arange(3)
    rb.extend(first)
    data = rows(3, 2)
    data["index"] = torch.tensor([5, POSITION_MARK])
    with pytest.raises(UnsupportedDataError, match="'index'"):
        rb.extend(data)
    assert len(rb) == 3
    assert torch.equal(rb[:]["step"], torch.arange(3))
    rb.storage.close()


def test_index_in_the_history_of_a_shared_archive(tmp_path):
    """In an archive's history, rows that shared writers placed read their place in the
    history; the rows a single writer wrote keep the position they had in the ring."""
    path = tmp_path / "archive.zarr"
    solo = TensorDictReplayBuffer(
        storage=ZarrStorage(8, path, archive=True, compression=Compression(block_rows=4))
    )
    solo.extend(rows(0, 6))
    solo.extend(rows(6, 4))  # ring positions 0-7, then 0-1
    solo.storage.close()
    a = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    b = TensorDictReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    a.extend(rows(10, 5))
    b.extend(rows(15, 4))
    for rb in (a, b):
        rb.storage.close()
    history = zarr_rb.open(path, history=True)
    got = history[np.arange(19)]
    assert torch.equal(got["step"], torch.arange(19))
    expected = torch.cat([torch.arange(8), torch.arange(2), torch.arange(10, 19)])
    assert torch.equal(got["index"], expected)


def test_forked_reader_reads_positions(tmp_path):
    """The zarr-python reader of forked DataLoader workers puts positions in too."""
    from zarr_rb.engine.forked import ForkedReader

    path = tmp_path / "forked.zarr"
    a, b = two_writers(path, 16)
    model = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    start = 0
    for count, rb in [(3, a), (3, b), (6, a), (3, b), (3, a)]:  # 18 rows: the ring wraps
        rb.extend(rows(start, count))
        model.extend(rows(start, count))
        start += count
    schema = a.storage.schema
    assert schema is not None
    reader = ForkedReader(path, schema.leaves)
    picked = np.array([15, 0, 7, 7, 3])
    got = reader.read(picked)
    assert np.array_equal(got[("index",)], picked)
    assert np.array_equal(got[("step",)], model[picked]["step"].numpy())
    for rb in (a, b):
        rb.storage.close()


def test_user_index_equal_to_a_writers_cursor_is_kept(tmp_path):
    """A plain buffer's writer leaves "index" to the data: values that happen to equal
    its cursor (a step within an episode) are kept, wherever the rows go."""
    path = tmp_path / "plain.zarr"
    a = ReplayBuffer(
        storage=ZarrStorage(16, path, shared=True, compression=Compression(block_rows=4))
    )
    b = ReplayBuffer(storage=ZarrStorage(path=path, shared=True))
    for start, rb in [(0, a), (3, b), (6, b), (9, a)]:
        data = rows(start, 3)
        data["index"] = torch.arange(3)
        rb.extend(data)
    for rb in (a, b):
        rb.storage.refresh()
        got = rb.storage.get(torch.arange(len(rb)))
        assert torch.equal(got["index"], got["step"] % 3)
    for rb in (a, b):
        rb.storage.close()


def test_index_with_trailing_dims_through_the_zarr_python_recipe(tmp_path):
    """Rows of TensorDicts of batch [n, T] in a 1-D storage: "index" is [n, T]."""
    import zarr

    path = tmp_path / "trailing.zarr"
    a, b = two_writers(path, 16)
    model = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    start = 0
    for count, rb in [(3, a), (5, b), (4, a), (6, b)]:  # 18 rows: the ring wraps
        step = torch.arange(start, start + count)[:, None].expand(count, 4).clone()
        data = TensorDict({"step": step}, [count, 4])
        rb.extend(data)
        model.extend(data.clone())
        start += count
    assert torch.equal(torch.as_tensor(a[:]["index"]), model[:]["index"])
    for rb in (a, b):
        rb.storage.close()
    group = zarr.open_group(str(path), mode="r")
    commit = group.attrs["zarr_rb"]["commit"]
    positions = np.arange(commit["length"])
    runs = runs_of(commit)
    run = np.searchsorted(runs[:, 0], positions, side="right") - 1
    rows_ = runs[run, 1] + positions - runs[run, 0]
    index = group["data/index"].oindex[rows_]  # as docs/reading-without-zarr_rb.md does
    marked = index == -(2**62)
    each = positions.reshape(-1, *[1] * (index.ndim - 1))
    index[marked] = np.broadcast_to(each, index.shape)[marked]
    assert np.array_equal(index, model[:]["index"].numpy())


def runs_of(commit: dict) -> np.ndarray:
    import base64
    import zlib

    data = zlib.decompress(base64.b64decode(commit["runs"]["data"]))
    return np.frombuffer(data, "<i8").reshape(-1, 3)
