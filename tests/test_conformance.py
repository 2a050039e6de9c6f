"""ZarrStorage behaves as TorchRL's own storages do, wherever TorchRL uses one.

Each test runs one TorchRL pattern twice, on TorchRL's storage (LazyTensorStorage or
LazyMemmapStorage) and on ZarrStorage, and compares everything observable: lengths,
cursors, stored rows, samples. The patterns are those of TorchRL's own replay-buffer tests
(``test/rb``); ``tools/torchrl_suite.py`` runs those tests themselves on ZarrStorage.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_identical
from tensordict import LazyStackedTensorDict, TensorDict
from torch.utils._pytree import tree_flatten
from torchrl.collectors import Collector
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.checkpointers import (
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    NestedStorageCheckpointer,
)
from torchrl.data.replay_buffers.writers import TensorDictRoundRobinWriter
from torchrl.envs import GymEnv, SerialEnv
from torchrl.envs.transforms import StepCounter

import zarr_rb
from zarr_rb import (
    Compression,
    SchemaMismatchError,
    StoreExistsError,
    StoreNotFoundError,
    ZarrStorage,
)
from zarr_rb.errors import ReadOnlyError, RowsNotCommittedError

SMALL = Compression(chunk_rows=2, block_rows=8, large_row_bytes=64)


def same(actual: Any, expected: Any) -> None:
    """The same data, bit for bit, whatever its kind (TensorDicts, tensors, pytrees)."""
    if isinstance(expected, (dict, list, tuple)):
        a, _ = tree_flatten(actual)
        e, _ = tree_flatten(expected)
        assert len(a) == len(e)
        for x, y in zip(a, e, strict=True):
            assert_identical(x, y)
    else:
        assert_identical(actual, expected)


def twins(tmp_path: Path, make: Callable[[Any], Any], *, max_size: int, **kwargs: Any):
    """The buffer ``make(storage)`` on LazyTensorStorage and on ZarrStorage."""
    return (
        make(LazyTensorStorage(max_size, **kwargs)),
        make(ZarrStorage(max_size, tmp_path / "rb.zarr", compression=SMALL, **kwargs)),
    )


def transitions(n: int, start: int = 0) -> TensorDict:
    step = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": step.float().view(-1, 1, 1).expand(-1, 4, 4).clone(),
            "action": step % 3,
            ("next", "reward"): step.float().unsqueeze(-1),
            ("next", "done"): (step % 5 == 4).unsqueeze(-1),
        },
        batch_size=[n],
    )


# --- 1. every keyword of TorchRL's lazy storages ------------------------------------------------

KEYWORDS: list[tuple[type, dict[str, Any]]] = [
    (LazyTensorStorage, {"compilable": True}),
    (LazyTensorStorage, {"consolidated": True}),
    (LazyTensorStorage, {"device": "auto"}),
    (LazyTensorStorage, {"ndim": 1, "cleanup_memmap": False}),
    (LazyMemmapStorage, {"scratch_dir": "SCRATCH"}),
    (LazyMemmapStorage, {"existsok": True, "auto_cleanup": False}),
    (LazyMemmapStorage, {"compilable": True}),
]


@pytest.mark.parametrize(("reference", "kwargs"), KEYWORDS)
def test_keywords_of_torchrl_storages(tmp_path: Path, reference: type, kwargs: dict) -> None:
    def make(cls: type, where: str) -> Any:
        options = {k: (tmp_path / where if v == "SCRATCH" else v) for k, v in kwargs.items()}
        if cls is ZarrStorage and "scratch_dir" not in options:
            options["path"] = tmp_path / where
        return TensorDictReplayBuffer(storage=cls(40, **options), batch_size=6)

    theirs, ours = make(reference, "theirs"), make(ZarrStorage, "ours")
    for rb in (theirs, ours):
        rb.extend(transitions(25))
    assert len(ours) == len(theirs)
    assert ours.storage.device == theirs.storage.device
    same(ours.storage[:], theirs.storage[:])
    torch.manual_seed(0)
    expected = theirs.sample()
    torch.manual_seed(0)
    same(ours.sample(), expected)
    if "scratch_dir" in kwargs:
        assert ours.storage.path == (tmp_path / "ours").absolute()


def test_shared_init_is_accepted_as_torchrl_storages_take_it() -> None:
    # Any process may make a ZarrStorage's first write (tested with processes in
    # test_shared.py); the flag is kept for TorchRL's collectors, which look at it.
    storage = ZarrStorage(10, shared_init=True)
    assert storage.shared_init is True
    storage.close()


def test_auto_cleanup_deletes_the_store(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(10, path, auto_cleanup=True)
    storage.set(torch.arange(3), torch.zeros(3, 2))
    assert path.is_dir()
    assert storage.cleanup() is True
    assert not path.exists()
    assert storage.cleanup() is False  # idempotent, as LazyMemmapStorage.cleanup
    kept = ZarrStorage(10, tmp_path / "kept.zarr")
    kept.set(torch.arange(3), torch.zeros(3, 2))
    kept.close()  # auto_cleanup is off for a path of the user's: the store stays
    assert ZarrStorage(path=tmp_path / "kept.zarr", read_only=True).__len__() == 3


# --- modes: what exists, what is created, what is reused -----------------------------------------


def test_modes(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    with pytest.raises(StoreNotFoundError):
        ZarrStorage(10, path, mode="r+")
    with pytest.raises(StoreNotFoundError):
        ZarrStorage(path=path, mode="r")
    storage = ZarrStorage(10, path, mode="w-")
    storage.set(torch.arange(4), torch.ones(4, 2))
    storage.close()
    for refuse in ({"mode": "w-"}, {"existsok": False}):
        with pytest.raises(StoreExistsError, match="mode='a' to append") as info:
            ZarrStorage(10, path, **refuse)
        assert isinstance(info.value, FileExistsError)
    assert len(ZarrStorage(10, path, mode="r+")) == 4  # closes when collected
    assert len(ZarrStorage(10, path, existsok=True)) == 4
    fresh = ZarrStorage(30, path, mode="w")  # starts over: new size, no rows
    assert len(fresh) == 0
    assert fresh.max_size == 30
    fresh.close()
    with pytest.raises(ValueError, match="ask for different modes"):
        ZarrStorage(10, path, mode="a", read_only=True)


def test_a_buffer_on_a_reopened_store_appends_after_its_last_row(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(20, path, compression=SMALL))
    rb.extend(transitions(12))
    rb.storage.close()
    for start in (12, 18):  # the second one wraps around the ring
        rb = TensorDictReplayBuffer(storage=ZarrStorage(20, path))
        index = rb.extend(transitions(6, start=start))
        assert index.tolist() == [(start + i) % 20 for i in range(6)]
        rb.storage.close()
    reopened = ZarrStorage(path=path, read_only=True)
    assert len(reopened) == 20
    steps = reopened[:]["action"].tolist()
    expected = [(20 + i if i < 4 else i) % 3 for i in range(20)]
    assert steps == expected


def test_compression_that_differs_from_the_store_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    storage = ZarrStorage(20, path, compression=SMALL)
    storage.set(torch.arange(4), transitions(4))
    storage.close()
    with pytest.raises(SchemaMismatchError, match="compression=None to reopen"):
        ZarrStorage(20, path, compression=Compression(codec="lz4"))
    reopened = ZarrStorage(20, path)  # compression=None: the store's own
    # (frames=None, decided at the first write: no leaf stored as frames.)
    assert reopened.compression == dataclasses.replace(SMALL, frames=False)
    reopened.close()


# --- 2. TorchRL's checkpointers, on a real collector's data --------------------------------------


def collector_batches(n_envs: int, frames: int) -> list[TensorDict]:
    def make_env() -> Any:
        return GymEnv("CartPole-v1", device=None).append_transform(StepCounter())

    env = make_env() if n_envs == 1 else SerialEnv(n_envs, make_env)
    env.set_seed(0)
    torch.manual_seed(0)
    collector = Collector(env, policy=env.rand_step, total_frames=90, frames_per_batch=frames)
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    return batches


CHECKPOINTERS = [FlatStorageCheckpointer, NestedStorageCheckpointer, H5StorageCheckpointer]


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("n_envs", "frames"), [(1, 22), (1, 122), (3, 24)])
def test_torchrl_checkpointers(tmp_path: Path, checkpointer: type, n_envs: int, frames: int):
    ndim = 1 if n_envs == 1 else 2
    batches = collector_batches(n_envs, frames)
    results = []
    for i, cls in enumerate((LazyMemmapStorage, ZarrStorage)):
        where = tmp_path / cls.__name__
        where.mkdir()
        rb = ReplayBuffer(storage=cls(100, ndim=ndim))
        restored = ReplayBuffer(storage=cls(100, ndim=ndim))
        rb.storage.checkpointer = checkpointer()
        restored.storage.checkpointer = checkpointer()
        rows = []
        for batch in batches:
            rb.extend(batch)
            rb.dumps(where / "ckpt")
            restored.loads(where / "ckpt")
            assert restored.writer._cursor == rb.writer._cursor
            assert len(restored) == len(rb)
            rows.append(restored[:].clone())
        results.append(rows)
        del i
    for ours, theirs in zip(results[1], results[0], strict=True):
        same(ours, theirs)


# --- 3. state dicts across storage types --------------------------------------------------------


def _filled(storage: Any, n: int = 30) -> Any:
    storage.set(torch.arange(n), transitions(n))
    return storage


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("zarr", "tensor"),
        ("zarr", "memmap"),
        ("tensor", "zarr"),
        ("memmap", "zarr"),
        ("zarr", "zarr"),
    ],
)
def test_state_dict_moves_rows_between_storage_types(
    tmp_path: Path, source: str, target: str
) -> None:
    makers = {
        "tensor": lambda where: LazyTensorStorage(40),
        "memmap": lambda where: LazyMemmapStorage(40, scratch_dir=tmp_path / f"mm-{where}"),
        "zarr": lambda where: ZarrStorage(40, tmp_path / f"{where}.zarr", compression=SMALL),
    }
    original = _filled(makers[source]("source"))
    state = original.state_dict()
    restored = makers[target]("target")
    restored.load_state_dict(state)
    assert len(restored) == 30
    same(restored[:], _filled(LazyTensorStorage(40))[:])
    if target == "zarr":  # the rows are in the new store: they survive reopening it
        restored.close()
        same(ZarrStorage(path=tmp_path / "target.zarr", read_only=True)[:], restored_rows())


def restored_rows() -> TensorDict:
    return _filled(LazyTensorStorage(40))[:]


def test_state_dict_reads_no_row_until_copied(tmp_path: Path, monkeypatch) -> None:
    storage = _filled(ZarrStorage(40, tmp_path / "rb.zarr", compression=SMALL))
    storage.flush()
    reads = []
    original = storage._store.read

    def spy(rows: Any, keys: Any, **kwargs: Any) -> Any:
        reads.append(list(keys))
        return original(rows, keys, **kwargs)

    monkeypatch.setattr(storage._store, "read", spy)
    state = storage.state_dict()
    assert reads == []
    LazyTensorStorage(40).load_state_dict(state)
    assert reads  # copied now


def test_state_dict_of_the_same_store_copies_nothing(tmp_path: Path) -> None:
    storage = _filled(ZarrStorage(40, tmp_path / "rb.zarr", compression=SMALL))
    state = storage.state_dict()
    storage.set(torch.arange(30, 35), transitions(5, start=30))
    assert len(storage) == 35
    storage.load_state_dict(state)  # back to the state's length and cursor, in place
    assert len(storage) == 30
    assert storage.cursor == 30


def _saved(state: dict) -> dict:
    """``state`` through ``torch.save`` and ``torch.load`` (as a checkpoint on disk)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("serialized", [True, False], ids=["saved", "in-memory"])
