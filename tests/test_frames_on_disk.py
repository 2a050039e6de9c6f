"""Leaves stored as frames, each once per block (``Compression(frames=True)``,
``docs/design/frames-on-disk.md``): rows bit for bit as TorchRL's storage has them, across
ring overwrites, reopens, crashes and repairs; the settings it refuses. The model-based
test is ``tests/test_frames_model.py`` (its stores of frames on disk)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_identical, chunk_file, chunk_files
from shared_workers import WRITER_STRIDE, independent_writer, torn
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.engine import RowArray
from zarr_rb.errors import RowsNotCommittedError
from zarr_rb.format.names import FRAMES_FORMAT
from zarr_rb.testing import CrashWorkload, forkserver_context, kill_randomly

FRAMES = Compression(frames=True, block_rows=8, large_row_bytes=256)
"""(A 4x12x10 stack is 480 bytes: a large leaf at 256.)"""
SPAWN = forkserver_context()


def episodes(start: int, n: int, *, every: int = 11) -> TensorDict:
    """Transitions ``start`` to ``start + n`` of 4-frame stacks of 12x10 frames, an episode
    every ``every`` steps (a reset repeats its first frame), each row's ``step`` its number."""

    def frame(t: int) -> torch.Tensor:
        out = torch.full((12, 10), (t * 37) % 251, dtype=torch.uint8)
        out[0, :2] = torch.tensor([t % 256, t // 256])  # each frame its own
        return out

    def stack(t: int, first: int) -> torch.Tensor:
        return torch.stack([frame(max(first, t - 3 + k)) for k in range(4)])

    steps = range(start, start + n)
    obs = torch.stack([stack(t, t - t % every) for t in steps])
    nxt = torch.stack([stack(t + 1, t - t % every) for t in steps])  # (an episode's last too)
    return TensorDict(
        {
            "obs": obs,
            "step": torch.arange(start, start + n),
            "next": {"obs": nxt, "done": torch.zeros(n, 1, dtype=torch.bool)},
        },
        batch_size=[n],
    )


def twins(path: Path, capacity: int, **kwargs):
    ours = TensorDictReplayBuffer(
        storage=ZarrStorage(capacity, path, compression=FRAMES, **kwargs), batch_size=4
    )
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=4)
    return ours, theirs


def same_rows(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    rows = torch.arange(len(theirs))
    assert_identical(
        ours.storage.get(rows).exclude("index"), theirs.storage.get(rows).exclude("index")
    )


@pytest.mark.parametrize("ram_bytes", ["auto", 0], ids=["tier", "store"])
def test_rows_come_back_as_written_across_a_ring_written_over_and_a_reopen(tmp_path, ram_bytes):
    path = tmp_path / "rb.zarr"
    ours, theirs = twins(path, 40, ram_bytes=ram_bytes)
    start = 0
    for n in (3, 9, 14, 1, 30, 8, 25, 40, 5):
        batch = episodes(start, n)
        start += n
        for rb in (ours, theirs):
            rb.extend(batch)
        if n % 3 == 0:
            ours.storage.flush()
        same_rows(ours, theirs)
    rewritten = torch.tensor([2, 3, 17, 30])
    for rb in (ours, theirs):
        rb.storage.set(rewritten, episodes(900, 4), set_cursor=False)
    same_rows(ours, theirs)
    ours.storage.close()
    reopened = ZarrStorage(path=path, ram_bytes=0)
    rows = torch.arange(len(theirs))
    assert_identical(reopened.get(rows).exclude("index"), theirs.storage.get(rows).exclude("index"))
    record = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    assert record["format"] == FRAMES_FORMAT
    assert record["schema"]["frames"] == [{"key": ["obs"], "next": ["next", "obs"], "stack": 4}]
    assert not (path / "data" / "next" / "obs").exists()  # stored with obs, once
    reopened.close()


def test_a_run_takes_about_one_frame_a_row_on_disk(tmp_path):
    data = episodes(0, 256, every=1000)
    sizes = {}
    for frames in (False, True):
        path = tmp_path / f"frames-{frames}" / "rb.zarr"
        compression = Compression(frames=frames, codec="none", block_rows=64, large_row_bytes=256)
        storage = ZarrStorage(256, path, compression=compression)
        storage.set(torch.arange(256), data)
        storage.close()
        # obs and next/obs: their stacks, or their cells and frame ids.
        parts = [path / "data" / "obs", path / "data" / "next" / "obs", path / "frame_ids"]
        sizes[frames] = sum(f.stat().st_size for p in parts for f in p.rglob("*") if f.is_file())
    # Raw bytes (no codec): 8 frames of 120 bytes a row as stacks; as frames, one a row (the
    # first row of each block 4 more), and 32 bytes of ids a row.
    assert sizes[True] * 4 < sizes[False]


def test_a_sample_reads_the_cells_a_row_and_its_next_share_once(tmp_path, monkeypatch):
    storage = ZarrStorage(64, tmp_path / "rb.zarr", compression=FRAMES, ram_bytes=0)
    data = episodes(0, 64)
    storage.set(torch.arange(64), data)
    storage.flush()
    reads: list[str] = []
    read_rows = RowArray.read_rows

    def counted(self, *args, **kwargs):
        reads.append(self.path)
        return read_rows(self, *args, **kwargs)

    monkeypatch.setattr(RowArray, "read_rows", counted)
    rows = torch.tensor([5, 40, 41, 7, 63, 5])
    assert_identical(storage.get(rows).exclude("index"), data[rows])
    # The cells of obs and next/obs are one array: one read of it (two before).
    assert sum(path.endswith("data/obs") for path in reads) == 1, reads
    storage.close()


def test_a_long_read_of_frames_in_any_order_comes_back_whole(tmp_path):
    # More rows than a read gathers at a time (READ_PART_ROWS), in any order, repeated.
    storage = ZarrStorage(700, tmp_path / "rb.zarr", compression=FRAMES, ram_bytes=0)
    data = episodes(0, 700)
    storage.set(torch.arange(700), data)
    storage.flush()
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 700, 1500))
    assert_identical(storage.get(rows).exclude("index"), data[rows])
    storage.close()


