"""Shared stores give back the disk of slots nothing refers to (``Sharing.collect``).

A kept save holds the slots of its rows, so the arrays of a shared store grow while
versions are kept; once they are replaced or dropped, a collection deletes the objects of
the slots past those writers take first. The many-writer model runs with saves, tagged
versions, drops and collections killed half-way, and checks after each step that every
writer and every kept version still reads exactly the twin's rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import chunk_files, name_chunks_with
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from shared_workers import stamped, torn
from test_shared_model import SharedWriters
from torchrl.data import ReplayBuffer

import zarr_rb
import zarr_rb.core.sharing as sharing_module
import zarr_rb.core.sharing_slots as slots_module
from zarr_rb import Compression, ZarrStorage
from zarr_rb.core.arrays import StoreArrays

ROWS = 64
BLOCK_ROWS = 4


def slot_objects(path: Path, array: str = "data/obs") -> set[int]:
    """The slots of which the store's ``obs`` array (or ``array``) holds an object."""
    return {int(file.name.split(".")[1]) for file in chunk_files(path, array)}


def stamps(storage: ZarrStorage) -> list[int]:
    return storage.get(torch.arange(len(storage)))["stamp"].tolist()


def version_stamps(path: str, version: str) -> list[int]:
    """The stamps of the rows of a kept version, loaded read-only."""
    loaded = zarr_rb.load(path, version=version, read_only=True, progress=False)
    try:
        return stamps(loaded.storage) if len(loaded.storage) else []
    finally:
        loaded.storage.close()


@pytest.fixture
def few_spare_slots(monkeypatch):
    """Shared stores made with twice their blocks as slots, none more."""
    monkeypatch.setattr(slots_module, "SPARE_SLOTS", 0)


def _grow_and_keep(
    path: str, turns: int, options: dict | None = None, *, frames: bool = False
) -> tuple[ZarrStorage, dict[str, list[int]]]:
    """A shared writer that keeps a version at each turn of its ring (each version holds
    the slots of a ring of rows, so the arrays grow); ``frames``: ``obs`` and its next
    stored as frames (a row of 8x8 bytes is a frame)."""
    layout = Compression(block_rows=BLOCK_ROWS, frames=frames, large_row_bytes=64)
    storage = ZarrStorage(ROWS, path, shared=True, compression=layout, storage_options=options)
    rb = ReplayBuffer(storage=storage)
    kept = {}
    for turn in range(turns):
        rb.extend(stamped(0, turn * ROWS, ROWS))
        zarr_rb.save(rb, tag=f"v{turn}", progress=False)
        kept[f"v{turn}"] = stamps(storage)
    return storage, kept


def test_dropped_versions_of_a_shared_store_of_frames_give_back_their_cells_and_ids(
    tmp_path, few_spare_slots
):
    path = tmp_path / "rb.zarr"
    storage, _ = _grow_and_keep(str(path), turns=10, frames=True)
    head = stamps(storage)
    storage.close()
    arrays = ("data/obs", "frame_ids/obs", "frame_ids/next/obs")  # cells, and ids of each key
    grown = {array: len(slot_objects(path, array)) for array in arrays}
    assert min(grown.values()) >= 10 * ROWS // BLOCK_ROWS  # ten rings held by ten versions
    for turn in range(9):
        zarr_rb.drop_version(str(path), f"v{turn}")
    for array in arrays:
        assert len(slot_objects(path, array)) < grown[array] // 2, array
    reader = ZarrStorage(path=str(path), read_only=True)
    assert stamps(reader) == head
    assert torn(reader.get(torch.arange(len(reader)))) == 0  # frames rebuilt from the cells
    reader.close()