def test_a_state_dict_loaded_back_after_its_rows_were_written_over(tmp_path, serialized):
    # The rows a state carries come back where rows were written over since it was taken:
    # the saved values after torch.save (the state holds them), the rows as they are now
    # when it stayed in memory (LazyTensorStorage's state holds its live tensor).
    theirs, ours = twins(tmp_path, lambda s: TensorDictReplayBuffer(storage=s), max_size=10)
    for rb in (theirs, ours):
        rb.extend(transitions(6))
        state = rb.state_dict()
        state = _saved(state) if serialized else state
        rb.extend(transitions(10, start=100))  # over every row
        rb.load_state_dict(state)
        assert len(rb) == 6
    same(ours.storage[:], theirs.storage[:])
    ours.extend(transitions(3, start=200))
    theirs.extend(transitions(3, start=200))
    same(ours.storage[:], theirs.storage[:])


def test_a_saved_state_dict_of_an_unchanged_store_copies_nothing(tmp_path, monkeypatch):
    storage = _filled(ZarrStorage(40, tmp_path / "rb.zarr", compression=SMALL))
    state = _saved(storage.state_dict())
    storage.set(torch.arange(30, 35), transitions(5, start=30))  # past its rows only
    writes = []
    original = storage._store.write
    monkeypatch.setattr(
        storage._store, "write", lambda *a, **k: writes.append(a) or original(*a, **k)
    )
    storage.load_state_dict(state)
    assert writes == []  # in place: its rows are those it covered
    assert (len(storage), storage.cursor) == (30, 30)
    same(storage[:], _filled(LazyTensorStorage(40))[:])


