"""A store under a prefix of an S3 (or S3-compatible) bucket.

Objects are read and written through TensorStore's ``s3`` kvstore, which also holds the
arrays' chunks. What is atomic here, and what the commit protocol relies on:

- one PUT replaces one object atomically (a reader gets the old or the new bytes);
- a conditional PUT (``If-Match: <etag>``, or ``If-None-Match: *`` to create) either
  replaces the object or fails with 412: :meth:`S3Location.write_if`. TensorStore sends
  real conditional PUTs only with ``use_conditional_write``, always set here (without it
  it checks with a HEAD first, which races);
- nothing spans objects: no rename, no directory, no lock. A commit is one object (the
  root ``zarr.json``) written only after every object it refers to, and the writer's
  right to write is a lease object (:mod:`zarr_rb.locations.lease`);
- a PUT acknowledged by the server is durable: :meth:`S3Location.sync` has nothing to do.

Copies between locations on one endpoint are made by the server (``CopyObject``), so the
bytes never pass through this process. TensorStore has no such request; it is made with
the small signer in :mod:`zarr_rb.locations._sigv4`, as are listings with sizes.
"""

from __future__ import annotations

import atexit
import builtins
import concurrent.futures
import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
import threading
import time
import urllib.error
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import tensorstore as ts

from zarr_rb.errors import (
    BucketNotFoundError,
    CredentialsError,
    EndpointUnreachableError,
    InvalidLocationError,
    ServerBusyError,
    StoreWriteError,
)
from zarr_rb.locations import _sigv4
from zarr_rb.locations.base import (
    LEASE_KEY,
    NO_VALUE,
    NOT_DATA,
    PROBE_DIR,
    ROOT_METADATA,
    Generation,
    Location,
    ProgressCallback,
    Versioned,
    WriterHold,
    join,
    writer_key,
)
from zarr_rb.locations.lock import mixed_writers, single_writer_holds
from zarr_rb.util.fork import starting_tensorstore
from zarr_rb.util.io import IOKind, announce, short_reason

OPTIONS = ("endpoint_url", "key", "secret", "token", "region", "anon")
"""``storage_options`` as fsspec/s3fs name them."""
OWN_OPTIONS = ("lease_seconds", "cache_bytes", "retries")
"""zarr_rb's own ``storage_options`` for object stores."""
DEFAULT_CACHE_BYTES = 2**30
"""Encoded objects kept in RAM per store and process (see ``zarr_rb.engine.cache``), so
that warm sampling sends no request: a million compressed Pong transitions fit."""
DEFAULT_RETRIES = 4
"""Attempts of a failed request (connection refused, 5xx), 0.1 s to 2 s apart: an
unreachable endpoint fails in a few seconds, not the minutes TensorStore waits by default."""
# TensorStore reads these when it makes its first HTTP transport: set them before. A
# request moving less than 1 byte a second for this long has failed (a hung server).
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "30")
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", "10")

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class S3Options:
    """Where the bucket is and how to sign requests (from ``storage_options`` first, the
    standard ``AWS_*`` environment variables second)."""

    endpoint: str | None
    region: str
    credentials: _sigv4.Credentials
    anonymous: bool
    lease_seconds: float
    cache_bytes: int
    retries: int

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> S3Options:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS) - set(OWN_OPTIONS))
        if unknown:
            raise InvalidLocationError(
                f"unknown storage_options {unknown}; expected some of {list(OPTIONS + OWN_OPTIONS)}"
            )
        env = os.environ
        endpoint = options.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3")
        endpoint = endpoint or env.get("AWS_ENDPOINT_URL")
        region = options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        anonymous = _flag(options.get("anon", False), "anon")
        if "key" in options or "secret" in options:
            key, secret, token = options.get("key"), options.get("secret"), options.get("token")
        else:
            key = env.get("AWS_ACCESS_KEY_ID")
            secret = env.get("AWS_SECRET_ACCESS_KEY")
            token = options.get("token") or env.get("AWS_SESSION_TOKEN")
        if (key is None) != (secret is None) and not anonymous:
            raise InvalidLocationError(
                "storage_options need both 'key' and 'secret' (or neither, to use the "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables)"
            )
        lease = float(options.get("lease_seconds", 20.0))
        if not 0.5 <= lease <= 30.0:
            raise InvalidLocationError(
                f"expected storage_options['lease_seconds'] in [0.5, 30], got {lease}"
            )
        return cls(
            endpoint=str(endpoint).rstrip("/") if endpoint else None,
            region=str(region or "us-east-1"),
            credentials=_sigv4.Credentials(
                None if anonymous else key, None if anonymous else secret, token
            ),
            anonymous=anonymous,
            lease_seconds=lease,
            cache_bytes=int(options.get("cache_bytes", DEFAULT_CACHE_BYTES)),
            retries=int(options.get("retries", DEFAULT_RETRIES)),
        )

    @property
    def http_endpoint(self) -> str:
        return self.endpoint or f"https://s3.{self.region}.amazonaws.com"


