"""Shared fixtures and helpers for the zarr_rb test suite."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_proxy import S3Proxy
from s3_server import S3Server, WeedNotFoundError, start_server, stop_server
from tensordict import TensorDict, is_tensor_collection

from zarr_rb import LazyColumn
from zarr_rb.util.io import observe_io

# The suite runs on small machines: keep torch from spawning a thread per core per test.
torch.set_num_threads(1)
os.environ.setdefault("TENSORSTORE_VERBOSE_LOGGING", "")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """One torch thread in every test, not only until the first collector: TorchRL's
    ParallelEnv and multi-process collectors set the process's count back to the number of
    cores when they close. With more than one, the LazyTensorStorage twins are not a model:
    an extend that writes a row twice (more rows than the capacity) leaves which value it
    keeps to torch's threads (``index_put_``), where ZarrStorage keeps the last."""
    torch.set_num_threads(1)


def chunk_file(store: Path, array: str, *indices: int) -> Path:
    """The file of an array's chunk (shard) at grid position ``indices``, as the arrays a
    store creates name them (``c.3.0.0``)."""
    return store / array / ".".join(["c", *(str(i) for i in indices)])


def name_chunks_with(monkeypatch: pytest.MonkeyPatch, separator: str) -> None:
    """The arrays created from now on (in this test) name their chunks with ``separator``:
    ``"/"`` as stores made before ``c.3.0.0`` did (``c/3/0/0``)."""
    from zarr_rb.engine import tensorstore

    encoding = {"name": "default", "separator": separator}
    monkeypatch.setattr(tensorstore, "CHUNK_KEY_ENCODING", encoding)


def chunk_files(store: Path, array: str) -> list[Path]:
    """Every chunk (shard) file of an array, sorted."""
    return sorted(
        p for p in (store / array).iterdir() if p.name.startswith("c.") and p.name[-1].isdigit()
    )


def assert_identical(actual, expected) -> None:
    """Bit-exact equality of tensors or tensor collections (NaNs included)."""
    if is_tensor_collection(expected):
        assert is_tensor_collection(actual), type(actual)
        expected_td = expected if isinstance(expected, TensorDict) else expected.to_tensordict()
        actual_td = actual if isinstance(actual, TensorDict) else actual.to_tensordict()
        assert actual_td.batch_size == expected_td.batch_size
        e_keys = set(expected_td.keys(include_nested=True, leaves_only=True))
        a_keys = set(actual_td.keys(include_nested=True, leaves_only=True))
        assert a_keys == e_keys
        for key in e_keys:
            assert_identical(actual_td.get(key), expected_td.get(key))
        return
    assert isinstance(actual, torch.Tensor)
    if isinstance(actual, LazyColumn):
        actual = actual.materialize()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
        assert torch.equal(actual.contiguous().view(bits), expected.contiguous().view(bits))
    else:
        assert torch.equal(actual, expected)


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "buffer.zarr"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) for the whole session, with bucket ``zarr-rb-test``.

    ``ZARR_RB_TEST_S3=<endpoint>,<key>,<secret>`` uses a running server instead.
    """
    try:
        server = start_server(tmp_path_factory.mktemp("s3-server"))
    except WeedNotFoundError as err:
        # Fail, not skip: a missing binary would otherwise hide every S3 test.
        pytest.fail(str(err), pytrace=False)
    _servers.append(server)
    yield server
    _servers.remove(server)
    gc.collect()  # storages a failed test left open close while the server still answers
    stop_server(server)


_servers: list[S3Server] = []
"""The S3 server this process started (:func:`s3_server`), for the failure reports."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test that used the S3 server (as a fixture, or one whose failure names it)
    reports the server's state with its failure: a server that refuses writes (a full disk,
    say) answers only "internal error"."""
    report = yield
    if report.failed and _servers:
        server = _servers[0]
        if "s3_server" in getattr(item, "funcargs", {}) or server.endpoint in report.longreprtext:
            report.sections.append(("S3 server", server.diagnosis()))
    return report


@pytest.fixture
def s3_url(s3_server: S3Server, request) -> str:
    """A fresh ``s3://zarr-rb-test/<test-name>-<uuid8>.zarr`` URL, unique per test."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")
    return s3_server.url(f"{name}-{uuid.uuid4().hex[:8]}.zarr")


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, str]:
    return s3_server.storage_options()


@pytest.fixture
def proxy(s3_server: S3Server):
    """A proxy in front of the S3 server that logs every request (:class:`S3Proxy`)."""
    proxy = S3Proxy(s3_server.endpoint, s3_server.bucket)
    yield proxy
    proxy.close()