def test_a_state_dict_of_a_store_made_again_at_its_path_copies_its_rows(tmp_path):
    path = tmp_path / "rb.zarr"
    first = TensorDictReplayBuffer(storage=ZarrStorage(10, path, compression=SMALL))
    first.extend(transitions(6))
    state = _saved(first.state_dict())
    first.storage.close()
    again = TensorDictReplayBuffer(storage=ZarrStorage(10, path, compression=SMALL, mode="w"))
    again.extend(transitions(6, start=100))  # a new store there: the same epoch, length
    again.load_state_dict(state)
    same(again.storage[:].exclude("index"), transitions(6))


def test_a_reader_refuses_a_state_whose_rows_the_writer_wrote_over(tmp_path):
    path = tmp_path / "rb.zarr"
    writer = TensorDictReplayBuffer(storage=ZarrStorage(10, path, compression=SMALL))
    writer.extend(transitions(6))
    state = _saved(writer.storage.state_dict())
    reader = ZarrStorage(path=path, read_only=True)
    writer.extend(transitions(10, start=100))
    writer.storage.flush()
    with pytest.raises(ReadOnlyError):  # (it cannot write the state's rows back)
        reader.load_state_dict(state)
    reader.close()


def test_a_pytree_state_dict_loaded_back_after_its_rows_were_written_over(tmp_path):
    def rows(n: int, start: int) -> dict:
        a = torch.arange(start, start + n).float()
        return {"a": a, "b": (a * 2, a.long())}

    rb = ReplayBuffer(storage=ZarrStorage(10, tmp_path / "rb.zarr", compression=SMALL))
    rb.extend(rows(6, 0))
    state = _saved(rb.state_dict())
    rb.extend(rows(10, 100))
    rb.load_state_dict(state)
    got = rb.storage.get(torch.arange(len(rb)))
    assert torch.equal(got["a"], torch.arange(6.0))
    assert torch.equal(got["b"][1], torch.arange(6))


