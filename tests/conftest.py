"""Shared fixtures and helpers for the zarr_rb test suite."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import uuid

import pytest
import torch
from s3_server import S3Server, WeedNotFoundError, start_server, stop_server
from tensordict import TensorDict, is_tensor_collection

from zarr_rb import LazyColumn
from zarr_rb.util.io import observe_io

# The suite runs on small machines: keep torch from spawning a thread per core per test.
torch.set_num_threads(1)
os.environ.setdefault("TENSORSTORE_VERBOSE_LOGGING", "")


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
    yield server
    gc.collect()  # storages a failed test left open close while the server still answers
    stop_server(server)


@pytest.fixture
def s3_url(s3_server: S3Server, request) -> str:
    """A fresh ``s3://zarr-rb-test/<test-name>-<uuid8>.zarr`` URL, unique per test."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")
    return s3_server.url(f"{name}-{uuid.uuid4().hex[:8]}.zarr")


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, str]:
    return s3_server.storage_options()


class PongRun:
    """A buffer of real ALE Pong transitions that wrapped its ring, and every transition
    written into it, in order (the reference for what the store must show)."""

    CAPACITY = 500
    STEPS = 700  # the ring wraps: the oldest 200 rows were overwritten
    EPISODE_STEPS = 90  # episodes truncated at 90 steps, so that several fit

    def __init__(self, path) -> None:
        import gymnasium
        from torchrl.data import TensorDictReplayBuffer

        from zarr_rb import ZarrStorage
        from zarr_rb.demo import collect, make_env

        self.path = path
        rb = TensorDictReplayBuffer(storage=ZarrStorage(self.CAPACITY, path))
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


@pytest.fixture(params=["local", "s3"])
def where(request, store_path):
    """A store's URL and storage options: a directory, or an S3 prefix."""
    if request.param == "local":
        return str(store_path), None
    return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_options")


class Crash(BaseException):
    """The writer dies here (nothing on the way catches a BaseException)."""


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
