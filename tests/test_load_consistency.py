"""zarr_rb.load reads one save, whole: a writer that saves again while a load reads the saved
state (slow reads: S3, NFS, a busy host) never gives the loaded buffer a sum tree from one
save and a min tree or a max priority from another.

Saves alternate between two state slots, so the slot a load reads is rewritten two saves
later. The tests run those two saves from another thread in the middle of the load's state
reads (a hook on the engine's state reads), so nothing depends on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.engine import Engine
from zarr_rb.errors import StateChangedError
from zarr_rb.state import LOAD_ATTEMPTS

N = 64
STEP = 8


def rows(n: int, start: int) -> TensorDict:
    return TensorDict({"obs": torch.arange(start, start + n).float().unsqueeze(-1)}, [n])


class Writer:
    """A buffer that saves again and again, each save with its own priorities (all rows at
    ``k + 1`` for save ``k``), and remembers what each save held."""

    def __init__(self, path: Path, *, grows: bool) -> None:
        self.rb = TensorDictReplayBuffer(
            storage=ZarrStorage(N, path),
            sampler=PrioritizedSampler(N, alpha=1.0, beta=0.5),
            batch_size=4,
        )
        self.grows = grows
        self.saves: list[dict[str, Any]] = []
        self.rb.extend(rows(STEP, 0))
        self.save()

    def save(self) -> None:
        k = len(self.saves)
        if self.grows and k:
            self.rb.extend(rows(STEP, len(self.rb)))
        self.rb.update_priority(torch.arange(len(self.rb)), torch.full((len(self.rb),), k + 1.0))
        zarr_rb.save(self.rb)
        self.saves.append(state_of(self.rb))

    def save_twice_from_another_thread(self) -> None:
        thread = threading.Thread(target=lambda: [self.save(), self.save()])
        thread.start()
        thread.join()


def state_of(rb: Any) -> dict[str, Any]:
    sampler = rb.sampler
    index = torch.arange(N)
    return {
        "sum_tree": torch.as_tensor(sampler._sum_tree[index]).clone(),
        "min_tree": torch.as_tensor(sampler._min_tree[index]).clone(),
        "max_priority": float(sampler._max_priority[0]),
        "length": len(rb),
        "cursor": rb.writer._cursor,
    }


def which_save(saves: list[dict[str, Any]], name: str, value: Any) -> list[int]:
    """The saves whose ``name`` is ``value``."""
    if isinstance(value, torch.Tensor):
        return [k for k, s in enumerate(saves) if torch.equal(s[name], value)]
    return [k for k, s in enumerate(saves) if s[name] == value]


@pytest.fixture
def saves_during_state_reads(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``arm(action, times)``: run ``action`` in the middle of a load's state reads, between
    its reads of the two priority trees, the first ``times`` times it reads them."""
    hooks: list[Callable[[], None]] = []
    first: list[str] = []  # the tree a load reads first (the other one comes next)
    read_state_array = Engine.read_state_array

    def reading(self: Engine, path: str, *, size: int) -> Any:
        values = read_state_array(self, path, size=size)
        name = path.rpartition("/")[2]
        if name in ("sum_tree", "min_tree"):
            if not first:
                first.append(name)
            if name == first[0] and hooks:
                hooks.pop()()
        return values

    monkeypatch.setattr(Engine, "read_state_array", reading)

    def arm(action: Callable[[], None], *, times: int) -> list[Callable[[], None]]:
        hooks.extend([action] * times)
        return hooks

    return arm


@pytest.mark.parametrize("grows", [False, True], ids=["same-rows", "rows-added"])
@pytest.mark.parametrize("storage", ["zarr", "memory"])
def test_a_load_gets_one_save_whole_while_two_more_saves_rewrite_its_slot(
    tmp_path: Path, saves_during_state_reads: Any, storage: str, grows: bool
) -> None:
    """Without rows added, the second save rewrites the slot with a record of the same
    length and cursor: only the save's identity tells them apart."""
    path = tmp_path / "rb.zarr"
    writer = Writer(path, grows=grows)
    pending = saves_during_state_reads(writer.save_twice_from_another_thread, times=1)

    loaded = zarr_rb.load(path, read_only=True) if storage == "zarr" else None
    loaded = loaded or zarr_rb.load(path, storage="memory", progress=False)

    assert not pending, "the two saves ran in the middle of the load's state reads"
    state = state_of(loaded)
    found = {name: which_save(writer.saves, name, value) for name, value in state.items()}
    assert found["sum_tree"] == found["min_tree"] == found["max_priority"] == [2], found
    assert state["length"] == writer.saves[2]["length"]
    assert state["cursor"] == writer.saves[2]["cursor"]
    torch.manual_seed(0)
    sample = loaded.sample()
    assert int(sample["obs"].max()) < state["length"]
    if storage == "zarr":
        loaded.storage.close()
    writer.rb.storage.close()


def test_a_load_that_never_reads_one_save_whole_gives_up_with_a_typed_error(
    tmp_path: Path, saves_during_state_reads: Any
) -> None:
    path = tmp_path / "rb.zarr"
    writer = Writer(path, grows=False)
    pending = saves_during_state_reads(writer.save_twice_from_another_thread, times=99)

    with pytest.raises(StateChangedError, match=rf"saved again .* {LOAD_ATTEMPTS} times"):
        zarr_rb.load(path, read_only=True)
    assert len(pending) == 99 - LOAD_ATTEMPTS
    pending.clear()
    loaded = zarr_rb.load(path, read_only=True)  # the store is intact: the last save loads
    assert which_save(writer.saves, "sum_tree", state_of(loaded)["sum_tree"]) == [
        len(writer.saves) - 1
    ]
    loaded.storage.close()
    writer.rb.storage.close()
