"""Every Python sample of the README and of the documentation's pages (``docs/``) runs as
written: each as ``python -c`` would run it (``sample_runner``), a page's samples in order,
in one working directory of that page's own, as a reader following the page would."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from s3_server import S3Server, create_bucket
from sample_runner import SampleRunner

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
ANALYSIS = DOCS / "analysis.md"


def _samples(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _name(page: Path) -> str:
    """The page as the repository names it: ``README.md``, ``docs/s3.md``."""
    return page.relative_to(ROOT).as_posix()


SAMPLES = [
    (_name(page), number, sample)
    for page in PAGES
    for number, sample in enumerate(_samples(page), start=1)
]


def test_the_readme_and_the_pages_have_samples() -> None:
    assert len(_samples(README)) >= 3
    assert len([name for name, _, _ in SAMPLES if name.startswith("docs/")]) >= 10
    # Every page the site shows is a page this test reads.
    site = (ROOT / "mkdocs.yml").read_text()
    assert all(_name(page).removeprefix("docs/") in site for page in PAGES[1:])


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small store where the demo puts it (``runs/demo.zarr``), which samples read."""
    where = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [sys.executable, "-m", "zarr_rb.demo", "--env", "cartpole", "--steps", "300"],
        cwd=where,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return where / "runs" / "demo.zarr"


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory, demo_store: Path) -> Callable[[str], Path]:
    """The working directory of a page (the same for all its samples), made at its first
    sample with a copy of the demo's store in it."""
    made: dict[str, Path] = {}

    def workdir(page: str) -> Path:
        if page not in made:
            where = tmp_path_factory.mktemp(re.sub(r"\W", "-", page))
            shutil.copytree(demo_store, where / "runs" / "demo.zarr")
            made[page] = where
        return made[page]

    return workdir


@pytest.fixture(scope="module")
def runner(s3_server: S3Server) -> Iterator[SampleRunner]:
    """Runs samples on a machine pointed at the test S3 server, which has the bucket
    ``buffers`` the samples use."""
    create_bucket(s3_server, "buffers")
    runner = SampleRunner({**os.environ, **s3_server.env()})
    yield runner
    runner.close()


@pytest.mark.parametrize(
    ("page", "number", "sample"),
    SAMPLES,
    ids=[f"{page}-{number}" for page, number, _ in SAMPLES],
)
def test_sample_runs(
    workdirs: Callable[[str], Path], runner: SampleRunner, page: str, number: int, sample: str
) -> None:
    result = runner.run(sample, cwd=workdirs(page), timeout=300)
    assert result.returncode == 0, f"{page}, sample {number} failed:\n{result.stderr[-3000:]}"


def _commands() -> list[str]:
    """The ``zarr-rb`` lines of the Analysis page's "The command line", without comments."""
    section = ANALYSIS.read_text().split("\n## The command line", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            lines.extend(part.strip() for part in command.split("&&") if part.strip())
    return lines


def test_documented_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
