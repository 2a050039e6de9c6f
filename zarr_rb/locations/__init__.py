"""Where stores live: a local directory or a prefix of an S3 bucket, chosen from the URL.

``open_location("runs/pong.zarr")`` and ``open_location("file:///data/pong.zarr")`` give
a :class:`LocalLocation`; ``open_location("s3://bucket/runs/pong.zarr", storage_options)``
an :class:`S3Location` (imported on first use). See :mod:`zarr_rb.locations.base` for the
interface and what each primitive guarantees.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from zarr_rb.errors import InvalidLocationError, NotSupportedError
from zarr_rb.locations.base import Location
from zarr_rb.locations.local import LocalLocation

__all__ = ["LocalLocation", "Location", "StoreURL", "is_remote", "open_location"]

StoreURL = str | os.PathLike[str]
"""A store's path (``"runs/pong.zarr"``), ``file://`` URL or ``s3://bucket/path`` URL."""


def is_remote(url: StoreURL) -> bool:
    """Whether ``url`` names a store on an object store."""
    return isinstance(url, str) and "://" in url and not url.startswith("file://")


def open_location(
    url: StoreURL | Location, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """The location of the store at ``url``.

    Raises:
        InvalidLocationError: a malformed URL, or ``storage_options`` for a local path.
        NotSupportedError: a scheme other than ``file://`` and ``s3://``.
    """
    if isinstance(url, Location):
        return url
    if not is_remote(url):
        if storage_options:
            raise InvalidLocationError(
                f"storage_options are for object stores (s3://...), got them for the local "
                f"path {str(url)!r}; drop them or pass an s3:// URL"
            )
        text = os.fspath(url)
        if text.startswith("file://"):
            parsed = urllib.parse.urlsplit(text)
            if parsed.netloc not in ("", "localhost"):
                raise InvalidLocationError(f"expected file:///<absolute path>, got {text!r}")
            text = urllib.parse.unquote(parsed.path)
        return LocalLocation(text)
    assert isinstance(url, str)
    scheme = url.partition("://")[0].lower()
    if scheme == "s3":
        from zarr_rb.locations.s3 import parse_s3_url

        return parse_s3_url(url, storage_options)
    raise NotSupportedError(
        f"stores live on local paths, file:// or s3:// URLs; got {url!r}. Other object "
        "stores with an S3 API (GCS interoperability, MinIO, Ceph, R2) work through s3:// "
        "with storage_options={'endpoint_url': ...}"
    )
