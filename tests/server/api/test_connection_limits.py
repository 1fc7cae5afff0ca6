"""Memory and connections before auth, against a real uvicorn server with the limits
``ckptd serve`` runs with (ckptd/api/_connections.py, ckptd/api/_limits.py): a request without the token is
refused from its headers, its body never read; a request head is bounded in size, count and time; a body
in time and in memory; connections in number, the probes still answered past the limit.

Everything goes over raw sockets: an HTTP client would not send what an attacker sends.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.api._connection_table import ConnectionTable
from ckptd.api._connections import PROBE_CONNECTIONS
from ckptd.api._limits import BodySizeLimit, parse_cost
from tests.support.helpers import wait_until
from tests.support.server import ServerHandle, start_server
from trainer_client.core import protocol as p

pytestmark = pytest.mark.integration

TOKEN = "conn-limits-token"


def _address(handle: ServerHandle) -> tuple[str, int]:
    host, port = handle.url.removeprefix("http://").split(":")
    return host, int(port)


def _answer(sock: socket.socket, timeout: float = 10.0, since: float | None = None) -> tuple[int | None, bytes, float]:
    """Read until the server closes (status or None, body, seconds it took: from ``since`` when given, a
    ``time.monotonic()`` reading); a reset counts as closed."""
    sock.settimeout(timeout)
    started = time.monotonic() if since is None else since
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    took = time.monotonic() - started
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None
    return status, body, took


def _send(handle: ServerHandle, data: bytes) -> socket.socket:
    sock = socket.create_connection(_address(handle), timeout=10)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused while sending: the answer is read next
        sock.sendall(data)
    return sock


def _error(status: int | None, body: bytes, code: p.ErrorCode) -> p.ErrorBody:
    assert status == p.ERROR_STATUS[code], (status, body[:300])
    error = p.ErrorBody.model_validate_json(body)
    assert error.code is code, error
    return error


def _metric(handle: ServerHandle, route: str, status: int) -> float:
    text = httpx.get(f"{handle.url}/metrics", timeout=10).text
    m = re.search(rf'^ckptd_http_requests_total\{{route="{route}",status="{status}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("limits") / "root"
    (root / "meta").mkdir(parents=True)
    return root


@pytest.fixture(scope="module")
def serve(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerHandle]]:
    handles: list[ServerHandle] = []

    def start(**overrides: Any) -> ServerHandle:
        handle = start_server(root, tmp_path_factory.mktemp("state"), **overrides)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


@pytest.fixture(scope="module")
def guarded(serve: Callable[..., ServerHandle]) -> ServerHandle:
    return serve(token=TOKEN, header_timeout_s=1.0, body_timeout_s=1.0, max_header_bytes=8192, max_headers=50)


def test_a_request_without_the_token_is_refused_before_its_body_is_read(guarded: ServerHandle) -> None:
    """Headers announcing a body just under the size limit, and no body: the 401 comes at once (the old order
    waited to buffer all of it first), and the connection is closed (the body is never read)."""
    head = (f"POST /v1/jobs/meta/resume HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {guarded.settings.limits.max_body_bytes - 1}\r\n\r\n").encode()
    before = _metric(guarded, "auth", 401)
    socks = [_send(guarded, head) for _ in range(32)]
    for sock in socks:
        with sock:
            status, body, took = _answer(sock)
            _error(status, body, p.ErrorCode.UNAUTHORIZED)
            assert took < 5
    # over the size limit, without the token: the token is checked first, no 413 that would say the route exists
    with _send(guarded, head.replace(str(guarded.settings.limits.max_body_bytes - 1).encode(), b"99999999999")) as sock:
        _error(*_answer(sock)[:2], p.ErrorCode.UNAUTHORIZED)
    assert _metric(guarded, "auth", 401) == before + 33


def test_oversized_request_heads_get_431(guarded: ServerHandle) -> None:
    before = _metric(guarded, "header_limit", 431)
    long_header = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    many_headers = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-N: 1\r\n" * 51 + b"\r\n"
    long_target = b"GET /healthz?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    for request in (long_header, many_headers, long_target):
        with _send(guarded, request) as sock:
            error = _error(*_answer(sock)[:2], p.ErrorCode.HEADERS_TOO_LARGE)
            assert error.detail in ({"max_header_bytes": 8192}, {"max_headers": 50})
    # a header of 64 MiB, streamed: refused once past the limit, the rest never read (the old server took it all)
    with socket.create_connection(_address(guarded), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Huge: ")
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(b"h" * (1 << 20))
                sent += 1 << 20
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 64 << 20, "the server read a 64 MiB header"
    assert _metric(guarded, "header_limit", 431) >= before + 3
    # and a head within the limits is served
    with _send(guarded, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"X-N: 1\r\n" * 40
               + b"\r\n") as sock:
        assert _answer(sock)[0] == 200


def test_bytes_that_are_not_http_get_the_error_body(guarded: ServerHandle) -> None:
    before = _metric(guarded, "malformed_http", 400)
    for garbage in (b"GARBAGE\r\n\r\n", b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01"):
        with _send(guarded, garbage) as sock:
            error = _error(*_answer(sock)[:2], p.ErrorCode.MALFORMED_HTTP)
            assert error.message.startswith("not a valid HTTP/1.1 request")
    assert _metric(guarded, "malformed_http", 400) == before + 3


def test_slow_and_silent_clients_are_closed_within_the_timeouts(guarded: ServerHandle) -> None:
    """Each wait is timed from before the connection is made, so its deadline (1 s, armed by the server once the
    connection or the head is in) has passed by the answer however slow the machine: the lower bounds cannot
    fail. The upper bound tells the deadline from the idle timeout that would close the connection without it
    (75 s): 30 s, thirty times the deadline, which no load here comes near."""
    before = _metric(guarded, "header_timeout", 408)
    # half a request head, then nothing (slow loris)
    started = time.monotonic()
    with _send(guarded, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ") as sock:
        status, body, took = _answer(sock, 60, since=started)
        _error(status, body, p.ErrorCode.REQUEST_TIMEOUT)
        assert 0.95 < took < 30, took
    # a connection that sends nothing at all
    started = time.monotonic()
    with socket.create_connection(_address(guarded), timeout=10) as sock:
        status, body, took = _answer(sock, 60, since=started)
        _error(status, body, p.ErrorCode.REQUEST_TIMEOUT)
        assert 0.95 < took < 30, took
    # headers in time, then half the body (with the token: the body is read)
    started = time.monotonic()
    with _send(guarded, b"POST /v1/jobs/meta/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"events": [') as sock:
        status, body, took = _answer(sock, 60, since=started)
        error = _error(status, body, p.ErrorCode.REQUEST_TIMEOUT)
        assert error.detail == {"body_timeout_s": 1.0} and 0.95 < took < 30, took
    assert _metric(guarded, "header_timeout", 408) == before + 2
    assert _metric(guarded, "body_timeout", 408) >= 1


def test_keep_alive_and_pipelining_still_work(guarded: ServerHandle) -> None:
    """An idle pooled connection is uvicorn's keep-alive timeout's (75 s), not the head's deadline: a client
    that waits longer than ``header_timeout_s`` between two requests is still served on the same connection."""
    with httpx.Client(base_url=guarded.url, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        time.sleep(guarded.settings.limits.header_timeout_s * 1.5)  # idle between requests, past the head deadline
        assert http.get("/healthz").status_code == 200
        assert http.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with _send(guarded, one * 3 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") as sock:
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 4


def _table(handle: ServerHandle) -> ConnectionTable[Any]:
    protocol: Any = handle.server.config.http_protocol_class  # guarded_protocol's class, with its table
    table: ConnectionTable[Any] = protocol.table
    return table


def test_idle_connections_give_their_place_to_new_ones_oldest_first(serve: Callable[..., ServerHandle]) -> None:
    """A full table no longer keeps a newcomer out: the oldest idle connection gives its slot up (``503 BUSY``
    when it never asked anything), the silent ones first, a keep-alive connection that carried the token last."""
    handle = serve(token=TOKEN, max_connections=4, header_timeout_s=60.0)
    table = _table(handle)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=handle.url, headers=auth, timeout=10,
                      limits=httpx.Limits(keepalive_expiry=120)) as pooled:
        port = pooled.get("/v1/jobs").extensions["network_stream"].get_extra_info("client_addr")[1]
        before = _metric(handle, "connection_evicted", 503)
        silent = [socket.create_connection(_address(handle), timeout=10) for _ in range(3)]  # no byte sent
        wait_until(lambda: len(table) == 4, timeout=10, what="the table full")
        newcomers = [httpx.Client(base_url=handle.url, timeout=10) for _ in silent]
        try:
            for newcomer, evicted in zip(newcomers, silent, strict=True):
                # each newcomer is served and takes the oldest silent connection's slot (and keeps its own)
                assert newcomer.get(p.ROUTE_HEALTHZ).status_code == 200
                with evicted:
                    error = _error(*_answer(evicted)[:2], p.ErrorCode.BUSY)
                    assert error.detail == {"max_connections": 4}
        finally:
            for newcomer in newcomers:
                newcomer.close()
        assert _metric(handle, "connection_evicted", 503) == before + 3
        # the authenticated keep-alive connection was kept while silent ones were there to give up
        again = pooled.get("/v1/jobs")
        assert again.extensions["network_stream"].get_extra_info("client_addr")[1] == port
        # with nothing else idle (three requests in progress), it is the one given up for a newcomer, closed
        # without a word, as a keep-alive timeout closes it: the client reconnects
        head = (b"POST /v1/jobs/meta/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n{{".encode())
        busy = [_send(handle, head) for _ in range(3)]
        try:
            wait_until(lambda: len(table) == 4 and getattr(table.oldest_idle(), "client", (None, None))[1] == port,
                       timeout=10, what="only the keep-alive one idle")
            with httpx.Client(base_url=handle.url, timeout=10) as newcomer:
                assert newcomer.get(p.ROUTE_HEALTHZ).status_code == 200
            reconnected = pooled.get("/v1/jobs")
            assert reconnected.status_code == 200
            assert reconnected.extensions["network_stream"].get_extra_info("client_addr")[1] != port
        finally:
            for sock in busy:
                sock.close()


def test_when_every_connection_is_busy_only_the_probes_are_answered(serve: Callable[..., ServerHandle]) -> None:
    handle = serve(max_connections=6, header_timeout_s=60.0, body_timeout_s=60.0)
    table = _table(handle)
    # six requests in progress: their heads sent, their bodies not (each holds its connection)
    head = (b"POST /v1/jobs/meta/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{")
    held = [_send(handle, head) for _ in range(6)]
    try:
        wait_until(lambda: len(table) >= 6 and table.oldest_idle() is None, timeout=10, what="6 requests in progress")
        with _send(handle, b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n") as sock:
            error = _error(*_answer(sock)[:2], p.ErrorCode.BUSY)
            assert error.detail == {"max_connections": 6}
        for probe in (p.ROUTE_HEALTHZ, p.ROUTE_READYZ):  # the kubelet's probes, each on a fresh connection
            with _send(handle, f"GET {probe} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) as sock:
                assert _answer(sock)[0] == 200, probe  # and closed after it (the read ends)
        # silent sockets cannot hold the probes' reserve: each newcomer takes the slot of the one before it
        silent = [socket.create_connection(_address(handle), timeout=10) for _ in range(PROBE_CONNECTIONS)]
        held += silent
        wait_until(lambda: len(table) == 7, timeout=10, what="the last silent socket in the reserve")
        with _send(handle, f"GET {p.ROUTE_HEALTHZ} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) as sock:
            assert _answer(sock)[0] == 200
        for sock in silent:
            _error(*_answer(sock)[:2], p.ErrorCode.BUSY)
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: len(table) == 0, timeout=10, what="the held connections to close")
    with httpx.Client(base_url=handle.url, timeout=10) as http:
        assert http.get("/v1/jobs").status_code == 200  # below the limit again: served
    assert _metric(handle, "connection_limit", 503) == 1


def _body_limit(handle: ServerHandle) -> BodySizeLimit:
    app: Any = handle.server.config.loaded_app
    while not isinstance(app, BodySizeLimit):  # uvicorn's wrappers, FastAPI's stack, BearerAuth, ...
        app = app.middleware_stack if hasattr(app, "middleware_stack") else app.app
    return app


def test_bodies_held_at_once_stay_under_the_budget(serve: Callable[..., ServerHandle]) -> None:
    """Many slow bodies, each within the size limit, cannot add up past ``max_body_bytes_in_flight``."""
    handle = serve(max_body_bytes=64 << 10, max_body_bytes_in_flight=128 << 10, body_timeout_s=30.0)
    head = (b"POST /v1/jobs/meta/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 65000\r\n\r\n")
    held = [_send(handle, head + b" " * 50_000) for _ in range(2)]
    try:
        limit = _body_limit(handle)
        wait_until(lambda: limit.in_flight >= 100_000, timeout=10, what="two bodies held")
        with _send(handle, head + b" " * 50_000) as sock:
            status, body, _ = _answer(sock)
            error = _error(status, body, p.ErrorCode.BUSY)
            assert error.detail == {"max_body_bytes_in_flight": 128 << 10}
        assert limit.in_flight <= 128 << 10
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _body_limit(handle).in_flight == 0, timeout=10, what="the held bodies to be let go")


def test_a_declared_body_is_charged_before_it_is_read(serve: Callable[..., ServerHandle]) -> None:
    """Heads that declare bodies and send none yet: their sizes are charged at once, so a third is refused before
    any of them sends a byte (bodies sent with the token were read first and charged after, piece by piece)."""
    handle = serve(max_body_bytes=64 << 10, max_body_bytes_in_flight=128 << 10, body_timeout_s=30.0)
    head = (b"POST /v1/jobs/meta/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 64000\r\n\r\n")
    held = [_send(handle, head) for _ in range(2)]
    try:
        limit = _body_limit(handle)
        wait_until(lambda: limit.in_flight == 128_000, timeout=10, what="two declared bodies charged")
        with _send(handle, head) as sock:
            status, body, took = _answer(sock)
            error = _error(status, body, p.ErrorCode.BUSY)
            assert error.detail == {"max_body_bytes_in_flight": 128 << 10} and took < 5
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _body_limit(handle).in_flight == 0, timeout=10, what="the declared bodies let go")


def test_json_that_would_take_more_than_the_budget_to_parse_is_refused_unparsed(
    serve: Callable[..., ServerHandle],
) -> None:
    """60 KB of ``[{}, {}, ...]`` is within the size limit, and Python's parse of it takes ~60 times that: 413
    before it is parsed (it was parsed, then refused as not a request)."""
    handle = serve(max_body_bytes=64 << 10, max_body_bytes_in_flight=1 << 20)
    costly = b'{"events": [' + b",".join([b"{}"] * 20_000) + b"]}"
    assert len(costly) < 64 << 10 and len(costly) + parse_cost(costly) > 1 << 20
    with httpx.Client(base_url=handle.url, timeout=10) as http:
        response = http.post("/v1/jobs/meta/events", content=costly, headers={"content-type": "application/json"})
        error = _error(response.status_code, response.content, p.ErrorCode.PAYLOAD_TOO_LARGE)
        assert error.detail == {"max_body_bytes_in_flight": 1 << 20}
        # a batch of the ordinary size is parsed and judged on its content
        ordinary = http.post("/v1/jobs/meta/events", json={"events": [{"kind": "start", "time": 1.0}] * 100})
        assert ordinary.status_code != 413, ordinary.text
    assert _body_limit(handle).in_flight == 0