def test_a_deep_copy_of_a_state_dict_is_a_snapshot(tmp_path):
    theirs, ours = twins(tmp_path, lambda s: TensorDictReplayBuffer(storage=s), max_size=10)
    for rb in (theirs, ours):
        rb.extend(transitions(6))
        state = copy.deepcopy(rb.state_dict())
        rb.extend(transitions(10, start=100))
        rb.load_state_dict(state)
    same(ours.storage[:], theirs.storage[:])


def test_a_state_kept_in_memory_refuses_to_load_once_its_rows_were_emptied(tmp_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, tmp_path / "rb.zarr", compression=SMALL))
    rb.extend(transitions(6))
    state = rb.state_dict()  # the store's own rows, by reference
    rb.empty()
    rb.extend(transitions(2, start=200))
    with pytest.raises(RowsNotCommittedError, match="no longer in the store"):
        rb.load_state_dict(state)
    assert len(rb) == 2  # as it was
    same(rb.storage[:].exclude("index"), transitions(2, start=200))


# --- 4. columns added by a later write --------------------------------------------------------


def test_a_later_write_adds_a_column(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: TensorDictReplayBuffer(storage=s), max_size=30)
    for rb in (theirs, ours):
        rb.extend(transitions(10))
        rb[3:5] = transitions(2, start=100).set("extra", torch.ones(2, 3))
        rb.extend(transitions(4, start=10).set("extra", torch.full((4, 3), 2.0)))
    same(ours.storage[:], theirs.storage[:])  # earlier rows read as zeros in it
    ours.storage.close()
    reopened = ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)
    same(reopened[:], theirs.storage[:])


