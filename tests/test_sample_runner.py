"""The runner of the documentation's samples ends as ``python -c`` ends: each case here runs
both ways and must give the same exit status and output."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sample_runner import SampleRunner


@pytest.fixture(scope="module")
def runner() -> Iterator[SampleRunner]:
    runner = SampleRunner(dict(os.environ))
    yield runner
    runner.close()


CASES = {
    "passes": "import torch\nprint(torch.ones(2).sum().item())",
    "forgets an import": "print(torch.ones(2))",
    "raises": "raise ValueError('no such key')",
    "exits with a code": "import sys\nsys.exit(3)",
    "exits with a message": "raise SystemExit('stopped')",
    "runs atexit handlers": "import atexit\natexit.register(print, 'at exit')",
    "joins its threads": (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()"
    ),
    "writes in its directory": "open('here.txt', 'w').write('x')\nimport os\nprint(os.listdir())",
    "reads stdin": "import sys\nprint(repr(sys.stdin.read()))",
    "is __main__": (
        "import sys\nprint(__name__, sys.argv, sorted(k for k in dir() if k[0] != '_'))"
    ),
    "pickles its functions": (
        "import pickle\ndef f(): return 1\nprint(pickle.loads(pickle.dumps(f))())"
    ),
    "spawns a child": (
        "import multiprocessing as mp\n"
        "with mp.get_context('spawn').Pool(1) as pool: print(pool.map(abs, [-1, -2]))"
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_sample_ends_as_python_c_ends(runner: SampleRunner, tmp_path: Path, case: str) -> None:
    code = CASES[case]
    (tmp_path / "forked").mkdir()
    (tmp_path / "fresh").mkdir()
    fresh = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path / "fresh",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    forked = runner.run(code, cwd=tmp_path / "forked", timeout=120)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    # The last line of a traceback (or the message of SystemExit) is the same; the frames
    # above it name the runner's lines.
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]


def test_a_sample_that_outruns_its_timeout_is_killed(runner: SampleRunner, tmp_path: Path) -> None:
    result = runner.run("import time\ntime.sleep(600)", cwd=tmp_path, timeout=1)
    assert result.returncode is None
    # The runner goes on with the next sample.
    assert runner.run("print('next')", cwd=tmp_path, timeout=60).stdout == "next\n"
