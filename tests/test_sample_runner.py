"""The runner of the documentation's samples ends as ``python -c`` ends: each case here runs
both ways and must give the same exit status and output."""

from __future__ import annotations

import os
import signal
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


def test_a_sample_gets_its_arguments_as_python_c_gives_them(
    runner: SampleRunner, tmp_path: Path
) -> None:
    result = runner.run("import sys\nprint(sys.argv)", cwd=tmp_path, timeout=60, argv=["a", "b c"])
    assert result.stdout == "['-c', 'a', 'b c']\n"  # as `python -c code a "b c"` has them


def test_a_call_interrupted_while_it_waits_leaves_the_next_its_own_answer(
    runner: SampleRunner, tmp_path: Path
) -> None:
    """A test's timeout (a signal) interrupts a caller waiting for its sample: the next call
    must get its own sample's answer, not the interrupted one's (found by a review)."""
    go = tmp_path / "go"
    waits = (
        f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nprint('late')"
    )

    def interrupt(*_: object) -> None:
        raise TimeoutError("interrupted")

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(TimeoutError):
            runner.run(waits, cwd=tmp_path, timeout=120)  # waits for `go`: still running
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    go.touch()
    result = runner.run("import sys\nsys.exit(3)", cwd=tmp_path, timeout=120)
    assert (result.returncode, result.stdout) == (3, "")
