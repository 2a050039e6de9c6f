"""Shared stores beside a collection, a repair, a load and a dropped version: the edges
where one writer's view of the record is older than what another writer did since."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
from conftest import chunk_file
from shared_workers import stamped
from test_shared_collect import (
    ROWS,
    _grow_and_keep,
    few_spare_slots,
    slot_objects,
    stamps,
    version_stamps,
)
from torchrl.data import ReplayBuffer

import zarr_rb
import zarr_rb.core.sharing_slots as slots_module
from zarr_rb import ZarrStorage
from zarr_rb.core.arrays import StoreArrays
from zarr_rb.core.saves import StoreSaves

__all__ = ["few_spare_slots"]  # (a fixture, used by name)


def _one_ring(path) -> ZarrStorage:
    """A shared writer of a small store, its ring written once."""
    layout = zarr_rb.Compression(block_rows=4)
    storage = ZarrStorage(ROWS, str(path), shared=True, compression=layout)
    ReplayBuffer(storage=storage).extend(stamped(0, 0, ROWS))
    return storage


def _keep_only(storage: ZarrStorage, prefix: str) -> None:
    store = storage._store
    versions = {tag: saved for tag, saved in store.meta.versions.items() if tag.startswith(prefix)}
    store.commits.update(lambda meta: dataclasses.replace(meta, versions=versions))


def test_a_writer_with_an_older_record_reads_again_across_a_collection(tmp_path, few_spare_slots):
    path = tmp_path / "rb.zarr"
    storage, _ = _grow_and_keep(str(path), turns=4)
    other = ZarrStorage(path=str(path), shared=True)
    assert len(other) == ROWS
    before = other._store.committed
    rb = ReplayBuffer(storage=storage)
    for turn in range(4):
        rb.extend(stamped(0, (4 + turn) * ROWS, ROWS))
        zarr_rb.save(rb, tag=f"w{turn}", progress=False)
    _keep_only(storage, "w")
    assert storage._store.collect() > 0
    assert other._store.committed is before  # the other writer has not looked since
    emptied = set((before.physical(np.arange(ROWS)) // 4).tolist())
    assert not emptied & slot_objects(path)
    # Read through the store (no refresh first): the record it holds names emptied slots.
    got = other._store.read(np.arange(ROWS), [("obs",), ("stamp",)])
    assert got[("stamp",)].tolist() == stamps(storage)
    assert (got[("obs",)][:, 0, 0] == got[("stamp",)] % 251).all()
    other.close()
    storage.close()


def test_a_repair_beside_a_shared_writer_withdraws_only_the_rows_it_found_damaged(
    tmp_path, monkeypatch
):
    verify_module = importlib.import_module("zarr_rb.verify")

    path = tmp_path / "rb.zarr"
    layout = zarr_rb.Compression(block_rows=4)
    storage = ZarrStorage(ROWS, str(path), shared=True, compression=layout)
    rb = ReplayBuffer(storage=storage)
    rb.extend(stamped(0, 0, ROWS))
    # One chunk of the first block damaged on disk.
    slot = int(storage._store.committed.physical(np.arange(1))[0]) // 4
    chunk = chunk_file(path, "data/obs", slot, 0, 0)
    chunk.write_bytes(b"damaged")
    other = ZarrStorage(path=str(path), shared=True)  # another writer (as in another process)
    check_array = verify_module._check_array
    written: list[int] = []

    def writer_goes_on(store, *args, **kwargs):
        if not written:
            # While the repair reads (through this process's writer, whose record is
            # older), the other writer turns the whole ring over: the damaged rows are no
            # longer any position's.
            data = stamped(1, 0, ROWS)
            ReplayBuffer(storage=other).extend(data)
            written.extend(data["stamp"].tolist())
        return check_array(store, *args, **kwargs)

    monkeypatch.setattr(verify_module, "_check_array", writer_goes_on)
    report = zarr_rb.verify(str(path), repair=True)
    assert written
    assert report.damaged  # found at the record the repair read
    assert report.withdrawn_rows == 0
    assert len(storage) == ROWS
    assert stamps(storage) == written
    reader = ZarrStorage(path=str(path), read_only=True)
    assert stamps(reader) == written
    reader.close()
    other.close()
    storage.close()


def test_a_load_puts_back_no_version_the_record_no_longer_keeps(
    tmp_path, few_spare_slots, monkeypatch
):
    path = tmp_path / "rb.zarr"
    storage, _ = _grow_and_keep(str(path), turns=4)
    head = stamps(storage)
    storage.close()
    use_save = StoreSaves.use_save
    dropped: list[int] = []

    def dropped_meanwhile(self: StoreSaves, saved) -> None:
        if not dropped:
            # Between the load reading the version and putting its rows back, the record
            # stops keeping it (as a holder that took the store over would), and its slots
            # are collected: the load must not name them again.
            store = self.store
            versions = {"v3": store.meta.versions["v3"]}
            store.commits.update(lambda meta: dataclasses.replace(meta, versions=versions))
            dropped.append(store.collect())
        use_save(self, saved)

    monkeypatch.setattr(StoreSaves, "use_save", dropped_meanwhile)
    with pytest.raises(zarr_rb.VersionNotFoundError, match="no longer keeps"):
        zarr_rb.load(str(path), version="v2", progress=False)
    assert dropped[0] > 0
    reader = ZarrStorage(path=str(path), read_only=True)
    assert stamps(reader) == head
    reader.close()


def test_a_version_dropped_beside_live_shared_writers_keeps_their_rows(
    tmp_path, few_spare_slots, monkeypatch
):
    api = importlib.import_module("zarr_rb.api")
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=4)
    other = ZarrStorage(path=str(path), shared=True)
    data = stamped(1, 0, 10)
    open_store = api.open_store
    committed: list[int] = []

    def others_commit_meanwhile(*args, **kwargs):
        store = open_store(*args, **kwargs)  # this process's first writer, shared
        if not committed:
            # The other writer commits after the drop looked at the record.
            ReplayBuffer(storage=other).extend(data)
            committed.append(len(data))
        return store

    monkeypatch.setattr(api, "open_store", others_commit_meanwhile)
    expected = data["stamp"].tolist() + kept["v3"][10:]
    zarr_rb.drop_version(str(path), "v1")  # through this process's first writer
    assert committed
    assert "v1" not in {v.tag for v in zarr_rb.versions(str(path))}
    with pytest.raises(zarr_rb.VersionNotFoundError):
        zarr_rb.drop_version(str(path), "v1")
    assert stamps(other) == expected
    assert stamps(storage) == expected
    # Both writers go on.
    ReplayBuffer(storage=storage).extend(stamped(0, 10_000, 5))
    ReplayBuffer(storage=other).extend(stamped(1, 10, 5))
    assert len(storage) == ROWS
    assert version_stamps(str(path), "v2") == kept["v2"]
    other.close()
    storage.close()


def test_a_collection_that_fails_gives_back_the_slots_it_held(
    tmp_path, few_spare_slots, monkeypatch
):
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=6)
    store = storage._store
    drop_slots = StoreArrays.drop_slots

    def failing(self: StoreArrays, keys, slots) -> None:
        drop_slots(self, keys[:1], slots)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StoreArrays, "drop_slots", failing)
    _keep_only(storage, "v5")
    with pytest.raises(OSError):
        store.collect()
    ring = store.commits.read_record().commit.ring
    assert {slot for _, slot in ring.open} <= {store.commits.slot}
    monkeypatch.setattr(StoreArrays, "drop_slots", drop_slots)
    assert store.collect() > 0  # the next collection empties them
    assert stamps(storage) == kept["v5"]
    ReplayBuffer(storage=storage).extend(stamped(0, 10_000, 3 * ROWS))
    assert stamps(storage) == list(range(10_000 + 2 * ROWS, 10_000 + 3 * ROWS))
    storage.close()


def test_retired_slots_among_those_taken_first_are_collected_too(tmp_path, few_spare_slots):
    path = tmp_path / "rb.zarr"
    storage, kept = _grow_and_keep(str(path), turns=2)
    store = storage._store
    _keep_only(storage, "v1")  # v0's slots (the first ring's) come free
    ring = store.committed.ring
    spare = slots_module.initial_capacity(ROWS // 4)
    head = set((store.committed.physical(np.arange(ROWS)) // 4).tolist())
    retired = sorted(set(range(spare)) - head)[:3]
    assert retired
    assert max(retired) < spare
    assert set(retired) <= slot_objects(path)

    def retire(meta):
        ring = dataclasses.replace(meta.commit.ring, retired=tuple(retired))
        return dataclasses.replace(meta, commit=dataclasses.replace(meta.commit, ring=ring))

    # A writer taken for gone (its lease expired) had them open: no writer takes them
    # again, none writes them but that one, late; their objects are garbage.
    store.commits.update(retire)
    assert ring.capacity >= spare
    assert store.collect() >= len(retired)
    assert not set(retired) & slot_objects(path)
    assert stamps(storage) == kept["v1"]
    storage.close()


def test_a_repair_keeps_rows_another_writer_rewrote_into_the_same_slot(tmp_path, monkeypatch):
    """ABA: the damaged slot comes free, another writer takes it again (lowest free slot)
    and writes the same positions at the same physical rows: the chunk is whole again, the
    rows are the other writer's new ones, yet the repair withdraws them."""
    verify_module = importlib.import_module("zarr_rb.verify")
    path = tmp_path / "rb.zarr"
    storage = _one_ring(path)
    slot = int(storage._store.committed.physical(np.arange(1))[0]) // 4
    chunk_file(path, "data/obs", slot, 0, 0).write_bytes(b"damaged")
    other = ZarrStorage(path=str(path), shared=True)
    check_array = verify_module._check_array
    written: list[int] = []

    def writer_goes_on(store, *args, **kwargs):
        found = check_array(store, *args, **kwargs)
        if found and not written:
            rb = ReplayBuffer(storage=other)
            rb.extend(stamped(1, 0, ROWS))  # the ring turns over: the first slots come free
            data = stamped(1, ROWS, ROWS)
            rb.extend(data)  # ... and are taken again, lowest first
            written.extend(data["stamp"].tolist())
            assert int(other._store.committed.physical(np.arange(1))[0]) // 4 == slot
        return found

    monkeypatch.setattr(verify_module, "_check_array", writer_goes_on)
    report = zarr_rb.verify(str(path), repair=True)
    assert report.damaged  # found at the record the repair read
    reader = ZarrStorage(path=str(path), read_only=True)
    try:
        assert zarr_rb.verify(str(path)).ok  # the chunk was written whole again
        assert report.withdrawn_rows == 0
        assert len(reader) == ROWS
        assert stamps(reader) == written
    finally:
        reader.close()
        other.close()
        storage.close()


