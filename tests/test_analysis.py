"""zarr_rb.open: a read-only view of a store, its episodes, and its keys as dask and xarray
arrays, checked against what was written (real Atari frames) and against NumPy."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PongRun, assert_identical, chunk_file
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import (
    Compression,
    EpisodeIndexError,
    LazyColumn,
    NoEpisodeFlagsError,
    RowsNotCommittedError,
    UnknownKeyError,
    ZarrStorage,
)

# --- a reference for episodes, written without zarr_rb's code ---------------------------


def reference_episodes(done, reward, *, full: bool, valid=None):
    """(first, stop, complete, return) per episode of chronological flags, split at holes."""
    n = len(done)
    valid = np.ones(n, dtype=bool) if valid is None else valid
    out = []
    start = None
    for i in range(n):
        if not valid[i]:
            if start is not None:
                out.append((start, i, False))
                start = None
            continue
        if start is None:
            start = i
        if done[i]:
            lost = (start == 0 and full) or (start > 0 and not valid[start - 1])
            out.append((start, i + 1, not lost))
            start = None
    if start is not None:
        out.append((start, n, False))
    return [(a, b, c, float(np.sum(reward[a:b], dtype=np.float64))) for a, b, c in out]


def _check_table(view, expected, row_of) -> None:
    table = view.episodes
    assert len(table) == len(expected)
    assert table["start"].tolist() == [row_of(a) for a, _, _, _ in expected]
    assert table["stop"].tolist() == [row_of(b - 1) + 1 for _, b, _, _ in expected]
    assert table["length"].tolist() == [b - a for a, b, _, _ in expected]
    assert table["complete"].tolist() == [c for _, _, c, _ in expected]
    np.testing.assert_allclose(table["return"].to_numpy(), [r for *_, r in expected], atol=1e-9)


@pytest.mark.parametrize("episode_key", [None, ("next", "done")], ids=["traj_ids", "done"])
def test_episodes_match_a_numpy_reference_on_pong(pong: PongRun, episode_key) -> None:
    kept = pong.kept
    expected = reference_episodes(
        kept["next", "done"].reshape(-1).numpy(),
        kept["next", "reward"].reshape(-1).numpy(),
        full=True,
    )
    assert len(expected) >= 5
    view = zarr_rb.open(pong.path, episode_key=episode_key)
    _check_table(view, expected, pong.row_of)
    table = view.episodes
    assert (table["stop"] <= table["start"]).sum() == 1  # one episode wraps the ring
    assert not table["complete"].iloc[0]  # its first rows were overwritten
    if episode_key is None:
        traj = kept["collector", "traj_ids"].numpy()
        assert table["traj_id"].tolist() == [int(traj[a]) for a, *_ in expected]


def test_episode_rows_are_the_frames_written(pong: PongRun) -> None:
    view = zarr_rb.open(pong.path)
    kept = pong.kept
    done = kept["next", "done"].reshape(-1).numpy()
    expected = reference_episodes(done, done, full=True)
    for number, (first, stop, _, _) in enumerate(expected):
        episode = view.episode(number)
        assert episode.batch_size == torch.Size([stop - first])
        assert_identical(episode["observation"], kept["observation"][first:stop])
        assert_identical(episode["next", "reward"], kept["next", "reward"][first:stop])
    assert_identical(view.episode(-1)["action"], kept["action"][expected[-1][0] :])
    with pytest.raises(EpisodeIndexError, match=f"holds {len(expected)} episodes"):
        view.episode(len(expected))
    with pytest.raises(IndexError):
        view.episode(-len(expected) - 1)


def test_view_reads_lazily_and_exactly(pong: PongRun) -> None:
    view = zarr_rb.open(pong.path)
    kept = pong.kept
    by_row = {pong.row_of(p): p for p in range(pong.CAPACITY)}
    assert len(view) == pong.CAPACITY
    assert view.shape == torch.Size([pong.CAPACITY])
    assert {"observation", ("next", "reward"), ("collector", "traj_ids")} <= set(view.keys())
    assert view.schema["observation"].shape == (4, 84, 84)
    assert view.schema["observation"].dtype == torch.uint8
    block = view[100:110]
    assert isinstance(block["observation"], LazyColumn)  # nothing read yet
    assert_identical(block["observation"], kept["observation"][by_row[100] : by_row[100] + 10])
    assert_identical(view["observation"][17], kept["observation"][by_row[17]])
    picked = view.select("observation", ("next", "reward"))
    assert set(picked.keys()) == {"observation", ("next", "reward")}
    rows = torch.tensor([3, 400, 3])
    got = picked[rows]
    assert set(got.keys(True, True)) == {"observation", ("next", "reward")}
    for i, row in enumerate(rows.tolist()):
        assert_identical(got["observation"][i], kept["observation"][by_row[row]])
    with pytest.raises(UnknownKeyError, match="holds") as raised:
        view["pixels"]
    assert isinstance(raised.value, KeyError)
    with pytest.raises(UnknownKeyError):
        picked.select("action")


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
        if p.is_file()
    }


def _rows(n: int, start: int = 0) -> TensorDict:
    step = torch.arange(start, start + n)
    return TensorDict(
        {"step": step, ("next", "done"): (step % 7 == 6).unsqueeze(-1)}, batch_size=[n]
    )


def test_view_takes_no_lock_writes_nothing_and_sees_commits_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "rb.zarr"
    writer = ZarrStorage(1000, path)
    writer.set(torch.arange(10), _rows(10))
    writer.flush()
    view = zarr_rb.open(path)  # next to a writer holding the store
    assert len(view) == 10
    writer.set(torch.arange(10, 15), _rows(5, 10))  # in the writer's RAM: not committed
    assert len(view.refresh()) == 10
    writer.flush()
    assert len(view) == 10  # a newer commit only on refresh()
    assert len(view.refresh()) == 15
    assert view["step"].tolist() == list(range(15))
    writer.close()

    before = _files(path)
    view = zarr_rb.open(path)
    assert len(view.episodes)
    view.episode(0)
    view.to_dask()["step"].sum().compute()
    view.dataset()[3]
    assert _files(path) == before
    other = ZarrStorage(path=path, mode="r+")  # a writer opens it while the view is open
    other.close()


def test_open_is_fast_and_episodes_of_millions_of_rows_take_under_a_second(
    tmp_path: Path,
) -> None:
    rows = 2_000_000
    path = tmp_path / "big.zarr"
    storage = ZarrStorage(rows, path)
    generator = torch.Generator().manual_seed(0)
    for start in range(0, rows, 500_000):
        n = 500_000
        done = torch.rand(n, 1, generator=generator) < 0.002
        reward = torch.randn(n, 1, generator=generator)
        storage.set(
            torch.arange(start, start + n),
            TensorDict({("next", "done"): done, ("next", "reward"): reward}, [n]),
        )
    storage.close()
    # CPU time, not wall time: the bounds hold on a machine busy with other work.
    opens = []
    for _ in range(5):
        t0 = time.process_time()
        view = zarr_rb.open(path)
        opens.append(time.process_time() - t0)
        view.close()
    assert statistics.median(opens) < 0.05, opens
    view = zarr_rb.open(path)
    t0 = time.process_time()
    table = view.episodes
    assert time.process_time() - t0 < 1.0
    done = view["next", "done"].numpy().reshape(-1)
    assert len(table) == int(done.sum()) + (not done[-1])
    assert table["length"].sum() == rows


def _envs_store(path: Path, *, envs: int, capacity: int, steps: int, chunk: int):
    """An ndim=2 store written ``chunk`` steps at a time; ``step`` encodes (time, env)."""
    generator = np.random.default_rng(5)
    done = generator.random((steps, envs)) < 0.15
    rb = TensorDictReplayBuffer(storage=ZarrStorage(capacity * envs, path, ndim=2))
    t = np.arange(steps)[:, None] * 10 + np.arange(envs)[None, :]
    for start in range(0, steps, chunk):
        part = slice(start, start + chunk)
        data = TensorDict(
            {
                "step": torch.from_numpy(t[part].T.copy()),
                ("next", "done"): torch.from_numpy(done[part].T.copy()).unsqueeze(-1),
                ("next", "reward"): torch.ones(envs, chunk, 1),
            },
            batch_size=[envs, chunk],
        )
        rb.extend(data)  # [n_envs, time], as collectors give it
    rb.storage.close()
    return done, t


def test_episodes_of_an_ndim2_store_run_per_environment(tmp_path: Path) -> None:
    envs, capacity, steps = 3, 20, 30
    path = tmp_path / "envs.zarr"
    done, t = _envs_store(path, envs=envs, capacity=capacity, steps=steps, chunk=5)
    view = zarr_rb.open(path)
    assert view.shape == torch.Size([capacity, envs])
    table = view.episodes
    kept = slice(steps - capacity, steps)
    expected = []
    for env in range(envs):
        for a, b, complete, ret in reference_episodes(
            done[kept, env], np.ones(capacity), full=True
        ):
            expected.append((env, a, b, complete, ret))
    assert table["env"].tolist() == [e for e, *_ in expected]
    assert table["length"].tolist() == [b - a for _, a, b, _, _ in expected]
    assert table["complete"].tolist() == [c for *_, c, _ in expected]
    assert table["return"].tolist() == [float(b - a) for _, a, b, _, _ in expected]
    for number, (env, a, b, _, _) in enumerate(expected):
        assert view.episode(number)["step"].tolist() == t[kept, env][a:b].tolist()


LAYOUT = Compression(chunk_rows=2, block_rows=8, large_row_bytes=64)


def _holed_store(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """96 rows, episodes of 5-14 rows, rows 24-31 withdrawn (a hole)."""
    lengths = [7, 12, 5, 9, 14, 6, 11, 8, 10, 4, 10]
    ends = np.cumsum(lengths) - 1
    done = np.zeros(96, dtype=bool)
    done[ends[ends < 96]] = True
    step = torch.arange(96)
    storage = ZarrStorage(96, path, compression=LAYOUT)
    storage.set(
        step,
        TensorDict(
            {
                "step": step,
                "obs": step.float().view(-1, 1, 1).expand(-1, 4, 4).clone(),
                ("next", "done"): torch.from_numpy(done).unsqueeze(-1),
                ("next", "reward"): step.float().unsqueeze(-1),
            },
            batch_size=[96],
        ),
    )
    storage.close()
    chunk_file(path, "data/obs", 3, 0, 0).unlink()
    zarr_rb.verify(path, repair=True)
    valid = np.ones(96, dtype=bool)
    valid[24:32] = False
    return done, valid


def test_holes_are_reported_never_read_and_cut_episodes(tmp_path: Path) -> None:
    path = tmp_path / "holed.zarr"
    done, valid = _holed_store(path)
    view = zarr_rb.open(path)
    assert view.holes == [(24, 32)]
    assert view.valid.tolist() == valid.tolist()
    with pytest.raises(RowsNotCommittedError, match="not readable"):
        view["step"][25].tolist()
    expected = reference_episodes(done, np.arange(96.0), full=True, valid=valid)
    _check_table(view, expected, lambda position: position)
    assert view.to_dask()["obs"][24:32].sum().compute() == 0  # holes read as zeros
    xr_valid = view.to_xarray()["valid"].to_numpy()
    assert xr_valid.tolist() == valid.tolist()
    dataset = view.dataset(keys=["step"])
    assert len(dataset) == 88
    assert sorted(int(dataset[i]["index"]) for i in range(88)) == np.flatnonzero(valid).tolist()


def test_bad_input_gets_typed_errors(tmp_path: Path, pong: PongRun) -> None:
    path = tmp_path / "flagless.zarr"
    storage = ZarrStorage(10, path)
    storage.set(torch.arange(4), TensorDict({"obs": torch.zeros(4, 3)}, [4]))
    storage.close()
    with pytest.raises(NoEpisodeFlagsError, match=r"'collector', 'traj_ids'.*episode_key="):
        _ = zarr_rb.open(path).episodes
    with pytest.raises(NoEpisodeFlagsError, match="float32 values"):
        _ = zarr_rb.open(path, episode_key="obs").episodes
    with pytest.raises(UnknownKeyError, match="no key 'done'"):
        _ = zarr_rb.open(path, episode_key="done").episodes
    from zarr_rb import NotAnImageError
    from zarr_rb.analysis.pictures import episode_frames

    with pytest.raises(NotAnImageError, match="float32 values, not images"):
        episode_frames(zarr_rb.open(pong.path), 0, ("next", "reward"))


# --- dask and xarray -------------------------------------------------------------------


def _in_storage_order(pong: PongRun, key) -> np.ndarray:
    kept = pong.kept[key].numpy()
    out = np.empty_like(kept)
    out[[pong.row_of(p) for p in range(pong.CAPACITY)]] = kept
    return out


def test_dask_reductions_match_numpy_and_chunks_follow_shards(pong: PongRun) -> None:
    view = zarr_rb.open(pong.path)
    arrays = view.to_dask()
    frames = _in_storage_order(pong, "observation")
    obs = arrays["observation"]
    block = view.storage._store.meta.block_rows
    assert obs.chunks[0][:-1] == (block,) * (len(obs.chunks[0]) - 1)
    np.testing.assert_array_equal(obs.mean(axis=0).compute(), frames.mean(axis=0))
    assert (obs[123].compute() == frames[123]).all()
    reward = _in_storage_order(pong, ("next", "reward"))
    assert float(arrays["next", "reward"].sum().compute()) == float(reward.sum())
    data = view.to_xarray()
    assert data["observation"].dims == ("row", "observation_0", "observation_1", "observation_2")
    assert float(data["next.reward"].sum()) == float(reward.sum())


def test_to_dask_keeps_dtypes_and_leaves_out_what_no_array_holds(tmp_path: Path) -> None:
    from tensordict import NonTensorStack

    path = tmp_path / "kinds.zarr"
    values = torch.randn(6, 2).to(torch.bfloat16)
    storage = ZarrStorage(10, path)
    storage.set(
        torch.arange(6),
        TensorDict({"half": values, "text": NonTensorStack(*[f"row {i}" for i in range(6)])}, [6]),
    )
    storage.close()
    arrays = zarr_rb.open(path).to_dask()
    assert set(arrays) == {"half"}
    assert str(arrays["half"].dtype) == "bfloat16"
    got = torch.from_numpy(arrays["half"].compute().view(np.int16)).view(torch.bfloat16)
    assert_identical(got, values)


def test_xarray_opens_the_data_group_without_zarr_rb(pong_stacks: PongRun) -> None:
    pong = pong_stacks  # (frames=False: stacks, as xarray reads them)
    expected = _in_storage_order(pong, "observation")[:, -1].astype(np.float64).mean()
    script = f"""
