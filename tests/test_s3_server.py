"""The S3 test server (tests/s3_server.py) serves a writable bucket, checks signatures, and
TensorStore's s3 driver talks to it."""

from __future__ import annotations

import uuid

import pytest
import tensorstore as ts
from s3_server import S3Server, create_bucket

from zarr_rb.locations._sigv4 import Credentials, request


def test_bucket_exists(s3_server: S3Server) -> None:
    # ListObjects (v1: _sigv4 sends no query string) answers only for an existing bucket.
    listing = s3_server.signed("GET", f"/{s3_server.bucket}")
    assert listing.status == 200, listing
    assert b"<ListBucketResult" in listing.body
    assert s3_server.signed("HEAD", f"/{s3_server.bucket}").status == 200
    assert s3_server.signed("HEAD", "/no-such-bucket-zarr-rb").status == 404


def test_signed_put_get_roundtrip(s3_server: S3Server) -> None:
    key = f"/{s3_server.bucket}/roundtrip-{uuid.uuid4().hex[:8]}/blob"
    payload = bytes(range(256)) * 3
    assert s3_server.signed("PUT", key, payload).status == 200
    got = s3_server.signed("GET", key)
    assert got.status == 200
    assert got.body == payload
    assert s3_server.signed("DELETE", key).status == 204
    assert s3_server.signed("GET", key).status == 404


def test_unsigned_and_badly_signed_requests_are_refused(s3_server: S3Server) -> None:
    for credentials in (Credentials(None, None), Credentials(s3_server.key, "wrong")):
        response = request(
            "GET",
            s3_server.endpoint,
            f"/{s3_server.bucket}",
            credentials=credentials,
            region=s3_server.region,
        )
        assert response.status == 403, (credentials, response)


def test_tensorstore_reads_and_writes(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # TensorStore's "environment" credentials are read when the kvstore is opened.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    kvstore = ts.KvStore.open(
        {
            "driver": "s3",
            "bucket": s3_server.bucket,
            "path": "probe/",
            "endpoint": s3_server.endpoint,
            "aws_region": s3_server.region,
            "use_conditional_write": True,
            "aws_credentials": {"type": "environment"},
        },
        # A server refusing writes fails the test in seconds, not TensorStore's 32 retries.
        context=ts.Context({"s3_request_retries": {"max_retries": 2, "initial_delay": "0.1s"}}),
    ).result()
    kvstore.write("a", b"x").result()
    assert kvstore.read("a").result().value == b"x"
    # The write really went to the server, under the kvstore's path.
    assert s3_server.signed("GET", f"/{s3_server.bucket}/probe/a").body == b"x"


def test_urls_and_options(s3_server: S3Server, s3_url: str, s3_options: dict[str, str]) -> None:
    assert s3_url.startswith("s3://zarr-rb-test/test_urls_and_options-")
    assert s3_url.endswith(".zarr")
    assert s3_options == {
        "endpoint_url": s3_server.endpoint,
        "key": s3_server.key,
        "secret": s3_server.secret,
        "region": "us-east-1",
    }
    assert s3_server.env()["AWS_ENDPOINT_URL"] == s3_server.endpoint


def test_many_buckets_take_writes(s3_server: S3Server) -> None:
    # Each bucket takes volumes of its own; with weed's default growth the 8th failed.
    names = [f"zarr-rb-many-{uuid.uuid4().hex[:8]}-{i}" for i in range(8)]
    for name in names:
        create_bucket(s3_server, name)
        assert s3_server.signed("PUT", f"/{name}/x", b"y").status == 200, name
    for name in names:
        assert s3_server.signed("DELETE", f"/{name}/x").status == 204
        assert s3_server.signed("DELETE", f"/{name}").status == 204
