"""A save keeps the rows it covered: ``load`` gives back exactly the saved buffer, rows
included, whatever training wrote since, and tagged saves are kept as versions that a
reader opens while the writer goes on. Each case runs the same pattern on a
LazyTensorStorage twin and compares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_identical, chunk_files
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, VersionExistsError, VersionNotFoundError, ZarrStorage
from zarr_rb.testing import simulate_crash

CAPACITY = 32
LAYOUT = Compression(block_rows=8)


def steps(start: int, stop: int) -> TensorDict:
    step = torch.arange(start, stop)
    return TensorDict(
        {"step": step, "obs": (step[:, None, None] * 3 + torch.arange(16).view(4, 4)) % 251},
        [stop - start],
    )


def buffers(path: Path) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer]:
    zarr = TensorDictReplayBuffer(storage=ZarrStorage(CAPACITY, path, compression=LAYOUT))
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    return zarr, twin


def extend(rbs: tuple[TensorDictReplayBuffer, ...], start: int, stop: int) -> None:
    for begin in range(start, stop, 5):  # across blocks, as a collector does
        for rb in rbs:
            rb.extend(steps(begin, min(begin + 5, stop)))


def rows(rb: TensorDictReplayBuffer) -> TensorDict:
    return rb.storage.get(torch.arange(len(rb))).exclude("index")


def test_load_gives_back_the_saved_rows_after_the_ring_turned_over(tmp_path):
    path = tmp_path / "rb.zarr"
    rb, twin = buffers(path)
    extend((rb, twin), 0, 45)
    zarr_rb.save(rb)
    saved = rows(twin).clone()
    saved_cursor = int(twin._writer._cursor)
    extend((rb, twin), 45, 120)  # every row written over, twice
    rb[torch.tensor([3])] = steps(-1, 0)
    rb.storage.close()

    loaded = zarr_rb.load(path)
    assert len(loaded) == CAPACITY
    assert int(loaded._writer._cursor) == saved_cursor
    assert (rows(loaded) == saved).all()
    # It goes on from the save, as the twin restored to it would.
    extend((loaded,), 200, 210)
    expected = saved.clone()
    for i, step in enumerate(range(200, 210)):
        expected[(saved_cursor + i) % CAPACITY] = steps(step, step + 1)[0]
    assert (rows(loaded) == expected).all()
    loaded.storage.close()
    reopened = ZarrStorage(path=path)
    assert (reopened.get(torch.arange(CAPACITY)).exclude("index") == expected).all()
    reopened.close()


def test_a_crash_after_a_save_loads_the_saved_rows(tmp_path):
    path = tmp_path / "rb.zarr"
    rb, twin = buffers(path)
    extend((rb, twin), 0, 40)
    zarr_rb.save(rb)
    saved = rows(twin).clone()
    extend((rb, twin), 40, 90)
    rb.storage.flush()
    simulate_crash(rb.storage)
    loaded = zarr_rb.load(path)
    assert (rows(loaded) == saved).all()
    loaded.storage.close()


def test_tagged_versions_are_read_while_the_writer_goes_on(tmp_path):
    path = tmp_path / "rb.zarr"
    rb, twin = buffers(path)
    kept = {}
    for tag, stop in (("first", 20), ("second", 50), ("third", 75)):
        extend((rb, twin), stop - 20 if stop > 20 else 0, stop)
        zarr_rb.save(rb, tag=tag)
        kept[tag] = (rows(twin).clone(), len(twin), int(twin._writer._cursor))
    readers = {tag: zarr_rb.load(path, version=tag, read_only=True) for tag in kept}
    extend((rb, twin), 75, 150)  # the writer goes on, over every row, and commits
    rb.storage.flush()
    for tag, reader in readers.items():
        want, length, _cursor = kept[tag]
        assert len(reader) == length
        assert (rows(reader) == want).all(), tag
        assert torch.isin(reader.sample(8)["step"], want["step"]).all()
        reader.storage.close()
    listed = zarr_rb.versions(path)
    assert [v.tag for v in listed] == ["first", "second", "third"]
    assert [v.last for v in listed] == [False, False, True]
    assert [v.length for v in listed] == [kept[t][1] for t in ("first", "second", "third")]
    # By number too, and for writing: back to the first version.
    rb.storage.close()
    loaded = zarr_rb.load(path, version=listed[0].number)
    assert (rows(loaded) == kept["first"][0]).all()
    loaded.storage.close()


def test_a_reader_of_a_save_that_is_replaced_raises_instead_of_reading_other_rows(tmp_path):
    path = tmp_path / "rb.zarr"
    rb, _ = buffers(path)
    extend((rb,), 0, 40)
    zarr_rb.save(rb)
    reader = zarr_rb.load(path, read_only=True)
    extend((rb,), 40, 120)
    zarr_rb.save(rb)  # the save the reader reads is replaced: its rows may be reused
    extend((rb,), 120, 200)
    rb.storage.flush()
    with pytest.raises(VersionNotFoundError, match="replaced by a newer save"):
        reader.storage.get(torch.arange(8))
    reader.storage.refresh()  # to the last commit
    assert len(reader) == CAPACITY
    assert reader.storage.get(torch.arange(CAPACITY))["step"].min() >= 168
    reader.storage.close()
    rb.storage.close()


def test_bad_versions_are_typed_errors_naming_them(tmp_path):
    path = tmp_path / "rb.zarr"
    rb, _ = buffers(path)
    extend((rb,), 0, 10)
    zarr_rb.save(rb, tag="warmup")
    with pytest.raises(VersionExistsError, match="'warmup'"):
        zarr_rb.save(rb, tag="warmup")
    with pytest.raises(ValueError, match="version tag"):
        zarr_rb.save(rb, tag="no spaces")
    rb.storage.close()
    with pytest.raises(VersionNotFoundError, match=r"'nope'.*0 \('warmup'\)"):
        zarr_rb.load(path, version="nope")
    with pytest.raises(VersionNotFoundError, match="no version 7"):
        zarr_rb.load(path, version=7)
    with pytest.raises(VersionNotFoundError, match="'nope'"):
        zarr_rb.drop_version(path, "nope")
    with pytest.raises(TypeError, match="version"):
        zarr_rb.load(path, version=1.5)  # type: ignore[arg-type]


def test_kept_versions_hold_their_rows_and_nothing_more(tmp_path):
    """Ten versions of a ring that turns over once: the disk holds the rows each version
    kept, in the blocks written between them, not ten copies; the slots of dropped versions
    are written again, and only the state groups of kept saves remain (and the one the next
    save writes, whose unchanged chunks it leaves)."""
    path = tmp_path / "rb.zarr"
    rb, _ = buffers(path)
    extend((rb,), 0, CAPACITY)
    for i in range(10):  # 10 versions, the ring turning over once across them
        start = CAPACITY + i * 4
        extend((rb,), start, start + 4)
        zarr_rb.save(rb, tag=f"v{i}")
    rb.storage.flush()

    def shards() -> int:
        return len({f.name.split(".")[1] for f in chunk_files(path, "data/obs")})

    def states() -> list[str]:
        return sorted(p.name for p in (path / "state").iterdir() if p.is_dir())

    blocks = CAPACITY // 8
    # Each version moved at most two blocks (4 rows, in one block or across two).
    held = shards()
    assert held <= blocks + 2 * 10
    assert states() == [str(i) for i in range(10)]
    for i in range(9):
        zarr_rb.drop_version(path, f"v{i}")
    assert states() == ["0", "9"]  # the last save's, and the one the next save rewrites
    extend((rb,), 100, 100 + 2 * CAPACITY)  # into the slots the dropped versions held
    rb.storage.flush()
    assert shards() <= held
    rb.storage.close()


def test_writing_on_from_a_version_leaves_the_other_versions_whole(tmp_path):
    """A version shorter than the ring, loaded for writing: the rows past its length are
    another version's, and its writes go elsewhere."""
    path = tmp_path / "rb.zarr"
    rb, twin = buffers(path)
    extend((rb, twin), 0, 20)
    zarr_rb.save(rb, tag="short")
    extend((rb, twin), 20, 32)
    zarr_rb.save(rb, tag="full")
    full = rows(twin).clone()
    rb.storage.close()
    loaded = zarr_rb.load(path, version="short")
    extend((loaded,), 100, 112)  # into rows 20-31, which "full" keeps
    loaded.storage.flush()
    assert rows(loaded)["step"].tolist() == [*range(20), *range(100, 112)]
    loaded.storage.close()
    again = zarr_rb.load(path, version="full", read_only=True)
    assert (rows(again) == full).all()
    again.storage.close()