def test_writes_without_a_key_keep_its_values(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: TensorDictReplayBuffer(storage=s), max_size=30)
    for rb in (theirs, ours):
        rb.extend(transitions(10))
        rb[2:6] = transitions(4, start=50).exclude("obs")
    same(ours.storage[:], theirs.storage[:])


def test_a_reader_sees_a_column_added_by_the_writer(tmp_path: Path) -> None:
    writer = ZarrStorage(30, tmp_path / "rb.zarr", compression=SMALL)
    writer.set(torch.arange(8), transitions(8))
    writer.flush()
    reader = ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)
    writer.set(torch.arange(8, 12), transitions(4, start=8).set("extra", torch.ones(4)))
    writer.flush()
    reader.refresh()
    assert ("extra",) in {leaf.key for leaf in reader.schema.leaves}
    assert reader[:]["extra"].tolist() == [0.0] * 8 + [1.0] * 4


# --- 5. in-place writes through the buffer ----------------------------------------------------

IN_PLACE: dict[str, Callable[[Any], None]] = {
    "slice": lambda rb: rb.__setitem__(slice(3, 5), transitions(2, start=200)),
    "index": lambda rb: rb.__setitem__(torch.tensor([7, 1, 7]), transitions(3, start=300)),
    "set_at_": lambda rb: rb.set_at_("action", torch.tensor([9, 9]), torch.tensor([0, 4])),
    "set_": lambda rb: rb.set_("action", torch.arange(12) * 2),
    "update_": lambda rb: rb.update_(transitions(12, start=400).exclude("obs")),
    "column_row": lambda rb: rb.storage[:]["action"].__setitem__(5, 42),
    "apply_": lambda rb: rb.storage[:].apply_(
        lambda x: x.logical_not_() if x.dtype == torch.bool else x.mul_(2)
    ),
    "nested_element": lambda rb: rb.storage[:]["obs"][2].__setitem__((1, 1), -1.0),
}


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_writes(tmp_path: Path, name: str) -> None:
    theirs, ours = twins(tmp_path, lambda s: TensorDictReplayBuffer(storage=s), max_size=12)
    for rb in (theirs, ours):
        rb.extend(transitions(12))
        IN_PLACE[name](rb)
    same(ours.storage[:], theirs.storage[:])
    ours.storage.close()  # and it is on disk
    same(ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)[:], theirs.storage[:])


def test_in_place_writes_on_two_dimensional_storages(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: ReplayBuffer(storage=s), max_size=102, ndim=2)
    data = TensorDict(
        {"a": torch.arange(50).expand(2, 50), ("b", "c"): torch.arange(50).expand(2, 50)},
        [2, 50],
    )
    zero = TensorDict({"a": torch.tensor([0]), ("b", "c"): torch.tensor([0])}, [1])
    for rb in (theirs, ours):
        rb.extend(data.clone())
        rb[0, 3:4] = zero
        rb[1, 5:6] = zero
        rb[:, 7:8] = zero.expand(2, 1)
    assert ours.writer._cursor == theirs.writer._cursor
    same(ours[:], theirs[:])


def test_two_dimensional_capacity_rounds_up_to_whole_rows(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: ReplayBuffer(storage=s), max_size=100, ndim=2)
    for rb in (theirs, ours):
        rb.extend(TensorDict({"a": torch.zeros(3, 40)}, [3, 40]))  # 3 envs, 40 steps
    assert ours.storage.max_size == theirs.storage.max_size == 102
    assert len(ours) == len(theirs) == 102
    ours.storage.close()
    reopened = ZarrStorage(path=tmp_path / "rb.zarr")  # and 100 or 102 both reopen it
    assert reopened.max_size == 102
    reopened.close()
    ZarrStorage(102, tmp_path / "rb.zarr").close()
    ZarrStorage(100, tmp_path / "rb.zarr").close()


