"""TorchRL's own checkpoints (``torchrl.checkpoint``) of a buffer on ZarrStorage keep a
version of the store and a pointer to it: a checkpoint costs metadata, restoring gives the
buffer as it was at that checkpoint, rotation drops the versions of rotated checkpoints.
Each case runs the same pattern on TorchRL's LazyTensorStorage and compares."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint, CheckpointError, CheckpointRotation
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

import zarr_rb
from zarr_rb.errors import FormatVersionError, NotSupportedError, VersionNotFoundError
from zarr_rb.torchrl import checkpoint_versions
from zarr_rb.torchrl.checkpoint_versions import POINTER, TAG_PREFIX

CAPACITY = 64


def rows(start: int, count: int) -> TensorDict:
    """Distinct, compressible rows: row ``i`` holds ``start + i`` everywhere."""
    ids = torch.arange(start, start + count)
    return TensorDict(
        {"obs": ids[:, None].expand(count, 1000).to(torch.float32), "id": ids}, [count]
    )


def buffer(storage) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(
        storage=storage,
        sampler=PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
        batch_size=8,
    )


def twins(tmp_path: Path, **kwargs) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer]:
    zarr = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "rb.zarr"), **kwargs))
    return zarr, buffer(LazyTensorStorage(CAPACITY))


def extend(buffers, start: int, count: int) -> None:
    for rb in buffers:
        rb.extend(rows(start, count))


def same(zarr: TensorDictReplayBuffer, model: TensorDictReplayBuffer) -> None:
    """The same rows, at the same positions, the same cursor and priorities."""
    assert len(zarr) == len(model)
    assert torch.equal(zarr[:]["id"], model[:]["id"])
    assert zarr.storage.cursor == int(model.writer._cursor)
    n = len(model)
    assert torch.allclose(
        torch.as_tensor([zarr.sampler._sum_tree[i] for i in range(n)]),
        torch.as_tensor([model.sampler._sum_tree[i] for i in range(n)]),
    )
    assert float(zarr.sampler._max_priority[0]) == float(model.sampler._max_priority[0])


def version_tags(path: Path) -> list[str]:
    return [v.tag for v in zarr_rb.versions(str(path)) if v.tag and v.tag.startswith(TAG_PREFIX)]


def files_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("form", ["directory", "archive"])
def test_a_checkpoint_keeps_a_version_and_restores_the_buffer_as_it_was(tmp_path, form):
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 40)
    for rb in (zarr, model):
        rb.update_priority(torch.arange(40), torch.arange(40.0) + 1)
    Checkpoint(buffer=zarr, format=form).save(tmp_path / "ckpt-zarr")
    Checkpoint(buffer=model, format=form).save(tmp_path / "ckpt-model")
    # The checkpoint holds a pointer, not the 40 x 4 kB of rows.
    assert files_bytes(tmp_path / "ckpt-zarr") < files_bytes(tmp_path / "ckpt-model") / 3
    assert len(version_tags(tmp_path / "rb.zarr")) == 1
    # Training goes on past the ring's end: the checkpoint's rows are written over.
    extend((zarr, model), 40, 100)
    Checkpoint(buffer=zarr, format=form).load(tmp_path / "ckpt-zarr")
    Checkpoint(buffer=model, format=form).load(tmp_path / "ckpt-model")
    same(zarr, model)
    extend((zarr, model), 140, 10)  # and goes on from there alike
    same(zarr, model)
    zarr.storage.close()


def test_a_new_process_restores_the_checkpoint_on_the_same_store(tmp_path):
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 50)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    extend((zarr,), 50, 30)
    zarr.storage.close()  # the run ends (or crashes after the checkpoint)
    again = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "rb.zarr")))
    Checkpoint(buffer=again).load(tmp_path / "ckpt")
    same(again, model)
    again.storage.close()


def test_a_checkpoint_restores_into_a_buffer_on_another_store(tmp_path):
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 30)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    other = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "other.zarr")))
    Checkpoint(buffer=other).load(tmp_path / "ckpt")  # the version's rows, copied
    same(other, model)
    assert len(zarr) == 30  # the source is left as it was
    other.storage.close()
    zarr.storage.close()


def test_rotation_drops_the_versions_of_rotated_checkpoints(tmp_path):
    zarr, model = twins(tmp_path)
    rotation = CheckpointRotation(tmp_path / "ckpts", keep_last=2)
    kept = {}
    for step in range(6):
        extend((zarr, model), 30 * step, 30)
        path = rotation.save(Checkpoint(buffer=zarr), step=step)
        kept[step] = zarr[:]["id"].clone()
        # Versions of the checkpoints rotation keeps, and at most one rotated since the
        # last checkpoint (dropped at the next one).
        assert 1 <= len(version_tags(tmp_path / "rb.zarr")) <= 3
    assert rotation.checkpoints()[-1] == path
    for path in rotation.checkpoints():
        step = int("".join(ch for ch in path.name if ch.isdigit()))
        Checkpoint(buffer=zarr).load(path)
        assert torch.equal(zarr[:]["id"], kept[step])
    zarr.storage.close()


def test_a_version_whose_checkpoint_was_never_published_is_dropped_next_time(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)

    class Failing:
        def state_dict(self):
            raise RuntimeError("the policy's save fails after the buffer's")

        def load_state_dict(self, state):
            pass

    with pytest.raises(Exception, match="fails after"):
        Checkpoint(buffer=zarr, zz_policy=Failing()).save(tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
    assert len(version_tags(tmp_path / "rb.zarr")) == 1  # kept while TorchRL staged it
    Checkpoint(buffer=zarr).save(tmp_path / "good")
    tags = version_tags(tmp_path / "rb.zarr")
    assert len(tags) == 1
    pointer = next((tmp_path / "good").rglob(POINTER))
    assert json.loads(pointer.read_text())["tag"] == tags[0]
    zarr.storage.close()


def test_a_checkpoint_deleted_by_hand_frees_its_version_at_the_next_one(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    Checkpoint(buffer=zarr, format="archive").save(tmp_path / "a.zip")
    Checkpoint(buffer=zarr).save(tmp_path / "b")
    assert len(version_tags(tmp_path / "rb.zarr")) == 2
    (tmp_path / "a.zip").unlink()
    (tmp_path / "notes.txt").write_text("a file beside the checkpoints names none of them")
    Checkpoint(buffer=zarr).save(tmp_path / "c")
    assert len(version_tags(tmp_path / "rb.zarr")) == 2  # b and c
    zarr.storage.close()


def test_a_checkpoint_of_a_shared_store(tmp_path):
    zarr, model = twins(tmp_path, shared=True)
    extend((zarr, model), 0, 40)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    Checkpoint(buffer=model).save(tmp_path / "model")
    extend((zarr, model), 40, 100)
    Checkpoint(buffer=zarr).load(tmp_path / "ckpt")
    Checkpoint(buffer=model).load(tmp_path / "model")
    same(zarr, model)
    zarr.storage.close()


def test_a_pointer_to_a_dropped_version_says_so(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    (tag,) = version_tags(tmp_path / "rb.zarr")
    zarr.storage.close()
    zarr_rb.drop_version(str(tmp_path / "rb.zarr"), tag)
    again = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "rb.zarr")))
    with pytest.raises(CheckpointError, match=tag) as caught:
        Checkpoint(buffer=again).load(tmp_path / "ckpt")
    assert isinstance(caught.value.__cause__, VersionNotFoundError)
    again.storage.close()


def test_a_pointer_from_a_newer_zarr_rb_says_so(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    pointer = next((tmp_path / "ckpt").rglob(POINTER))
    pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "format": 99}))
    with pytest.raises(CheckpointError, match="upgrade zarr_rb") as caught:
        Checkpoint(buffer=zarr).load(tmp_path / "ckpt")
    assert isinstance(caught.value.__cause__, FormatVersionError)
    zarr.storage.close()


def test_an_archive_checkpoint_holds_the_pointer_only(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    Checkpoint(buffer=zarr, format="archive").save(tmp_path / "a.zip")
    with zipfile.ZipFile(tmp_path / "a.zip") as archive:
        assert any(name.endswith(POINTER) for name in archive.namelist())
        assert not any("zarr.json" in name for name in archive.namelist())
    zarr.storage.close()


def test_loading_a_checkpoint_version_with_zarr_rb_load_says_how_to_restore_it(tmp_path):
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    zarr.storage.close()
    (tag,) = version_tags(tmp_path / "rb.zarr")
    with pytest.raises(NotSupportedError, match=r"Checkpoint\(buffer=rb\)\.load"):
        zarr_rb.load(str(tmp_path / "rb.zarr"), version=tag)


def test_a_run_copied_with_its_checkpoints_keeps_their_versions(tmp_path):
    run1 = tmp_path / "run1"
    run1.mkdir()
    zarr = buffer(zarr_rb.ZarrStorage(CAPACITY, str(run1 / "rb.zarr")))
    extend((zarr,), 0, 30)
    Checkpoint(buffer=zarr).save(run1 / "ckpt")
    kept = zarr[:]["id"].clone()
    zarr.storage.close()
    shutil.copytree(run1, tmp_path / "run2")
    shutil.rmtree(run1 / "ckpt")  # the first run goes on without it
    run2 = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "run2" / "rb.zarr")))
    extend((run2,), 30, 10)
    Checkpoint(buffer=run2).save(tmp_path / "run2" / "next")  # (its own store's versions)
    Checkpoint(buffer=run2).load(tmp_path / "run2" / "ckpt")
    assert torch.equal(run2[:]["id"], kept)
    run2.storage.close()


def test_a_renamed_checkpoint_keeps_its_version_after_the_next_checkpoint(tmp_path):
    """A checkpoint renamed in its directory still names its version: the next checkpoint
    keeps it (checkpoints beside the recorded destination count)."""
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 40)
    Checkpoint(buffer=zarr).save(tmp_path / "step-40")
    Checkpoint(buffer=model).save(tmp_path / "model-40")
    os.rename(tmp_path / "step-40", tmp_path / "best")  # keep it aside, by hand
    extend((zarr, model), 40, 10)
    Checkpoint(buffer=zarr).save(tmp_path / "step-50")  # drops the renamed one's version
    Checkpoint(buffer=zarr).load(tmp_path / "best")
    Checkpoint(buffer=model).load(tmp_path / "model-40")
    same(zarr, model)
    zarr.storage.close()


def test_a_checkpoint_moved_with_its_store_keeps_its_version_after_the_next_checkpoint(
    tmp_path,
):
    """A checkpoint moved together with its store restores through the pointer's relative
    path, and keeps its version through the next checkpoint (a version made while the
    store was elsewhere is never dropped: its paths are no longer this store's)."""
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 40)
    Checkpoint(buffer=zarr).save(tmp_path / "ckpt")
    Checkpoint(buffer=model).save(tmp_path / "model")
    zarr.storage.close()
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(tmp_path / "rb.zarr", moved / "rb.zarr")
    shutil.move(tmp_path / "ckpt", moved / "ckpt")
    zarr = buffer(zarr_rb.ZarrStorage(CAPACITY, str(moved / "rb.zarr")))
    Checkpoint(buffer=zarr).load(moved / "ckpt")
    extend((zarr,), 40, 10)
    Checkpoint(buffer=zarr).save(moved / "ckpt-next")
    assert len(version_tags(moved / "rb.zarr")) == 2  # both checkpoints exist
    Checkpoint(buffer=zarr).load(moved / "ckpt")
    Checkpoint(buffer=model).load(tmp_path / "model")
    same(zarr, model)
    zarr.storage.close()


