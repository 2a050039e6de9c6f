"""Stores on S3: a real SeaweedFS server on loopback (see ``s3_server.py``), no mocks.

Everything a local store does, on an ``s3://`` URL: create, extend with wrap-around,
sample, flush, reopen, readers in other processes, save/load, snapshots, verify,
TorchRL dump conversion, the CLI; one writer by lease, with fencing; typed errors in
bounded time for a missing bucket, refused credentials and an unreachable endpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_identical
from sample_runner import python_c
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.errors import (
    BucketNotFoundError,
    ChunkCorruptedError,
    CredentialsError,
    EndpointUnreachableError,
    FencedError,
    InvalidLocationError,
    LockedError,
    NotAStoreError,
    NotSupportedError,
    StoreNotFoundError,
)
from zarr_rb.interop import export_torchrl, import_torchrl
from zarr_rb.locations import open_location

CAPACITY = 100


def batch(start: int, n: int) -> TensorDict:
    """Rows whose every key is a function of their step number."""
    t = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": ((t[:, None] * 7 + torch.arange(64)) % 251).to(torch.uint8).view(n, 4, 4, 4),
            "action": t % 5,
            "next": {"reward": t.to(torch.float32)[:, None] / 3},
        },
        batch_size=[n],
    )


def twin_buffers(url, options):
    """The same prioritized buffer on S3 and on TorchRL's LazyTensorStorage."""
    ours = TensorDictPrioritizedReplayBuffer(
        alpha=0.7,
        beta=0.5,
        storage=ZarrStorage(CAPACITY, url, storage_options=options),
        batch_size=16,
    )
    theirs = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=16
    )
    return ours, theirs


def fill(*buffers, total: int = 250, step: int = 30) -> None:
    for start in range(0, total, step):
        rows = batch(start, min(step, total - start))
        for rb in buffers:
            index = rb.extend(rows)
            rb.update_priority(index, 1.0 + (index % 7).float())


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run ``code`` in another process (another "machine": nothing shared but S3): a fork of
    a runner that imported the libraries, or, given variables to set, a fresh interpreter
    (the libraries may read them as they are imported)."""
    if env is None:
        return python_c(textwrap.dedent(code), cwd=os.path.dirname(__file__), timeout=timeout)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(__file__),
    )


def bucket_keys(s3_server) -> set[str]:
    """Every key of the test bucket."""
    from zarr_rb.locations.s3 import S3Location, S3Options

    bucket = S3Location(s3_server.bucket, "", S3Options.parse(s3_server.storage_options()))
    return set(bucket.list())


# --- everything works there -------------------------------------------------------------


def test_extend_sample_flush_reopen_round_trip_every_key(s3_url, s3_options):
    ours, theirs = twin_buffers(s3_url, s3_options)
    fill(ours, theirs)  # 250 rows into 100: the ring wraps twice
    assert len(ours) == len(theirs) == CAPACITY
    assert_identical(ours.storage[:], theirs.storage[:])
    torch.manual_seed(3)
    sample = ours.sample()
    assert sample["obs"].shape == (16, 4, 4, 4)
    ours.storage.close()

    reopened = ZarrStorage(path=s3_url, storage_options=s3_options)
    assert len(reopened) == CAPACITY
    assert reopened.cursor == 250 % CAPACITY
    assert_identical(reopened[:], theirs.storage[:])
    reopened.close()


def test_save_load_in_place_gives_the_same_samples(s3_url, s3_options, tmp_path):
    ours, theirs = twin_buffers(s3_url, s3_options)
    ours.set_rng(torch.Generator().manual_seed(5))
    fill(ours, theirs)
    assert zarr_rb.save(ours) == s3_url
    local = zarr_rb.save(ours, tmp_path / "local.zarr", progress=False)
    expected = [ours.sample(return_info=True) for _ in range(3)]
    ours.storage.close()

    from_s3 = zarr_rb.load(s3_url, storage_options=s3_options)
    from_disk = zarr_rb.load(local)
    assert isinstance(from_s3, TensorDictPrioritizedReplayBuffer)
    for want, want_info in expected:
        for loaded in (from_s3, from_disk):
            got, info = loaded.sample(return_info=True)
            assert torch.equal(info["index"], want_info["index"])
            assert_identical(got.exclude("priority_weight"), want.exclude("priority_weight"))
    from_s3.storage.close()
    from_disk.storage.close()


def test_reader_in_another_process_with_aws_environment(s3_server, s3_url, s3_options):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 40))
    rb.storage.flush()
    env = {**os.environ, **s3_server.env()}
    code = textwrap.dedent(
        f"""
        import time, torch
        from zarr_rb import ZarrStorage
        from test_s3 import batch
        reader = ZarrStorage(path={s3_url!r}, read_only=True)  # credentials from AWS_*
        assert len(reader) == 40, len(reader)
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while len(reader) < 70 and time.monotonic() < deadline:
            time.sleep(0.05)
            reader.refresh()
        expected = batch(0, 70)
        got = reader[:70]
        for key in expected.keys(include_nested=True, leaves_only=True):
            assert torch.equal(got[key], expected[key]), key
        print("ok", len(reader), flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(__file__),
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    rb.extend(batch(40, 30))  # held in RAM: not visible to the reader until flushed
    rb.storage.flush()
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-3000:]
    assert out.strip() == "ok 70"
    rb.storage.close()


