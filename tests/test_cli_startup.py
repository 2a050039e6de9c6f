"""The zarr-rb command starts without importing torch, TorchRL or TensorStore (seconds of
imports), ``import zarr_rb`` resolves its public names on first use, and ``zarr-rb info``
reads a local store as files into the same report as through a View (its twin)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import chunk_file
from s3_server import S3Server
from tensordict import TensorDict, lazy_stack
from torchrl.data import TensorDictReplayBuffer

import zarr_rb
from zarr_rb import Compression, ZarrStorage
from zarr_rb.analysis._files import LocalFiles
from zarr_rb.analysis.report import ViewSource, describe, store_episodes
from zarr_rb.locations import LocalLocation

HEAVY = ("torch", "torchrl", "tensordict", "tensorstore")


def imported_by(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime *args``: the run, and every module it imported."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "zarr_rb" in modules, out.stderr[-2000:]
    return out, modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_help_and_import_zarr_rb_import_none_of_torch_torchrl_tensorstore() -> None:
    out, modules = imported_by("-m", "zarr_rb", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "info" in out.stdout
    assert heavy(modules) == []
    probe = "import zarr_rb.cli, sys; print(sorted(m for m in sys.modules if m == 'torch'))"
    _, modules = imported_by("-c", probe)
    assert heavy(modules) == []


def test_info_reads_a_local_store_without_torch_or_tensorstore(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    episode_store(path)
    out, modules = imported_by("-m", "zarr_rb", "info", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "6 (5 complete), from collector.traj_ids, next.done" in out.stdout
    assert heavy(modules) == []


def test_public_names_resolve_on_first_use() -> None:
    script = """
import sys, zarr_rb
assert "torch" not in sys.modules
assert set(zarr_rb.__all__) <= set(dir(zarr_rb))
for name in zarr_rb.__all__:
    assert getattr(zarr_rb, name) is not None, name
from zarr_rb import ZarrStorage, verify
import zarr_rb.verify  # the submodule named like the function
assert zarr_rb.verify is verify and callable(zarr_rb.verify)
assert zarr_rb.ZarrStorage is ZarrStorage and zarr_rb.errors.ZarrRBError
assert zarr_rb.analysis.View is zarr_rb.View
try:
    zarr_rb.no_such_name
except AttributeError as err:
    assert "no_such_name" in str(err)
else:
    raise AssertionError("no AttributeError")
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


# --- the report read as files is the report read through a View ---------------------------


