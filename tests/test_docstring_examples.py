"""Every ``Examples:`` section of zarr_rb's docstrings (those the API reference shows) runs
as written and prints what it says: each module's examples in order, in a working
directory of its own, as a reader pasting them into a console would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zarr_rb"
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if "Examples:" in path.read_text()
)


def test_the_api_reference_has_examples() -> None:
    assert len(MODULES) >= 8


_RUN = """
import doctest, importlib, sys
module = importlib.import_module(sys.argv[1])
flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
result = doctest.testmod(module, optionflags=flags)
sys.exit(1 if result.failed or not result.attempted else 0)
"""


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str, tmp_path: Path) -> None:
    """In a fresh interpreter, in an empty working directory."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN, name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
