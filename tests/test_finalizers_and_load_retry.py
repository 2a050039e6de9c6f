"""Storages dropped without close() beside other storages of the same store (finalizers
the garbage collector runs at any allocation, on any thread), and loads tried again when
another writer replaced the last save."""

from __future__ import annotations

import gc
import threading

import torch
from shared_workers import stamped
from tensordict import TensorDict
from test_shared_collect import ROWS
from torchrl.data import ReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.core.lifetime import Lifetime
from zarr_rb.core.saves import StoreSaves
from zarr_rb.testing import simulate_crash


def _one_ring(path) -> ZarrStorage:
    layout = zarr_rb.Compression(block_rows=4)
    storage = ZarrStorage(ROWS, str(path), shared=True, compression=layout)
    ReplayBuffer(storage=storage).extend(stamped(0, 0, ROWS))
    return storage


def test_a_load_tried_again_detaches_the_buffer_of_the_attempt_that_failed(tmp_path, monkeypatch):
    """load(path) tried again after another writer replaced the last save: the buffer
    built by the failed attempt does not stay attached to the storage (TorchRL keeps
    strong references in _attached_entities, and notifies each on every write)."""
    path = tmp_path / "rb.zarr"
    storage = _one_ring(path)
    zarr_rb.save(ReplayBuffer(storage=storage), progress=False)
    other = ZarrStorage(path=str(path), shared=True)
    use_save = StoreSaves.use_save
    saved_meanwhile: list[bool] = []

    def other_saves_meanwhile(self, saved):
        if not saved_meanwhile:
            zarr_rb.save(ReplayBuffer(storage=other), progress=False)
            saved_meanwhile.append(True)
        use_save(self, saved)

    monkeypatch.setattr(StoreSaves, "use_save", other_saves_meanwhile)
    try:
        loaded = zarr_rb.load(str(path), progress=False)
        assert saved_meanwhile
        attached = [e for e in loaded.storage._attached_entities if e is not loaded]
        assert attached == []  # only the buffer that was returned
        loaded.storage.close()
    finally:
        other.close()
        storage.close()


def test_rows_of_a_storage_dropped_while_another_stays_are_committed(tmp_path):
    """A storage dropped without close() beside another storage of the same store, outside
    any call of the store: its rows are committed at once (a crash of the process later
    keeps them)."""
    path = tmp_path / "rb.zarr"
    kept = ZarrStorage(1000, path, compression=zarr_rb.Compression(block_rows=64))
    dropped = ZarrStorage(path=path)
    rb = ReplayBuffer(storage=dropped)
    rb.extend(TensorDict({"a": torch.arange(8.0)}, [8]))
    del rb, dropped
    gc.collect()
    assert kept._store.lifetime.users == 1
    reader = ZarrStorage(path=path, read_only=True)
    try:
        assert len(reader) == 8  # the dropped storage's rows are committed
    finally:
        reader.close()
        simulate_crash(kept)


def test_a_storage_dropped_on_another_thread_while_the_other_closes_closes_the_store(
    tmp_path, monkeypatch
):
    """A finalizer run by the garbage collector on one thread (users 2 read, then
    decremented) while another thread closes the other storage: unless the two are
    serialized, users ends at 0 with the store never closed (its lock never released, a
    temporary store never deleted)."""
    first = ZarrStorage(100)  # a temporary store, deleted at its last close
    second = ZarrStorage(path=first.path)  # the same store, users 2
    ReplayBuffer(storage=first).extend(TensorDict({"a": torch.arange(4.0)}, [4]))
    store = first._store
    tmpdir = store.path.parent
    value = {"users": store.lifetime.__dict__.pop("users")}
    checked = threading.Event()
    closed = threading.Event()
    reads = {"n": 0}

    def get(self):
        if threading.current_thread().name == "gc-thread":
            reads["n"] += 1
            if reads["n"] == 2:  # between drop_user's check and its decrement
                checked.set()
                closed.wait(60)
        return value["users"]

    def put(self, v):
        value["users"] = v

    monkeypatch.setattr(Lifetime, "users", property(get, put), raising=False)
    first._finalizer.detach()  # its finalizer is run below, as the GC would, on a thread
    gc_thread = threading.Thread(target=store.lifetime.drop_user, name="gc-thread")
    try:
        gc_thread.start()
        assert checked.wait(60)
        # Between its check and its decrement, no call of the store can run (a close on
        # another thread waits): the lock is held.
        try:
            assert not store.calls.mutex.acquire(blocking=False)
        finally:
            closed.set()
        gc_thread.join(60)
        second.close()  # the other user closes then: the last one
    finally:
        monkeypatch.undo()
        store.lifetime.__dict__["users"] = value["users"]
    try:
        assert store.closed, f"users={value['users']}, the store was never closed"
        assert not tmpdir.exists()
    finally:
        if not store.closed:
            store.lifetime.__dict__["users"] = 1
            store.close()
