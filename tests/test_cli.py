"""The zarr-rb command, run as users run it (a subprocess) on a buffer of real Atari frames:
its tables, the pictures it writes (decoded back), its copies and conversions, and what it
says and returns for bad input (most of that in this process: every subprocess starts an
interpreter, which takes seconds)."""

from __future__ import annotations

import contextlib
import csv
import io
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
from sample_runner import Result, python_c
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.cli import main

COMMANDS = ["info", "episodes", "show", "plot", "snapshot", "import", "export", "verify"]


_AS_MAIN = """
import os, runpy
os.environ["COLUMNS"] = "160"
runpy.run_module("zarr_rb", run_name="__main__", alter_sys=True)
"""


def run(*args: str) -> Result:
    """``python -m zarr_rb args``, in another process (see :func:`python_c`)."""
    return python_c(_AS_MAIN, *args, cwd=os.getcwd(), timeout=300)


def call(*args: str, columns: int = 160) -> subprocess.CompletedProcess[str]:
    """``zarr-rb args`` run in this process, as :func:`run` reports it."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        patch.setenv("COLUMNS", str(columns))
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = int(exit.code or 0)
    return subprocess.CompletedProcess(
        ["zarr-rb", *args], code, stdout.getvalue(), stderr.getvalue()
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
    assert "zstd -1" in text
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
    assert call("show", str(pong.path), "--episode", "2", "-o", str(strip)).returncode == 0
    picture = Image.open(strip)
    assert picture.format == "PNG"
    assert picture.size == (84 * 12, 84)


def test_show_writes_an_mp4_video_that_decodes_to_the_episode(
    pong: PongRun, tmp_path: Path
) -> None:
    import cv2

    frames = zarr_rb.open(pong.path).episode(2)["observation"][:, -1].numpy()
    movie = tmp_path / "ep2.mp4"
    out = run("show", str(pong.path), "--episode", "2", "-o", str(movie), "--fps", "30")
    assert out.returncode == 0, out.stderr
    capture = cv2.VideoCapture(str(movie))
    assert capture.get(cv2.CAP_PROP_FPS) == 30
    decoded = []
    while True:
        ok, picture = capture.read()
        if not ok:
            break
        decoded.append(cv2.cvtColor(picture, cv2.COLOR_BGR2GRAY))
    capture.release()
    assert len(decoded) == len(frames)  # every frame, none merged
    assert decoded[0].shape == frames[0].shape == (84, 84)
    # MPEG-4 is lossy: each frame is close to the episode's, and closer to it than to others.
    errors = [np.abs(a.astype(int) - b).mean() for a, b in zip(decoded, frames, strict=True)]
    assert max(errors) < 8, max(errors)


def test_an_mp4_of_odd_sized_colour_frames_keeps_every_pixel(tmp_path: Path) -> None:
    import cv2

    from zarr_rb.analysis.pictures import write_frames

    frames = np.zeros((5, 35, 47, 3), dtype=np.uint8)
    frames[:, :, :, 0] = 200  # red, channels last
    frames[np.arange(5), np.arange(5) * 7, 46] = 255
    assert write_frames(frames, tmp_path / "x.mp4") == 5
    capture = cv2.VideoCapture(str(tmp_path / "x.mp4"))
    ok, first = capture.read()
    assert ok
    assert first.shape == (36, 48, 3)  # padded to even sizes, not cropped
    assert abs(int(first[10, 10, 2]) - 200) < 16  # red is channel 2 in OpenCV's BGR
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 5


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


# --- tables fit 80 columns; messages say what happened and what to do --------------------

LONG_KEYS = {
    ("observation", "pixels_of_the_wrist_camera_stacked"): torch.zeros(4, 3, 8, 8),
    ("observation", "proprioception", "joint_positions_and_velocities"): torch.zeros(4, 14),
    ("next", "observation", "pixels_of_the_wrist_camera_stacked"): torch.zeros(4, 3, 8, 8),
    ("next", "done"): torch.zeros(4, 1, dtype=torch.bool),
    ("a_single_key_name_longer_than_any_column_of_an_eighty_column_terminal",): torch.zeros(4),
}


def small_store(path: Path, data: dict[tuple[str, ...], torch.Tensor] | None = None) -> Path:
    data = data or {("next", "done"): torch.tensor([[False], [True], [False], [True]])}
    storage = ZarrStorage(8, path)
    storage.set(torch.arange(4), TensorDict(dict(data), [4]))
    storage.close()
    return path


def key_column(table: list[str]) -> list[str]:
    """The keys of an info table, their wrapped lines joined (a row starts where the dtype
    column is filled)."""
    at = table[0].index("dtype")
    keys: list[str] = []
    for line in table[1:]:
        key, rest = line[:at].strip(), line[at:].strip()
        if rest:
            keys.append(key)
        else:
            keys[-1] += key
    return keys


def test_info_fits_80_columns_and_shows_every_long_key_whole(tmp_path: Path) -> None:
    path = small_store(tmp_path / "long.zarr", LONG_KEYS)
    out = call("info", str(path), columns=80)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, out.stdout
    assert "…" not in out.stdout
    start = next(i for i, line in enumerate(lines) if line.startswith("key "))
    table = lines[start : next(i for i in range(start, len(lines)) if lines[i].startswith("("))]
    assert sorted(key_column(table)) == sorted(".".join(k) for k in LONG_KEYS)
    wide = call("info", str(path))  # 160 columns: one line per key
    assert all(".".join(k) in wide.stdout for k in LONG_KEYS)


def test_info_on_a_folder_of_stores_names_them_and_the_command_to_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    stores = [small_store(runs / "a.zarr"), small_store(runs / "seed1" / "b.zarr")]
    out = call("info", str(runs))
    assert out.returncode == 2
    assert f"zarr-rb info: {str(runs)!r} is a folder of 2 zarr_rb store(s)" in out.stderr
    assert all(str(store) in out.stderr for store in stores)
    assert "delete" not in out.stderr
    suggested = out.stderr.rsplit("e.g. ", 1)[1].split()
    assert suggested == ["zarr-rb", "info", str(stores[0])]
    assert call(*suggested[1:]).returncode == 0
    episodes = call("episodes", str(runs), "--limit", "4")  # the same for every command
    assert episodes.returncode == 2
    assert f"e.g. zarr-rb episodes {stores[0]} --limit 4" in episodes.stderr
    inside = call("info", str(stores[0] / "data"))
    assert inside.returncode == 2
    assert f"inside the zarr_rb store {str(stores[0])!r}" in inside.stderr
    assert inside.stderr.strip().endswith(f"name the store: zarr-rb info {stores[0]}")


def test_info_on_a_torchrl_dump_says_to_import_it(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(8))
    rb.extend(TensorDict({"obs": torch.arange(4.0)}, [4]))
    rb.dumps(tmp_path / "dump")
    out = call("info", str(tmp_path / "dump"))
    assert out.returncode == 2
    assert "is a TorchRL dump (written by rb.dumps), not a zarr_rb store" in out.stderr
    command = out.stderr.split("first, ", 1)[1].split(", then", 1)[0].split()
    assert command == ["zarr-rb", "import", str(tmp_path / "dump"), f"{tmp_path / 'dump'}.zarr"]
    assert call(*command[1:]).returncode == 0  # the command it gives works
    assert "rows      4 of 8" in call("info", command[-1]).stdout


def test_show_and_plot_refuse_a_file_type_they_do_not_write(tmp_path: Path) -> None:
    path = small_store(tmp_path / "s.zarr")
    movie = tmp_path / "x.webm"
    out = call("show", str(path), "--episode", "0", "-o", str(movie))
    assert out.returncode == 2
    assert "'.webm'" in out.stderr
    assert ".gif (an animated GIF) or .png (a PNG strip) or .mp4 (an MP4 video)" in out.stderr
    assert not movie.exists()
    out = call("plot", str(path), "-o", str(tmp_path / "x.jpg"))
    assert out.returncode == 2
    assert "plots are written as .png" in out.stderr
    assert not (tmp_path / "x.jpg").exists()


def test_a_missing_optional_library_names_how_to_install_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    frames = {("pixels",): torch.zeros(4, 8, 8, dtype=torch.uint8), **LONG_KEYS}
    path = small_store(tmp_path / "s.zarr", frames)
    for name in ("PIL", "PIL.Image"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import PIL.Image` fail
    assert main(["show", str(path), "--episode", "0", "-o", str(tmp_path / "x.gif")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zarr-rb show: ")
    assert err.count("zarr-rb show") == 1
    assert "pip install -e '.[analysis]' in a checkout of zarr_rb" in err
    assert "zarr-rb[" not in err


def test_show_into_a_missing_folder_or_at_no_speed_exits_2_and_says_why(tmp_path: Path) -> None:
    frames = {("pixels",): torch.zeros(4, 8, 8, dtype=torch.uint8), **LONG_KEYS}
    path = small_store(tmp_path / "s.zarr", frames)
    out = call("show", str(path), "--episode", "0", "-o", str(tmp_path / "nope" / "x.mp4"))
    assert out.returncode == 2, out.stderr
    assert "there is no folder" in out.stderr
    assert "Traceback" not in out.stderr
    out = call("show", str(path), "--episode", "0", "-o", str(tmp_path / "x.gif"), "--fps", "0")
    assert out.returncode == 2, out.stderr
    assert "positive number of frames per second" in out.stderr
