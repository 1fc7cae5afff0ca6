"""A fault-injecting HTTP proxy for storage chaos tests: a thread on 127.0.0.1 in front of a GCS emulator.

Point ``STORAGE_EMULATOR_HOST`` (gcsfs) and ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore, so Orbax) of a
process at ``proxy.url`` and every request it makes to "GCS" passes through here, where ``FaultPlan``
decides its fate, per request and at random (seeded): forward it untouched, answer ``503`` without
forwarding (a throttled or unavailable front end), answer ``503`` *after* forwarding (an ambiguous
failure: the write happened, the client is told it did not), delay it (a slow response), hang past
the client's timeout and drop the connection, or reset the connection at once. The plan can be changed
while the proxy runs (``proxy.plan = ...``), e.g. to take storage down completely (``FaultPlan.down()``).

Every follow-up request comes back through here too: a response header that hands the client a URL on
the upstream (``Location``: fake-gcs-server answers the first request of a resumable upload with the
upload's URL, built from its own ``-external-url``) is rewritten to the same URL on the proxy, so the
upload's later ``PUT``/``POST`` requests are counted and can be faulted like any other. Bodies are
forwarded untouched (the JSON API names no upload URL in them; ``selfLink``/``mediaLink`` are not
followed by gcsfs or tensorstore). A finished upload answers as on GCS: fake-gcs-server forgets an
upload once its last part is in and answers a repeat of it ``404``, where GCS answers with the object,
so a client retrying a last part whose answer the proxy faulted (``503`` after forwarding) would fail
on the emulator alone; the proxy keeps each upload's final answer and gives it again in that case.

Only the standard library; every request and every injected fault is counted (``proxy.stats``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit, urlunsplit

# Headers that belong to one hop, never forwarded as they are.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "expect",
}

_Answer = tuple[int, bytes, list[tuple[str, str]]]  # an HTTP response: status, body, headers

# Response headers that hand the client a URL to follow (a resumable upload's URL is in ``Location``).
_URL_HEADERS = {"location", "content-location", "x-goog-upload-url"}


@dataclass(frozen=True)
class FaultPlan:
    """Probabilities (0..1) of each fault, tried in this order for every request."""

    p_reset: float = 0.0  # close the connection without an answer
    p_503: float = 0.0  # answer 503 without forwarding
    p_503_after: float = 0.0  # forward, then answer 503 anyway (ambiguous: it did happen)
    p_hang: float = 0.0  # wait ``hang_s`` then close the connection without an answer
    p_slow: float = 0.0  # wait ``slow_s`` (uniform up to) before forwarding
    slow_s: float = 0.5
    hang_s: float = 5.0
    only_methods: frozenset[str] | None = None  # faults only for these methods (None: all)

    @staticmethod
    def healthy() -> FaultPlan:
        return FaultPlan()

    @staticmethod
    def down() -> FaultPlan:
        """Every request answered 503: storage is unavailable."""
        return FaultPlan(p_503=1.0)

    def with_(self, **changes: object) -> FaultPlan:
        return replace(self, **changes)  # type: ignore[arg-type]


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that gave up on a slow or dropped request is part of the game, not an error."""


class FaultProxy:
    """``with FaultProxy(upstream_url, plan, seed=...) as proxy:`` -> ``proxy.url``."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None, *, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream_host, self.upstream_port = parts.hostname, parts.port
        self._upstream_netloc = parts.netloc.lower()
        self.plan = plan or FaultPlan()
        self.stats: Counter[str] = Counter()
        self._finished_uploads: dict[str, _Answer] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fault-proxy", daemon=True
        )

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def to_proxy(self, url: str) -> str:
        """``url`` with the upstream's ``http://host:port`` replaced by the proxy's (any other URL as it is)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.netloc.lower() != self._upstream_netloc:
            return url
        return urlunsplit(parts._replace(netloc=urlsplit(self.url).netloc))

    def _rewritten(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Forwarded response headers, with every URL on the upstream pointed back at the proxy."""
        return [(k, self.to_proxy(v) if k.lower() in _URL_HEADERS else v) for k, v in headers]

    def _as_gcs(self, path: str, answer: _Answer) -> _Answer:
        """The upstream's ``answer`` to ``path``, except that a finished resumable upload answers with its
        object (as GCS does) where the emulator has forgotten it (``404``)."""
        upload_id = parse_qs(urlsplit(path).query).get("upload_id", [""])[0]
        if not upload_id:
            return answer
        with self._lock:
            if answer[0] in (200, 201):
                self._finished_uploads[upload_id] = answer
            elif answer[0] == 404 and upload_id in self._finished_uploads:
                self.stats["finished_upload_replayed"] += 1
                return self._finished_uploads[upload_id]
        return answer

    # ---- decisions -------------------------------------------------------------------------------

    def injected(self) -> int:
        """How many requests got a fault so far."""
        return sum(n for key, n in self.stats.items() if key.startswith("fault:"))

    def _decide(self, method: str) -> tuple[str, float]:
        plan = self.plan
        with self._lock:
            self.stats["requests"] += 1
            self.stats[f"method:{method}"] += 1
            if plan.only_methods is not None and method not in plan.only_methods:
                return "forward", 0.0
            roll = self._rng.random
            for kind, p in (
                ("reset", plan.p_reset),
                ("503", plan.p_503),
                ("503_after", plan.p_503_after),
                ("hang", plan.p_hang),
                ("slow", plan.p_slow),
            ):
                if p > 0 and roll() < p:
                    self.stats[f"fault:{kind}"] += 1
                    delay = plan.hang_s if kind == "hang" else plan.slow_s * roll() if kind == "slow" else 0.0
                    return kind, delay
            return "forward", 0.0

    # ---- the handler -----------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for large uploads

            def log_message(self, format: str, *args: object) -> None:
                return

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _drop(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _answer(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _unavailable(self) -> None:
                body = json.dumps(
                    {
                        "error": {
                            "code": 503,
                            "message": "injected by the fault proxy",
                            "errors": [{"reason": "backendError"}],
                        }
                    }
                ).encode()
                self._answer(503, body, [("Content-Type", "application/json")])

            def _forward(self, body: bytes) -> _Answer:
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    headers["Host"] = f"{proxy.upstream_host}:{proxy.upstream_port}"
                    conn.request(
                        self.command,
                        self.path,
                        body=body if body or self.command in ("POST", "PUT", "PATCH") else None,
                        headers=headers,
                    )
                    response = conn.getresponse()
                    data = response.read()
                    return proxy._as_gcs(self.path, (response.status, data, proxy._rewritten(response.getheaders())))
                finally:
                    conn.close()

            def _handle(self) -> None:
                body = self._body()
                kind, delay = proxy._decide(self.command)
                if kind == "reset":
                    self._drop()
                    return
                if kind == "503":
                    self._unavailable()
                    return
                if kind == "hang":
                    time.sleep(delay)
                    self._drop()
                    return
                if kind == "slow":
                    time.sleep(delay)
                try:
                    status, data, headers = self._forward(body)
                except OSError as exc:
                    proxy.stats["upstream_error"] += 1
                    self._answer(502, str(exc).encode(), [("Content-Type", "text/plain")])
                    return
                if kind == "503_after":
                    self._unavailable()
                    return
                self._answer(status, data, headers)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        return Handler


__all__ = ["FaultPlan", "FaultProxy"]
