"""One signed S3 request (AWS Signature Version 4, path-style), with the standard library.

TensorStore's s3 kvstore covers reads, writes, conditional writes, listing and deletes;
this is for the two requests it does not make: creating a bucket and copying an object
on the server (``CopyObject``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """What a request is signed with (``key is None``: anonymous, unsigned)."""

    key: str | None
    secret: str | None
    token: str | None = None

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(key={self.key!r}, secret=***)"


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def request(
    method: str,
    endpoint: str,
    path: str,
    *,
    credentials: Credentials,
    region: str,
    query: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    timeout: float = 30.0,
) -> Response:
    """Send one request to ``endpoint`` + ``path`` (``path`` already ``/bucket/key``, not
    yet percent-encoded); HTTP errors are returned, not raised.

    Raises:
        OSError: the endpoint cannot be reached (``urllib.error.URLError``, a timeout).
    """
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.netloc
    quoted = quote(parsed.path.rstrip("/") + path)
    query_string = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted((query or {}).items())
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    payload_hash = hashlib.sha256(body).hexdigest()
    all_headers = {
        "host": host,
        "x-amz-content-sha256": payload_hash,
        "x-amz-date": amz_date,
        **{k.lower(): v.strip() for k, v in (headers or {}).items()},
    }
    if credentials.token:
        all_headers["x-amz-security-token"] = credentials.token
    if credentials.key is not None and credentials.secret is not None:
        signed = sorted(all_headers)
        canonical = "\n".join(
            [
                method,
                quoted,
                query_string,
                "".join(f"{name}:{all_headers[name]}\n" for name in signed),
                ";".join(signed),
                payload_hash,
            ]
        )
        datestamp = amz_date[:8]
        scope = f"{datestamp}/{region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signing_key = ("AWS4" + credentials.secret).encode()
        for part in (datestamp, region, "s3", "aws4_request"):
            signing_key = hmac.new(signing_key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
        all_headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.key}/{scope}, "
            f"SignedHeaders={';'.join(signed)}, Signature={signature}"
        )
    del all_headers["host"]
    req = urllib.request.Request(
        f"{parsed.scheme}://{host}{quoted}" + (f"?{query_string}" if query_string else ""),
        data=body if method in ("PUT", "POST") else None,
        method=method,
        headers=all_headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return Response(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as err:
        return Response(err.code, dict(err.headers), err.read())


def quote(path: str, safe: str = "/-_.~") -> str:
    """``path`` percent-encoded as SigV4 wants it."""
    return urllib.parse.quote(path, safe=safe)
