"""Real object servers on 127.0.0.1 for the remote-source tests and ``python -m bench``.

- :class:`RangeHTTPServer`: serves a directory over HTTP/1.1 (keep-alive) with ``HEAD``, single
  ``Range: bytes=a-b`` requests, ``ETag``/``Last-Modified`` (optional), and injectable faults
  (a status code, or ``"reset"``: half the body then a TCP reset) and denials; it records every
  request it answers (a reset one with status 0).
- :class:`CountingMotoServer`: moto's standalone S3 server behind a WSGI middleware that records
  every request and the body bytes it returned, and can deny keys with a real ``AccessDenied``.

Both count at the server, independently of mergefs's own counters. This module does not import
mergefs.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Served:
    """One request answered: method, path, the byte range of the body (``[start, end)``)."""

    method: str
    path: str
    status: int
    start: int = 0
    end: int = 0


@dataclass
class Log:
    """Thread-safe record of requests; ``faults[path]`` is consumed one action per GET."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    served: list[Served] = field(default_factory=list)
    faults: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    deny: set[str] = field(default_factory=set)

    def add(self, s: Served) -> None:
        with self.lock:
            self.served.append(s)

    def reset(self) -> None:
        with self.lock:
            self.served.clear()

    def next_fault(self, path: str) -> str | None:
        with self.lock:
            todo = self.faults.get(path)
            return todo.pop(0) if todo else None

    def denied(self, path: str) -> bool:
        return any(path.startswith(p) for p in self.deny)

    def requests(self, path_part: str = "", method: str | None = None) -> list[Served]:
        with self.lock:
            return [s for s in self.served
                    if path_part in s.path and (method is None or s.method == method)]

    def body_bytes(self, path_part: str = "") -> int:
        return sum(s.end - s.start for s in self.requests(path_part, "GET") if s.status < 300)


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHTTPServer:
    """A static file server honouring single Range requests. ``url`` is its base URL."""

    def __init__(self, root: Path, etags: bool = True) -> None:
        self.root = Path(root).resolve()
        self.etags = etags
        self.log = Log()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _empty(self, status: int, path: str, method: str) -> None:
                # logged before the response leaves: a client that has its answer (and a test
                # that then resets the log) never races the server's bookkeeping
                server.log.add(Served(method, path, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve(self, head: bool) -> None:
                method = "HEAD" if head else "GET"
                path = self.path.split("?", 1)[0]
                if server.log.denied(path):
                    return self._empty(403, path, method)
                fault = None if head else server.log.next_fault(path)
                if fault is not None and fault != "reset":
                    return self._empty(int(fault), path, method)
                target = (server.root / path.lstrip("/")).resolve()
                if server.root not in target.parents or not target.is_file():
                    return self._empty(404, path, method)
                st = target.stat()
                size = st.st_size
                start, end, status = 0, size, 200
                rng = self.headers.get("Range")
                if rng:
                    m = _RANGE.match(rng.strip())
                    if not m or int(m.group(1)) >= size:
                        return self._empty(416, path, method)
                    start = int(m.group(1))
                    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                    status = 206
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
                if server.etags:
                    self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                if head:
                    server.log.add(Served(method, path, status))  # before the answer leaves
                    self.end_headers()
                    return None
                with open(target, "rb") as f:
                    f.seek(start)
                    body = f.read(end - start)
                if fault == "reset":  # half the body, then a TCP reset
                    server.log.add(Served(method, path, 0))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return None
                server.log.add(Served(method, path, status, start, end))  # before it leaves
                self.end_headers()
                self.wfile.write(body)
                return None

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)


class CountingMotoServer:
    """moto's S3 server on a free port of 127.0.0.1, recording requests in ``log``.

    ``log.deny`` holds path prefixes (``/bucket/key``) answered with 403 AccessDenied.
    """

    def __init__(self) -> None:
        self.log = Log()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def _entry(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class Quiet(MotoRequestHandler):  # type: ignore[misc]
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._middleware(app), True,
                                   request_handler=Quiet)
        self._ready.set()
        self._server.serve_forever()

    def _middleware(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        log = self.log

        def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]
                    ) -> Iterable[bytes]:
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            if log.denied(path):
                body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied'
                        b"</Code><Message>Access Denied</Message></Error>")
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(body)))])
                log.add(Served(method, path, 403))
                return [body if method != "HEAD" else b""]
            status: list[int] = [0]

            def sr(st: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
                status[0] = int(st.split()[0])
                return start_response(st, headers, *exc)

            chunks = list(app(environ, sr))
            n = sum(len(c) for c in chunks) if method == "GET" else 0
            m = _RANGE.match(environ.get("HTTP_RANGE", "") or "")
            start = int(m.group(1)) if m and status[0] == 206 else 0
            log.add(Served(method, path, status[0], start, start + n))
            return chunks

        return wrapped

    def start(self) -> CountingMotoServer:
        self._thread = threading.Thread(target=self._entry, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join(10)


def upload_tree(fs: Any, local: Path, remote: str) -> None:
    """Put every file under ``local`` at ``remote/<relative path>`` (an fsspec filesystem)."""
    for dirpath, _, names in os.walk(local):
        for name in names:
            p = Path(dirpath) / name
            fs.put_file(str(p), f"{remote}/{p.relative_to(local).as_posix()}")


#: credentials moto accepts, for the processes that talk to CountingMotoServer
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}