def episode_store(path: Path, *, rows: int = 40, capacity: int = 64, **kwargs: object) -> None:
    """Episodes of 7 rows marked by trajectory ids and done flags, a bfloat16 reward, and
    rows of different lengths."""
    step = torch.arange(rows)
    data = TensorDict(
        {
            "obs": step.float().view(-1, 1, 1).expand(-1, 4, 4).clone(),
            "collector": {"traj_ids": step // 7},
            "next": {
                "done": (step % 7 == 6).unsqueeze(-1),
                "reward": (step % 5).to(torch.bfloat16).unsqueeze(-1),
            },
        },
        [rows],
    )
    storage = ZarrStorage(capacity, path, **kwargs)  # type: ignore[arg-type]
    rb = TensorDictReplayBuffer(storage=storage)
    for start in range(0, rows, 10):
        rb.extend(data[start : start + 10])
    zarr_rb.save(rb)
    storage.close()


def both_reports(path: Path, **keys: object) -> tuple[object, object]:
    files = describe(LocalFiles(path, command=str), **keys)  # type: ignore[arg-type]
    with zarr_rb.open(path) as view:
        through_view = describe(ViewSource(view), **keys)  # type: ignore[arg-type]
    return files, dataclasses.replace(through_view, url=files.url)


@pytest.mark.parametrize(
    "kind", ["plain", "wrapped ring", "holes", "ndim=2", "ragged", "empty", "episode key"]
)
def test_info_read_as_files_equals_info_read_through_a_view(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s.zarr"
    keys: dict[str, object] = {}
    if kind == "plain":
        episode_store(path)
    elif kind == "wrapped ring":
        episode_store(path, rows=100, capacity=64)
    elif kind == "holes":
        layout = Compression(chunk_rows=2, block_rows=8, large_row_bytes=32)
        episode_store(path, rows=48, capacity=48, compression=layout)
        chunk_file(path, "data/obs", 2, 0, 0).unlink()  # rows 16-23
        zarr_rb.verify(path, repair=True)
    elif kind == "ndim=2":
        storage = ZarrStorage(30, path, ndim=2)
        done = torch.zeros(3, 10, 1, dtype=torch.bool)
        done[:, 3] = done[1, 7] = True
        data = TensorDict({"next": {"done": done, "reward": torch.ones(3, 10, 1)}}, [3, 10])
        TensorDictReplayBuffer(storage=storage).extend(data)
        storage.close()
    elif kind == "ragged":
        storage = ZarrStorage(8, path, ragged=["tokens"])
        rows = [TensorDict(tokens=torch.arange(n), done=torch.tensor([n > 2])) for n in (2, 5, 3)]
        TensorDictReplayBuffer(storage=storage).extend(lazy_stack(rows))
        storage.close()
    elif kind == "empty":
        episode_store(path)
        rb = TensorDictReplayBuffer(storage=ZarrStorage(path=path, mode="r+"))
        rb.empty()
        rb.storage.close()
    else:
        episode_store(path)
        keys = {"episode_key": ("next", "done"), "reward_key": ("obs",)}
    files, through_view = both_reports(path, **keys)
    assert files == through_view
    if kind == "holes":
        assert files.holes == [(16, 24)]  # type: ignore[attr-defined]
    # The episodes zarr-rb episodes and plot show: those of View.episodes.
    episodes = store_episodes(LocalFiles(path, command=str), **keys)  # type: ignore[arg-type]
    view = zarr_rb.open(path, **keys)  # type: ignore[arg-type]
    want = view._episode_index().columns()
    got = episodes.columns()
    assert list(got) == list(want)
    for name, column in want.items():
        np.testing.assert_array_equal(got[name], column, err_msg=name)
    view.close()


def test_info_reads_the_writers_as_the_lock_files_tell_them(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    episode_store(path)

    def same() -> list[dict[str, object]]:
        files = LocalFiles(path, command=str).holders()
        assert files == LocalLocation(path).holders()
        return files

    assert same() == []
    writer = ZarrStorage(path=path, mode="r+")
    writer.set(torch.arange(1), TensorDict({"obs": torch.zeros(1, 4, 4)}, [1]))
    try:
        holders = same()
        assert [(h["kind"], h["pid"]) for h in holders] == [("single writer", os.getpid())]
    finally:
        writer.close()
    assert same() == []
    shared = [ZarrStorage(path=path, mode="r+", shared=True) for _ in range(2)]
    try:
        holders = same()
        assert sorted(h["kind"] for h in holders) == ["shared writer"] * 2
    finally:
        for storage in shared:
            storage.close()
    assert same() == []


def test_info_of_an_s3_store_equals_its_report_read_as_files(
    s3_server: S3Server, s3_url: str, s3_options: dict[str, str], tmp_path: Path
) -> None:
    """A store on S3 is read through a View: its report is that of the same store on disk."""
    local = tmp_path / "s.zarr"
    for path, options in ((local, None), (s3_url, s3_options)):
        rb = TensorDictReplayBuffer(storage=ZarrStorage(16, path, storage_options=options))
        rb.extend(TensorDict({"next": {"done": torch.arange(10).unsqueeze(-1) % 3 == 2}}, [10]))
        rb.storage.close()
    env = {**os.environ, **s3_server.env(), "COLUMNS": "120"}
    outputs = [
        subprocess.run(
            [sys.executable, "-m", "zarr_rb", "info", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        for path in (local, s3_url)
    ]
    for out in outputs:
        assert out.returncode == 0, out.stderr
    assert "4 (3 complete), from next.done" in outputs[1].stdout
    # Past the first line (the URL), only the sizes of objects may differ, and the S3
    # store says how its objects are written (created once: the server refuses a second).
    first, second = (out.stdout.splitlines()[1:] for out in outputs)
    objects = [i for i, line in enumerate(second) if line.startswith("objects")]
    assert len(objects) == 1
    assert second[objects[0]].split()[1:3] == ["created", "once,"]
    end = objects[0] + 1
    while second[end].startswith(" " * 10):  # (its text wrapped onto more lines)
        end += 1
    del second[objects[0] : end]
    # The RAM a writer would take here follows the memory available at each run.
    first, second = (_without_line("in RAM", lines) for lines in (first, second))
    assert [line.split("zstd")[0] for line in first] == [line.split("zstd")[0] for line in second]


def _without_line(label: str, lines: list[str]) -> list[str]:
    """``lines`` without the line of ``label`` and the lines its text wrapped onto."""
    out: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith(label):
            skipping = True
        elif skipping and not line.startswith(" " * 10):
            skipping = False
        if not skipping:
            out.append(line)
    return out