def test_a_user_version_tagged_like_a_checkpoint_loads_with_zarr_rb_load(tmp_path):
    """A user's tag may start with the checkpoint prefix: zarr_rb.load loads it (a
    checkpoint's version is recognised by its note, not by its tag alone)."""
    zarr, _ = twins(tmp_path)
    extend((zarr,), 0, 20)
    zarr_rb.save(zarr, tag="torchrl-checkpoint-before-finetune")
    extend((zarr,), 20, 5)
    zarr_rb.save(zarr)
    zarr.storage.close()
    loaded = zarr_rb.load(str(tmp_path / "rb.zarr"), version="torchrl-checkpoint-before-finetune")
    assert len(loaded) == 20
    loaded.storage.close()


def test_restoring_on_the_same_store_through_a_symlink_uses_the_version(tmp_path, monkeypatch):
    """A store opened by a path through a symlink (macOS's /tmp, a scratch link) or with
    '..' in it is the same store: the restore uses the version, it copies no row."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    zarr = buffer(zarr_rb.ZarrStorage(CAPACITY, str(tmp_path / "link" / "rb.zarr")))
    _, model = twins(tmp_path)
    extend((zarr, model), 0, 40)
    Checkpoint(buffer=zarr).save(tmp_path / "link" / "ckpt")
    Checkpoint(buffer=model).save(tmp_path / "model")
    extend((zarr, model), 40, 50)

    def no_copy(*args, **kwargs):
        raise AssertionError("restoring on the same store copied its rows")

    monkeypatch.setattr(checkpoint_versions, "copy_rows", no_copy)
    Checkpoint(buffer=zarr).load(tmp_path / "link" / "ckpt")
    Checkpoint(buffer=model).load(tmp_path / "model")
    same(zarr, model)
    assert torch.equal(zarr[:]["id"], model[:]["id"])
    zarr.storage.close()


@pytest.mark.parametrize("form", ["directory", "archive"])
def test_a_checkpoint_written_again_at_its_path_frees_the_older_version(tmp_path, form):
    """A destination written again: the newer pointer restores, the older version is
    dropped at the next checkpoint."""
    zarr, model = twins(tmp_path)
    extend((zarr, model), 0, 30)
    Checkpoint(buffer=zarr, format=form).save(tmp_path / "ckpt")
    extend((zarr, model), 30, 50)
    Checkpoint(buffer=zarr, format=form).save(tmp_path / "ckpt")
    Checkpoint(buffer=model, format=form).save(tmp_path / "model")
    extend((zarr, model), 80, 7)
    Checkpoint(buffer=zarr, format=form).save(tmp_path / "other")
    assert len(version_tags(tmp_path / "rb.zarr")) == 2
    Checkpoint(buffer=zarr, format=form).load(tmp_path / "ckpt")
    Checkpoint(buffer=model, format=form).load(tmp_path / "model")
    same(zarr, model)
    zarr.storage.close()