# --- 6. the device of samples -------------------------------------------------------------------


@pytest.mark.parametrize("ndim", [1, 2])
def test_samples_from_collector_batches_are_on_the_storage_device(tmp_path: Path, ndim: int):
    n_envs = 1 if ndim == 1 else 3
    batches = collector_batches(n_envs, 30)
    theirs, ours = twins(
        tmp_path,
        lambda s: TensorDictReplayBuffer(storage=s, batch_size=8),
        max_size=200,
        ndim=ndim,
    )
    for rb in (theirs, ours):
        for batch in batches:
            rb.extend(batch)
    torch.manual_seed(0)
    expected = theirs.sample()
    torch.manual_seed(0)
    sample = ours.sample()
    assert sample.device == expected.device == torch.device("cpu")
    same(sample, expected)


# --- 7. smaller ones ----------------------------------------------------------------------------


def test_save_hooks_see_the_shift_and_fullness(tmp_path: Path) -> None:
    seen = {}

    class Hook:
        shift = None
        is_full = None

        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, data: Any, path: Any = None) -> Any:
            seen[self.name] = (self.shift, self.is_full)
            return data

    for cls in (LazyMemmapStorage, ZarrStorage):
        rb = ReplayBuffer(storage=cls(10))
        rb.register_save_hook(Hook(cls.__name__))
        rb.extend(torch.arange(5))
        rb.dumps(tmp_path / cls.__name__)
    assert seen["ZarrStorage"] == seen["LazyMemmapStorage"] == (5, False)


def test_extend_with_a_lazy_stack_of_equal_shapes(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: ReplayBuffer(storage=s, batch_size=3), max_size=6)
    parts = [TensorDict(a=torch.full((5, 8), float(i)), batch_size=5) for i in range(2)]
    for rb in (theirs, ours):
        rb.extend(LazyStackedTensorDict(*parts, stack_dim=1))
    same(ours.storage[:], theirs.storage[:])


def test_update_if_present_skips_a_never_written_slot(tmp_path: Path) -> None:
    results = []
    for storage in twins(tmp_path, lambda s: s, max_size=8):
        rb = TensorDictReplayBuffer(
            storage=storage, writer=TensorDictRoundRobinWriter(track_generations=True)
        )
        rb.extend(TensorDict({"a": torch.zeros(4)}, [4]))
        result = rb.update_if_present(
            index=torch.tensor([1, 6]),
            generation=torch.tensor([0, 0]),
            patch={"a": torch.tensor([5.0, 5.0])},
        )
        results.append((result.updated.tolist(), rb[:4]["a"].tolist()))
    assert results[0] == results[1]


def test_a_prioritized_sampler_dumped_and_loaded(tmp_path: Path) -> None:
    """TorchRL's ``rb.save`` / ``rb.load`` of a prioritized buffer, into another buffer."""
    for cls in (LazyMemmapStorage, ZarrStorage):
        where = tmp_path / cls.__name__
        rb = ReplayBuffer(storage=cls(10), sampler=PrioritizedSampler(10, alpha=0.8, beta=0.6))
        rb.extend(TensorDict({"a": torch.zeros(1, 3)}, [1]))
        rb.save(where)
        other = ReplayBuffer(storage=cls(10), sampler=PrioritizedSampler(10, alpha=0.5, beta=0.5))
        other.extend(TensorDict({"a": torch.ones(1, 3)}, [1]))
        other.load(where)
        assert (other.sampler._alpha, other.sampler._beta) == (0.8, 0.6)
        assert other.sampler._max_priority[0] == rb.sampler._max_priority[0]
        same(other.storage[:], rb.storage[:])


def test_a_buffer_pickles_within_a_process(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(20, tmp_path / "rb.zarr"), batch_size=4)
    rb.extend(transitions(8))
    copy = pickle.loads(pickle.dumps(rb))
    assert copy.__dict__.keys() == rb.__dict__.keys()
    same(copy.storage[:], rb.storage[:])
    copy.extend(transitions(2, start=8))  # one store, one writer: both see it
    assert len(rb) == len(copy) == 10


