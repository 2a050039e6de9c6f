"""Ray: collector actors writing one shared store while a learner samples it, and TorchRL's
Ray replay buffer on a ZarrStorage (a real local Ray cluster)."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from shared_workers import WRITER_STRIDE, stamped, torn
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

import zarr_rb.ray
from zarr_rb import ZarrStorage

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    # Workers import this module's functions by name, as a user's own package would be.
    tests = str(Path(__file__).parent)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": tests}},
    )
    yield
    ray.shutdown()


def _collect(url: str, frames: int) -> int:
    """A collector actor's work: a real CartPole collector writing straight into the store."""
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv

    rb = TensorDictReplayBuffer(storage=ZarrStorage(path=url, mode="r+", shared=True))
    collector = Collector(GymEnv("CartPole-v1"), None, frames_per_batch=100, total_frames=frames)
    written = 0
    for data in collector:
        rb.extend(data.reshape(-1))
        written += data.numel()
    collector.shutdown()
    rb.storage.close()
    return written


@pytest.mark.slow  # (Ray actors; the writer actors run by default; CI runs it)
def test_collector_actors_write_one_store_while_a_learner_samples(cluster, store_path):
    url = str(store_path)
    learner = TensorDictReplayBuffer(storage=ZarrStorage(10_000, url, shared=True), batch_size=64)
    collect = ray.remote(num_cpus=1)(_collect)
    jobs = [collect.remote(url, 600) for _ in range(2)]
    samples = 0
    while ray.wait(jobs, timeout=0.05, num_returns=len(jobs))[1]:
        if len(learner):
            batch = learner.sample()
            assert batch["observation"].shape == (64, 4)
            samples += 1
    assert sum(ray.get(jobs)) == 1200
    storage = learner.storage
    storage.refresh()
    rows = np.setdiff1d(np.arange(len(storage)), storage._store.unreadable_rows())
    assert rows.size == 1200
    steps = storage.get(torch.from_numpy(rows))[("collector", "traj_ids")]
    assert steps.numel() == 1200
    storage.close()


def test_writer_actors_from_zarr_rb_ray(cluster, store_path):
    url = str(store_path)
    ZarrStorage(4000, url, shared=True).close()
    writers = [zarr_rb.ray.writer_actor(url) for _ in range(2)]
    placed = ray.get(
        [w.extend.remote(stamped(i, b * 50, 50)) for b in range(4) for i, w in enumerate(writers)]
    )
    ray.get([w.close.remote() for w in writers])
    reader = ZarrStorage(path=url, read_only=True)
    everything = sorted(row for rows in placed for row in rows)
    assert everything == sorted(set(everything))  # no two writes shared a row
    data = reader.get(torch.tensor(everything))
    assert torn(data) == 0
    assert sorted(data["stamp"].tolist()) == sorted(
        w * WRITER_STRIDE + s for w in range(2) for s in range(200)
    )
    reader.close()


@pytest.mark.slow  # (20 s of Ray actors; the writer actors run by default; CI runs it)
def test_torchrls_ray_replay_buffer_on_a_zarr_storage(cluster, store_path):
    rb = ReplayBuffer(
        storage=partial(ZarrStorage, 100, store_path),
        batch_size=4,
        service_backend="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
    )
    rb.extend(TensorDict({"value": torch.arange(8)}, batch_size=[8]))
    assert len(rb) == 8
    assert rb.sample().shape == torch.Size([4])
    rb.shutdown()
    reader = ZarrStorage(path=store_path, read_only=True)  # the actor's rows, on disk
    assert torch.equal(reader.get(torch.arange(8))["value"], torch.arange(8))
    reader.close()


def test_without_ray_the_helpers_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]' in a checkout"):
        zarr_rb.ray.writer_actor("runs/x.zarr")
