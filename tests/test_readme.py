"""Every Python sample of the README runs as written (each in a fresh interpreter, in order, in
one working directory, as a reader following the README would)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from s3_server import S3Server, create_bucket

README = Path(__file__).resolve().parent.parent / "README.md"
SAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_samples() -> None:
    assert len(SAMPLES) >= 3


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("readme")
    # The last samples read the demo's store: make a small one where the demo puts it.
    subprocess.run(
        [sys.executable, "-m", "zarr_rb.demo", "--env", "cartpole", "--steps", "300"],
        cwd=where,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return where


@pytest.fixture(scope="module")
def s3_env(s3_server: S3Server) -> dict[str, str]:
    """The environment of a machine pointed at the test S3 server, which has the bucket
    ``buffers`` the README's samples use."""
    create_bucket(s3_server, "buffers")
    return {**os.environ, **s3_server.env()}


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=lambda i: f"sample-{i + 1}")
def test_readme_sample_runs(workdir: Path, s3_env: dict[str, str], index: int) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SAMPLES[index]],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env=s3_env,
    )
    assert result.returncode == 0, f"README sample {index + 1} failed:\n{result.stderr[-3000:]}"


def _commands() -> list[str]:
    """The ``zarr-rb`` lines of the README's Analysis section, without their comments."""
    analysis = README.read_text().split("## Analysis", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", analysis, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            lines.extend(part.strip() for part in command.split("&&") if part.strip())
    return lines


def test_readme_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zarr_rb import demo
    from zarr_rb.cli import main

    commands = _commands()
    assert len(commands) >= 6
    assert all(command.startswith("zarr-rb ") for command in commands)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--env", "pong", "--steps", "300"]) == 0
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, f"{command!r} failed"
    assert (tmp_path / "episode0.gif").stat().st_size > 0
    assert (tmp_path / "returns.png").stat().st_size > 0