def test_pytrees(tmp_path: Path) -> None:
    def data(n: int, start: int = 0) -> dict[Any, Any]:
        x = torch.arange(start, start + n)
        return {"a": x, "b": {"c": [x.float(), (x.view(-1, 1).expand(-1, 2).clone(),)]}, 30: -x}

    theirs, ours = twins(tmp_path, lambda s: ReplayBuffer(storage=s, batch_size=4), max_size=10)
    for rb in (theirs, ours):
        rb.extend(data(6))
        rb.extend(data(6, start=6))  # wraps around
    same(ours[:], theirs[:])
    for seed in range(3):
        torch.manual_seed(seed)
        expected = theirs.sample()
        torch.manual_seed(seed)
        same(ours.sample(), expected)
    ours.storage.close()
    same(ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)[:], theirs[:])


def test_get_by_key(tmp_path: Path) -> None:
    theirs, ours = twins(tmp_path, lambda s: s, max_size=10)
    for storage in (theirs, ours):
        storage.set(torch.arange(6), transitions(6))
    same(ours.get(("next", "done")), theirs.get(("next", "done")))
    same(ours.get("action"), theirs.get("action"))


def test_zarr_storage_signature_covers_torchrl() -> None:
    ours = inspect.signature(ZarrStorage.__init__).parameters
    for cls in (LazyMemmapStorage, LazyTensorStorage):
        for name, parameter in inspect.signature(cls.__init__).parameters.items():
            assert name in ours
            if parameter.kind is parameter.KEYWORD_ONLY and name != "device":
                assert ours[name].kind is parameter.KEYWORD_ONLY, name


def test_load_of_a_storage_never_written_in_torchrl_layout(tmp_path: Path) -> None:
    """A ZarrStorage loads a TorchRL tensor dump even before its first write (TorchRL's own
    storages cannot)."""
    source = LazyMemmapStorage(10, scratch_dir=tmp_path / "mm")
    source.set(range(3), torch.arange(3))
    source.dumps(tmp_path / "dump")
    fresh = ZarrStorage(10, tmp_path / "rb.zarr")
    fresh.loads(tmp_path / "dump")
    assert fresh[:3].tolist() == [0, 1, 2]
    np.testing.assert_equal(len(fresh), 3)


def test_read_back_every_key_written_by_a_collector(tmp_path: Path) -> None:
    batches = collector_batches(1, 45)
    rb = TensorDictReplayBuffer(storage=ZarrStorage(500, tmp_path / "rb.zarr"))
    for batch in batches:
        rb.extend(batch)
    rb.storage.close()
    stored = zarr_rb.ZarrStorage(path=tmp_path / "rb.zarr", read_only=True)[:]
    expected = torch.cat(batches)
    keys = set(expected.keys(True, True))
    assert keys <= set(stored.keys(True, True))
    for key in keys:
        assert_identical(stored[key], expected[key])


def test_a_max_value_writer_on_a_reopened_store_keeps_the_best_rows(tmp_path: Path) -> None:
    """Reopened, a max-value writer goes on as if it had never stopped."""
    from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter

    def buffer(storage: Any) -> Any:
        return TensorDictReplayBuffer(
            storage=storage, writer=TensorDictMaxValueWriter(rank_key=("next", "reward"))
        )

    def batch(start: int) -> TensorDict:
        data = transitions(8, start=start)
        data["next", "reward"] = torch.rand(8, 1, generator=torch.Generator().manual_seed(start))
        return data

    continuous = buffer(LazyTensorStorage(20))
    reopened = buffer(ZarrStorage(20, tmp_path / "rb.zarr", compression=SMALL))
    for start in (0, 8, 16):
        continuous.extend(batch(start))
        reopened.extend(batch(start))
    reopened.storage.close()
    reopened = buffer(ZarrStorage(path=tmp_path / "rb.zarr"))
    for start in (24, 32, 40):
        continuous.extend(batch(start))
        reopened.extend(batch(start))
    same(reopened.storage[:], continuous.storage[:])
