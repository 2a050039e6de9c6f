"""A tiny run of the benchmark suite, so that it keeps working (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.mark.slow  # (40 s: the benchmark scripts end to end; CI runs it)
def test_benchmark_suite_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    out = tmp_path / "results.json"
    assert (
        run.main(
            [
                "--rows",
                "96",
                "--samples",
                "3",
                "--datasets",
                "pong,random",
                "--extend-rounds",
                "2",
                "--prioritized-capacity",
                "4096",
                "--capacities",
                "2000,200000",
                "--parts",
                "datasets,prefetch,prioritized,capacity",
                "--json",
                str(out),
                "--workdir",
                str(tmp_path),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert set(results["datasets"]) == {"pong", "random"}
    for per_storage in results["datasets"].values():
        assert set(per_storage) == {
            "ZarrStorage",
            "ZarrStorage, ram_bytes=0",
            "LazyMemmapStorage",
            "LazyTensorStorage",
            "TensorDict.to_zarr",
        }
        assert per_storage["ZarrStorage"]["disk_bytes"] > 0
        assert len(per_storage["LazyMemmapStorage"]["extend_s"]) == 2
    assert set(results["save_load"]) == {"24", "96"}
    assert results["capacity"]["200000"]["flush_ms"] > 0
    assert results["prefetch"]["ZarrStorage prefetch=4"]["batches_per_s"] > 0
    printed = capsys.readouterr().out
    assert "| ZarrStorage |" in printed
    assert "ZarrStorage, ram_bytes=0 / LazyMemmapStorage: extend" in printed
    sys.modules.pop("run", None)


def test_out_of_core_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(run, "POOL_ROWS", 64)
    result = run.out_of_core(300, 3, tmp_path)
    assert result["rows"] == 300
    assert result["disk_gb"] > 0
    sys.modules.pop("run", None)


def test_beyond_ram_children_fill_and_sample_each_storage(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import beyond_ram
    import run

    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(beyond_ram, "POOL_ROWS", 64)
    for kind in beyond_ram.STORAGES:
        where = tmp_path / kind
        where.mkdir()
        result = beyond_ram.fill_and_sample(kind, 300, 3, where)
        assert result["rows"] == 300
        assert result["sample_random"]["median_ms"] > 0
        assert result["disk_bytes"] > 0
    assert beyond_ram.parse_bytes("1.5G") == 3 * 2**29
    assert beyond_ram.parse_bytes("512MiB") == 2**29
    sys.modules.pop("run", None)


def test_a_memory_cgroup_confines_a_child_and_is_removed(monkeypatch):
    import subprocess

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import beyond_ram

    try:
        with beyond_ram.MemoryCgroup.made(f"zarr-rb-test-{os.getpid()}", 64 * 2**20) as cgroup:
            # The child's memory is charged to the cgroup: its peak counts the 8 MiB.
            small = subprocess.run(
                [sys.executable, "-c", "bytearray(8 * 2**20)"], preexec_fn=cgroup.join
            )
            peak = cgroup.peak_bytes()
            path = cgroup.path
    except beyond_ram.CgroupUnavailableError as err:
        pytest.skip(str(err))
    assert small.returncode == 0
    assert peak is not None
    assert 8 * 2**20 <= peak <= 64 * 2**20
    assert not path.exists()


def test_data_kinds_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import data_kinds
    import run

    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(data_kinds, "BLOCK", 50)
    frames = run.dataset("random", 64)  # no emulator: random frames stand for Pong's
    monkeypatch.setattr(data_kinds.run, "dataset", lambda name, rows: frames)
    out = tmp_path / "kinds.json"
    args = ["--rows", "120", "--samples", "3", "--save-gb", "0.001", "--repeats", "1"]
    assert data_kinds.main([*args, "--json", str(out), "--workdir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert results["ragged"]["rows"] == 120
    assert results["ragged"]["ZarrStorage"]["disk_bytes"] > 0
    assert results["save"]["zarr_rb.save"]["disk_bytes"] > 0
    assert "| ZarrStorage |" in capsys.readouterr().out
    sys.modules.pop("data_kinds", None)
    sys.modules.pop("run", None)


def test_s3_benchmark_smoke(tmp_path, monkeypatch, s3_server):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import s3

    out = tmp_path / "s3.json"
    options = s3_server.storage_options()
    argv = ["--rows", "64", "--repeats", "2", "--dataset", "random", "--json", str(out)]
    argv += ["--endpoint", options["endpoint_url"], "--key", options["key"]]
    argv += ["--secret", options["secret"], "--bucket", s3_server.bucket]
    assert s3.main(argv) == 0
    results = json.loads(out.read_text())
    assert set(results["local"]) == set(results["s3"])
    assert results["s3"]["raw_mb"] == results["local"]["raw_mb"]


@pytest.mark.slow  # (16 s: the analysis benchmark end to end; CI runs it)
def test_analysis_benchmark_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import analysis

    out = tmp_path / "analysis.json"
    args = ["--rows", "3000", "--frames", "300", "--collect", "150", "--workers", "0"]
    args += ["--json", str(out)]
    assert analysis.main(args) == 0
    results = json.loads(out.read_text())
    assert results["small"]["episodes"] > 0
    assert results["mean_frame"]["raw_bytes"] == 300 * 4 * 84 * 84
    assert len(results["epoch_rows_per_s"]) == 2
    sys.modules.pop("analysis", None)


def test_compression_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import compression
    import run

    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    frames = run.dataset("random", 64)  # no emulator: random frames stand for Pong's
    monkeypatch.setattr(run, "dataset", lambda name, rows: frames)
    out = tmp_path / "compression.json"
    args = ["--games", "pong", "--rows", "64", "--rounds", "2", "--json", str(out)]
    assert compression.main([*args, "--workdir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert set(results["games"]["pong"]) == {*compression.SETTINGS, "LazyMemmapStorage"}
    assert "| pong | zstd, 2-row chunks (default) |" in capsys.readouterr().out
    sys.modules.pop("run", None)


def test_dedup_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import dedup
    import run

    # Stacks of 4 consecutive frames of one run (no emulator), as ALE's frame stacks are.
    single = torch.randint(0, 256, (64 + 4, 84, 84), dtype=torch.uint8).numpy()
    stacks = np.stack([single[i : i + 4] for i in range(64 + 1)])
    monkeypatch.setattr(run, "atari_episode_frames", lambda game, rows, seed: (stacks, None))
    out = tmp_path / "dedup.json"
    args = ["--games", "pong", "--rows", "64", "--rounds", "2", "--write-rounds", "1"]
    assert dedup.main([*args, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["pong"]
    assert results["single frames"]["raw_over_disk"] > 1  # each frame once, not 8 times
    assert results["single frames, 8 to a row"]["raw_over_disk"] > 1
    assert results["copy into the page cache (obs, next/obs)"]["write_gb_per_s"] > 0
    assert "| stacked, two keys (zarr_rb today) |" in capsys.readouterr().out
    sys.modules.pop("run", None)


def test_frames_once_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import frames_once

    out = tmp_path / "frames_once.json"
    args = ["--datasets", "random", "--rows", "512", "--rounds", "1", "--dir", str(tmp_path)]
    assert frames_once.main([*args, "--json", str(out)]) == 0  # (rows rebuilt and checked)
    results = json.loads(out.read_text())["random"]
    # Stacks of consecutive random frames: next/obs[i] is obs[i + 1] inside a block, so 4
    # new frames a row, and the first row of each block's next/obs.
    assert 4 <= results["new_frames_per_row"] < 4.1
    assert "| random |" in capsys.readouterr().out
    sys.modules.pop("run", None)


@pytest.mark.slow  # (about 40 s: children importing torch; CI runs it)
def test_checkpoint_and_dqn_loop_benchmarks_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import checkpoint
    import dqn_loop

    out = tmp_path / "checkpoint.json"
    assert checkpoint.main(["--sizes-mb", "1", "--json", str(out), "--where", str(tmp_path)]) == 0
    figures = json.loads(out.read_text())["1 MB"]
    assert figures["ZarrStorage"]["directory"]["checkpoint_bytes"] > 0
    assert figures["LazyMemmapStorage"]["archive"]["checkpoint_bytes"] > 0
    out = tmp_path / "dqn_loop.json"
    argv = ["--batches", "2", "--rows-per-batch", "40", "--updates", "3", "--pool", "64"]
    argv += ["--buffer-size", "1000", "--rounds", "1", "--json", str(out)]
    assert dqn_loop.main([*argv, "--where", str(tmp_path)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {
        "LazyMemmapStorage",
        "LazyTensorStorage",
        "ZarrStorage",
        "ZarrStorage, ram_bytes",
        "ZarrStorage, ram_bytes=0",
        "ZarrStorage, stacks on disk",
    }
    assert all(r["sample_ms"] > 0 and r["peak_rss_gb"] > 0 for r in results.values())


def test_sync_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sync

    result = sync.main(["--files", "3", "--kb", "4", "--rounds", "2", "--dir", str(tmp_path)])
    assert set(result["median_ms"]) == {"fsync", "write-back, then fsync"}
    assert "3 files of 4 kB" in capsys.readouterr().out


@pytest.mark.slow  # (16 s: fills of three storages; CI runs it)
def test_fill_benchmark_smoke(tmp_path):
    out = tmp_path / "fill.json"
    argv = ["--dataset", "random", "--rows", "64", "--rounds", "2", "--breakdown"]
    argv += ["--between", "0.01"]
    argv += ["--dir", str(tmp_path), "--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fill.py"), *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| zarr-0 |" in result.stdout
    fills = json.loads(out.read_text())["fills"]
    assert set(fills) == {"memmap", "zarr", "zarr-0", "zarr-stacks"}
    assert all(f["wall_s"] > 0 and f["cpu_s"] > 0 and len(f["all"]) == 2 for f in fills.values())
    # (The work after each extend is in the fill's time, not in the extend's.)
    assert all(f["wall_s"] >= 0.01 and f["extend_ms"] > 0 for f in fills.values())
    # Every ZarrStorage fill commits (and syncs); only the default one fills a RAM tier.
    parts = {kind: fills[kind]["breakdown_s"] for kind in ("zarr", "zarr-0")}
    assert all(p["commits"] > 0 and p["fsync, on this thread"] > 0 for p in parts.values())
    tier = "frames into the RAM tier"
    assert parts["zarr"][tier] > parts["zarr-0"][tier]
    assert fills["zarr-stacks"]["breakdown_s"]["commits"] > 0


def test_fill_benchmark_names_chunks_as_stores_made_before_when_asked(tmp_path, monkeypatch):
    """``zarr-nested``: the arrays of that fill name their chunks ``c/3/0/0``; the others,
    and the fills after it, ``c.3.0.0``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fill
    import run

    from zarr_rb.engine import tensorstore as tensorstore_engine

    made: list[str] = []
    create = tensorstore_engine.Engine._create

    def noted(self, path, **settings):
        made.append(tensorstore_engine.CHUNK_KEY_ENCODING["separator"])
        return create(self, path, **settings)

    monkeypatch.setattr(tensorstore_engine.Engine, "_create", noted)
    data = run.dataset("random", 16)
    for kind in ("zarr-nested", "zarr"):
        made.clear()
        fill.fill(kind, data, tmp_path)
        assert made
        assert set(made) == {"/" if kind == "zarr-nested" else "."}


def test_holes_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import holes

    out = tmp_path / "holes.json"
    result = holes.main(["--rows", "500", "--samples", "2", "--repeat", "1", "--json", str(out)])
    assert [run["holes"] for run in result["runs"]] == [0, 1]
    assert all(run["sample_ms"] > 0 for run in result["runs"])
    assert json.loads(out.read_text()) == result
    assert "| 1 |" in capsys.readouterr().out


def test_reopen_benchmark_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import reopen

    out = tmp_path / "reopen.json"
    argv = ["--dataset", "random", "--rows", "300", "--rounds", "1"]
    assert reopen.main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())["result"]
    assert result["samples_during"] >= 1
    assert all(result[key] > 0 for key in ("during_ms", "after_ms", "decoded_ms", "memmap_ms"))
    assert "| sample() after |" in capsys.readouterr().out
