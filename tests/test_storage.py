"""ZarrStorage on its own: bit-exact round trips, index forms, reopen, lazy views."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict, tensorclass
from torchrl.data import LazyTensorStorage

import zarr_rb
from zarr_rb import Compression, LazyColumn, ZarrStorage

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
]


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def random_tensor(shape, dtype, generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 1e3
        values = values.to(dtype)
        flat = values.view(-1)
        if flat.numel() > 3:  # special values survive bit-exactly
            flat[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
        return values
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(
        dtype
    )


def make_data(kind: str, dtype: torch.dtype, batch: tuple[int, ...], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "tensor":
        return random_tensor((*batch, 3, 2), dtype, g)
    if kind == "tensorclass":
        return Transition(
            obs=random_tensor((*batch, 2, 4, 4), dtype, g),
            reward=random_tensor((*batch, 1), dtype, g),
            batch_size=list(batch),
        )
    return TensorDict(
        {
            "obs": random_tensor((*batch, 2, 4, 4), dtype, g),
            "scalar": random_tensor(batch, dtype, g),
            "next": {"obs": random_tensor((*batch, 2, 4, 4), dtype, g)},
            ("deep", "er", "still"): random_tensor((*batch, 5), dtype, g),
        },
        batch_size=list(batch),
    )


@pytest.mark.parametrize("kind", ["tensor", "tensordict", "tensorclass"])
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bit_exact_after_reopen(store_path, kind, ndim, dtype):
    batch = (10,) if ndim == 1 else (10, 3)
    max_size = 16 if ndim == 1 else 48
    data = make_data(kind, dtype, batch)
    storage = ZarrStorage(max_size, store_path, ndim=ndim)
    reference = LazyTensorStorage(max_size, ndim=ndim)
    for s in (storage, reference):
        s.set(torch.arange(10), data)
    assert len(storage) == len(reference)
    assert_identical(storage.get(torch.arange(10)), reference.get(torch.arange(10)))
    storage.close()

    reopened = ZarrStorage(max_size, store_path, ndim=ndim)
    assert len(reopened) == len(reference)
    assert_identical(reopened.get(torch.arange(10)), reference.get(torch.arange(10)))
    assert_identical(reopened[:], reference[:])
    reopened.close()


@pytest.fixture
def pair():
    """The same data in a ZarrStorage and a LazyTensorStorage, 30 rows out of 40."""
    data = make_data("tensordict", torch.float32, (30,))
    storage = ZarrStorage(40, compression=Compression(block_rows=8))
    reference = LazyTensorStorage(40)
    for s in (storage, reference):
        s.set(torch.arange(30), data)
    yield storage, reference
    storage.close()


INDICES = [
    0,
    29,
    -1,
    slice(None),
    slice(3, 17),
    slice(2, 29, 3),
    slice(25, 100),
    [4, 1, 4, 28],
    torch.tensor([7, 7, 0, 13]),
    torch.tensor([[1, 2, 3], [27, 2, 0]]),
    np.array([5, 9]),
    torch.arange(30) % 2 == 0,
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_get_index_forms_match_torchrl(pair, index):
    storage, reference = pair
    assert_identical(storage.get(index), reference.get(index))


@pytest.mark.parametrize(
    "index",
    [0, 39, -1, slice(0, 8), slice(35, 40), [3, 1, 3], torch.tensor([[5, 6], [38, 0]])],
    ids=repr,
)
def test_set_index_forms_match_torchrl(pair, index):
    storage, reference = pair
    target = reference._storage[index]
    update = make_data("tensordict", torch.float32, tuple(target.batch_size), seed=5)
    if isinstance(index, list):
        # Duplicate indices: the last write wins in both storages.
        update[2] = update[0]
    for s in (storage, reference):
        s.set(index, update, set_cursor=False)
    assert len(storage) == len(reference)
    assert_identical(storage.get(torch.arange(len(reference))), reference.get(torch.arange(30)))
    storage.flush()
    assert_identical(storage.get(slice(0, 30)), reference.get(slice(0, 30)))


def test_wrap_around_cursor_and_reopen(store_path):
    compression = Compression(block_rows=8)
    storage = ZarrStorage(20, store_path, compression=compression)
    reference = LazyTensorStorage(20)
    cursor = 0
    for step in range(9):
        data = make_data("tensordict", torch.float32, (7,), seed=step)
        index = (torch.arange(7) + cursor) % 20
        cursor = (cursor + 7) % 20
        for s in (storage, reference):
            s.set(index, data)
        assert len(storage) == len(reference)
        rows = torch.arange(len(reference))
        assert_identical(storage.get(rows), reference.get(rows))
    storage.close()
    reopened = ZarrStorage(20, store_path)
    assert len(reopened) == 20
    assert reopened._last_cursor_index == (cursor - 1) % 20
    assert reopened.cursor == cursor
    assert_identical(reopened.get(torch.arange(20)), reference.get(torch.arange(20)))


def test_ndim2_tuple_indices_match_torchrl():
    data = make_data("tensordict", torch.float32, (6, 4))
    storage = ZarrStorage(40, ndim=2)
    reference = LazyTensorStorage(40, ndim=2)
    for s in (storage, reference):
        s.set(torch.arange(6), data)
    assert storage.shape == reference.shape
    index = (torch.tensor([0, 5, 5, 2]), torch.tensor([3, 0, 1, 3]))
    assert_identical(storage.get(index), reference.get(index))
    patch = make_data("tensordict", torch.float32, (4,), seed=3)
    for s in (storage, reference):
        s.set(index, patch, set_cursor=False)
    assert_identical(storage.get(slice(None)), reference.get(slice(None)))


def test_lazy_full_view_reads_only_the_keys_asked(store_path, monkeypatch):
    storage = ZarrStorage(64, store_path)
    data = make_data("tensordict", torch.uint8, (40,))
    storage.set(torch.arange(40), data)
    storage.flush()
    read_keys: list[tuple[str, ...]] = []
    original = storage._store.read

    def spy(rows, keys, **kwargs):
        keys = list(keys)
        read_keys.extend(keys)
        return original(rows, keys, **kwargs)

    monkeypatch.setattr(storage._store, "read", spy)
    view = storage[:]
    assert isinstance(view["obs"], LazyColumn)
    assert read_keys == []
    assert_identical(view["scalar"].clone(), data["scalar"])
    assert read_keys == [("scalar",)]
    assert_identical(view["next", "obs"][7], data["next", "obs"][7])
    assert_identical(view["obs"][3:9], data["obs"][3:9])
    assert_identical(view["obs"][torch.tensor([9, 2])], data["obs"][torch.tensor([9, 2])])
    assert ("deep", "er", "still") not in read_keys


def test_rows_in_ram_are_visible_then_written_on_flush(store_path):
    storage = ZarrStorage(1000, store_path, compression=Compression(block_rows=64))
    data = make_data("tensordict", torch.float32, (10,))
    storage.set(torch.arange(10), data)
    # Ten rows do not fill a 64-row block: they are in RAM, not yet committed.
    assert storage._store.committed.length == 0
    assert_identical(storage.get(torch.arange(10)), data)
    storage.flush()
    assert storage._store.committed.length == 10
    reader = ZarrStorage(path=store_path, read_only=True)
    assert_identical(reader.get(torch.arange(10)), data)


def test_full_blocks_are_written_and_committed_during_extend(store_path):
    storage = ZarrStorage(1000, store_path, compression=Compression(block_rows=64))
    storage.set(torch.arange(150), make_data("tensordict", torch.float32, (150,)))
    assert storage._store.committed.length == 128
    assert len(storage) == 150


def test_a_store_of_a_billion_rows_holding_a_few_costs_what_the_few_cost(store_path):
    # Commits, reads and reopening track the rows written, not max_size: a mask over a
    # billion rows would be a gigabyte per commit (numpy's allocations are traced).
    import tracemalloc

    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    data = TensorDict(
        {
            "obs": torch.arange(3000.0).unsqueeze(-1).expand(-1, 4).clone(),
            "done": torch.zeros(3000, dtype=torch.bool),
        },
        batch_size=[3000],
    )
    tracemalloc.start()
    try:
        rb = TensorDictReplayBuffer(
            storage=ZarrStorage(10**9, store_path), sampler=RandomSampler(), batch_size=64
        )
        for start in range(0, 3000, 500):
            rb.extend(data[start : start + 500])
            rb.storage.flush()
        rb.storage.set(torch.arange(10, 20), data[:10])  # rows rewritten in place
        rb.storage.flush()
        sample = rb.sample()
        rb.storage.close()
        reopened = ZarrStorage(path=store_path)
        got = reopened.get(torch.arange(3000))
        reopened.close()
        report = zarr_rb.verify(store_path)  # a check reads the rows committed, not max_size
        reopened = ZarrStorage(path=store_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = data.clone()
    expected[10:20] = data[:10]
    # TorchRL counts the rows set again in len: rows 3000-3009, never written, are holes.
    assert len(reopened) == 3010
    assert reopened.unreadable_rows().tolist() == list(range(3000, 3010))
    assert torch.equal(got["obs"], expected["obs"])
    assert torch.equal(got["done"], expected["done"])
    assert torch.equal(sample["obs"], expected["obs"][sample["index"]])
    assert report.ok
    assert report.rows_checked == 3000
    assert peak < 64 * 2**20
    reopened.close()


def frames(first: int, count: int) -> TensorDict:
    """Rows of 4 KiB frames (a large leaf) and small leaves, each a function of its step."""
    step = torch.arange(first, first + count)
    return TensorDict(
        {
            "obs": (step % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 4, 32, 32).clone(),
            "step": step,
            "next": {"done": step % 7 == 0, "reward": step.float() / 3},
        },
        batch_size=[count],
    )


def test_ram_bytes_keeps_frames_in_ram_and_returns_what_a_lazy_tensor_storage_does(store_path):
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    def buffer(storage):
        return TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)

    zarr = buffer(ZarrStorage(128, store_path, ram_bytes=2**20))
    twin = buffer(LazyTensorStorage(128))
    for start in range(0, 200, 50):  # around the ring and past its start
        zarr.extend(frames(start, 50))
        twin.extend(frames(start, 50))
    rows = torch.tensor([3, 70, 71, 127])  # scattered writes, in place
    zarr.storage.set(rows, frames(1000, 4), set_cursor=False)
    twin.storage.set(rows, frames(1000, 4), set_cursor=False)
    for seed in range(5):
        torch.manual_seed(seed)
        got = zarr.sample()
        torch.manual_seed(seed)
        assert_identical(got, twin.sample())
    assert resident(zarr.storage).all()  # the frames are gathered in RAM
    everything = torch.arange(128)
    assert_identical(zarr.storage.get(everything), twin.storage.get(everything))
    zarr.storage.close()
    reopened = ZarrStorage(path=store_path, ram_bytes=2**20)  # the copy in RAM read back
    assert_identical(reopened.get(everything), twin.storage.get(everything))
    assert resident(reopened).all()
    reopened.close()


def test_frames_past_ram_bytes_are_read_from_the_store_again(store_path):
    row = 4 * 32 * 32 + 8 + 1 + 4  # bytes of one row of frames()
    storage = ZarrStorage(100, store_path, ram_bytes=10 * row)
    storage.set(torch.arange(8), frames(0, 8))
    assert_identical(storage.get(torch.arange(8)), frames(0, 8))
    assert resident(storage)[:8].all()
    storage.set(torch.arange(8, 60), frames(8, 52))  # 60 rows: past what RAM may hold
    held = resident(storage)
    assert not held[:40].any()
    assert held[56:60].all()  # the newest rows stay
    assert ("step",) in storage._store.ram.mirror  # small leaves stay (within 256 MiB)
    assert_identical(storage.get(torch.arange(60)), frames(0, 60))
    storage.close()


def resident(storage: ZarrStorage) -> np.ndarray:
    """Which rows of ``storage`` its RAM tier holds."""
    tier = storage._store.ram.frames
    return np.zeros(storage._store.rows, bool) if tier is None else tier.resident.copy()


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor`` held in RAM (Linux: a present bit per page in
    ``/proc/self/pagemap``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = tensor.data_ptr() // page
    last = (tensor.data_ptr() + tensor.untyped_storage().nbytes() - 1) // page
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        entries = np.frombuffer(fh.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap")
def test_a_copy_in_ram_takes_memory_only_for_the_rows_written(store_path):
    capacity = 4096  # a 16 MiB copy of the frames, allocated at the first write
    storage = ZarrStorage(capacity, store_path, ram_bytes=2**26)
    twin = LazyTensorStorage(capacity)
    for start in range(0, 300, 100):
        storage.set(torch.arange(start, start + 100), frames(start, 100))
        twin.set(torch.arange(start, start + 100), frames(start, 100))
    scattered = torch.tensor([250, 7, 120])
    storage.set(scattered, frames(5000, 3), set_cursor=False)
    twin.set(scattered, frames(5000, 3), set_cursor=False)
    tier = storage._store.ram.frames
    pool = tier._pools[("obs",)].frames
    assert pool.untyped_storage().nbytes() >= capacity * 4 * 32 * 32  # room for every row
    assert resident_bytes(pool) <= 303 * 4 * 32 * 32  # the rows written
    assert_identical(storage.get(torch.arange(300)), twin.get(torch.arange(300)))
    storage.close()


def test_a_buffer_loaded_with_ram_bytes_samples_its_frames_from_ram(store_path):
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=ZarrStorage(64, store_path), batch_size=16)
    rb.extend(frames(0, 40))
    torch.manual_seed(1)
    zarr_rb.save(rb)
    expected = rb.sample()
    rb.storage.close()
    loaded = zarr_rb.load(store_path, ram_bytes=2**20)
    torch.manual_seed(1)
    assert_identical(loaded.sample(), expected)
    assert resident(loaded.storage)[:40].all()
    loaded.storage.close()
    with pytest.raises(ValueError, match="ram_bytes is for storage='zarr'"):
        zarr_rb.load(store_path, storage="memory", ram_bytes=2**20)


@pytest.mark.parametrize(
    ("ram_bytes", "error"),
    [(-1, ValueError), ("1G", TypeError), (True, TypeError), (1.5, TypeError)],
)
def test_ram_bytes_must_be_a_number_of_bytes(store_path, ram_bytes, error):
    with pytest.raises(error, match="ram_bytes"):
        ZarrStorage(10, store_path, ram_bytes=ram_bytes)
    assert not store_path.exists()


def test_empty_then_refill(store_path):
    storage = ZarrStorage(30, store_path)
    storage.set(torch.arange(20), make_data("tensordict", torch.float32, (20,)))
    storage._empty()
    assert len(storage) == 0
    fresh = make_data("tensordict", torch.float32, (5,), seed=9)
    storage.set(torch.arange(5), fresh)
    assert_identical(storage[:], fresh)
    storage.close()
    assert len(ZarrStorage(30, store_path)) == 5


def test_state_dict_round_trip(tmp_path):
    source = ZarrStorage(50, tmp_path / "a.zarr")
    data = make_data("tensordict", torch.int32, (25,))
    source.set(torch.arange(25), data)
    state = source.state_dict()
    assert state["_len"] == 25

    same = ZarrStorage(50, tmp_path / "a.zarr", read_only=True)
    assert len(same) == 25
    copy = ZarrStorage(50, tmp_path / "b.zarr")
    copy.load_state_dict(state)
    assert len(copy) == 25
    assert_identical(copy[:], data)


def test_temporary_store_is_removed_when_storage_is_collected():
    storage = ZarrStorage(10)
    storage.set(torch.arange(3), torch.ones(3, 2))
    path = storage.path
    assert path.exists()
    del storage
    import gc

    gc.collect()
    assert not path.parent.exists()


def test_compression_settings_are_applied(store_path):
    import zarr

    frames = torch.zeros(300, 4, 84, 84, dtype=torch.uint8)
    frames[:, :, 20:40, 30:50] = 200
    # (frames=False: stacks, whose chunks are asserted; frames have their own layout.)
    compression = Compression(chunk_rows=2, frames=False)
    storage = ZarrStorage(20_000, store_path, compression=compression)
    storage.set(torch.arange(300), TensorDict({"obs": frames, "r": torch.ones(300)}, [300]))
    storage.close()
    group = zarr.open_group(store_path, mode="r")
    obs = group["data/obs"]
    assert obs.chunks == (2, 4, 84, 84)
    assert obs.shards is not None
    assert obs.shards[0] >= 256
    assert group["data/r"].shards is None
    assert storage.nbytes_on_disk() < frames.numel() / 20


def test_each_codec_has_its_default_level_and_refuses_levels_it_cannot_take(store_path):
    """zstd's default is its fast level -1 (recorded with the store, so a reopen keeps it),
    lz4's 1; a level out of a codec's range is refused when the settings are made, naming
    the codec and its range."""
    import zarr

    assert Compression().level == -1
    assert Compression(codec="lz4").level == 1
    assert Compression(level=3).level == 3
    with pytest.raises(ValueError, match="lz4 compression level from 0 to 9, got -1"):
        Compression(codec="lz4", level=-1)
    with pytest.raises(ValueError, match="zstd compression level from -131072 to 22, got 23"):
        Compression(level=23)
    storage = ZarrStorage(64, store_path)
    storage.set(torch.arange(8), TensorDict({"obs": torch.zeros(8, 4, 84, 84)}, [8]))
    storage.close()
    codecs = zarr.open_group(store_path, mode="r")["data/obs"].metadata.to_dict()["codecs"]
    assert '"level": -1' in json.dumps(codecs)
    with ZarrStorage(path=store_path, read_only=True) as reader:
        assert reader.compression.level == -1


def test_repeated_gather_is_a_fresh_copy_of_current_rows(pair):
    storage, reference = pair
    index = torch.tensor([4, 2, 4])
    first = storage.get(index)
    first["obs"].add_(1000)  # the caller owns what it got
    assert_identical(storage.get(index), reference.get(index))
    second = storage.get(index)
    third = storage.get(index)
    assert third["obs"].data_ptr() != second["obs"].data_ptr()
    update = make_data("tensordict", torch.float32, (1,), seed=11)
    for s in (storage, reference):
        s.set(torch.tensor([2]), update, set_cursor=False)
    assert_identical(storage.get(index), reference.get(index))


def test_a_repeated_gather_keeps_negative_zeros(store_path):
    """A sampler reads the same rows twice; the second read is a copy of the first, bit for
    bit (``TensorDict.clone`` adds 0 to float tensors, which turned ``-0.0`` into ``0.0``)."""
    storage = ZarrStorage(8, store_path, ram_bytes=0)
    storage.set(torch.arange(3), TensorDict({"f": torch.tensor([1.0, -0.0, -0.0])}, [3]))
    index = torch.arange(3)
    for _ in range(2):
        assert storage.get(index)["f"].signbit().tolist() == [False, True, True]
    storage.close()


def test_a_torchrl_dump_with_strings_loads_bit_for_bit(tmp_path):
    """A LazyTensorStorage dump with a string per row and negative zeros: its rows are
    copied block by block, strings and signs kept (a copy tensor by tensor through the
    TensorDict's pytree failed on the strings; found by review)."""
    from tensordict import NonTensorStack
    from torchrl.data import TensorDictReplayBuffer

    data = TensorDict(
        {"obs": torch.tensor([1.0, -0.0, 2.0]), "s": NonTensorStack("a", "b", "c")}, [3]
    )
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    theirs.extend(data)
    theirs.dumps(tmp_path / "dump")
    ours = TensorDictReplayBuffer(storage=ZarrStorage(8, tmp_path / "z.zarr"), batch_size=2)
    ours.loads(tmp_path / "dump")
    got = ours.storage.get(torch.arange(3))
    assert list(got["s"]) == ["a", "b", "c"]
    assert got["obs"].signbit().tolist() == [False, True, False]
    ours.storage.close()


def test_runs_of_rows_read_in_order(pair):
    storage, reference = pair
    index = torch.cat([torch.arange(20, 28), torch.arange(0, 8), torch.arange(5, 13)])
    assert_identical(storage.get(index), reference.get(index))


def test_a_storage_collected_in_the_middle_of_another_ones_write_flushes_nothing_there(
    tmp_path, monkeypatch
):
    """The garbage collector runs finalizers at any allocation, on the thread that
    allocates: a storage of the same store dropped without close() may be finalized in
    the middle of another storage's write or commit. It only leaves: a flush there would
    run inside that write (the store's lock is re-entrant) and commit it half-done."""
    from zarr_rb.core.solo import SoloCommits
    from zarr_rb.core.store import Store

    path = tmp_path / "rb.zarr"
    kept = ZarrStorage(1000, path, compression=Compression(block_rows=8))
    dropped = ZarrStorage(path=path)  # one store, two users
    kept.set(torch.arange(4), TensorDict({"a": torch.zeros(4), "b": torch.zeros(4)}, [4]))
    flush, publish = Store.flush, SoloCommits.publish
    inside: list[str] = []
    flushes: list[str] = []

    def publishing(self, *args, **kwargs):
        if not inside:
            inside.append("publish")
            dropped._finalizer()  # as the garbage collector would, here
        return publish(self, *args, **kwargs)

    def flushing(self):
        flushes.append("nested" if self.calls.depth else "outer")
        return flush(self)

    monkeypatch.setattr(SoloCommits, "publish", publishing)
    monkeypatch.setattr(Store, "flush", flushing)
    kept.flush()
    assert inside
    assert "nested" not in flushes  # (its rows were committed as the flush ended)
    monkeypatch.undo()
    assert kept._store.lifetime.users == 1
    kept.set(torch.arange(4, 24), TensorDict({"a": torch.ones(20), "b": torch.ones(20)}, [20]))
    kept.close()
    reader = ZarrStorage(path=path, read_only=True)
    assert len(reader) == 24
    assert (reader[4:24]["a"] == 1).all()
    reader.close()


@pytest.mark.parametrize("shared", [False, True])
def test_an_extend_of_no_rows_changes_nothing(tmp_path: Path, shared: bool) -> None:
    """As on LazyTensorStorage (found by review: the write buffer raised a ValueError from
    ``zip``)."""
    from torchrl.data import TensorDictReplayBuffer

    data = TensorDict({"obs": torch.arange(12.0).view(4, 3)}, [4])
    zarr = TensorDictReplayBuffer(
        storage=ZarrStorage(10, tmp_path / "rb.zarr", shared=shared), batch_size=2
    )
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    for rb in (zarr, twin):
        rb.extend(data)
        rb.extend(data[:0])
        rb.extend(data[:2])
        rb.extend(data[:0])
    assert len(zarr) == len(twin) == 6
    assert int(zarr._writer._cursor) == int(twin._writer._cursor)
    assert_identical(zarr[:]["obs"], twin[:]["obs"])
    zarr.storage.close()