@pytest.fixture
def options(s3_options: dict[str, str], proxy: S3Proxy) -> dict[str, str]:
    """Storage options that reach the S3 server through :func:`proxy`."""
    return {**s3_options, "endpoint_url": proxy.endpoint}


class PongRun:
    """A buffer of real ALE Pong transitions that wrapped its ring, and every transition
    written into it, in order (the reference for what the store must show)."""

    CAPACITY = 500
    STEPS = 700  # the ring wraps: the oldest 200 rows were overwritten
    EPISODE_STEPS = 90  # episodes truncated at 90 steps, so that several fit

    def __init__(self, path, compression: Any = None) -> None:
        import gymnasium
        from torchrl.data import TensorDictReplayBuffer

        from zarr_rb import ZarrStorage
        from zarr_rb.demo import collect, make_env

        self.path = path
        rb = TensorDictReplayBuffer(
            storage=ZarrStorage(self.CAPACITY, path, compression=compression)
        )
        written = []

        class Both:
            def extend(self, td):
                written.append(td.clone())
                rb.extend(td)

        env = gymnasium.wrappers.TimeLimit(make_env("pong"), max_episode_steps=self.EPISODE_STEPS)
        collect(Both(), env, self.STEPS, batch_size=64, seed=3, progress=False)
        env.close()
        rb.storage.close()
        self.written = torch.cat(written)

    @property
    def kept(self) -> TensorDict:
        """The transitions the ring holds, oldest first."""
        return self.written[-self.CAPACITY :]

    def row_of(self, position: int) -> int:
        """Storage row of the ``position``-th kept transition."""
        return (self.STEPS - self.CAPACITY + position) % self.CAPACITY


@pytest.fixture(scope="session")
def pong(tmp_path_factory) -> PongRun:
    return PongRun(tmp_path_factory.mktemp("pong") / "pong.zarr")


@pytest.fixture(scope="session")
def pong_stacks(tmp_path_factory) -> PongRun:
    """:func:`pong` with every leaf stored as stacks (``frames=False``), as other programs
    read plain arrays."""
    from zarr_rb import Compression

    return PongRun(tmp_path_factory.mktemp("pong") / "pong.zarr", Compression(frames=False))


@pytest.fixture(params=["local", "s3"])
def where(request, store_path):
    """A store's URL and storage options: a directory, or an S3 prefix."""
    if request.param == "local":
        return str(store_path), None
    return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_options")


class Crash(BaseException):
    """The writer dies here (nothing on the way catches a BaseException)."""


def crash_and_read(rb: Any, path: Any) -> tuple[list[int], int]:
    """``rb``'s writer crashes; its store is opened again: the ``step`` of each of its rows
    and its writer's cursor (every row of ``[0, len)`` must be readable)."""
    from torchrl.data import TensorDictReplayBuffer

    from zarr_rb import ZarrStorage
    from zarr_rb.testing import simulate_crash

    simulate_crash(rb.storage)
    with ZarrStorage(path=path) as reopened:
        assert reopened._store.unreadable_rows().size == 0
        steps = reopened.get(torch.arange(len(reopened)))["step"].tolist()
        return steps, int(TensorDictReplayBuffer(storage=reopened)._writer._cursor)


@contextlib.contextmanager
def crash_at_row_write(at: int):
    """Raise :class:`Crash` at the ``at``-th write of row data inside the block."""
    writes = 0

    def observe(kind: str, where: object) -> None:
        nonlocal writes
        if kind == "write" and "data" in str(where):
            writes += 1
            if writes == at:
                raise Crash

    with observe_io(observe):
        yield


@contextlib.contextmanager
def fail_at_row_write(at: int, count: int = 1):
    """Fail ``count`` writes of row data from the ``at``-th inside the block, as a full
    disk does (``OSError`` ENOSPC)."""
    writes = 0

    def observe(kind: str, where: object) -> None:
        nonlocal writes
        if kind == "write" and "data" in str(where):
            writes += 1
            if at <= writes < at + count:
                raise OSError(errno.ENOSPC, "No space left on device", str(where))

    with observe_io(observe):
        yield


