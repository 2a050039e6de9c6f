"""Every ``Examples:`` section of zarr_rb's docstrings (those the API reference shows) runs
as written and prints what it says: each module's examples in order, in a working
directory of its own, as a reader pasting them into a console would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zarr_rb"
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if "Examples:" in path.read_text()
)


def test_the_api_reference_has_examples() -> None:
    assert len(MODULES) >= 8


_RUN = """
import doctest, importlib, os, sys, tempfile
failed = []
for name in sys.argv[1:]:
    os.chdir(tempfile.mkdtemp(prefix="examples-"))  # each module in a directory of its own
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags)
    if result.failed or not result.attempted:
        failed.append(name)
print("FAILED:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def test_examples_run(tmp_path: Path) -> None:
    """In one fresh interpreter (torch and TorchRL imported once), each module's examples in
    an empty working directory of their own."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN, *MODULES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