def assert_readable_rows_whole(path: Path, written: TensorDict) -> None:
    """Every row a reader finds readable (a repair withdrew the others) reads back as
    written."""
    reader = ZarrStorage(path=path, read_only=True, ram_bytes=0)
    readable = torch.from_numpy(np.setdiff1d(np.arange(len(written)), reader.unreadable_rows()))
    assert_identical(reader.get(readable).exclude("index"), written[readable])
    reader.close()


def test_a_repair_withdraws_the_rows_whose_frames_were_damaged(tmp_path):
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(64, path, compression=FRAMES)
    storage.set(torch.arange(40), episodes(0, 40))
    storage.close()
    assert zarr_rb.verify(path).ok
    shard = chunk_files(path, "data/obs")[0]
    damaged = bytearray(shard.read_bytes())
    damaged[50] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    report = zarr_rb.verify(path)
    assert not report.ok
    assert {chunk.array for chunk in report.damaged} == {"data/obs"}
    # obs and ("next", "obs") name the same cells: a damaged row is listed once.
    ranges = sorted(chunk.rows for chunk in report.damaged)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges)), ranges
    repaired = zarr_rb.verify(path, repair=True)
    assert 0 < repaired.withdrawn_rows <= 8  # the rows of the damaged block naming them
    assert zarr_rb.verify(path).ok
    assert_readable_rows_whole(path, episodes(0, 40))


