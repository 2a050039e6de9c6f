"""A store as a PyTorch Dataset: DataLoader epochs in real worker processes (spawned, the
default once TorchRL is imported, and forked, where workers read with zarr-python), TorchRL's
samplers drawing its batches, and TensorStore refused with a typed error in a forked child
instead of aborting it."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PongRun, assert_identical
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.data import SliceSampler, TensorDictReplayBuffer

import zarr_rb
from zarr_rb import NotSupportedError, ReplayDataset, ZarrStorage
from zarr_rb.analysis import TorchRLBatches

KEYS = ["observation", ("next", "reward"), ("collector", "traj_ids")]


def _by_row(pong: PongRun) -> TensorDict:
    """The kept transitions in storage-row order."""
    order = torch.tensor([pong.row_of(p) for p in range(pong.CAPACITY)])
    out = pong.kept.clone()
    out[order] = pong.kept
    return out


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_a_dataloader_epoch_with_two_workers_sees_every_row_once(
    pong: PongRun, context: str
) -> None:
    dataset = zarr_rb.open(pong.path).dataset(keys=KEYS)  # TensorStore runs in this process
    assert len(dataset) == pong.CAPACITY
    loader = DataLoader(
        dataset,
        batch_size=64,
        shuffle=True,
        num_workers=2,
        collate_fn=torch.stack,
        multiprocessing_context=context,
    )
    expected = _by_row(pong)
    seen = []
    for batch in loader:
        index = batch["index"]
        seen.extend(index.tolist())
        assert set(batch.keys(True, True)) == {"index", *KEYS}
        assert_identical(batch["observation"], expected["observation"][index])
        assert_identical(batch["next", "reward"], expected["next", "reward"][index])
    assert sorted(seen) == list(range(pong.CAPACITY))
    assert seen != sorted(seen)  # shuffled


def test_the_dataset_pickles_as_its_path(pong: PongRun) -> None:
    dataset = ReplayDataset(pong.path, keys=["observation"])
    raw = pickle.dumps(dataset)
    assert len(raw) < 4096
    again = pickle.loads(raw)
    assert len(again) == len(dataset)
    assert_identical(again[7], dataset[7])
    assert again.keys == ["observation"]
    assert set(again[7].keys()) == {"observation", "index"}


def test_torchrl_slice_sampler_draws_the_batches(pong: PongRun) -> None:
    dataset = ReplayDataset(pong.path, keys=[("collector", "traj_ids")])
    sampler = SliceSampler(num_slices=4, traj_key=("collector", "traj_ids"))
    batches = TorchRLBatches(dataset, sampler, 32, num_batches=5)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=torch.stack)
    count = 0
    for batch in loader:
        count += 1
        assert batch.batch_size == torch.Size([32])
        for piece in batch.split(8):  # each slice: 8 rows of one trajectory, in order
            traj = piece["collector", "traj_ids"]
            assert (traj == traj[0]).all()
            steps = (piece["index"] - piece["index"][0]) % pong.CAPACITY
            assert steps.tolist() == list(range(8))
    assert count == 5


def test_items_of_an_ndim2_store_carry_time_and_env(tmp_path: Path) -> None:
    path = tmp_path / "envs.zarr"
    storage = ZarrStorage(12, path, ndim=2)
    step = torch.arange(12).view(4, 3)
    storage.set(slice(0, 4), TensorDict({"step": step}, [4, 3]))
    storage.close()
    dataset = zarr_rb.open(path).dataset()
    assert len(dataset) == 12
    items = [dataset[i] for i in range(12)]
    assert [item["index"].tolist() for item in items[:4]] == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert [int(item["step"]) for item in items] == list(range(12))


def _child(path: str, queue) -> None:
    try:
        ZarrStorage(path=path, read_only=True)
        queue.put("opened")
    except NotSupportedError as err:
        queue.put(f"NotSupportedError: {err}")


def test_a_forked_child_gets_a_typed_error_instead_of_an_abort(pong: PongRun) -> None:
    zarr_rb.open(pong.path).episode(0)  # TensorStore runs in this process
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(str(pong.path), queue))
    child.start()
    message = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert message.startswith("NotSupportedError")
    assert "'spawn'" in message


def test_an_emptied_store_is_an_empty_epoch(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, tmp_path / "empty.zarr"))
    rb.extend(TensorDict({"obs": torch.ones(10, 3)}, [10]))
    rb.empty()
    rb.storage.close()
    dataset = zarr_rb.open(tmp_path / "empty.zarr").dataset()
    assert len(dataset) == 0
    assert list(DataLoader(dataset, batch_size=8, collate_fn=torch.stack)) == []


def test_bad_positions_and_keys(pong: PongRun) -> None:
    dataset = ReplayDataset(pong.path, keys=["action"])
    with pytest.raises(IndexError, match="out of range"):
        dataset[pong.CAPACITY]
    assert_identical(dataset[-1], dataset[pong.CAPACITY - 1])
    with pytest.raises(KeyError, match="no key 'pixels'"):
        ReplayDataset(pong.path, keys=["pixels"])
    positions = dataset.positions_of(np.array([0, 499]))
    assert positions.tolist() == [0, 499]


@pytest.mark.slow  # (S3; the local store opens by default; CI runs it)
def test_a_store_on_s3_opens_for_analysis(s3_server, s3_url, s3_options, pong: PongRun) -> None:
    """The analysis face on an object store: the view, its episodes, dask, a DataLoader whose
    spawned workers read the store themselves, and the command line with the AWS_* variables."""
    import os
    import subprocess
    import sys

    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(pong.CAPACITY, s3_url, storage_options=s3_options)
    )
    for start in range(0, pong.STEPS, 64):  # as the local store was filled
        rb.extend(pong.written[start : start + 64].exclude("index"))
    rb.storage.close()
    view = zarr_rb.open(s3_url, storage_options=s3_options)
    local = zarr_rb.open(pong.path)
    assert view.episodes["length"].tolist() == local.episodes["length"].tolist()
    assert_identical(view.episode(2)["observation"], local.episode(2)["observation"])
    total = view.to_dask()["next", "reward"].sum().compute()
    assert float(total) == float(local.to_dask()["next", "reward"].sum().compute())
    loader = DataLoader(
        view.dataset(keys=["observation"]),
        batch_size=100,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="spawn",
        collate_fn=torch.stack,
    )
    expected = _by_row(pong)["observation"]
    seen = []
    for batch in loader:
        assert_identical(batch["observation"], expected[batch["index"]])
        seen.extend(batch["index"].tolist())
    assert sorted(seen) == list(range(pong.CAPACITY))
    out = subprocess.run(
        [sys.executable, "-m", "zarr_rb", "episodes", s3_url],
        env={**os.environ, **s3_server.env(), "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"{len(local.episodes)} episodes of {s3_url}" in " ".join(out.stdout.split())