def test_snapshots_on_the_server_and_across_locations(s3_server, s3_url, s3_options, tmp_path):
    ours, theirs = twin_buffers(s3_url, s3_options)
    fill(ours, theirs)
    snapshot = s3_url.replace(".zarr", "-snapshot.zarr")
    assert zarr_rb.save(ours, snapshot, progress=False) == snapshot  # options: the buffer's
    local = zarr_rb.save(ours, tmp_path / "from-s3.zarr", progress=False)
    fill(ours, total=30)  # later training does not change the snapshots
    ours.storage.close()
    for where, options in ((snapshot, s3_options), (local, None)):
        rb = zarr_rb.load(where, storage_options=options, read_only=True)
        assert_identical(rb.storage[:], theirs.storage[:])
        rb.storage.close()

    # Local to S3: streamed.
    rb = zarr_rb.load(local)
    up = s3_server.url(f"up-{os.getpid()}-{time.monotonic_ns()}.zarr")
    assert zarr_rb.save(rb, up, storage_options=s3_options, progress=False) == up
    rb.storage.close()
    back = zarr_rb.load(up, storage_options=s3_options, read_only=True)
    assert_identical(back.storage[:], theirs.storage[:])
    back.storage.close()


def test_server_side_copy_moves_no_bytes_through_the_process(s3_url, s3_options):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 60))
    rb.storage.flush()
    engine = rb.storage._store.engine
    target = open_location(s3_url.replace(".zarr", "-copy.zarr"), s3_options)
    assert engine.snapshot_to(target) == 0
    assert set(target.list()) == {
        key for key in engine.location.list() if not key.startswith(".zarr_rb")
    }
    rb.storage.close()