def test_a_store_of_one_writer_with_frames_takes_shared_writers(tmp_path):
    path = tmp_path / "rb.zarr"
    ours, theirs = twins(path, 40)
    for rb in (ours, theirs):
        rb.extend(episodes(0, 12))
    ours.storage.close()
    writers = [ZarrStorage(path=path, shared=True) for _ in range(2)]
    rb = TensorDictReplayBuffer(storage=writers[0], batch_size=4)
    for i, start in enumerate(range(12, 60, 8)):  # turns, over the ring's end
        data = episodes(start, 8)
        writers[i % 2].set(torch.arange(8), data)
        theirs.extend(data)
    writers[0].refresh()
    assert len(rb) == len(theirs) == 40
    assert_identical(rb[:].exclude("index"), theirs[:].exclude("index"))
    record = json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]
    assert record["format"] == FRAMES_FORMAT  # (shared writers relabel others at 3)
    assert record["schema"]["frames"] == [{"key": ["obs"], "next": ["next", "obs"], "stack": 4}]
    for writer in writers:
        writer.close()
    assert zarr_rb.verify(path).ok


def test_shared_writers_in_processes_store_frames_once_and_never_tear_a_row(tmp_path):
    url = str(tmp_path / "rb.zarr")
    # (A row of obs, 8x8 bytes, is a frame of its own: its next is the writer's next row.)
    frames = Compression(frames=True, block_rows=16, large_row_bytes=64)
    ZarrStorage(256, url, shared=True, compression=frames).close()
    progress = SPAWN.Queue()
    writers = [
        SPAWN.Process(target=independent_writer, args=(url, w, 25, 16, None, progress, 0.0))
        for w in range(3)
    ]
    for writer in writers:
        writer.start()
    storage = ZarrStorage(path=url, shared=True, ram_bytes=0)  # reads from the cells
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)
    try:
        samples = 0
        while any(w.is_alive() for w in writers):
            if len(rb):
                try:
                    batch = rb.sample()
                except RowsNotCommittedError:
                    continue  # (the writers turned the ring over under every redraw)
                assert torn(batch) == 0
                samples += 1
        for writer in writers:
            writer.join(120)
        assert [w.exitcode for w in writers] == [0, 0, 0]
        storage.refresh()
        assert storage._store.schema is not None
        assert storage._store.schema.frames
        assert len(storage) == 256
        stamps = storage.get(torch.arange(256))
        assert torn(stamps) == 0  # obs and next obs rebuilt from the cells, bit for bit
        for writer in range(3):  # each keeps its newest rows, once each
            mine = stamps["stamp"][stamps["stamp"] // WRITER_STRIDE == writer] % WRITER_STRIDE
            if mine.numel():
                assert torch.equal(mine.sort().values, torch.arange(int(mine.min()), 25 * 16))
        assert samples
    finally:
        storage.close()
    report = zarr_rb.verify(url)
    assert report.ok, report


@pytest.mark.slow  # (10 s: writer processes killed in turn; CI runs it)
def test_random_kills_leave_every_committed_row_whole(tmp_path):
    workload = CrashWorkload(frames=True)
    context = forkserver_context()
    saved = 0
    for seed in range(4):
        where = tmp_path / f"seed-{seed}"
        where.mkdir()
        check = kill_randomly(where, seed, workload, context, after_a_save=True)
        saved += check.saved is not None
    assert saved >= 2


def test_a_forked_worker_reads_the_frames_with_zarr_python(tmp_path):
    # (DataLoader workers forked from a process that used TensorStore read with zarr-python.)
    from zarr_rb.engine.forked import ForkedReader

    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(40, path, compression=FRAMES)
    storage.set(torch.arange(40), episodes(0, 40))
    storage.set(torch.arange(5), episodes(500, 5))  # moved to another slot, values copied
    storage.close()
    schema = ZarrStorage(path=path, read_only=True)._store.schema
    assert schema is not None
    rows = np.array([39, 0, 4, 5, 17, 17, 2])
    got = ForkedReader(path, schema.leaves).read(rows)
    expected = torch.cat([episodes(500, 5), episodes(5, 35)])[torch.from_numpy(rows)]
    for key in (("obs",), ("next", "obs"), ("step",)):
        assert np.array_equal(got[key], expected[key].numpy()), key


@pytest.mark.parametrize("ram_bytes", ["auto", 0], ids=["tier", "store"])
def test_a_key_written_alone_over_a_full_block_moves_it_in_one_row_of_cells(tmp_path, ram_bytes):
    """A set of ``obs`` alone over a row of a committed block whose region is full (frames
    that repeat nothing: every row takes its row of cells) moves the block. The row's
    ``next`` is copied by value and its ``obs`` written in the same call, as one write:
    written in two, the row took two rows of cells and the block ran out (the set, and
    every flush and close after it, raised RegionFullError)."""
    gen = torch.Generator().manual_seed(3)

    def noise(n: int, start: int) -> TensorDict:
        def frames() -> torch.Tensor:
            return torch.randint(0, 256, (n, 4, 12, 10), generator=gen, dtype=torch.uint8)

        return TensorDict(
            {"obs": frames(), "step": torch.arange(start, start + n), "next": {"obs": frames()}},
            batch_size=[n],
        )

    path = tmp_path / "rb.zarr"
    ours = ZarrStorage(16, path, compression=FRAMES, ram_bytes=ram_bytes)
    theirs = LazyTensorStorage(16)
    data = noise(16, 0)
    for storage in (ours, theirs):
        storage.set(torch.arange(16), data)
    ours.flush()
    for round_ in range(3):
        rows = torch.tensor([3, 9 + round_])
        patch = noise(2, 100 + round_).select("obs")
        for storage in (ours, theirs):
            storage.set(rows, patch, set_cursor=False)
        ours.flush()
        assert_identical(ours.get(torch.arange(16)), theirs.get(torch.arange(16)))
    ours.close()
    with ZarrStorage(path=path, read_only=True) as reader:
        assert_identical(reader.get(torch.arange(16)), theirs.get(torch.arange(16)))
    assert zarr_rb.verify(path).ok


def test_a_reader_opened_before_the_writer_added_slots_reads_the_moved_blocks(tmp_path):
    """Writes over committed rows move their blocks to slots past the arrays' ends: the
    writer grows the arrays. A reader opened before, refreshed, reads the cells and ids of
    those slots (it opens the arrays again; before, it raised IndexError)."""
    path = tmp_path / "rb.zarr"
    ours = ZarrStorage(16, path, compression=FRAMES, ram_bytes=0)
    theirs = LazyTensorStorage(16)
    for storage in (ours, theirs):
        storage.set(torch.arange(16), episodes(0, 16))
    ours.flush()
    reader = ZarrStorage(path=path, read_only=True, ram_bytes=0)
    assert_identical(reader.get(torch.arange(16)), theirs.get(torch.arange(16)))
    for round_ in range(3):
        rows = torch.tensor([1, 9, 12])
        for storage in (ours, theirs):
            storage.set(rows, episodes(100 + 10 * round_, 3), set_cursor=False)
        ours.flush()
        reader.refresh()
        assert_identical(reader.get(torch.arange(16)), theirs.get(torch.arange(16)))
    reader.close()
    ours.close()


def test_bfloat16_frames_come_back_bit_for_bit_across_a_move_and_a_reopen(tmp_path):
    """bfloat16 cells are stored as their uint16 bits: read back as bfloat16 (before, as
    uint16, and a moved block's kept rows were converted by value, changed on disk)."""
    gen = torch.Generator().manual_seed(5)

    def rows(n: int, start: int) -> TensorDict:
        def stacks() -> torch.Tensor:
            return torch.randn((n, 4, 12, 10), generator=gen).to(torch.bfloat16)

        return TensorDict(
            {"obs": stacks(), "step": torch.arange(start, start + n), "next": {"obs": stacks()}},
            batch_size=[n],
        )

    path = tmp_path / "rb.zarr"
    ours = ZarrStorage(8, path, compression=FRAMES, ram_bytes=0)
    theirs = LazyTensorStorage(8)
    for data, at in ((rows(8, 0), torch.arange(8)), (rows(1, 100), torch.tensor([0]))):
        for storage in (ours, theirs):
            storage.set(at, data)  # the second moves the block, its other rows copied
        ours.flush()
        assert_identical(ours.get(torch.arange(8)), theirs.get(torch.arange(8)))
    ours.close()
    with ZarrStorage(path=path, read_only=True, ram_bytes=0) as reader:
        assert_identical(reader.get(torch.arange(8)), theirs.get(torch.arange(8)))


def test_a_repair_withdraws_rows_with_damaged_frames_beside_damaged_frame_ids(tmp_path):
    """The frame ids of next/obs damaged in one chunk, and a frame of other rows: a repair
    withdraws both, not only the rows of the damaged ids (found by a review: a damaged ids
    chunk of a key skipped the check of the frames of every row of that key)."""
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(64, path, compression=FRAMES)
    storage.set(torch.arange(40), episodes(0, 40))
    storage.close()
    for chunk in [
        chunk_file(path, "frame_ids/next/obs", 0, 0),
        chunk_file(path, "data/obs", 4, 0, 0, 0),
    ]:
        data = bytearray(chunk.read_bytes())
        data[min(50, len(data) - 1)] ^= 0xFF
        chunk.write_bytes(bytes(data))
    report = zarr_rb.verify(path)
    assert {chunk.array for chunk in report.damaged} == {"frame_ids/next/obs", "data/obs"}
    zarr_rb.verify(path, repair=True)
    assert zarr_rb.verify(path).ok
    assert_readable_rows_whole(path, episodes(0, 40))


@pytest.mark.parametrize("ram_bytes", ["auto", 0], ids=["tier", "store"])
def test_a_fill_of_frames_lists_no_directory(tmp_path, monkeypatch, ram_bytes):
    """Where a block's new cells start was found by listing every object of the frame ids
    arrays, for each new block: a cost growing with the blocks already stored (2.5 ms a
    listing at 98 blocks of Pong rows, two per new block). A block's objects are looked up
    alone."""
    from zarr_rb.locations.local import LocalLocation

    listed: list[str] = []
    list_keys = LocalLocation.list

    def counted(self, prefix=""):
        listed.append(prefix)
        return list_keys(self, prefix)

    ours, theirs = twins(tmp_path / "rb.zarr", 400, ram_bytes=ram_bytes)
    ours.extend(episodes(0, 8))  # (the first write makes the arrays)
    theirs.extend(episodes(0, 8))
    monkeypatch.setattr(LocalLocation, "list", counted)
    for start in range(8, 600, 37):
        ours.extend(episodes(start, 37))
        theirs.extend(episodes(start, 37))
    ours.storage.flush()
    assert listed == []
    monkeypatch.undo()
    same_rows(ours, theirs)


@pytest.mark.parametrize("ram_bytes", ["auto", 0], ids=["tier", "store"])
def test_a_reopened_writer_continues_a_block_without_naming_its_cells_again(tmp_path, ram_bytes):
    """The first write into a block a reopened writer finds on disk takes its cells past
    those its rows name (found from the frame ids stored), not from the region's start."""
    path = tmp_path / "rb.zarr"
    ours, theirs = twins(path, 40, ram_bytes=ram_bytes)
    for rb in (ours, theirs):
        rb.extend(episodes(0, 13))  # a block and 5 rows of the next
    ours.storage.close()
    ours = TensorDictReplayBuffer(
        storage=ZarrStorage(40, path, compression=FRAMES, ram_bytes=ram_bytes), batch_size=4
    )
    assert len(ours) == 13
    for start, n in ((13, 2), (15, 9), (24, 30)):  # into both blocks, then around the ring
        for rb in (ours, theirs):
            rb.extend(episodes(100 + start, n))
        same_rows(ours, theirs)
    ours.storage.close()
    # (The tier serves the rows it holds: the disk is read again without it.)
    ours = TensorDictReplayBuffer(storage=ZarrStorage(path=path, ram_bytes=0), batch_size=4)
    same_rows(ours, theirs)
    ours.storage.close()
