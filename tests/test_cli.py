"""The zarr-rb command, run as users run it (a subprocess) on a buffer of real Atari frames:
its tables, the pictures it writes (decoded back), its copies and conversions, and what it
says and returns for bad input."""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PongRun, assert_identical
from PIL import Image, ImageSequence
from tensordict import TensorDict
from torchrl.data import TensorDictPrioritizedReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.cli import main

COMMANDS = ["info", "episodes", "show", "plot", "snapshot", "import", "export", "verify"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "zarr_rb", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_info_shows_keys_rows_episodes_and_the_writer(pong: PongRun, tmp_path: Path) -> None:
    view = zarr_rb.open(pong.path)
    table = view.episodes
    done = ZarrStorage(path=pong.path, mode="r+")  # a writer holds the store meanwhile
    try:
        out = run("info", str(pong.path))
    finally:
        done.close()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"{pong.CAPACITY} of {pong.CAPACITY}" in text
    assert f"{len(table)} ({int(table['complete'].sum())} complete)" in text
    assert f"single writer: pid {os.getpid()}" in text
    for key in ("observation", "next.reward", "collector.traj_ids"):
        assert key in text
    assert "zstd 1" in text
    assert "holes     none" in text


def test_episodes_table_and_csv(pong: PongRun, tmp_path: Path) -> None:
    target = tmp_path / "episodes.csv"
    out = run("episodes", str(pong.path), "--csv", str(target), "--episode-key", "next.done")
    assert out.returncode == 0, out.stderr
    table = zarr_rb.open(pong.path, episode_key=("next", "done")).episodes
    assert f"{len(table)} episodes" in out.stdout
    with open(target) as file:
        rows = list(csv.DictReader(file))
    assert [int(r["start"]) for r in rows] == table["start"].tolist()
    assert [int(r["length"]) for r in rows] == table["length"].tolist()
    assert [r["complete"] == "True" for r in rows] == table["complete"].tolist()


def test_show_writes_the_frames_of_an_episode(pong: PongRun, tmp_path: Path) -> None:
    episode = zarr_rb.open(pong.path).episode(2)
    frames = episode["observation"][:, -1].numpy()  # frame stacks show their last frame
    gif = tmp_path / "ep2.gif"
    out = run("show", str(pong.path), "--episode", "2", "--key", "observation", "-o", str(gif))
    assert out.returncode == 0, out.stderr
    decoded = [np.asarray(f.convert("L")) for f in ImageSequence.Iterator(Image.open(gif))]
    # A GIF stores a run of identical frames once, for the run's duration.
    distinct = [frames[0]] + [b for a, b in itertools.pairwise(frames) if (a != b).any()]
    assert len(decoded) == len(distinct)
    assert len(decoded) > len(frames) // 2
    for got, want in zip(decoded, distinct, strict=True):
        np.testing.assert_array_equal(got, want)
    strip = tmp_path / "ep2.png"
    assert run("show", str(pong.path), "--episode", "2", "-o", str(strip)).returncode == 0
    picture = Image.open(strip)
    assert picture.format == "PNG"
    assert picture.size == (84 * 12, 84)


def test_plot_writes_a_png(pong: PongRun, tmp_path: Path) -> None:
    target = tmp_path / "returns.png"
    out = run("plot", str(pong.path), "-o", str(target))
    assert out.returncode == 0, out.stderr
    picture = Image.open(target)
    assert picture.format == "PNG"
    assert picture.size == (800, 500)
    assert f"{len(zarr_rb.open(pong.path).episodes)} episodes" in out.stdout


def test_bad_input_exits_with_2_and_says_why(
    pong: PongRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gif = str(tmp_path / "x.gif")
    out = run("show", str(pong.path), "--episode", "999", "-o", gif)
    assert out.returncode == 2
    assert "episode 999 is out of range" in out.stderr
    assert main(["show", str(pong.path), "--episode", "0", "--key", "next.reward", "-o", gif]) == 2
    assert "not images" in capsys.readouterr().err
    flagless = tmp_path / "flagless.zarr"
    storage = ZarrStorage(8, flagless)
    storage.set(torch.arange(2), TensorDict({"obs": torch.zeros(2, 3)}, [2]))
    storage.close()
    assert main(["episodes", str(flagless)]) == 2
    err = capsys.readouterr().err
    assert "('next', 'done')" in err
    assert "--episode-key" in err
    assert main(["info", str(tmp_path / "nowhere.zarr")]) == 2
    assert "no zarr_rb store" in capsys.readouterr().err
    assert not (tmp_path / "x.gif").exists()


def test_each_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        assert "Exit codes" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as done:
        main(["nonsense"])
    assert done.value.code == 2
    script = Path(sys.executable).parent / "zarr-rb"  # the installed console script
    entry = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert entry.returncode == 0, entry.stderr
    assert all(command in entry.stdout for command in COMMANDS)


def _saved_buffer(path: Path) -> TensorDictPrioritizedReplayBuffer:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=ZarrStorage(64, path), batch_size=8
    )
    rb.extend(TensorDict({"obs": torch.arange(40.0).view(-1, 1), "act": torch.arange(40)}, [40]))
    rb.update_priority(torch.arange(40), torch.linspace(0.1, 4.0, 40))
    zarr_rb.save(rb)
    return rb


def test_snapshot_export_and_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "src.zarr"
    rb = _saved_buffer(source)
    rows = rb.storage.get(torch.arange(40))
    assert main(["snapshot", str(source), str(tmp_path / "copy.zarr")]) == 2  # rb writes it
    assert "is being written" in capsys.readouterr().err
    rb.storage.close()
    assert main(["snapshot", str(source), str(tmp_path / "copy.zarr")]) == 0
    copy = zarr_rb.load(tmp_path / "copy.zarr")
    assert_identical(copy.storage.get(torch.arange(40)), rows)
    assert type(copy.sampler).__name__ == "PrioritizedSampler"
    copy.storage.close()
    assert main(["export", str(source), str(tmp_path / "dump")]) == 0
    assert main(["import", str(tmp_path / "dump"), str(tmp_path / "back.zarr")]) == 0
    assert "TensorDictPrioritizedReplayBuffer of 40 rows" in capsys.readouterr().out
    back = zarr_rb.load(tmp_path / "back.zarr")
    assert_identical(back.storage.get(torch.arange(40)), rows)
    weights = back.sampler._sum_tree
    assert [weights[i] for i in (0, 39)] == pytest.approx([0.1**0.7, 4.0**0.7], rel=1e-5)
    back.storage.close()
    assert main(["snapshot", str(source), str(tmp_path / "copy.zarr")]) == 2  # exists
    assert "exists" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "back.zarr")]) == 0