class HeldBackWrites:
    """Writes of rows that land only when waited for (a slow disk, as seen by a block
    written while the next rows come), or never, if the writer dies first (:meth:`drop`).
    Blocks written behind that :attr:`lands_now` picks land as they are started instead
    (the disk took them at once): the write starts on the writer's thread, in its call,
    and lands on its own."""

    def __init__(self, lands_now: Callable[[int], bool] | None = None) -> None:
        self.pending: list[Any] = []
        self.gates: weakref.WeakKeyDictionary[Any, threading.Event] = weakref.WeakKeyDictionary()
        """The gate of each write started (by the object that waits for it: never by its
        ``id``, which a later write may take once it is gone, and with it an open gate)."""
        self.open = False  # every write lands as it is started
        self.lands_now = lands_now or (lambda n: False)
        """Whether the ``n``-th block written behind (from 1) lands as it is started."""
        self.behind = 0  # blocks written behind so far
        self.starting_now = False  # the block being started lands as it is started
        self.landing: list[Any] = []
        """The landing of each block that lands as it is started (``PendingWrite.landed``)."""

    def drop(self) -> None:
        """The process dies: the writes not waited for never land; those that land as they
        are started have landed (so that none lands after the store is opened again)."""
        for future in self.pending:
            future.dropped = True
        self.pending.clear()
        landing, self.landing = self.landing, []
        for landed in landing:
            landed.result()


class _HeldBackFuture:
    def __init__(self, start: Any, held: HeldBackWrites) -> None:
        self._start = start
        self._held = held
        self.dropped = False
        self._done = False

    def result(self) -> None:
        if self.dropped:
            raise ValueError("the writer died before this write landed")
        if not self._done:
            self._done = True
            with contextlib.suppress(ValueError):
                self._held.pending.remove(self)
            self._start().result()


@contextlib.contextmanager
def writes_held_back(lands_now: Callable[[int], bool] | None = None):
    """Inside, every write of row data started by the arrays lands when it is waited for
    (see :class:`HeldBackWrites`); a write started to land on its own thread (a block
    written while the next rows come) waits there until the writer waits for it, but the
    blocks ``lands_now`` picks (by their number, from 1), which land as they are started."""
    from zarr_rb.core.array_writes import ArrayWrites
    from zarr_rb.engine import rows as engine_rows

    held = HeldBackWrites(lands_now)
    original = engine_rows.RowArray.start_write_rows
    land_method = ArrayWrites.__dict__["_land"]
    land, finish = ArrayWrites._land, ArrayWrites.finish
    start_rows = ArrayWrites.start_rows

    def start(self: Any, rows: Any, values: Any, *, behind: bool = False) -> Any:
        if held.starting_now:
            return original(self, rows, values, behind=behind)
        # The real write (its announcement included: a fault or a crash injected at it
        # happens then) starts when the write is waited for, from a copy of the values.
        copy = values.copy()
        width = int(values.shape[1]) if self.ragged else None
        keys = self.chunk_keys(rows, width, run=engine_rows.is_run(rows))
        future = _HeldBackFuture(lambda: original(self, rows, copy, behind=behind)[0], held)
        held.pending.append(future)
        return future, keys

    def counted_start_rows(self: Any, writes: Any, **kwargs: Any) -> Any:
        # (On the writer's thread: which block lands at once follows the order of calls.)
        if kwargs.get("behind"):
            held.behind += 1
            held.starting_now = held.lands_now(held.behind)
        try:
            pending = start_rows(self, writes, **kwargs)
        finally:
            now, held.starting_now = held.starting_now, False
        if now:
            held.gates.setdefault(pending, threading.Event()).set()
            held.landing.append(pending.landed)
        return pending

    def gated_land(pending: Any) -> Any:
        # Until the writer waits for it, or dies (its writes are dropped: they fail here).
        gate = held.gates.setdefault(pending, threading.Event())
        while not gate.wait(0.01):
            if held.open or all(getattr(f, "dropped", False) for f in pending.futures):
                break
        return land(pending)

    def opening_finish(self: Any, pending: Any, **kwargs: Any) -> Any:
        held.gates.setdefault(pending, threading.Event()).set()
        return finish(self, pending, **kwargs)

    engine_rows.RowArray.start_write_rows = start  # type: ignore[method-assign]
    ArrayWrites.start_rows = counted_start_rows  # type: ignore[method-assign]
    ArrayWrites._land = staticmethod(gated_land)  # type: ignore[method-assign,assignment]
    ArrayWrites.finish = opening_finish  # type: ignore[method-assign]
    try:
        yield held
    finally:
        held.open = True  # (no thread is left waiting)
        engine_rows.RowArray.start_write_rows = original  # type: ignore[method-assign]
        ArrayWrites.start_rows = start_rows  # type: ignore[method-assign]
        ArrayWrites._land = land_method  # type: ignore[method-assign]
        ArrayWrites.finish = finish  # type: ignore[method-assign]