class S3Location(Location):
    """The store at ``s3://<bucket>/<prefix>``."""

    def __init__(self, bucket: str, prefix: str, options: S3Options) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options
        starting_tensorstore(f"store 's3://{bucket}/{self.prefix}'")
        self._context = _context(options)
        self._credentials_spec = _credentials_spec(options)
        self.cache_bytes = options.cache_bytes
        self._kv = self.run(
            lambda: ts.KvStore.open(self.kvstore(""), context=self._context).result(), "open"
        )
        self._creates_once: bool | None = None

    def __repr__(self) -> str:
        return f"S3Location({self.url!r})"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def context(self) -> ts.Context:
        return self._context

    def identity(self) -> tuple[str, ...]:
        return ("s3", self.options.http_endpoint, self.bucket, self.prefix)

    def kvstore(self, key: str) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": self.bucket,
            "path": join(self.prefix, key) + "/",
            "aws_region": self.options.region,
            "use_conditional_write": True,
            "aws_credentials": self._credentials_spec,
        }
        if self.options.endpoint:
            spec["endpoint"] = self.options.endpoint
        return spec

    def child(self, key: str) -> S3Location:
        return S3Location(self.bucket, join(self.prefix, key), self.options)

    # --- objects ---------------------------------------------------------------------------

    def read_versioned(self, key: str) -> Versioned:
        result = self.run(lambda: self._kv.read(key).result(), f"reading {key!r}")
        value = bytes(result.value) if result.state == "value" else None
        return Versioned(value, bytes(result.stamp.generation))

    def write(self, key: str, value: bytes) -> Generation:
        announce("publish" if key == ROOT_METADATA else "write", self.path_of(key))
        stamp = self.run(lambda: self._kv.write(key, value).result(), f"writing {key!r}")
        return bytes(stamp.generation)

    def write_if(
        self, key: str, value: bytes | None, *, generation: Generation
    ) -> Generation | None:
        kind: IOKind = "remove" if value is None else "write"
        announce("publish" if key == ROOT_METADATA else kind, self.path_of(key))
        stamp = self.run(
            lambda: self._kv.write(key, value, if_equal=generation).result(),
            f"writing {key!r} conditionally",
        )
        # TensorStore reports a failed condition (412) as an empty generation.
        return bytes(stamp.generation) or None

    def delete(self, key: str) -> None:
        announce("remove", self.path_of(key))
        self.run(lambda: self._kv.write(key, None).result(), f"deleting {key!r}")

    def delete_prefix(self, prefix: str) -> None:
        announce("remove", self.path_of(prefix))
        start = prefix.strip("/") + "/" if prefix.strip("/") else ""
        # The first key after every "<prefix>/..." ("" : no end, the whole store).
        end = start[:-1] + "0" if start else ""
        self.run(
            lambda: self._kv.delete_range(ts.KvStore.KeyRange(start, end)).result(),
            f"deleting {start or 'the store'!r}",
        )

    @property
    def signs(self) -> bool:
        """Whether requests beyond TensorStore's can be signed here: keys were given (in
        ``storage_options`` or ``AWS_*``), or the bucket is public (``anon``). Credentials
        from other sources (IAM roles, SSO profiles) reach TensorStore only."""
        creds = self.options.credentials
        return self.options.anonymous or (creds.key is not None and creds.secret is not None)

    def has(self, key: str) -> bool:
        """(A listing of the keys from ``key`` to the next possible one: one request.)"""
        keys = self.run(
            lambda: self._kv.list(ts.KvStore.KeyRange(key, key + "\0")).result(),
            f"looking up {key!r}",
        )
        return key.encode() in keys

    def list(self, prefix: str = "") -> dict[str, int]:
        """Keys and sizes (``ListObjectsV2``, page by page; sizes ``-1`` when requests
        cannot be signed here, the keys then listed by TensorStore)."""
        if not self.signs:
            start = prefix.strip("/") + "/" if prefix.strip("/") else ""
            keys = self.run(
                lambda: self._kv.list(
                    ts.KvStore.KeyRange(start, start[:-1] + "0" if start else "")
                ).result(),
                "listing",
            )
            return {key.decode(): -1 for key in keys}
        base = join(self.prefix, prefix)
        base = base + "/" if base else ""
        found: dict[str, int] = {}
        token: str | None = None
        while True:
            query = {"list-type": "2", "prefix": base, "max-keys": "1000"}
            if token:
                query["continuation-token"] = token
            body = self.request("GET", f"/{self.bucket}", query=query, what="listing")
            root = ET.fromstring(body)
            ns = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
            for item in root.iter(f"{ns}Contents"):
                name = item.findtext(f"{ns}Key") or ""
                own = name[len(self.prefix) + 1 :] if self.prefix else name
                found[own] = int(item.findtext(f"{ns}Size") or 0)
            token = root.findtext(f"{ns}NextContinuationToken")
            if root.findtext(f"{ns}IsTruncated") != "true" or not token:
                return found

    def copy_to(
        self,
        target: Location,
        keys: Iterable[str],
        *,
        progress: ProgressCallback | None = None,
    ) -> int:
        """To a location on the same endpoint: ``CopyObject`` on the server, 16 at a
        time (nothing passes through this process), the root record last, once every
        other object is copied; elsewhere, streamed."""
        if not (
            isinstance(target, S3Location)
            and self.signs
            and target.options.http_endpoint == self.options.http_endpoint
            and target.options.credentials == self.options.credentials
        ):
            return super().copy_to(target, keys, progress=progress)
        sizes = self.list()

        def copy(key: str) -> int:
            announce("write", target.path_of(key))
            source = "/" + join(self.bucket, self.prefix, key)
            body = target.request(
                "PUT",
                "/" + join(target.bucket, target.prefix, key),
                headers={"x-amz-copy-source": _sigv4.quote(source)},
                what=f"copying {key!r}",
            )
            if b"CopyObjectResult" not in body:  # S3 may answer 200 with an <Error> body
                raise self._http_error(f"CopyObject failed: {_s3_code(body)}", f"copying {key!r}")
            return max(0, sizes.get(key, 0))

        keys = list(keys)
        last = [key for key in keys if key == ROOT_METADATA]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for batch in ([key for key in keys if key != ROOT_METADATA], last):
                for size in pool.map(copy, batch):
                    if progress is not None:
                        progress(size)
        return 0

    # --- the store as a whole --------------------------------------------------------------

    def check_usable(self) -> None:
        """A listing of one key, which (unlike a read) fails for a missing bucket."""
        self.run(
            lambda: self._kv.list(
                ts.KvStore.KeyRange(ROOT_METADATA, ROOT_METADATA + "\0")
            ).result(),
            "checking the bucket",
        )

    def exists(self) -> bool:
        """Whether the prefix holds any object other than a writer's lease."""
        keys = self.run(lambda: self._kv.list().result(), "listing")
        return any(key.decode().partition("/")[0] not in NOT_DATA for key in keys)

    def create_root(self) -> None:
        pass  # an object store has no directories

    def creates_once(self) -> bool:
        """Asked of the server once: an object created twice by conditional PUTs, whose
        second must be refused (AWS S3, MinIO, SeaweedFS 3.97+ refuse it; a server that
        ignores the condition overwrites silently, and the writer then writes as before)."""
        if self._creates_once is None:
            key = f"{PROBE_DIR}/{os.urandom(8).hex()}"
            try:
                first = self.write_if(key, b"first", generation=NO_VALUE)
                second = self.write_if(key, b"second", generation=NO_VALUE)
            finally:
                self.delete(key)
            self._creates_once = first is not None and second is None
        return self._creates_once

    def acquire_writer(self) -> WriterHold:
        from zarr_rb.locations.lease import Lease

        lease = Lease.acquire(self, seconds=self.options.lease_seconds)
        others = self.live_writers()
        if others:
            lease.release()
            raise mixed_writers(self.url, len(others))
        return lease

    def join_writers(self, writer: str) -> WriterHold:
        from zarr_rb.locations.lease import Lease, lease_alive

        if lease_alive(self, LEASE_KEY):
            raise single_writer_holds(self.url, {})
        return Lease.acquire(
            self, seconds=self.options.lease_seconds, key=writer_key(writer), writer=writer
        )

    def holders(self) -> builtins.list[dict[str, Any]]:
        from zarr_rb.locations.lease import lease_holders

        return lease_holders(self)

    def writer_alive(self, writer: str) -> bool:
        from zarr_rb.locations.lease import lease_alive

        if lease_alive(self, writer_key(writer)):
            return True
        self.delete(writer_key(writer))  # expired for good: writer ids are never reused
        return False

    # --- errors ----------------------------------------------------------------------------

    def run(self, call: Callable[[], _T], what: str) -> _T:
        """``call()``, with TensorStore's errors about the bucket, the credentials and the
        endpoint as typed ones (others stay ``ValueError``, as from a local store)."""
        try:
            return call()
        except ValueError as err:
            typed = self._error(short_reason(err), what)
            if isinstance(typed, _UnclassifiedError):
                raise
            raise typed from None

    def _error(self, reason: str, what: str) -> Exception:
        where = f"store {self.url!r}"
        endpoint = self.options.http_endpoint
        if "NoSuchBucket" in reason:
            return BucketNotFoundError(
                f"{where}: bucket {self.bucket!r} does not exist at {endpoint} ({what}); "
                "create it first, or check the URL and storage_options['endpoint_url']"
            )
        if reason.startswith("PERMISSION_DENIED") or "AccessDenied" in reason:
            return CredentialsError(
                f"{where}: {endpoint} refused the credentials ({what}: {reason[:200]}); "
                "check storage_options 'key'/'secret' (or AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY) and the bucket's permissions"
            )
        if "CURL error" in reason or reason.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")):
            return EndpointUnreachableError(
                f"{where}: {endpoint} did not answer ({what}: {reason[:200]}); check "
                "storage_options['endpoint_url'] (or AWS_ENDPOINT_URL) and that the server "
                "is up"
            )
        if "http_response_code='5" in reason:
            return ServerBusyError(
                f"{where}: {endpoint} kept answering with a server error ({what}: "
                f"{reason[:200]}) after {self.options.retries} attempts; retry later, or "
                "raise storage_options['retries']"
            )
        return _UnclassifiedError(f"{where}: {what} failed ({reason[:300]})")

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        what: str,
    ) -> bytes:
        """One signed request to the server (retried as ``storage_options['retries']``
        says); returns the body of its answer. ``what``: for the error it may raise."""
        for attempt in range(max(1, self.options.retries)):
            # As TensorStore does: connection failures and 5xx answers (SlowDown) are
            # retried, 0.1 s to 2 s apart; anything else is final.
            if attempt:
                time.sleep(min(2.0, 0.1 * 2 ** (attempt - 1)))
            try:
                response = _sigv4.request(
                    method,
                    self.options.http_endpoint,
                    path,
                    query=query,
                    credentials=self.options.credentials,
                    region=self.options.region,
                    headers=headers,
                    timeout=float(os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"]),
                )
            except (OSError, urllib.error.URLError) as err:
                failure = f"CURL error {err}"
                continue
            if response.status < 500:
                break
            failure = f"HTTP {response.status} {_s3_code(response.body)}"
        else:
            raise self._http_error(failure, what)
        if response.status == 404 and b"NoSuchBucket" in response.body:
            raise self._http_error("NoSuchBucket", what)
        if response.status == 403:
            raise self._http_error(f"PERMISSION_DENIED {_s3_code(response.body)}", what)
        if response.status >= 300:
            raise self._http_error(f"HTTP {response.status} {_s3_code(response.body)}", what)
        return response.body

    def _http_error(self, reason: str, what: str) -> Exception:
        error = self._error(reason, what)
        return StoreWriteError(None, str(error)) if isinstance(error, _UnclassifiedError) else error


class _UnclassifiedError(ValueError):
    """A TensorStore error that is none of the location's typed ones."""


def _s3_code(body: bytes) -> str:
    with contextlib.suppress(ET.ParseError):
        return ET.fromstring(body).findtext("Code") or ""
    return ""


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise InvalidLocationError(f"expected storage_options[{name!r}] True or False, got {value!r}")


def _context(options: S3Options) -> ts.Context:
    return ts.Context(
        {
            # Shard indexes, for writes of part of a shard (rows are read from the cache
            # of encoded objects, see zarr_rb.engine.cache).
            "cache_pool": {"total_bytes_limit": 32 * 2**20},
            "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            "s3_request_concurrency": {"limit": 32},
            "s3_request_retries": {
                "max_retries": max(1, options.retries),
                "initial_delay": "100ms",
                "max_delay": "2s",
            },
        }
    )


_CREDENTIALS_DIR: str | None = None
_CREDENTIALS_LOCK = threading.Lock()
_CREDENTIALS_FILES: dict[tuple[str | None, ...], str] = {}


def _remove_credentials(directory: str, process: int) -> None:
    """At exit, the credentials directory of ``process`` (not of a child forked from it,
    whose exit would remove it under its parent)."""
    if os.getpid() == process:
        shutil.rmtree(directory, ignore_errors=True)


def _credentials_spec(options: S3Options) -> dict[str, Any]:
    """TensorStore's ``aws_credentials``. Its spec cannot hold keys, so keys given in
    ``storage_options`` are written to a credentials file in a private (0700) temporary
    directory of this process, removed at exit."""
    if options.anonymous:
        return {"type": "anonymous"}
    creds = options.credentials
    if creds.key is None or creds.secret is None:
        return {"type": "default"}
    global _CREDENTIALS_DIR
    with _CREDENTIALS_LOCK:
        if _CREDENTIALS_DIR is None:
            _CREDENTIALS_DIR = tempfile.mkdtemp(prefix="zarr_rb-aws-")
            atexit.register(_remove_credentials, _CREDENTIALS_DIR, os.getpid())
        identity = (creds.key, creds.secret, creds.token, options.region)
        path = _CREDENTIALS_FILES.get(identity)
        if path is None:
            # A random name: nothing derived from the secret appears in paths or messages.
            path = os.path.join(_CREDENTIALS_DIR, secrets.token_hex(8))
            _CREDENTIALS_FILES[identity] = path
            lines = ["[default]", f"aws_access_key_id = {creds.key}"]
            lines.append(f"aws_secret_access_key = {creds.secret}")
            if creds.token:
                lines.append(f"aws_session_token = {creds.token}")
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write("\n".join(lines) + "\n")
            config = path + ".config"
            with open(config, "w") as fh:
                fh.write(f"[default]\nregion = {options.region}\n")
            os.replace(path + ".tmp", path)
    return {
        "type": "profile",
        "profile": "default",
        "credentials_file": path,
        "config_file": path + ".config",
    }


def parse_s3_url(url: str, storage_options: Mapping[str, Any] | None) -> S3Location:
    """The location of ``s3://bucket/prefix``."""
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidLocationError(f"expected s3://<bucket>/<path>, got {url!r} (no bucket)")
    if not prefix.strip("/"):
        raise InvalidLocationError(
            f"expected s3://<bucket>/<path>, got {url!r}: name a path inside the bucket "
            "(e.g. s3://bucket/runs/pong.zarr); a store never takes a whole bucket"
        )
    return S3Location(bucket, prefix, S3Options.parse(storage_options))
