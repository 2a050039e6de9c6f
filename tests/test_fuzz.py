"""Hostile metadata: a hypothesis fuzzer mutates the root attributes and zarr.json files.

Whatever it writes, opening, reading, loading and verifying the store ends in a typed
zarr_rb error raised by zarr_rb itself (or works), in bounded time and memory, and
nothing is written outside the store.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import zarr_rb
from zarr_rb import StoreCorruptedError, ZarrRBError, ZarrStorage
from zarr_rb.testing import CrashWorkload

WORKLOAD = CrashWorkload(capacity=48, block_rows=8)
FILES = [
    "zarr.json",
    "data/zarr.json",
    "data/obs/zarr.json",
    "data/reward/zarr.json",
    "state/0/zarr.json",
    "state/0/sampler/sum_tree/zarr.json",
]
PACKAGE = Path(zarr_rb.__file__).parent

HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 2**31, 2**40, 2**53 + 1, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["..", "/", "../../escape", "a/../../b", "", "__x", "\x00", "state/../.."]),
    st.lists(st.integers(min_value=-5, max_value=2**42), max_size=6),
    st.lists(st.sampled_from(["..", "obs", "/", "next"]), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths.extend(json_paths(child, (*prefix, key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths.extend(json_paths(child, (*prefix, index)))
    return paths


def set_path(document: Any, path: tuple[Any, ...], value: Any, *, delete: bool) -> Any:
    if not path:
        return value
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return document


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, str, Any]:
    """``(file, operation, argument)``; the file's new bytes are made by :func:`mutate`."""
    name = draw(st.sampled_from(FILES))
    operation = draw(st.sampled_from(["replace", "replace", "replace", "delete", "bytes", "deep"]))
    if operation in ("replace", "delete"):
        return name, operation, (draw(st.integers(min_value=0)), draw(HOSTILE_VALUES))
    if operation == "deep":
        return name, operation, draw(st.integers(min_value=1, max_value=200_000))
    return name, operation, (draw(st.integers(min_value=0)), draw(st.binary(max_size=8)))


def mutate(store: Path, mutation: tuple[str, str, Any]) -> None:
    name, operation, argument = mutation
    path = store / name
    raw = path.read_bytes()
    if operation == "deep":  # nesting far beyond any parser's recursion limit
        depth = argument
        path.write_bytes(
            b'{"zarr_format": 3, "node_type": "group", "attributes": {"zarr_rb": '
            + b"[" * depth
            + b"]" * depth
            + b"}}"
        )
        return
    if operation == "bytes":  # truncated, invalid UTF-8, garbage spliced in
        cut, junk = argument
        cut %= len(raw) + 1
        path.write_bytes(raw[:cut] + junk + b"\xff\xfe\xc3(" * (cut % 2))
        return
    document = json.loads(raw)
    index, value = argument
    paths = json_paths(document)
    target = paths[index % len(paths)]
    document = set_path(document, target, value, delete=operation == "delete")
    path.write_text(json.dumps(document))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "rb.zarr"
    rb = WORKLOAD.buffer(path)
    steps = torch.arange(40)
    index = rb.extend(WORKLOAD.rows(steps, WORKLOAD.capacity))
    rb.update_priority(index, WORKLOAD.priority(steps))
    zarr_rb.save(rb, progress=False)
    rb.storage.close()
    assert (
        json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]["saved"]["slot"] == 0
    )
    return path


def _sample(rb: Any) -> None:
    """A batch, from a buffer that holds rows: TorchRL refuses to sample an empty one (a
    record whose length was set to 0 loads as one, its state over no rows), and asks for a
    batch size when the buffer has none (a state whose batch size was set to null)."""
    if len(rb):
        rb.sample(8 if rb.batch_size is None else None)


