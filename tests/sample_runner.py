"""Runs Python samples as ``python -c`` would, without paying for the imports each time.

A sample run with ``python -c`` spends most of its time importing torch and TorchRL (about
4 s here, for samples that run in under a second). ``SampleRunner`` starts one interpreter
that imports those libraries and nothing else, then forks it once per sample. The child is
the fresh interpreter the sample would have had, with the libraries already in
``sys.modules``:

- the sample runs as a fresh ``__main__`` module whose namespace holds nothing the runner
  imported (a sample that forgets an import still fails), with ``sys.argv == ["-c", *argv]``;
- in its own working directory and process group, stdin from ``/dev/null``, stdout and
  stderr captured;
- it ends as an interpreter ends (threads that are not daemons are waited for, then
  ``atexit`` handlers run), with the exit status ``python -c`` would give: 0, 1 after an
  uncaught exception with its traceback on stderr, or the code of ``SystemExit``. The
  modules are not torn down (that takes over a second with torch imported), so an object
  that needs its ``__del__`` at exit to finish its work fails here, as it may for a user.

The runner itself never runs a torch operation, so no thread pool of torch's exists when it
forks.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

# The libraries the samples import. Importing them before the fork is the whole point; a
# sample importing anything else imports it itself, as it would in a fresh interpreter.
PRELOAD = [
    "numpy",
    "torch",
    "tensordict",
    "torchrl.data",
    "zarr_rb",
    "zarr_rb.storage",
]

_SERVER = r"""
import atexit, importlib, json, os, signal, sys, tempfile, threading, time, traceback, types

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
requests, answers = sys.stdin, sys.stdout
answers.write("ready\n")
answers.flush()


def run(code, cwd, argv):
    # In the forked child: become what `python -c code *argv` run in cwd would be.
    os.setpgid(0, 0)
    os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdin = open(0, closefd=False)
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["-c", *argv]
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
        status = 0
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    # The end of an interpreter, in CPython's order: wait for the threads that are not
    # daemons, run the atexit handlers, flush. Tearing down the modules (over a second with
    # torch imported) is left out: it has nothing to say about the sample.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


for line in requests:
    request = json.loads(line)
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    child = os.fork()
    if child == 0:
        run(request["code"], request["cwd"], request["argv"])
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(child, signal.SIGKILL)
            os.waitpid(child, 0)
            returncode = None
            break
        time.sleep(0.01)
    # Whatever the sample left running in its group goes with it, as a test's would.
    try:
        os.killpg(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out.seek(0)
    err.seek(0)
    answers.write(json.dumps({
        "returncode": returncode,
        "stdout": out.read().decode(errors="replace"),
        "stderr": err.read().decode(errors="replace"),
    }) + "\n")
    answers.flush()
"""


@dataclasses.dataclass(frozen=True)
class Result:
    """What a sample did: its exit status (``None`` when it outran its timeout), its
    output."""

    returncode: int | None
    stdout: str
    stderr: str


class SampleRunner:
    """One interpreter with the libraries imported, forked for each sample (``run``);
    ``close`` ends it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        """One sample at a time: answers come back in the order of the requests."""
        self._unanswered = 0
        """Requests sent whose answer was not read: their caller was interrupted (a
        test's timeout, an exception while it waited). Their answers are read first."""
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(PRELOAD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._answer()
        if ready != "ready\n":
            raise RuntimeError(f"the sample runner did not start: {ready!r}")

    def _answer(self) -> str:
        assert self._process.stdout is not None
        return self._process.stdout.readline()

    def run(self, code: str, cwd: Path, timeout: float, argv: Sequence[str] = ()) -> Result:
        """Runs ``code`` as ``python -c code *argv`` would in ``cwd``; waits for it to end."""
        assert self._process.stdin is not None
        request = {"code": code, "cwd": str(cwd), "timeout": timeout, "argv": list(argv)}
        with self._lock:
            while self._unanswered:  # (an interrupted call's answer: not this one's)
                if not self._answer():
                    break
                self._unanswered -= 1
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            self._unanswered += 1
            answer = self._answer()
            if not answer:
                raise RuntimeError("the sample runner ended while it ran a sample")
            self._unanswered -= 1
        return Result(**json.loads(answer))

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait()


_RUNNER: SampleRunner | None = None
_STARTING = threading.Lock()
_ENVIRONMENT = dict(os.environ)
"""The environment of :func:`python_c`'s runner: this process's as the tests were collected
(not as a test that changed it left it, whichever test starts the runner)."""


def python_c(code: str, *argv: str, cwd: Path | str, timeout: float = 120) -> Result:
    """``python -c code *argv`` in ``cwd``, run to its end by this process's runner (started
    on first use): another process, which shares nothing with this one but the files it
    names, in a fraction of a fresh interpreter's time."""
    global _RUNNER
    with _STARTING:
        if _RUNNER is None:
            _RUNNER = SampleRunner(_ENVIRONMENT)
            atexit.register(_RUNNER.close)
    return _RUNNER.run(code, Path(cwd), timeout, argv)