def test_tags_that_cannot_be_kept_are_refused_before_anything_is_written(tmp_path):
    memory = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    memory.extend(steps(0, 4))
    with pytest.raises(zarr_rb.NotSupportedError, match="LazyTensorStorage"):
        zarr_rb.save(memory, tmp_path / "new.zarr", tag="a")
    assert not (tmp_path / "new.zarr").exists()
    with pytest.raises(TypeError, match="version tag"):
        zarr_rb.save(memory, tmp_path / "new.zarr", tag=7)  # type: ignore[arg-type]
    path = tmp_path / "rb.zarr"
    rb, _ = buffers(path)
    extend((rb,), 0, 4)
    zarr_rb.save(rb, tag="a")
    rb.storage.close()
    with pytest.raises(TypeError, match="tag of a version"):
        zarr_rb.drop_version(path, 0)  # type: ignore[arg-type]


def test_a_version_of_a_shared_store_keeps_its_rows_while_its_writers_go_on(tmp_path):
    path = tmp_path / "shared.zarr"
    compression = zarr_rb.Compression(block_rows=4)
    writers = [ZarrStorage(16, path, shared=True, compression=compression) for _ in range(2)]
    rb = TensorDictReplayBuffer(storage=writers[0], batch_size=4)
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    for step in range(5):  # writers take turns: rows interleave, the ring wraps
        data = steps(5 * step, 5 * step + 5)
        writers[step % 2].set(torch.arange(5), data)
        twin.extend(data)
    zarr_rb.save(rb, tag="mid")
    with pytest.raises(zarr_rb.VersionExistsError, match="mid"):
        zarr_rb.save(rb, tag="mid")
    for step in range(5, 15):  # both writers write the ring over, several times
        writers[step % 2].set(torch.arange(5), steps(5 * step, 5 * step + 5))
    kept = zarr_rb.load(path, version="mid", read_only=True)
    try:
        assert torch.equal(kept[:]["step"], twin[:]["step"])
    finally:
        kept.storage.close()
    assert [v.tag for v in zarr_rb.versions(path)] == ["mid"]
    for writer in writers:
        writer.close()
    zarr_rb.drop_version(path, "mid")
    assert [v.tag for v in zarr_rb.versions(path)] == [None]