def test_verify_finds_a_damaged_object_and_the_cli_takes_urls(s3_server, s3_url, s3_options):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 64))
    zarr_rb.save(rb)
    rb.storage.close()
    report = zarr_rb.verify(s3_url, storage_options=s3_options)
    assert report.ok
    assert report.rows_checked == 64
    location = open_location(s3_url, s3_options)
    shard = next(key for key in location.list() if key.startswith("data/obs/c."))
    location.write(shard, b"\x00" * 100)
    report = zarr_rb.verify(s3_url, storage_options=s3_options)
    assert not report.ok
    assert report.damaged[0].array == "data/obs"
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
    with pytest.raises(ChunkCorruptedError):
        reader.get(torch.arange(64))
    reader.close()
    cli = subprocess.run(
        [sys.executable, "-m", "zarr_rb", "verify", s3_url],
        env={**os.environ, **s3_server.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 1, cli.stderr
    assert "data/obs" in cli.stdout


def test_torchrl_dumps_convert_to_and_from_s3(s3_url, s3_options, tmp_path):
    old = TensorDictReplayBuffer(storage=LazyMemmapStorage(CAPACITY), batch_size=8)
    old.extend(batch(0, 70))
    old.dumps(tmp_path / "dump")
    new = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    assert import_torchrl(tmp_path / "dump", new, progress=False) == s3_url
    new.storage.close()
    out = export_torchrl(s3_url, tmp_path / "out", storage_options=s3_options, progress=False)
    back = TensorDictReplayBuffer(storage=LazyMemmapStorage(CAPACITY), batch_size=8)
    back.loads(out)
    assert_identical(back.storage[:70], old.storage[:70])


def test_temporary_storage_settings_survive_pickling_to_another_process(s3_url, s3_options):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 30))
    rb.storage.flush()
    import pickle

    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
    blob = pickle.dumps(reader).hex()
    result = run_python(
        f"""
        import pickle, torch
        from test_s3 import batch
        storage = pickle.loads(bytes.fromhex({blob!r}))
        assert torch.equal(storage[:30]["obs"], batch(0, 30)["obs"])
        print(len(storage))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "30"
    rb.storage.close()


# --- one writer: lease and fencing ----------------------------------------------------------

WRITER = """
import sys, time
from zarr_rb import ZarrStorage
from zarr_rb.errors import FencedError
from torchrl.data import TensorDictReplayBuffer
from test_s3 import batch
url, endpoint, key, secret, lease = sys.argv[1:6]
options = dict(endpoint_url=endpoint, key=key, secret=secret, lease_seconds=float(lease))
rb = TensorDictReplayBuffer(storage=ZarrStorage(100, url, storage_options=options))
rb.extend(batch(0, 20))
rb.storage.flush()
print("ready", flush=True)
for line in sys.stdin:
    try:
        rb.extend(batch(1000, 20))
        rb.storage.flush()
        print("flushed", flush=True)
    except FencedError as err:
        print("fenced", err, flush=True)
"""


def start_writer(s3_server, url: str, lease: float) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, s3_server.endpoint, s3_server.key,
         s3_server.secret, str(lease)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    return child


def test_a_second_writer_gets_locked_error_naming_the_holder(s3_server, s3_url, s3_options):
    child = start_writer(s3_server, s3_url, lease=5)
    try:
        with pytest.raises(LockedError, match=f"pid {child.pid}") as raised:
            ZarrStorage(path=s3_url, storage_options=s3_options)
        assert raised.value.holder["pid"] == child.pid
        assert raised.value.holder["host"] == socket.gethostname()
        reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
        assert len(reader) == 20  # readers need no lease
    finally:
        child.kill()
        child.wait()


def test_a_dead_writers_lease_expires_and_a_new_writer_gets_in(s3_server, s3_url, s3_options):
    child = start_writer(s3_server, s3_url, lease=2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed = time.monotonic()
    with pytest.raises(LockedError):
        ZarrStorage(path=s3_url, storage_options=s3_options)
    while True:
        try:
            storage = ZarrStorage(path=s3_url, storage_options=s3_options)
            break
        except LockedError:
            assert time.monotonic() - killed < 5, "the dead writer's lease did not expire"
            time.sleep(0.1)
    assert len(storage) == 20
    assert_identical(storage[:20].exclude("index"), batch(0, 20))
    storage.close()


@pytest.mark.slow  # (test_s3_fencing covers fencing by default; CI runs it)
def test_a_stalled_writer_is_fenced_and_cannot_overwrite_the_new_writer(
    s3_server, s3_url, s3_options
):
    child = start_writer(s3_server, s3_url, lease=1.5)
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        child.send_signal(signal.SIGSTOP)  # a stall: GC pause, swapped out, partitioned
        time.sleep(2.5)  # its lease expires
        rb = TensorDictReplayBuffer(
            storage=ZarrStorage(path=s3_url, storage_options=s3_options), batch_size=8
        )
        rb.extend(batch(500, 30))  # rows 20-49
        rb.storage.flush()
        child.send_signal(signal.SIGCONT)
        child.stdin.write("write\n")
        child.stdin.flush()
        answer = child.stdout.readline()
        assert answer.startswith("fenced"), answer
        assert "lost the store" in answer
        rb.storage.flush()  # the new writer goes on
        assert_identical(rb.storage[:20].exclude("index"), batch(0, 20))
        assert_identical(rb.storage[20:50].exclude("index"), batch(500, 30))
        rb.storage.close()
        reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
        assert len(reader) == 50
        assert_identical(reader[20:50].exclude("index"), batch(500, 30))
        reader.close()
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # (waits out lease periods; CI runs it)
def test_lease_is_renewed_while_the_writer_lives(s3_url, s3_options):
    options = {**s3_options, "lease_seconds": 1.0}
    storage = ZarrStorage(CAPACITY, s3_url, storage_options=options)
    rb = TensorDictReplayBuffer(storage=storage)
    for i in range(6):  # 3 s: three lease lifetimes
        time.sleep(0.5)
        rb.extend(batch(i * 10, 10))
        storage.flush()
    other_writer = f"""
        from zarr_rb import ZarrStorage
        from zarr_rb.errors import LockedError
        try:
            ZarrStorage(path={s3_url!r}, storage_options={options!r}).close()
            print("opened")
        except LockedError:
            print("locked")
        """
    assert run_python(other_writer).stdout.strip() == "locked"
    storage.close()
    assert run_python(other_writer).stdout.strip() == "opened"  # released on close


def test_commit_record_changed_by_another_writer_fences(s3_url, s3_options):
    storage = ZarrStorage(CAPACITY, s3_url, storage_options=s3_options)
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(batch(0, 10))
    storage.flush()
    location = open_location(s3_url, s3_options)
    record = location.read("zarr.json") or b""
    location.write("zarr.json", record + b" ")  # the same record, another generation
    with pytest.raises(FencedError, match="commit record was changed"):  # noqa: PT012
        rb.extend(batch(10, 10))  # (full blocks are written, and committed, at once)
        storage.flush()
    assert len(ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)) == 10


# --- bad input: typed errors, in bounded time ---------------------------------------------


@pytest.mark.parametrize(
    "url", ["s3://", "s3:///runs/a.zarr", "s3://bucket", "s3://bucket/", "s3://bucket//"]
)
def test_a_url_without_bucket_or_path_is_refused(url, s3_options):
    with pytest.raises(InvalidLocationError, match="s3://<bucket>/<path>"):
        ZarrStorage(10, url, storage_options=s3_options)


def test_other_schemes_and_options_are_refused(s3_url, s3_options, tmp_path):
    with pytest.raises(NotSupportedError, match="s3://"):
        ZarrStorage(10, "gs://bucket/a.zarr")
    with pytest.raises(InvalidLocationError, match="unknown storage_options"):
        ZarrStorage(10, s3_url, storage_options={**s3_options, "endpoint": "x"})
    with pytest.raises(InvalidLocationError, match="storage_options are for object stores"):
        ZarrStorage(10, tmp_path / "a.zarr", storage_options=s3_options)
    with pytest.raises(InvalidLocationError, match="lease_seconds"):
        ZarrStorage(10, s3_url, storage_options={**s3_options, "lease_seconds": 120})
    storage = ZarrStorage(10, f"file://{tmp_path / 'b.zarr'}")  # file:// URLs are paths
    assert storage.path == tmp_path / "b.zarr"
    storage.close()


def test_missing_bucket_is_a_typed_error_at_once(s3_server, s3_options):
    url = f"s3://no-such-bucket-{os.getpid()}/a.zarr"
    for mode in ("a", "r"):
        started = time.monotonic()
        with pytest.raises(BucketNotFoundError, match="does not exist") as raised:
            ZarrStorage(10, url, mode=mode, storage_options=s3_options)
        assert time.monotonic() - started < 5
        assert isinstance(raised.value, StoreNotFoundError)


def test_refused_credentials_are_a_typed_error(s3_url, s3_options):
    for options in ({**s3_options, "secret": "wrong"}, {**s3_options, "key": "nobody"}):
        started = time.monotonic()
        with pytest.raises(CredentialsError, match="refused the credentials") as raised:
            ZarrStorage(10, s3_url, storage_options=options)
        assert time.monotonic() - started < 5
        assert isinstance(raised.value, PermissionError)
        assert "wrong" not in str(raised.value)  # never prints the secret


def test_unreachable_endpoint_fails_in_bounded_time(s3_url, s3_options):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: nothing listens
    options = {**s3_options, "endpoint_url": f"http://127.0.0.1:{port}"}
    started = time.monotonic()
    with pytest.raises(EndpointUnreachableError, match="did not answer"):
        ZarrStorage(10, s3_url, storage_options=options)
    assert time.monotonic() - started < 15


@pytest.mark.slow  # (waits out timeouts; CI runs it)
def test_a_hung_endpoint_fails_in_bounded_time(s3_url, s3_options):
    """A server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    threading.Thread(
        target=lambda: accepted.extend(listener.accept() for _ in range(16)), daemon=True
    ).start()
    port = listener.getsockname()[1]
    options = {**s3_options, "endpoint_url": f"http://127.0.0.1:{port}"}
    result = run_python(
        f"""
        import time
        from zarr_rb import ZarrStorage
        from zarr_rb.errors import EndpointUnreachableError
        started = time.monotonic()
        try:
            ZarrStorage(10, {s3_url!r}, storage_options={options!r})
        except EndpointUnreachableError as err:
            print("unreachable", round(time.monotonic() - started, 1))
        """,
        env={"TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "2"},
        timeout=60,
    )
    listener.close()
    assert result.returncode == 0, result.stderr[-3000:]
    word, seconds = result.stdout.split()
    assert word == "unreachable"
    assert float(seconds) < 15


def test_objects_that_are_not_a_store_are_refused(s3_url, s3_options):
    location = open_location(s3_url, s3_options)
    location.write("notes.txt", b"hello")
    with pytest.raises(NotAStoreError, match="no zarr_rb store"):
        ZarrStorage(10, s3_url, storage_options=s3_options)
    other = s3_url.replace(".zarr", "-group.zarr")
    open_location(other, s3_options).write(
        "zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'
    )
    with pytest.raises(NotAStoreError, match="not a zarr_rb store"):
        ZarrStorage(10, other, storage_options=s3_options)
    with pytest.raises(StoreNotFoundError):
        ZarrStorage(path=s3_url.replace(".zarr", "-none.zarr"), storage_options=s3_options,
                    mode="r")  # fmt: skip


def test_an_interrupted_snapshot_is_no_store_and_is_not_overwritten(s3_url, s3_options):
    from zarr_rb.util.io import observe_io

    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 64))
    rb.storage.flush()
    target = s3_url.replace(".zarr", "-snap.zarr")
    calls = []

    def crash_after_three_writes(kind, path):
        if kind in ("write", "publish") and target.split("://")[1] in str(path):
            calls.append(path)
            if len(calls) > 3:
                raise OSError("connection lost")

    engine = rb.storage._store.engine
    with observe_io(crash_after_three_writes), pytest.raises(OSError, match="connection"):
        engine.snapshot_to(open_location(target, s3_options))
    assert "zarr.json" not in open_location(target, s3_options).list()  # root copied last
    with pytest.raises(NotAStoreError):
        ZarrStorage(path=target, read_only=True, storage_options=s3_options)
    with pytest.raises(FileExistsError, match="not empty"):
        zarr_rb.save(rb, target, progress=False)
    rb.storage.close()