def test_a_damaged_chunk_read_beside_a_committing_writer_raises_chunk_corrupted(
    tmp_path, monkeypatch
):
    """A chunk damaged at the record of now, read while another writer commits (rows the
    read does not touch): the read must report the damage (ChunkCorruptedError, which
    tells to run verify), not RowsNotCommittedError after 50 tries."""

    path = tmp_path / "rb.zarr"
    storage = _one_ring(path)
    slot = int(storage._store.committed.physical(np.arange(1))[0]) // 4
    chunk_file(path, "data/obs", slot, 0, 0).write_bytes(b"damaged")
    other = ZarrStorage(path=str(path), shared=True)
    with pytest.raises(zarr_rb.ChunkCorruptedError):
        storage.get(torch.arange(4))  # alone: the damage is reported
    read_disk = StoreArrays.read
    commits = [0]

    def other_commits_meanwhile(self, *args, **kwargs):
        if self.store is storage._store:
            commits[0] += 1
            other.set(torch.tensor([ROWS - 1]), stamped(1, commits[0], 1), set_cursor=False)
        return read_disk(self, *args, **kwargs)

    monkeypatch.setattr(StoreArrays, "read", other_commits_meanwhile)
    try:
        with pytest.raises(zarr_rb.ChunkCorruptedError):
            storage.get(torch.arange(4))
    finally:
        monkeypatch.undo()
        other.close()
        storage.close()


def test_loading_the_last_save_while_another_writer_saves_loads_the_newer_one(
    tmp_path, monkeypatch
):
    """load(path) (no version: the last save) while another shared writer publishes a newer
    save between the load reading the state and putting the rows back: the store keeps a
    last save all along, which the load loads again."""
    path = tmp_path / "rb.zarr"
    storage = _one_ring(path)
    rb = ReplayBuffer(storage=storage)
    zarr_rb.save(rb, progress=False)
    other = ZarrStorage(path=str(path), shared=True)
    use_save = StoreSaves.use_save
    saved_meanwhile: list[bool] = []

    def other_saves_meanwhile(self, saved):
        if not saved_meanwhile:
            zarr_rb.save(ReplayBuffer(storage=other), progress=False)  # no row written
            saved_meanwhile.append(True)
        use_save(self, saved)

    monkeypatch.setattr(StoreSaves, "use_save", other_saves_meanwhile)
    try:
        loaded = zarr_rb.load(str(path), progress=False)  # the newer save, loaded again
        assert saved_meanwhile
        assert stamps(loaded.storage) == list(range(ROWS))
        loaded.storage.close()
    finally:
        other.close()
        storage.close()