def stored_slots(url: str, options: dict | None) -> int:
    """Shards of the ``step`` array in the store (one per slot written)."""
    reader = ZarrStorage(path=url, read_only=True, storage_options=options)
    try:
        return len(reader._store.arrays.get(("step",)).stored_chunks())
    finally:
        reader.close()


def test_dropped_versions_give_their_slots_back_to_the_disk(where):
    """Ten versions of a ring written over between them hold ten rings' worth of slots;
    once dropped, the objects of the slots nothing refers to are deleted (past the spare
    slots the ring reuses first), and every row reads as before, then as written on."""
    url, options = where
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, url, compression=LAYOUT, storage_options=options)
    )
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    extend((rb, twin), 0, CAPACITY)
    for version in range(10):
        extend((rb, twin), CAPACITY * (version + 1), CAPACITY * (version + 2))
        zarr_rb.save(rb, tag=f"v{version}")
    blocks = CAPACITY // 8
    held = stored_slots(url, options)
    assert held >= 10 * blocks
    rb.storage.close()
    for version in range(10):
        zarr_rb.drop_version(url, f"v{version}", storage_options=options)
    # The spare slots, the ring's and the last save's (which is v9's).
    assert stored_slots(url, options) <= 4 * blocks < held
    rb = zarr_rb.load(url, storage_options=options)
    assert_identical(rows(rb), rows(twin))
    extend((rb, twin), 1000, 1000 + 3 * CAPACITY)
    assert_identical(rows(rb), rows(twin))
    rb.storage.close()