def test_nothing_is_written_outside_the_stores_prefix(s3_server, s3_url, s3_options):
    before = bucket_keys(s3_server)
    prefix = s3_url.removeprefix(f"s3://{s3_server.bucket}/") + "/"
    ours, _ = twin_buffers(s3_url, s3_options)
    fill(ours)
    zarr_rb.save(ours)
    ours.storage.close()
    zarr_rb.load(s3_url, storage_options=s3_options).storage.close()
    new = bucket_keys(s3_server) - before
    assert new
    assert all(key.startswith(prefix) for key in new), sorted(new)[:5]


# --- crashes ---------------------------------------------------------------------------------


def random_kills_on_s3(s3_server, s3_url, tmp_path, seeds) -> None:
    from zarr_rb.testing import CrashWorkload, forkserver_context, kill_randomly

    context = forkserver_context()
    options = {**s3_server.storage_options(), "lease_seconds": 2}
    saved = 0
    for seed in seeds:
        where = tmp_path / f"seed-{seed}"
        where.mkdir()
        check = kill_randomly(
            where,
            seed,
            CrashWorkload(),
            context,
            max_delay=3.0,
            after_a_save=True,  # waited for: then load must restore a save
            store=s3_url.replace(".zarr", f"-{seed}.zarr"),
            storage_options=options,
        )
        saved += check.saved is not None
    assert saved >= len(seeds) // 2


