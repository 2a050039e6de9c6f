"""Review of TorchRL checkpoints of a ZarrStorage (a version of the store and a pointer):
cases that break what docs/design/checkpoint.md promises. Each compares with a
LazyTensorStorage twin run through the same steps (helpers of test_torchrl_checkpoint)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_torchrl_checkpoint import CAPACITY, buffer, extend, same, twins, version_tags
from torchrl.checkpoint import Checkpoint

import zarr_rb
from zarr_rb.torchrl import checkpoint_versions


def test_a_renamed_checkpoint_keeps_its_version_after_the_next_checkpoint(tmp_path):
    """ "A checkpoint that TorchRL published can always be restored": the version is dropped
    when the destination recorded at the checkpoint no longer names it, so a checkpoint
    renamed (or moved, or copied and the original rotated) loses its rows at the next
    checkpoint, although it still exists and points at the store."""
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
    """The pointer's relative path is there so that a checkpoint moved together with its
    store still restores; it does, once, but the next checkpoint on the moved store drops
    its version (its recorded destination, the old path, is gone)."""
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
    """zarr_rb.save accepts any tag of letters, digits, '.', '_', '-'; a user's tag that
    starts with the checkpoint prefix is refused by zarr_rb.load as if a checkpoint kept it
    (the version is recognised by its tag, not by its note)."""
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
    '..' in it: the pointer's path resolves, the storage's does not, so the restore takes
    the "another store" route and copies every row of the version back into the same
    store (a full copy: the cost a checkpoint as a version is meant to avoid)."""
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
    """(Held.) A destination written again: the newer pointer restores, the older
    version is dropped at the next checkpoint."""
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
