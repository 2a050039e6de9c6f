"""Rows far wider than a frame (many environments per row, big images, 256 MiB rows) are
stored, flushed, reopened and read back bit for bit, and a block of about 32 MiB stays the
unit rows wait in RAM; a write the store cannot lay out is refused at the first write."""

from __future__ import annotations

import math

import pytest
import torch
import zarr
from conftest import assert_identical
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

from zarr_rb import Compression, UnsupportedDataError, ZarrStorage
from zarr_rb.engine.layout import MAX_CHUNK_ELEMENTS, choose_block_rows, leaf_layout
from zarr_rb.format.schema import LeafSpec

TARGET_BLOCK_BYTES = 32 * 2**20


def frames(shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """uint8 frames: random pixels over a flat background, so zstd has work to do."""
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(shape, dtype=torch.uint8)
    flat = values.view(-1)
    picked = torch.randint(0, flat.numel(), (flat.numel() // 8,), generator=g)
    flat[picked] = torch.randint(1, 256, picked.shape, dtype=torch.uint8, generator=g)
    return values


def write_both(storage, twin, data: TensorDict, start: int) -> None:
    rows = torch.arange(start, start + data.shape[0])
    for s in (storage, twin):
        s.set(rows, data)


def chunking(path, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (inner chunk, shard) shapes of an array as zarr-python reads them."""
    array = zarr.open_array(str(path / "data" / key), mode="r")
    return tuple(array.chunks), tuple(array.shards or array.chunks)


def reopened_matches(path, twin, rows: int, *, picked: list[int] | None = None) -> None:
    """A new storage on ``path`` (nothing kept from the writer) reads the rows written as the
    twin holds them, in order and (``picked``) scattered."""
    reopened = ZarrStorage(path=path)
    try:
        assert len(reopened) == len(twin)
        index = torch.arange(rows)
        assert_identical(reopened.get(index), twin.get(index))
        if picked is not None:
            assert_identical(reopened.get(torch.tensor(picked)), twin.get(torch.tensor(picked)))
    finally:
        reopened.close()


ORDINARY = [
    # (element shape, dtype, batch shape): block rows, inner chunk and shard of the element,
    # as stores of these rows have been written all along.
    (((4, 84, 84), "uint8", (1_000_000,)), (1024, (2, 4, 84, 84), (1024, 4, 84, 84))),
    (((3, 256, 256), "uint8", (100_000,)), (256, (2, 3, 256, 256), (256, 3, 256, 256))),
    (((4, 84, 84), "uint8", (125_000, 8)), (256, (2, 8, 4, 84, 84), (256, 8, 4, 84, 84))),
    (((2**19,), "uint8", (10_000,)), (256, (2, 2**19), (256, 2**19))),
    (((2**17,), "float32", (10_000,)), (256, (2, 2**17), (256, 2**17))),
]


@pytest.mark.parametrize(("rows", "expected"), ORDINARY, ids=lambda v: str(v[:1]))
def test_ordinary_rows_keep_their_layout(rows, expected):
    shape, dtype, batch = rows
    leaves = (
        LeafSpec(key=("obs",), dtype=dtype, shape=shape),
        LeafSpec(key=("reward",), dtype="float32", shape=(1,)),
    )
    compression = Compression()
    block = choose_block_rows(compression, leaves, batch)
    layout = leaf_layout(leaves[0], batch_shape=batch, block_rows=block, compression=compression)
    assert (block, layout.chunks, layout.shards) == expected


def test_atari_frames_of_32_environments_per_row(store_path):
    # ZarrStorage(1_000_000, ndim=2) fed [T, 32] batches of 4x84x84 frames: one storage row
    # holds 32 frames (882 KiB), so 256 rows per block would be 220 MiB and 231M elements.
    storage = ZarrStorage(1_000_000, store_path, ndim=2)
    twin = LazyTensorStorage(80 * 32, ndim=2)
    for start, steps in ((0, 40), (40, 30)):
        data = TensorDict(
            {
                "obs": frames((steps, 32, 4, 84, 84), seed=start),
                "reward": torch.randn(steps, 32, 1),
            },
            batch_size=[steps, 32],
        )
        write_both(storage, twin, data, start)
    block = storage._store.meta.block_rows
    row_bytes = 32 * 4 * 84 * 84
    assert block * row_bytes <= TARGET_BLOCK_BYTES < 2 * block * row_bytes
    storage.flush()
    storage.close()

    chunks, shards = chunking(store_path, "obs")
    assert shards == (block, 32, 4, 84, 84)
    assert chunks[1:] == shards[1:]
    assert math.prod(shards) <= MAX_CHUNK_ELEMENTS
    reopened_matches(store_path, twin, 70, picked=[69, 0, 33, 31, 32])


def test_one_3x512x512_frame_per_row(store_path):
    storage = ZarrStorage(10_000, store_path)
    twin = LazyTensorStorage(10_000)
    data = TensorDict(
        {"pixels": frames((70, 3, 512, 512), seed=1), "action": torch.randint(0, 6, (70,))},
        batch_size=[70],
    )
    write_both(storage, twin, data, 0)
    block = storage._store.meta.block_rows
    assert block * 3 * 512 * 512 <= TARGET_BLOCK_BYTES
    storage.close()

    chunks, shards = chunking(store_path, "pixels")
    assert shards == (block, 3, 512, 512)
    assert chunks == (2, 3, 512, 512)
    reopened_matches(store_path, twin, 70, picked=[69, 0, 33, 31, 32])


HUGE_ROWS = {
    # name: (ndim, shape of a batch, dtype); each storage row is 256 MiB.
    "uint8-2**28": (1, (1, 16, 4096, 4096), torch.uint8),
    "float32-64Mi": (1, (1, 64, 1024, 1024), torch.float32),
    "uint8-ndim2": (2, (1, 2, 8, 4096, 4096), torch.uint8),
    "float32-ndim2": (2, (1, 2, 32, 1024, 1024), torch.float32),
}


def huge_values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values that change along every dimension (a chunk written in another's place shows),
    made by broadcasting one random vector per dimension: no index array as large as the
    values."""
    g = torch.Generator().manual_seed(2)
    values = torch.zeros(shape, dtype=dtype)
    for dim, n in enumerate(shape):
        along = torch.randint(0, 256, (n,), generator=g).to(dtype)
        values += along.view(n, *([1] * (len(shape) - dim - 1)))
    return values


@pytest.mark.parametrize("name", list(HUGE_ROWS))
def test_rows_of_256_mib_are_stored_one_row_per_block(store_path, name):
    ndim, shape, dtype = HUGE_ROWS[name]
    batch = shape[:ndim]
    max_size = math.prod(batch)
    # (frames=False: a row of [32, 1024, 1024] is a stack by its shape, whose layout as
    # frames test_frames_of_rows_of_256_mib_are_cut_into_chunks_readers_accept checks.)
    storage = ZarrStorage(max_size, store_path, ndim=ndim, compression=Compression(frames=False))
    twin = LazyTensorStorage(max_size, ndim=ndim)
    data = TensorDict({"big": huge_values(shape, dtype)}, batch_size=list(batch))
    write_both(storage, twin, data, 0)
    del data
    # One row per block: the blocks a store keeps in RAM are rows, not hundreds of rows.
    assert storage._store.meta.block_rows == 1
    storage.close()

    chunks, shards = chunking(store_path, "big")
    row_elements = math.prod(shape[1:])
    assert shards[0] == chunks[0] == 1
    assert math.prod(shards) <= MAX_CHUNK_ELEMENTS
    if row_elements > MAX_CHUNK_ELEMENTS:
        # The row is cut along its own dimensions into chunks read one by one.
        assert math.prod(chunks) < row_elements
    else:
        assert chunks[1:] == shape[1:]
    reopened_matches(store_path, twin, batch[0])


def test_a_block_taller_than_any_chunk_can_be_is_refused_at_the_first_write(store_path):
    # 2**28 rows per block of a one-element column: no chunk may hold one block.
    rows = 2**28 + 2
    storage = ZarrStorage(rows, store_path, compression=Compression(block_rows=2**28))
    data = TensorDict({"flag": torch.ones(2, dtype=torch.bool)}, batch_size=[2])
    with pytest.raises(UnsupportedDataError, match=r"'flag'.*block_rows"):
        storage.set(torch.arange(2), data)
    storage.close()
    assert not store_path.exists()  # refused before anything was made


def test_a_shared_store_refuses_it_before_publishing_a_schema(store_path):
    rows = 2**28 + 2
    storage = ZarrStorage(rows, store_path, shared=True, compression=Compression(block_rows=2**28))
    data = TensorDict({"flag": torch.ones(2, dtype=torch.bool)}, batch_size=[2])
    with pytest.raises(UnsupportedDataError, match=r"'flag'.*block_rows"):
        storage.set(torch.arange(2), data)
    assert not (store_path / "data" / "flag").exists()
    storage.close()
    reopened = ZarrStorage(path=store_path, shared=True)
    assert reopened._store.schema is None
    reopened.close()


@pytest.mark.parametrize("shape", [(0,), (3, 0, 84), (5, 0)], ids=str)
def test_rows_of_no_elements_are_stored(store_path, shape):
    # The other end of row sizes: a dimension of length 0 still gets chunks of one.
    storage = ZarrStorage(10, store_path)
    twin = LazyTensorStorage(10)
    data = TensorDict(
        {"empty": torch.zeros(4, *shape), "reward": torch.arange(4.0)}, batch_size=[4]
    )
    write_both(storage, twin, data, 0)
    storage.close()
    reopened_matches(store_path, twin, 4, picked=[3, 1])


def test_frames_of_rows_of_256_mib_are_cut_into_chunks_readers_accept(store_path):
    # Stored as frames (Compression(frames=True)): a row's 16 frames of 4096x4096 bytes are
    # its cells, 2**28 elements, more than a chunk may hold: cut, as a stack would be.
    ndim, shape, dtype = HUGE_ROWS["uint8-2**28"]
    storage = ZarrStorage(1, store_path, ndim=ndim, compression=Compression(frames=True))
    twin = LazyTensorStorage(1, ndim=ndim)
    data = TensorDict({"big": huge_values(shape, dtype)}, batch_size=[1])
    write_both(storage, twin, data, 0)
    del data
    assert storage._store.schema is not None
    assert storage._store.schema.frames  # (the frames of a stack of 16)
    storage.close()
    chunks, shards = chunking(store_path, "big")  # the cells
    assert math.prod(shards) <= MAX_CHUNK_ELEMENTS
    assert math.prod(chunks) <= MAX_CHUNK_ELEMENTS
    assert shards[0] == chunks[0] == 1
    reopened_matches(store_path, twin, 1)