@pytest.mark.slow  # (spawned writers; test_crash kills local ones by default; CI runs it)
def test_sigkilled_writers_leave_the_store_at_its_last_commit(s3_server, s3_url, tmp_path):
    random_kills_on_s3(s3_server, s3_url, tmp_path, range(4))


@pytest.mark.slow
def test_many_sigkilled_writers_on_s3(s3_server, s3_url, tmp_path):
    random_kills_on_s3(s3_server, s3_url, tmp_path, range(100, 140))


@pytest.mark.slow  # (a spawned writer; test_crash kills local saves by default; CI runs it)
def test_a_writer_killed_during_a_save_on_s3(s3_server, s3_url, tmp_path):
    from zarr_rb.testing import (
        CrashWorkload,
        forkserver_context,
        kill_at_each_operation_of_a_save,
    )

    options = {**s3_server.storage_options(), "lease_seconds": 2}
    outcomes = []
    operations = 0
    for _, operations, check in kill_at_each_operation_of_a_save(  # noqa: B007
        tmp_path,
        CrashWorkload(),
        forkserver_context(),
        stride=4,
        store=s3_url.removesuffix(".zarr"),
        storage_options=options,
    ):
        outcomes.append(check.saved)
    assert operations > 10
    previous, new = outcomes[0], check.written
    assert set(outcomes) <= {previous, new}
    assert outcomes == sorted(outcomes, key=lambda saved: saved == new)  # one switch