def test_dropped_versions_of_a_shared_store_give_their_slots_back(tmp_path, few_spare_slots):
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=10)
    head = stamps(storage)
    storage.close()
    grown = len(slot_objects(path))
    assert grown >= 10 * ROWS // BLOCK_ROWS  # ten rings held by ten versions
    for turn in range(9):
        zarr_rb.drop_version(str(path), f"v{turn}")
    spare = slots_module.initial_capacity(ROWS // BLOCK_ROWS)
    left = slot_objects(path)
    # The slots writers take first, and those past them that v9 and the head refer to.
    assert len(left - set(range(spare))) <= 2 * ROWS // BLOCK_ROWS
    assert len(left) < grown // 2
    reader = ZarrStorage(path=str(path), read_only=True)
    assert stamps(reader) == head
    reader.close()
    assert version_stamps(str(path), "v9") == kept["v9"]
    # The store goes on: the slots given back are taken again, the rows read right.
    writer = ZarrStorage(path=str(path), shared=True)
    expected = stamps(writer)
    cursor = writer._store.committed.cursor
    for step in range(6):
        data = stamped(1, step * 50, 50)
        ReplayBuffer(storage=writer).extend(data)
        for i, stamp in enumerate(data["stamp"].tolist()):
            expected[(cursor + i) % ROWS] = stamp
        cursor = (cursor + 50) % ROWS
    assert stamps(writer) == expected
    writer.close()


def test_dropped_versions_of_a_shared_store_on_s3_give_their_slots_back(
    s3_url, s3_options, few_spare_slots
):
    def stored() -> set[int]:
        reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
        try:
            return reader._store.arrays.get(("obs",)).stored_chunks()
        finally:
            reader.close()

    storage, kept = _grow_and_keep(s3_url, turns=6, options=s3_options)
    other = ZarrStorage(path=s3_url, shared=True, storage_options=s3_options)
    grown = stored()
    assert len(grown) >= 6 * ROWS // BLOCK_ROWS
    storage.close()  # the other writer goes on meanwhile
    for turn in range(5):
        zarr_rb.save(ReplayBuffer(storage=other), progress=False)  # not a drop: shared
        ReplayBuffer(storage=other).extend(stamped(1, turn * 10, 10))
    other.close()
    for turn in range(5):
        zarr_rb.drop_version(s3_url, f"v{turn}", storage_options=s3_options)
    spare = slots_module.initial_capacity(ROWS // BLOCK_ROWS)
    left = stored()
    assert len(left - set(range(spare))) <= 3 * ROWS // BLOCK_ROWS < len(grown - set(range(spare)))
    loaded = zarr_rb.load(s3_url, version="v5", read_only=True, storage_options=s3_options)
    assert stamps(loaded.storage) == kept["v5"]
    loaded.storage.close()
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
    assert stamps(reader) == stamped(1, 0, 50)["stamp"].tolist() + kept["v5"][50:]
    reader.close()


def test_a_save_that_replaces_the_last_collects_the_slots_it_held(tmp_path, few_spare_slots):
    path = tmp_path / "rb.zarr"
    layout = Compression(block_rows=BLOCK_ROWS)
    storage = ZarrStorage(ROWS, str(path), shared=True, compression=layout)
    rb = ReplayBuffer(storage=storage)
    for turn in range(8):
        rb.extend(stamped(0, turn * ROWS, ROWS))
        zarr_rb.save(rb, progress=False)  # untagged: each replaces the last
    # At most the head's ring, the last save's and the slots taken first hold objects.
    spare = slots_module.initial_capacity(ROWS // BLOCK_ROWS)
    assert len(slot_objects(path) - set(range(spare))) <= 2 * ROWS // BLOCK_ROWS
    assert stamps(storage) == list(range(7 * ROWS, 8 * ROWS))
    storage.close()


def test_a_collector_killed_while_it_holds_slots_leaves_them_to_the_next(
    tmp_path, few_spare_slots, monkeypatch
):
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=6)
    other = ZarrStorage(path=str(path), shared=True)
    drop_slots = StoreArrays.drop_slots
    dropped: list[int] = []

    def killed(self: StoreArrays, keys, slots) -> None:
        if self.store is storage._store and slots and not dropped:
            drop_slots(self, keys[:1], slots)  # one array emptied, then killed
            dropped.extend(slots)
            raise KeyboardInterrupt

    give_back = sharing_module.Sharing._give_back
    monkeypatch.setattr(StoreArrays, "drop_slots", killed)
    # (Killed: nothing runs after, the slots held are not given back.)
    monkeypatch.setattr(sharing_module.Sharing, "_give_back", lambda self, slots: None)
    # The writer keeps only its last version: the others' slots come free and it collects.
    store = storage._store
    for turn in range(5):
        versions = dict(store.meta.versions)
        versions.pop(f"v{turn}")
        store.commits.update(lambda meta, v=versions: _with_versions(meta, v))
    with pytest.raises(KeyboardInterrupt):
        store.collect()
    assert dropped
    held = {slot for who, slot in store.committed.ring.open if who == store.commits.writer}
    assert set(dropped) <= held  # held while they were emptied
    store.lifetime.abandon()  # killed there
    monkeypatch.setattr(StoreArrays, "drop_slots", drop_slots)
    monkeypatch.setattr(sharing_module.Sharing, "_give_back", give_back)
    # The next writer that takes a slot drops the dead one's; its rows are all there.
    rb_other = ReplayBuffer(storage=other)
    rb_other.extend(stamped(1, 0, 3 * BLOCK_ROWS))
    ring = other._store.committed.ring
    assert not set(dropped) & {slot for _, slot in ring.open}
    # (Six turns of the ring: its cursor is at 0.)
    expected = stamped(1, 0, 3 * BLOCK_ROWS)["stamp"].tolist() + kept["v5"][3 * BLOCK_ROWS :]
    assert stamps(other) == expected
    assert version_stamps(str(path), "v5") == kept["v5"]
    assert other._store.collect() > 0  # what the dead one left goes at the next one
    assert stamps(other) == expected
    other.close()


def test_slots_a_collection_holds_are_taken_by_no_other_writer(
    tmp_path, few_spare_slots, monkeypatch
):
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=6)
    other = ZarrStorage(path=str(path), shared=True)
    store = storage._store
    drop_slots = StoreArrays.drop_slots
    written: list[int] = []

    def others_write_first(self: StoreArrays, keys, slots) -> None:
        if self.store is store and not written:
            # Another writer needs three rings of slots while these are being emptied.
            data = stamped(1, 0, 3 * ROWS)
            ReplayBuffer(storage=other).extend(data)
            written.extend(data["stamp"].tolist())
        drop_slots(self, keys, slots)

    monkeypatch.setattr(StoreArrays, "drop_slots", others_write_first)
    versions = {"v5": store.meta.versions["v5"]}
    store.commits.update(lambda meta: _with_versions(meta, versions))
    assert store.collect() > 0
    assert written
    assert stamps(other) == written[-ROWS:]
    assert stamps(storage) == written[-ROWS:]
    assert version_stamps(str(path), "v5") == kept["v5"]
    other.close()
    storage.close()


def _with_versions(meta, versions):
    import dataclasses

    return dataclasses.replace(meta, versions=versions)


def test_a_reader_of_an_older_record_reads_again_across_a_collection(tmp_path, few_spare_slots):
    path = tmp_path / "rb.zarr"
    storage, _ = _grow_and_keep(str(path), turns=4)
    reader = ZarrStorage(path=str(path), read_only=True)  # reads the record, no row yet
    assert len(reader) == ROWS
    store = reader._store
    before = store.committed
    # The writer writes four more rings, each kept, then keeps only those and collects:
    # the slots the reader's record names are emptied.
    rb = ReplayBuffer(storage=storage)
    for turn in range(4):
        rb.extend(stamped(0, (4 + turn) * ROWS, ROWS))
        zarr_rb.save(rb, tag=f"w{turn}", progress=False)
    store_w = storage._store
    versions = {tag: saved for tag, saved in store_w.meta.versions.items() if tag.startswith("w")}
    store_w.commits.update(lambda meta: _with_versions(meta, versions))
    assert store_w.collect() > 0
    assert store.committed is before  # the reader has not looked since
    emptied = set((before.physical(np.arange(ROWS)) // BLOCK_ROWS).tolist())
    assert not emptied & slot_objects(path)  # every slot the reader's record names
    assert stamps(reader) == stamps(storage)  # read again through the record of now
    reader.close()
    storage.close()


# --- the many-writer model, with saves, versions and collections ---------------------------


class SharedWritersKeepingVersions(SharedWriters):
    """Writers save (tagged or not), versions are dropped, collections killed half-way:
    every writer reads the twin's rows, every kept version the rows it was saved with.
    (A small ring, turned over within a few steps.)"""

    @initialize(rows=st.just(12), block_rows=st.sampled_from([2, 4]))
    def setup(self, rows: int, block_rows: int) -> None:
        # Arrays made with a slot more than the blocks: they grow, and slots come free past
        # those writers take first, within a few steps.
        self._initial_capacity = slots_module.initial_capacity
        slots_module.initial_capacity = lambda blocks: blocks + 1
        super().setup(rows, block_rows)
        self.versions: dict[str, list[int]] = {}
        self.tags = 0

    def _twin_stamps(self) -> list[int]:
        length = len(self.twin)
        return self.twin.get(torch.arange(length))["stamp"].tolist() if length else []

    @rule(writer=st.integers(0, 2), tag=st.booleans())
    def save(self, writer: int, tag: bool) -> None:
        name = None
        if tag:
            name, self.tags = f"t{self.tags}", self.tags + 1
        zarr_rb.save(ReplayBuffer(storage=self.writers[writer]), tag=name, progress=False)
        if name is not None:
            self.versions[name] = self._twin_stamps()

    @rule(data=st.data())
    def drop_a_version(self, data) -> None:
        """Every writer closes (a drop needs the store alone), one version goes, the
        writers come back."""
        if not self.versions:
            return
        name = data.draw(st.sampled_from(sorted(self.versions)))
        for storage in self.writers:
            storage.close()
        zarr_rb.drop_version(self.url, name)
        del self.versions[name]
        self.writers = [ZarrStorage(path=self.url, mode="r+", shared=True) for _ in self.writers]

    @rule(writer=st.integers(0, 2), arrays=st.integers(0, 3))
    def crash_in_collect(self, writer: int, arrays: int) -> None:
        """A writer killed while it deletes the objects of slots it holds: after
        ``arrays`` arrays of them."""
        storage = self.writers[writer]
        store = storage._store
        original = StoreArrays.drop_slots

        def killed(self_: StoreArrays, keys, slots) -> None:
            if self_.store is store:
                original(self_, keys[:arrays], slots)
                raise _KilledError
            original(self_, keys, slots)

        give_back = sharing_module.Sharing._give_back
        StoreArrays.drop_slots = killed  # type: ignore[method-assign]
        # (Killed: nothing runs after, the slots held are not given back.)
        sharing_module.Sharing._give_back = lambda self, slots: None  # type: ignore[method-assign]
        try:
            store.collect()
        except _KilledError:
            pass
        finally:
            StoreArrays.drop_slots = original  # type: ignore[method-assign]
            sharing_module.Sharing._give_back = give_back  # type: ignore[method-assign]
        store.lifetime.abandon()
        self.writers[writer] = ZarrStorage(path=self.url, mode="r+", shared=True)

    @rule(writer=st.integers(0, 2))
    def collect(self, writer: int) -> None:
        self.writers[writer]._store.collect()

    @invariant()
    def every_kept_version_reads_as_saved(self) -> None:
        for name, expected in getattr(self, "versions", {}).items():
            assert version_stamps(self.url, name) == expected, name

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if hasattr(self, "_initial_capacity"):
                slots_module.initial_capacity = self._initial_capacity


class _KilledError(Exception):
    pass


class SharedWritersOfFramesKeepingVersions(SharedWritersKeepingVersions):
    """The same, ``obs`` and its next stored as frames: collections delete the slots'
    cells and ids too, and a slot taken again takes its cells from the first."""

    frames = True


TestSharedWritersKeepingVersions = SharedWritersKeepingVersions.TestCase
TestSharedWritersOfFramesKeepingVersions = SharedWritersOfFramesKeepingVersions.TestCase
for _case in (TestSharedWritersKeepingVersions, TestSharedWritersOfFramesKeepingVersions):
    _case.settings = settings(
        max_examples=10,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
del _case  # (else pytest collects the last case twice, under this name)


def test_a_collection_empties_a_slot_once(tmp_path, few_spare_slots, monkeypatch):
    """A collection counts the slots it empties as taken (a sample holding a commit whose
    rows were there reads again), and the next collection knows them empty: it deletes
    nothing and counts nothing (found by review: every save deleted the same slots again
    and counted them as taken again, which soon made every record too new for held reads
    to tell)."""
    path = tmp_path / "rb.zarr"
    storage, _ = _grow_and_keep(str(path), turns=6)
    for turn in range(6):
        storage.store.saves.drop_version(f"v{turn}")
    deleted: list[list[int]] = []
    drop = StoreArrays.drop_slots

    def spied(self, keys, slots):
        deleted.append(list(slots))
        return drop(self, keys, slots)

    monkeypatch.setattr(StoreArrays, "drop_slots", spied)
    before = storage.store.commits.read_record().commit
    rb = ReplayBuffer(storage=storage)
    for _ in range(3):
        zarr_rb.save(rb, progress=False)
    assert deleted == [], deleted
    after = storage.store.commits.read_record().commit
    assert after.ring is not None
    assert before.ring is not None
    assert after.ring.takes == before.ring.takes
    storage.close()


@pytest.mark.parametrize("separator", [".", "/"])
def test_a_leftover_lock_file_beside_a_chunk_is_no_stored_chunk(tmp_path, monkeypatch, separator):
    """TensorStore writes a chunk through ``<key>.__lock``; one a killed writer left is not
    a chunk of the slot it names (collection would hold that slot, and give it back at
    every listing). Found by review: with chunks named ``c.25``, a 1-D array's leftover
    ``c.25.__lock`` counted as slot 25."""
    name_chunks_with(monkeypatch, separator)
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(ROWS, path, compression=Compression(block_rows=BLOCK_ROWS))
    ReplayBuffer(storage=storage).extend(stamped(0, 0, 8))
    storage.close()
    arrays = {("stamp",): "c/9", ("obs",): "c/9/0/0"}  # (obs: [rows, 8, 8] chunks)
    for key, name in arrays.items():
        leftover = path / "data" / key[0] / (name.replace("/", separator) + ".__lock")
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"partial")
    reader = ZarrStorage(path=path, read_only=True)
    try:
        for key in arrays:
            assert reader._store.arrays.get(key).stored_chunks() == {0, 1}
    finally:
        reader.close()
