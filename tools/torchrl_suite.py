"""Run TorchRL's own replay-buffer tests with ``ZarrStorage`` in place of its storages.

TorchRL's tests (``test/rb/`` of a pytorch/rl checkout of the installed release line) build
``LazyMemmapStorage`` and ``LazyTensorStorage``; this script makes both names stand for
:class:`zarr_rb.ZarrStorage` (thin subclasses that only count themselves) before any test
module imports them, runs the tests, and reports how many of the tests that built a
substitute passed.

Usage::

    git clone --depth 1 --branch v0.14.1 https://github.com/pytorch/rl /tmp/rl
    python tools/torchrl_suite.py /tmp/rl/test/rb --json torchrl_suite.json [PYTEST ARGS]

TorchRL internals keep their own classes: only the public re-exports
(``torchrl.data.LazyMemmapStorage``, ``torchrl.data.replay_buffers.LazyMemmapStorage``, ...)
are replaced, which is what user code and the tests import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

_BUILT: set[str] = set()
"""Node ids of the tests that built a substitute storage."""
_CURRENT: list[str] = []


def _substitutes() -> dict[str, type]:
    from zarr_rb import ZarrStorage

    def counted(name: str) -> type:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            if _CURRENT:
                _BUILT.add(_CURRENT[-1])
            ZarrStorage.__init__(self, *args, **kwargs)

        def reduce(self: Any, protocol: Any) -> Any:
            # Processes that did not load this plugin (spawned children, Ray's workers) get
            # the ZarrStorage it stands for.
            return (_plain_storage, (self.__getstate__(),))

        attributes = {"__init__": init, "__module__": __name__, "__reduce_ex__": reduce}
        cls = type(name, (ZarrStorage,), attributes)
        globals()[name] = cls  # picklable by name
        return cls

    return {name: counted(name) for name in ("LazyMemmapStorage", "LazyTensorStorage")}


def __getattr__(name: str) -> type:
    """The substitutes in a process that imports this module without loading it as a
    plugin (a Ray worker unpickling ``partial(LazyTensorStorage, ...)``)."""
    if name in ("LazyMemmapStorage", "LazyTensorStorage"):
        return _substitutes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plain_storage(state: dict[str, Any]) -> Any:
    from zarr_rb import ZarrStorage

    storage = ZarrStorage.__new__(ZarrStorage)
    storage.__setstate__(state)
    return storage


def _gym_from_gymnasium() -> None:
    """Make ``import gym`` give gymnasium (TorchRL's tests look for ``gym`` to run their
    collector cases; its last release does not run on NumPy 2)."""
    import gymnasium

    sys.modules.setdefault("gym", gymnasium)
    for name, module in list(sys.modules.items()):
        if name.startswith("gymnasium."):
            sys.modules.setdefault("gym" + name[len("gymnasium") :], module)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ZARR_RB_SUITE_GYM") == "gymnasium":
        _gym_from_gymnasium()
    import torchrl.data
    import torchrl.data.replay_buffers
    import torchrl.data.replay_buffers.storages

    for name, cls in _substitutes().items():
        for module in (
            torchrl.data,
            torchrl.data.replay_buffers,
            torchrl.data.replay_buffers.storages,
        ):
            setattr(module, name, cls)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    substitutes = tuple(_substitutes_in_globals())
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(_mentions(value, substitutes) for value in params.values()):
            _BUILT.add(item.nodeid)


def _substitutes_in_globals() -> list[type]:
    return [globals()[name] for name in ("LazyMemmapStorage", "LazyTensorStorage")]


def _mentions(value: Any, classes: tuple[type, ...]) -> bool:
    import functools

    if isinstance(value, type):
        return issubclass(value, classes)
    if isinstance(value, classes):
        return True
    if isinstance(value, functools.partial):
        return _mentions(value.func, classes) or any(
            _mentions(v, classes) for v in (*value.args, *value.keywords.values())
        )
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, classes) for v in value)
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _CURRENT.append(item.nodeid)
    try:
        yield
    finally:
        _CURRENT.pop()


_OUTCOMES: dict[str, str] = {}
_REASONS: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        previous = _OUTCOMES.get(report.nodeid)
        if previous in (None, "passed"):
            _OUTCOMES[report.nodeid] = report.outcome
            if report.outcome == "failed":
                crash = getattr(report.longrepr, "reprcrash", None)
                _REASONS[report.nodeid] = str(getattr(crash, "message", report.longrepr))[:300]
            elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                _REASONS[report.nodeid] = str(report.longrepr[2])[:300]


def summary() -> dict[str, Any]:
    built = {nodeid: _OUTCOMES.get(nodeid, "not run") for nodeid in sorted(_BUILT)}
    counts: dict[str, int] = {}
    for outcome in built.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "tests_run": len(_OUTCOMES),
        "tests_using_substitute": len(built),
        "outcomes_using_substitute": counts,
        "not_passed": {
            nodeid: {"outcome": outcome, "reason": _REASONS.get(nodeid, "")}
            for nodeid, outcome in built.items()
            if outcome != "passed"
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="TorchRL's test/rb directory (or one file)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument(
        "--gym-from-gymnasium",
        action="store_true",
        help="run the tests that need gym with gymnasium standing in for it",
    )
    args, pytest_args = parser.parse_known_args()
    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    # Processes that do not inherit sys.path (Ray's workers) import the substitutes by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if args.gym_from_gymnasium:
        os.environ["ZARR_RB_SUITE_GYM"] = "gymnasium"
    os.environ.setdefault("TORCHRL_TEST_STORAGE", "zarr_rb")
    started = time.monotonic()
    code = pytest.main(
        [
            str(args.tests),
            "-p",
            "torchrl_suite",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(args.tests if args.tests.is_dir() else args.tests.parent),
            *pytest_args,
        ],
    )
    import torchrl_suite as plugin  # the instance pytest loaded

    result = plugin.summary()
    result["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    counts = result["outcomes_using_substitute"]
    print(
        f"\n{result['tests_using_substitute']} tests built a ZarrStorage substitute: "
        + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    )
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