# --- the cache of encoded objects --------------------------------------------------------------


class CountingSource:
    """A kvstore that counts the reads passed on to it."""

    def __init__(self, source) -> None:
        self.source = source
        self.reads = 0

    def read(self, key, **kwargs):
        self.reads += 1
        return self.source.read(key, **kwargs)


def test_warm_reads_send_no_request_and_never_return_stale_rows(s3_url, s3_options):
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(64, s3_url, storage_options=s3_options), batch_size=16
    )
    rb.extend(batch(0, 64))
    rb.storage.flush()
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
    assert_identical(reader.get(torch.arange(64)).exclude("index"), batch(0, 64))
    cache = reader._store.engine.cache
    counting = CountingSource(cache._source)
    cache._source = counting
    sampler = TensorDictReplayBuffer(storage=reader, batch_size=16)
    for _ in range(5):
        sampler.sample()
    assert counting.reads == 0  # warm: every object comes from RAM
    rb.extend(batch(100, 40))  # rows 0-39 rewritten (the ring wraps)
    rb.storage.flush()
    reader.refresh()
    expected = torch.cat([batch(100, 40)["action"], batch(40, 24)["action"]])
    assert torch.equal(reader.get(torch.arange(64))["action"], expected)
    assert counting.reads > 0  # revalidated after the commit moved
    rb.storage.close()
    reader.close()


def test_the_cache_stays_within_its_bound(s3_url, s3_options):
    options = {**s3_options, "cache_bytes": 4096}
    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=options), batch_size=16
    )
    rb.extend(batch(0, CAPACITY))
    rb.storage.flush()
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=options)
    for start in range(0, CAPACITY, 10):
        rows = torch.arange(start, start + 10)
        assert_identical(reader.get(rows).exclude("index"), batch(start, 10))
    cache = reader._store.engine.cache
    assert cache.nbytes <= 4096 + max(entry.size for entry in cache._entries.values())
    reader.close()
    rb.storage.close()


