"""Limits on HTTP connections, below the application: how many, how large a request head, how long it takes.

uvicorn bounds none of these (measured): its httptools protocol accumulates a header however
long it is (a 200 MB header was accepted), runs no timer before a connection's first request is parsed (a
connection that sent half a request stayed open for good) and accepts connections until the process runs
out of file descriptors (then ``/healthz`` and the catalog's storage reads fail too). ``guarded_protocol``
is uvicorn's httptools protocol with these bounds (``Limits``, from the settings):

* at most ``max_connections`` connections. A new connection that finds them all taken takes the slot of the
  oldest idle one (no complete request head yet, or idle between requests; ``ConnectionTable``,
  ckptd/api/_connection_table.py), which is closed (``503 BUSY`` when it had not asked anything): idle
  sockets cannot keep a probe or an authenticated client out. Only when every connection has a request in
  progress are a few more (``PROBE_CONNECTIONS``) taken for the probes only (``GET /healthz``,
  ``GET /readyz``, then closed), so requests that hold every connection do not fail the kubelet's liveness
  probe; any other request on them gets ``503 BUSY``, and a connection past those is answered ``503 BUSY``
  and closed at once;
* a request head (request line and headers) of at most ``max_header_bytes`` bytes and ``max_headers``
  headers, else ``431 HEADERS_TOO_LARGE``;
* a request head complete within ``header_timeout_s`` of its first byte, and a new connection's first
  request within that of the connect, else ``408 REQUEST_TIMEOUT``.

Bytes that are not HTTP get ``400 MALFORMED_HTTP`` (uvicorn's own answer is plain text). Every refusal is
the one error body and closes the connection. A body's deadline is the application's
(``BodySizeLimit``, ckptd/api/_limits.py); the idle time between requests is uvicorn's keep-alive timeout.
``server_config`` builds the uvicorn config that uses all of this, for ``ckptd serve`` and the tests alike.
What each limit defends: docs/operations.md, "Security".
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ckptd.api._auth import BearerAuth
from ckptd.api._connection_table import ConnectionTable
from ckptd.api._errors import raw_error_response
from ckptd.config import Settings
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)

PROBE_CONNECTIONS = 8  # connections past max_connections that may still carry a probe
_PROBES = {p.ROUTE_HEALTHZ.encode(), p.ROUTE_READYZ.encode()}
_FEED_BYTES = 8192  # a request head is parsed in pieces this large, so its size is checked as it grows

Count = Callable[[str, int], None]  # (why, status): the request counter's route label and the answer's status


@dataclass(frozen=True)
class Limits:
    """The connection limits of one server (``LimitSettings`` fields of the same names), and ``count(why, status)``,
    called per refusal (``why``: ``connection_limit``, ``connection_evicted``, ``header_limit``,
    ``header_timeout``, ``malformed_http``). ``token``: the bearer token, whose requests leave their connection
    in the tier given up last (``ConnectionTable``); ``None``: every request does."""

    max_connections: int
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    count: Count | None = field(default=None, compare=False)
    token: bytes | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, count: Count | None = None) -> Limits:
        limits, token = settings.limits, settings.auth.token
        return cls(max_connections=limits.max_connections, max_header_bytes=limits.max_header_bytes,
                   max_headers=limits.max_headers, header_timeout_s=limits.header_timeout_s, count=count,
                   token=token.encode("utf-8") if token else None)


class _GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with ``limits``; ``guarded_protocol`` makes the subclass that binds them and the
    server's ``table`` of connections."""

    limits: ClassVar[Limits]
    table: ClassVar[ConnectionTable[_GuardedProtocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probes_only = False  # past max_connections: this connection may carry a probe, nothing else
        self._refused = False
        self._in_head = False  # between a request's first byte and the end of its headers
        self._in_body = False
        self._head_bytes = 0
        self._head_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._trusted = False  # the last request carried the token (or ckptd has none)

    # ---- refusals ----------------------------------------------------------------------------------

    def _refuse(self, why: str, code: p.ErrorCode, message: str, detail: dict[str, object] | None = None) -> None:
        """Answer ``code`` (unless a response is under way on this connection) and close the connection."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        _log.debug("connection refused (%s): %s", why, message)
        if self.limits.count is not None:
            self.limits.count(why, p.ERROR_STATUS[code])
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(raw_error_response(code, message, detail))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse("header_timeout", p.ErrorCode.REQUEST_TIMEOUT,
                     f"the request's line and headers did not arrive within {self.limits.header_timeout_s:g} s",
                     {"header_timeout_s": self.limits.header_timeout_s})

    # ---- the connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.table) >= self.limits.max_connections and (idle := self.table.oldest_idle()) is not None:
            idle._give_up()  # an idle connection's slot: this one may be a probe or an authenticated client
        others = len(self.table)
        if others >= self.limits.max_connections + PROBE_CONNECTIONS:
            self._refuse("connection_limit", p.ErrorCode.BUSY,
                         f"more than {self.limits.max_connections} open connections; retry later",
                         {"max_connections": self.limits.max_connections})
            return
        self.table.add(self)
        self._probes_only = others >= self.limits.max_connections
        self._arm()  # the first request must come, and its head be whole, within header_timeout_s

    def _give_up(self) -> None:
        """Close this idle connection for a newer one: ``503 BUSY`` when it has not asked anything yet (or is
        half-way through a request head); closed without a word between requests, as a keep-alive timeout
        closes it (HTTP clients reconnect)."""
        self.table.drop(self)
        if self._in_head or self.cycle is None:
            self._refuse("connection_evicted", p.ErrorCode.BUSY,
                         f"all {self.limits.max_connections} connections were taken: this one, idle, gave its "
                         "place to a newer one; retry", {"max_connections": self.limits.max_connections})
            return
        self._refused = True
        self._disarm()
        _log.debug("closed an idle connection for a newer one")
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.table.drop(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        while data and not self._refused and not self.transport.is_closing():
            if self._in_body:  # a body: the application bounds it (size, time)
                super().data_received(data)
                return
            piece, data = data[:_FEED_BYTES], data[_FEED_BYTES:]
            super().data_received(piece)
            if self._in_head:
                self._head_bytes += len(piece)
                if self._head_bytes > self.limits.max_header_bytes:
                    self._refuse("header_limit", p.ErrorCode.HEADERS_TOO_LARGE,
                                 f"the request's line and headers are larger than {self.limits.max_header_bytes} bytes",
                                 {"max_header_bytes": self.limits.max_header_bytes})

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses (plain text there): the one error body here."""
        self._refuse("malformed_http", p.ErrorCode.MALFORMED_HTTP, f"not a valid HTTP/1.1 request ({msg})")

    # ---- parser callbacks (httptools) --------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_head, self._in_body = True, False
        self._head_bytes = self._head_count = 0
        if self.cycle is None or self.cycle.response_complete:
            self.table.waiting(self)  # between requests: half a head holds no slot against a newer connection
        self._arm()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._head_count += 1
        if self._head_count > self.limits.max_headers:
            self._refuse("header_limit", p.ErrorCode.HEADERS_TOO_LARGE,
                         f"the request has more than {self.limits.max_headers} headers",
                         {"max_headers": self.limits.max_headers})
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head, self._in_body = False, True
        self._disarm()
        self.table.busy(self)
        token = self.limits.token
        self._trusted = token is None or BearerAuth.carries_token({"headers": self.headers}, token)
        if not self._probes_only:
            super().on_headers_complete()
            return
        path = self.url.split(b"?", 1)[0]
        if self.parser.get_method() != b"GET" or path not in _PROBES:
            self._refuse("connection_limit", p.ErrorCode.BUSY,
                         f"more than {self.limits.max_connections} open connections: only the probes are answered",
                         {"max_connections": self.limits.max_connections})
            return
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.keep_alive = False  # one probe, then the connection is given back

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refused or self.transport.is_closing() or not self.cycle.response_complete:
            return  # closing, or a pipelined request started
        if self._in_head:
            self.table.waiting(self)
        else:
            self.table.idle(self, trusted=self._trusted)


def guarded_protocol(limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol bounded by ``limits``, with a table of its own connections."""
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"limits": limits, "table": ConnectionTable()})


def server_config(app: FastAPI, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn config ckptd serves ``app`` (``create_app``) with: the guarded protocol, its refusals
    counted with the app's requests, the keep-alive timeout, no access log (``overrides``: e.g. the tests'
    log level)."""
    count: Count | None = getattr(app.state, "count_request", None)
    options: dict[str, Any] = {
        "host": settings.serve.host, "port": settings.serve.port, "log_level": settings.serve.log_level,
        "access_log": False, "timeout_keep_alive": math.ceil(settings.limits.keep_alive_s),
        "http": guarded_protocol(Limits.from_settings(settings, count)),
    }
    return uvicorn.Config(app, **{**options, **overrides})


__all__ = ["PROBE_CONNECTIONS", "Limits", "guarded_protocol", "server_config"]
