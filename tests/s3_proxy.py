"""An HTTP proxy in front of the tests' S3 server: it counts the requests that pass, and
can play a server that ignores ``If-None-Match`` or a network that loses a response.

Clients are pointed at :attr:`S3Proxy.endpoint` instead of the server's; requests go on
unchanged (their signatures cover the ``Host`` header, which the proxy keeps).
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


class S3Proxy:
    """A proxy to ``upstream`` (``http://host:port``), serving on a free local port.

    Attributes:
        log: ``(method, key, status, conditional)`` of every request forwarded, in order
            (``key``: the path below the bucket, without its query; ``status``: the
            server's answer; ``conditional``: whether it carried ``If-None-Match``).
        ignore_if_none_match: answer a conditional create of a probe object (the test a
            writer makes of the server, ``Location.creates_once``) that the server refused
            (412) as if it had succeeded, as a server that ignores the condition answers
            it. (The header cannot be dropped instead: it is signed. Other requests pass
            unchanged: TensorStore's own conditional writes need real answers.)
        lose_response: called with ``(method, key)`` after a request was forwarded; when
            it returns true the client's connection is closed without the response (the
            request took effect, its answer was lost).
    """

    def __init__(self, upstream: str, bucket: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._bucket = bucket
        self.log: list[tuple[str, str, int, bool]] = []
        self.ignore_if_none_match = False
        self.lose_response: Callable[[str, str], bool] = lambda method, key: False
        self._mutex = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # (headers and body go out in two writes)

            def log_message(self, *args: Any) -> None:
                pass

            def __getattr__(self, name: str) -> Any:
                if name in ("do_GET", "do_PUT", "do_POST", "do_DELETE", "do_HEAD"):
                    return lambda: proxy._forward(self)
                raise AttributeError(name)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _key(self, path: str) -> str:
        path = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
        return path.removeprefix(f"/{self._bucket}").lstrip("/")

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        method = handler.command
        key = self._key(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        connection = http.client.HTTPConnection(*self._upstream, timeout=60)
        connection.putrequest(method, handler.path, skip_host=True, skip_accept_encoding=True)
        for name, value in handler.headers.items():
            if name.lower() in _HOP_BY_HOP:
                continue
            connection.putheader(name, value)
        connection.endheaders(body if method in ("PUT", "POST") else None)
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        conditional = handler.headers.get("If-None-Match") is not None
        with self._mutex:
            self.log.append((method, key, response.status, conditional))
        probe = key.partition("/")[2].startswith(".zarr_rb.probe/")
        if self.ignore_if_none_match and probe and conditional and response.status == 412:
            handler.send_response(200, "OK")
            handler.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if self.lose_response(method, key):
            handler.close_connection = True
            handler.connection.shutdown(2)  # the client sees the connection reset
            return
        handler.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(payload)