def test_a_writer_collects_what_each_drop_frees_without_listing_the_store(tmp_path, monkeypatch):
    """Versions dropped while the writer goes on free the slots they kept: each drop
    deletes them, and finds them without listing the arrays' objects (a listing costs
    the store's size): a writer lists them once at most, none for a store it made."""
    from zarr_rb.engine.rows import RowArray

    listings = []
    stored_chunks = RowArray.stored_chunks

    def counted(self: RowArray) -> set[int]:
        listings.append(self.path)
        return stored_chunks(self)

    monkeypatch.setattr(RowArray, "stored_chunks", counted)
    url = str(tmp_path / "rb.zarr")
    blocks = CAPACITY // 8

    def turns(rb: TensorDictReplayBuffer, start: int) -> None:
        """Six versions, a turn of the ring apart, then all dropped."""
        for turn in range(6):
            extend((rb, twin), start + CAPACITY * turn, start + CAPACITY * (turn + 1))
            zarr_rb.save(rb, tag=f"t{start}-{turn}")
        held = len(listings), stored_slots(url, None)
        del listings[held[0] :]
        assert held[1] >= 6 * blocks
        for turn in range(6):
            zarr_rb.drop_version(url, f"t{start}-{turn}")

    rb = TensorDictReplayBuffer(storage=ZarrStorage(CAPACITY, url, compression=LAYOUT))
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    turns(rb, 0)
    assert not listings  # a store this writer made: it knows which slots it wrote
    # The ring, the spare slots, and the slots of the commits the writer keeps for
    # readers (at most a ring's worth besides the last commit's).
    assert stored_slots(url, None) <= 4 * blocks
    listings.clear()
    assert_identical(rows(rb), rows(twin))
    rb.storage.close()
    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=url))
    turns(rb, 1000)
    assert 0 < len(listings) == len(set(listings))  # reopened: listed by the first drop
    assert stored_slots(url, None) <= 4 * blocks
    assert_identical(rows(rb), rows(twin))
    rb.storage.close()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("storage", ["memory", "zarr"])
def test_a_version_longer_than_the_buffer_now_loads_whole(tmp_path, storage, shared):
    """A kept version loads with its own rows and length into any storage, after the
    buffer was emptied and holds fewer rows than the version."""
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, path, compression=LAYOUT, shared=shared)
    )
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    extend((rb, twin), 0, 27)
    zarr_rb.save(rb, tag="long")
    expected = rows(twin).clone()
    rb.empty()
    extend((rb,), 100, 103)  # three rows now
    zarr_rb.save(rb)
    kept = zarr_rb.load(path, version="long", storage=storage, read_only=storage == "zarr")
    try:
        assert len(kept) == 27
        assert_identical(rows(kept), expected)
        assert int(kept.sample(64)["step"].max()) < 27  # only the version's rows are drawn
    finally:
        if storage == "zarr":
            kept.storage.close()
    now = zarr_rb.load(path, storage=storage, read_only=storage == "zarr")
    assert len(now) == 3
    assert torch.equal(rows(now)["step"], torch.arange(100, 103))
    if storage == "zarr":
        now.storage.close()
    rb.storage.close()