def test_a_takeover_fences_a_writer_that_passed_its_lease_check(s3_url, s3_options):
    """A writer that stalls right after its last lease check (so that the check cannot
    stop it) still cannot commit over the writer that took the store over."""
    options = {**s3_options, "lease_seconds": 1.0}
    storage = ZarrStorage(CAPACITY, s3_url, storage_options=options)
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(batch(0, 10))
    storage.flush()
    lease = storage._store.lifetime._lock
    lease._lost = "stopped renewing for the test"  # the renewal thread stops
    lease.check = lambda: None  # as if its last check passed just before the stall
    time.sleep(1.5)  # the lease expires
    other = run_python(
        f"""
        from zarr_rb import ZarrStorage
        storage = ZarrStorage(path={s3_url!r}, storage_options={options!r})
        print(len(storage))
        storage.close()
        """
    )
    assert other.returncode == 0, other.stderr[-3000:]
    assert other.stdout.strip() == "10"
    with pytest.raises(FencedError, match="commit record was changed"):  # noqa: PT012
        rb.extend(batch(10, 10))  # (full blocks are written, and committed, at once)
        storage.flush()
    with pytest.raises(FencedError, match="commit record was changed"):
        storage.flush()  # told again, not taken for committed
    with pytest.raises(FencedError, match="commit record was changed"):
        rb.extend(batch(20, 1))  # and at any further write
    storage.close()  # the error was raised at the write: closing a fenced writer releases it
    assert storage.closed
    reader = ZarrStorage(path=s3_url, read_only=True, storage_options=s3_options)
    assert len(reader) == 10
    reader.close()


def test_a_closed_writer_leaves_an_expired_lease_which_is_no_data(s3_url, s3_options):
    import json

    rb = TensorDictReplayBuffer(storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options))
    rb.extend(batch(0, 4))  # the store is made, and its lease taken, at the first write
    rb.storage.close()
    location = open_location(s3_url, s3_options)
    record = json.loads(location.read(".zarr_rb.lease") or b"{}")
    assert record["expires"] < time.time()  # released by a conditional PUT, not a delete
    only_lease = open_location(s3_url.replace(".zarr", "-lease-only.zarr"), s3_options)
    only_lease.write(".zarr_rb.lease", json.dumps(record).encode())
    assert not only_lease.exists()
    new = TensorDictReplayBuffer(
        storage=ZarrStorage(10, only_lease.url, storage_options=s3_options)
    )
    new.extend(batch(0, 4))  # a new store, made over the expired lease
    new.storage.close()


def test_a_server_side_snapshot_copies_the_root_record_last(s3_url, s3_options):
    from zarr_rb.util.io import observe_io

    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options), batch_size=8
    )
    rb.extend(batch(0, 64))
    rb.storage.flush()
    copied = []
    target = open_location(s3_url.replace(".zarr", "-ordered.zarr"), s3_options)
    with observe_io(lambda kind, path: copied.append(str(path))):
        rb.storage._store.engine.snapshot_to(target)
    assert len(copied) > 5
    assert copied[-1].endswith("-ordered.zarr/zarr.json")
    assert sum(path.endswith("-ordered.zarr/zarr.json") for path in copied) == 1
    rb.storage.close()


def test_torchrl_dumps_and_loads_of_a_buffer_on_s3(s3_url, s3_options, tmp_path):
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7,
        beta=0.5,
        storage=ZarrStorage(CAPACITY, s3_url, storage_options=s3_options),
        batch_size=8,
    )
    fill(rb, total=120)
    rb.dumps(tmp_path / "dump")  # TorchRL's route: a local directory, streamed from S3
    other = s3_url.replace(".zarr", "-loaded.zarr")
    back = TensorDictPrioritizedReplayBuffer(
        alpha=0.7,
        beta=0.5,
        storage=ZarrStorage(CAPACITY, other, storage_options=s3_options),
        batch_size=8,
    )
    back.loads(tmp_path / "dump")
    assert len(back) == len(rb) == CAPACITY
    assert_identical(back.storage[:], rb.storage[:])
    assert torch.equal(back.sampler._sum_tree[torch.arange(CAPACITY)],
                       rb.sampler._sum_tree[torch.arange(CAPACITY)])  # fmt: skip
    rb.storage.close()
    back.storage.close()