def use_the_store(path: Path) -> None:
    """What users do with a store: every step may raise a zarr_rb error, nothing else."""
    steps = [
        lambda: ZarrStorage(path=path, read_only=True).get(torch.arange(8)),
        lambda: ZarrStorage(path=path, read_only=True)[:]["obs"][2:5].clone(),
        lambda: _sample(zarr_rb.load(path, read_only=True)),
        lambda: zarr_rb.verify(path),
        lambda: ZarrStorage(path=path).close(),
        lambda: zarr_rb.load(path).storage.close(),
    ]
    for step in steps:
        try:
            step()
        except ZarrRBError as err:
            frame = traceback.extract_tb(err.__traceback__)[-1]
            raised_by_us = Path(frame.filename).is_relative_to(PACKAGE)
            assert raised_by_us, f"{type(err).__name__} raised from {frame.filename}"  # noqa: PT017


def files_outside(sandbox: Path, store: Path) -> dict[str, int]:
    return {
        str(p): p.stat().st_mtime_ns
        for p in sandbox.rglob("*")
        if p != store and store not in p.parents
    }


def run_fuzz(template: Path, mutation: tuple[str, str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sandbox = Path(tmp)
        store = sandbox / "inner" / "rb.zarr"
        shutil.copytree(template, store)
        (sandbox / "escape").mkdir()
        before = files_outside(sandbox, store)
        mutate(store, mutation)
        start = time.monotonic()
        use_the_store(store)
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"{mutation}: took {elapsed:.1f} s"
        assert files_outside(sandbox, store) == before, f"{mutation}: wrote outside the store"


FUZZ_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "derandomize": True,
}


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(mutation=mutations())
@example(mutation=("zarr.json", "replace", (245309, [])))  # an unhashable leaf dtype
@example(mutation=("state/0/zarr.json", "replace", (0, None)))  # a save's state group, null
@example(mutation=("zarr.json", "replace", (258_085_696_937_218, 0)))  # the save's length: 0
def test_hostile_metadata_gets_typed_errors(template, mutation):
    run_fuzz(template, mutation)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("ZARR_RB_FUZZ_EXAMPLES", "600")), **FUZZ_SETTINGS)
@given(mutation=mutations())
def test_hostile_metadata_long_run(template, mutation):
    run_fuzz(template, mutation)


def huge_values(
    template: Path, files: list[str], values: tuple[int, ...], *, stride: int = 1
) -> int:
    """Set every ``stride``-th value of ``files`` to each huge number in turn; returns the
    cases run."""
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cases = 0
    for name in files:
        document = json.loads((template / name).read_text())
        for index in range(0, len(json_paths(document)), stride):
            for value in values:
                run_fuzz(template, (name, "replace", (index, value)))
                cases += 1
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    assert grown_mib < 1024, f"peak memory grew by {grown_mib:.0f} MiB"
    return cases


def test_huge_numbers_are_refused_before_anything_is_sized_from_them(template):
    """Huge shapes, lengths, chunk shapes and settings: bounded time and memory."""
    huge_values(template, ["zarr.json", "data/obs/zarr.json"], (2**62,), stride=3)


@pytest.mark.slow
def test_huge_numbers_everywhere(template):
    huge_values(template, FILES, (2**40, 2**62, 10**30, -1))


@pytest.mark.parametrize(("name", "value"), [("batch_size", -1), ("pin_memory", -1)])
def test_damaged_buffer_settings_are_typed_errors_at_load(template, tmp_path, name, value):
    """Settings no buffer was built with are refused at the load, naming them (TorchRL
    would fail at the first sample, or try to pin memory on a GPU)."""
    store = tmp_path / "rb.zarr"
    shutil.copytree(template, store)
    state = store / "state" / "0" / "zarr.json"
    document = json.loads(state.read_text())
    document["attributes"]["zarr_rb_state"]["buffer"]["arguments"][name] = value
    state.write_text(json.dumps(document))
    with pytest.raises(StoreCorruptedError, match=name):
        zarr_rb.load(store, read_only=True)
