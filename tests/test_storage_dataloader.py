"""A ZarrStorage as the dataset of a PyTorch DataLoader, as TorchRL's storages are:
``DataLoader(rb.storage, batch_size=..., num_workers=2)`` in real worker processes. Spawned
workers open the store read-only (the writer's store is not made shared for them); forked
ones are refused with a typed error instead of being aborted by TensorStore."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_identical
from tensordict import TensorDict
from torch.utils.data import DataLoader, get_worker_info
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import NotSupportedError, StoreClosedError, ZarrStorage
from zarr_rb.core.store import Store
from zarr_rb.testing import forkserver_context

ROWS = 300
BATCH = 32


def _rows(first: int, count: int) -> TensorDict:
    step = torch.arange(first, first + count)
    frame = (step % 251).to(torch.uint8).view(-1, 1, 1).expand(-1, 16, 16).clone()
    return TensorDict(
        {"step": step, "obs": frame, "next": {"reward": step.float() / 2}}, batch_size=[count]
    )


def _filled(storage: Any, rows: int = ROWS) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(storage=storage)
    for first in range(0, rows, 100):
        rb.extend(_rows(first, min(100, rows - first)))
    return rb


def _stack_in_worker(items: list[TensorDict]) -> tuple[TensorDict, bool, bool]:
    """A batch, and whether the worker's storage is read-only and its store shared."""
    worker = get_worker_info()
    assert worker is not None
    storage = worker.dataset
    return torch.stack(items), storage.read_only, storage._store.is_shared


def _epoch(loader: DataLoader, storage: ZarrStorage) -> list[int]:
    """The rows of one epoch, each batch checked against ``storage[i]`` in this process."""
    seen: list[int] = []
    for batch, read_only, shared in loader:
        assert read_only
        assert not shared
        steps = batch["step"]
        assert_identical(batch, torch.stack([storage[int(i)] for i in steps]))
        seen.extend(steps.tolist())
    return seen


def test_spawned_workers_read_every_row_once_per_epoch_as_readers(tmp_path: Path) -> None:
    rb = _filled(ZarrStorage(1000, tmp_path / "rb.zarr"))
    storage = rb.storage
    loader = DataLoader(
        storage,
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="spawn",
        persistent_workers=True,
        collate_fn=_stack_in_worker,
    )
    first = _epoch(loader, storage)  # rows still in the writer's RAM were committed for it
    assert sorted(first) == list(range(ROWS))
    assert first != sorted(first)
    assert not storage._store.is_shared
    rb.extend(_rows(ROWS, 50))  # the writer keeps writing between epochs, alone
    storage.flush()
    second = _epoch(loader, storage)  # the same workers, which pick up the new commit
    assert sorted(second) == list(range(ROWS + 50))
    assert not storage._store.is_shared
    assert len(storage) == ROWS + 50


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_the_same_loader_over_lazy_tensor_storage_gives_the_same_batches(shuffle: bool) -> None:
    """A temporary store (path=None) too: workers open it by its path while the storage
    that made it is open."""
    batches = {}
    for name, storage in (("zarr", ZarrStorage(1000)), ("lazy", LazyTensorStorage(1000))):
        _filled(storage)
        loader = DataLoader(
            storage,
            batch_size=BATCH,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(3),
            num_workers=2,
            multiprocessing_context=forkserver_context(),
            collate_fn=torch.stack,
        )
        batches[name] = list(loader)
    assert len(batches["zarr"]) == len(batches["lazy"]) == -(-ROWS // BATCH)
    for ours, theirs in zip(batches["zarr"], batches["lazy"], strict=True):
        assert_identical(ours, theirs)
    steps = torch.cat([batch["step"] for batch in batches["zarr"]]).tolist()
    assert sorted(steps) == list(range(ROWS))
    assert (steps == sorted(steps)) != shuffle


def test_forked_workers_are_told_to_use_spawn(tmp_path: Path) -> None:
    storage = _filled(ZarrStorage(1000, tmp_path / "rb.zarr")).storage
    loader = DataLoader(
        storage,
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=torch.stack,
    )
    batches = iter(loader)
    try:
        with pytest.raises(NotSupportedError, match="forked from one that used TensorStore") as err:
            next(batches)
    finally:
        # torch's reraise leaves the iterator in a reference cycle: stopped by a later
        # cyclic collection, whose weakref callbacks close its queues first, each worker
        # would wait 5 s for a shutdown message that never comes.
        batches._shutdown_workers()
    assert str(tmp_path / "rb.zarr") in str(err.value)
    assert "multiprocessing_context='spawn'" in str(err.value)


def test_a_batch_is_one_read_of_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the writer, and in a reader, as a worker has it (every row from the files)."""
    writer = _filled(ZarrStorage(1000, tmp_path / "rb.zarr")).storage
    writer.flush()
    reader = ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)
    reads = []
    read = Store.read

    def counted(store: Store, rows: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(rows)
        return read(store, rows, *args, **kwargs)

    monkeypatch.setattr(Store, "read", counted)
    for storage in (writer, reader):
        reads.clear()
        items = storage.__getitems__([250, 3, 77, 3])
        assert len(reads) == 1
        assert sorted(reads[0].tolist()) == [3, 3, 77, 250]
        for i, item in zip([250, 3, 77, 3], items, strict=True):
            assert_identical(item, writer[i])


def test_a_storage_never_written_is_an_empty_epoch(tmp_path: Path) -> None:
    storage = ZarrStorage(1000, tmp_path / "rb.zarr")
    assert list(DataLoader(storage, batch_size=BATCH, collate_fn=torch.stack)) == []
    loader = DataLoader(
        storage,
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context=forkserver_context(),
        collate_fn=torch.stack,
    )
    assert list(loader) == []
    assert not storage._store.is_shared


@pytest.mark.parametrize("workers", [0, 2])
def test_a_closed_storage_is_a_typed_error_naming_the_store(tmp_path: Path, workers: int) -> None:
    storage = _filled(ZarrStorage(1000, tmp_path / "rb.zarr")).storage
    storage.close()
    loader = DataLoader(
        storage,
        batch_size=BATCH,
        num_workers=workers,
        multiprocessing_context=forkserver_context() if workers else None,
        collate_fn=torch.stack,
    )
    with pytest.raises(StoreClosedError, match=f"store '{tmp_path / 'rb.zarr'}' is closed"):
        list(loader)
    with pytest.raises(StoreClosedError):
        pickle.dumps(storage)


def test_an_ndim2_storage_points_to_the_dataset(tmp_path: Path) -> None:
    storage = ZarrStorage(12, tmp_path / "rb.zarr", ndim=2)
    storage.set(slice(0, 2), TensorDict({"a": torch.arange(6).view(2, 3)}, [2, 3]))
    with pytest.raises(NotSupportedError, match=r"ndim=2.*zarr_rb.open\(path\).dataset\(\)"):
        storage.__getitems__([0, 1])
