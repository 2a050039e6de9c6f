"""A new store is made at its first write, as TorchRL's storages make their files: nothing
is on disk before, and a storage built in a directory that is deleted before its first
write (TorchRL's TD3 and SAC scripts build theirs in a ``TemporaryDirectory`` they leave at
once) works as LazyMemmapStorage does there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from sample_runner import python_c
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.errors import NotAStoreError, StoreExistsError


def rows(start: int, n: int) -> TensorDict:
    return TensorDict({"step": torch.arange(start, start + n)}, [n])


def built_in_a_temporary_directory(cls: type) -> tuple[TensorDictReplayBuffer, Path]:
    """As TorchRL's SAC and TD3 ``make_replay_buffer``: the buffer is returned from inside
    ``with tempfile.TemporaryDirectory() as scratch_dir``, whose directory then goes."""
    with tempfile.TemporaryDirectory() as scratch_dir:
        rb = TensorDictReplayBuffer(storage=cls(100, scratch_dir=scratch_dir), batch_size=4)
    assert not Path(scratch_dir).exists()
    return rb, Path(scratch_dir)


@pytest.mark.parametrize("cls", [LazyMemmapStorage, ZarrStorage], ids=lambda c: c.__name__)
def test_torchrl_scripts_build_the_storage_in_a_directory_they_delete(cls: type) -> None:
    rb, scratch_dir = built_in_a_temporary_directory(cls)
    try:
        rb.extend(rows(0, 30))
        rb.extend(rows(30, 10))
        assert len(rb) == 40
        assert torch.equal(rb[:]["step"], torch.arange(40))
        assert rb.sample()["step"].shape == (4,)
        if cls is ZarrStorage:
            rb.storage.close()
            with ZarrStorage(path=scratch_dir, read_only=True) as reopened:
                assert torch.equal(reopened[:]["step"], torch.arange(40))
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)


def test_nothing_is_on_disk_before_the_first_write(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "rb.zarr"
    storage = ZarrStorage(1000, path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    assert len(rb) == 0
    rb.storage.flush()
    rb.empty()
    assert not (tmp_path / "runs").exists()
    storage.close()
    assert not (tmp_path / "runs").exists()
    with pytest.raises(zarr_rb.errors.StoreNotFoundError):
        ZarrStorage(path=path)


def test_the_first_write_makes_the_store(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(1000, path))
    rb.extend(rows(0, 5))
    assert (path / "zarr.json").is_file()
    rb.storage.close()
    with ZarrStorage(path=path, read_only=True) as reopened:
        assert torch.equal(reopened[:]["step"], torch.arange(5))


def test_a_save_of_a_buffer_never_written_makes_the_store(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(1000, path), batch_size=4)
    zarr_rb.save(rb)
    rb.storage.close()
    loaded = zarr_rb.load(path)
    assert len(loaded) == 0
    loaded.extend(rows(0, 3))
    assert torch.equal(loaded[:]["step"], torch.arange(3))
    loaded.storage.close()


CHILD = """
import sys, torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from zarr_rb import ZarrStorage

rb = TensorDictReplayBuffer(storage=ZarrStorage(100, sys.argv[1]))
print("opened", flush=True)
for line in sys.stdin:
    try:
        rb.extend(TensorDict({"step": torch.arange(100, 104)}, [4]))
    except Exception as err:
        print(type(err).__name__, flush=True)
    else:
        print("written", flush=True)
"""


def test_two_writers_opened_on_one_new_path(tmp_path: Path) -> None:
    """Two processes open one new path (nothing is there yet); the first to write makes
    the store and holds it; the other's first write is refused with a typed error while
    the first holds it, and once it let go, and writes nothing."""
    path = tmp_path / "rb.zarr"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "opened"
        assert not path.exists()
        rb = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
        rb.extend(rows(0, 10))  # makes the store and takes its lock

        def child_writes() -> str:
            child.stdin.write("write\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        assert child_writes() == "LockedError"
        rb.storage.close()
        assert child_writes() == "StoreExistsError"
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    with ZarrStorage(path=path, read_only=True) as reopened:
        assert torch.equal(reopened[:]["step"], torch.arange(10))


WRITE_AND_CLOSE = """
import sys, torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from zarr_rb import ZarrStorage

for path in sys.argv[1:]:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
    rb.extend(TensorDict({"step": torch.arange(100, 110)}, [10]))
    rb.storage.close()
"""


def another_process_makes_the_stores(*paths: Path) -> None:
    done = python_c(WRITE_AND_CLOSE, *map(str, paths), cwd=paths[0].parent)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_storage_that_never_wrote_deletes_nothing_when_it_cleans_up(tmp_path: Path) -> None:
    """auto_cleanup (and cleanup()) delete the store this storage made, never one that
    another process made at the path since."""
    path = tmp_path / "rb.zarr"
    idle = ZarrStorage(100, path, auto_cleanup=True)
    also_idle = ZarrStorage(100, tmp_path / "other.zarr")
    another_process_makes_the_stores(path, tmp_path / "other.zarr")
    idle.close()
    also_idle.cleanup()
    for where in (path, tmp_path / "other.zarr"):
        with ZarrStorage(path=where, read_only=True) as reopened:
            assert reopened[:]["step"].tolist() == list(range(100, 110))


def test_a_store_made_meanwhile_is_opened_again_as_the_error_says(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    late = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
    another_process_makes_the_stores(path)
    with pytest.raises(StoreExistsError, match=r"storage\.close\(\)"):
        late.extend(rows(0, 4))
    late.storage.close()
    again = TensorDictReplayBuffer(storage=ZarrStorage(path=path))  # as the message says
    assert len(again) == 10
    again.extend(rows(0, 4))
    assert again[:]["step"].tolist() == [*range(100, 110), 0, 1, 2, 3]
    again.storage.close()


def test_files_put_in_the_directory_before_the_first_write_are_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, path))
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(NotAStoreError, match="nothing was written"):
        rb.extend(rows(0, 4))
    rb.storage.close()
    assert (path / "notes.txt").read_text() == "mine"
    assert not (path / "zarr.json").exists()