import sys
sys.modules["zarr_rb"] = None  # zarr_rb absent
import json, numpy, xarray, zarr
data = xarray.open_zarr({str(pong.path / "data")!r}, consolidated=False)
obs = data["observation"]
commit = zarr.open_group({str(pong.path)!r}, mode="r").attrs["zarr_rb"]["commit"]
rows = positions = numpy.arange(commit["length"])
if "slots" in commit:  # the ring was written over: blocks live in other slots
    block_rows, runs = commit["slots"]["block_rows"], commit["slots"]["runs"]
    slot = numpy.zeros(sum(count for _, _, count in runs), dtype=numpy.int64)
    for first, where, count in runs:
        slot[first : first + count] = numpy.arange(where, where + count)
    rows = slot[positions // block_rows] * block_rows + positions % block_rows
mean = float(obs.isel(row=rows)[:, -1].mean())
print(json.dumps({{"dims": list(obs.dims), "mean": mean, "moved": "slots" in commit}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dims"] == ["row", "observation_0", "observation_1", "observation_2"]
    assert result["moved"]  # the run wrapped: read through the slot map
    assert result["mean"] == pytest.approx(expected)


def test_a_dask_mean_frame_streams_with_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from analysis import mean_frame  # the benchmark's own measurement

    rows, block = 16_384, 256
    path = tmp_path / "frames.zarr"
    storage = ZarrStorage(rows, path, compression=Compression(block_rows=block))
    for start in range(0, rows, block):
        frames = torch.arange(start, start + block).remainder(251).to(torch.uint8)
        frames = frames.view(-1, 1, 1, 1).expand(-1, 4, 84, 84).contiguous()
        storage.set(torch.arange(start, start + block), TensorDict({"obs": frames}, [block]))
    storage.close()
    raw = rows * 4 * 84 * 84  # 462 MB
    result = mean_frame(path, "obs")
    assert 0 < result["rss_growth_bytes"] < raw / 3, result  # about 50 MB: a few blocks of 7 MB
    assert result["mean"] == pytest.approx(float(np.mean(np.arange(rows) % 251)))


@pytest.mark.slow
def test_episodes_of_ten_million_rows_take_under_a_second(tmp_path: Path) -> None:
    rows = 10_000_000
    path = tmp_path / "huge.zarr"
    storage = ZarrStorage(rows, path)
    for start in range(0, rows, 1_000_000):
        n = 1_000_000
        done = torch.rand(n, 1) < 0.001
        storage.set(
            torch.arange(start, start + n),
            TensorDict({("next", "done"): done, ("next", "reward"): torch.randn(n, 1)}, [n]),
        )
    storage.close()
    # CPU time of this process (its threads included): the work done, whatever else the
    # machine runs meanwhile (wall-clock time would measure the neighbours too).
    times = []
    for _ in range(3):
        view = zarr_rb.open(path)
        t0 = time.process_time()
        assert len(view.episodes)
        times.append(time.process_time() - t0)
        view.close()
    assert min(times) < 1.0, times
