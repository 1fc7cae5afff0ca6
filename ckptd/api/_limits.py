"""Limits that protect the service from load and hostile input, outside the route handlers.

* ``BodySizeLimit``: an ASGI middleware that reads a request body before the application does, within
  bounds. A body larger than ``max_body_bytes`` gets ``413 PAYLOAD_TOO_LARGE`` (at once when
  ``Content-Length`` says so, else as soon as the streamed body passes the limit); one that does not
  arrive whole within ``timeout_s`` gets ``408 REQUEST_TIMEOUT`` (a slow sender holds no worker and no
  connection for long). What all requests' bodies cost in memory together stays under ``max_in_flight``
  bytes, past which ``503 BUSY`` (with ``Retry-After``): a body is charged its bytes (a declared
  ``Content-Length`` before a byte is read, a chunked body as it comes) and, once read, what parsing it as
  JSON may cost (``parse_cost``: the parsed values, measured); a body whose bytes and parse alone exceed the
  whole budget gets ``413``. The charge is given back when the answer has been sent. Each refusal is the one
  error body and closes the connection. Bodies within bounds are held in one buffer (no list of pieces joined
  into a copy) and handed on whole, unchanged. It runs *inside* the token check (ckptd/api/_app.py): a request
  without the token is refused before a byte of its body is read.
* ``limit_worker_threads``: how many threads run the synchronous route handlers. Handlers are CPU-bound
  on a local root; every extra thread competes for the GIL with the event loop, so under load a big pool
  makes every request, ``/healthz`` included, wait on all the others (measured in the load test).

Limits below the application (connections, request heads): ckptd/api/_connections.py. Bodies are parsed
without copies by the routes (ckptd/api/_json_body.py) and the hot path (ckptd/api/_hot_path.py).
"""

from __future__ import annotations

import ctypes
import io
import logging
from typing import Any

import anyio
import anyio.to_thread
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api._errors import REFUSED_BY, error_response, is_json_media_type
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)

_CLOSE = {"Connection": "close"}  # a refusal leaves the rest of the body unread: the connection cannot go on

# What parsing a JSON body may take in memory beyond its bytes, measured on the routes that take bodies
# (docs/operations.md, "Security"): each byte may be copied into a parsed string (ASCII: the parser's and
# Python's, two bytes a byte, measured 2.0; anything else up to four bytes a character in Python's string,
# measured 6.0 for ASCII with one emoji), and each value of an array or object (counted from the commas, colons
# and opening brackets: an upper bound) takes up to VALUE_BYTES as parsed values and the model's input
# (measured 70-90 for [{}, ...], up to 290 for an object of distinct keys).
ASCII_COPIES = 2
WIDE_COPIES = 7
VALUE_BYTES = 320
TRIM_AFTER_BYTES = 16 << 20  # bodies charged since freed memory was last given back, past which it is again
_VALUE_MARKS = (b",", b":", b"[", b"{")


def parse_cost(body: bytes) -> int:
    """What parsing ``body`` as JSON may take in memory beyond its own bytes, at most (an estimate from its
    size, its characters and its count of values: a few milliseconds for 8 MiB)."""
    copies = ASCII_COPIES if body.isascii() else WIDE_COPIES
    return copies * len(body) + VALUE_BYTES * sum(body.count(mark) for mark in _VALUE_MARKS)


class BodySizeLimit:
    """``app.add_middleware(BodySizeLimit, max_body_bytes=N, timeout_s=T, max_in_flight=M)``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_s: float = 30.0,
                 max_in_flight: int | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.timeout_s = timeout_s
        self.max_in_flight = max(max_in_flight or 0, max_body_bytes)
        self.in_flight = 0  # bytes charged for bodies now, every request of this app (one event loop: no lock)
        self._since_trim = 0  # bytes charged since freed memory was last given back

    def _take(self, amount: int) -> bool:
        """Charge ``amount`` bytes to the budget, if they fit."""
        if self.in_flight + amount > self.max_in_flight:
            return False
        self.in_flight += amount
        return True

    def _too_large(self) -> JSONResponse:
        return error_response(p.ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is larger than {self.limit} bytes",
                              {"max_body_bytes": self.limit}, headers=_CLOSE)

    def _busy(self) -> tuple[str, JSONResponse]:
        return "body_budget", error_response(
            p.ErrorCode.BUSY, "too many request bodies in memory at once; retry",
            {"max_body_bytes_in_flight": self.max_in_flight}, headers={**_CLOSE, "Retry-After": "1"})

    def _costs_too_much(self, cost: int) -> tuple[str, JSONResponse]:
        return "body_budget", error_response(
            p.ErrorCode.PAYLOAD_TOO_LARGE,
            f"the request body would take about {cost} bytes of memory to parse (its size and its number of JSON "
            f"values), more than the {self.max_in_flight} bytes all bodies may take together",
            {"max_body_bytes_in_flight": self.max_in_flight}, headers=_CLOSE)

    async def _refuse(self, why: str, response: JSONResponse, scope: Scope, receive: Receive, send: Send) -> None:
        scope[REFUSED_BY] = why
        _log.info("refused a request body (%s, %d): %s %s", why, response.status_code, scope.get("method"),
                  scope.get("path"))
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        charge = _Charge()
        try:
            await self._read_then_call(scope, receive, send, charge)
        finally:  # the answer is sent and the request's frames are gone: its body and parsed values are freed
            self.in_flight -= charge.bytes
            self._since_trim += charge.bytes
            if self.in_flight == 0 and self._since_trim >= TRIM_AFTER_BYTES:
                self._since_trim = 0
                give_back_freed_memory()

    async def _read_then_call(self, scope: Scope, receive: Receive, send: Send, charge: _Charge) -> None:
        headers = dict(scope.get("headers") or [])
        declared = 0
        if (length := headers.get(b"content-length")) is not None:
            try:
                declared = max(int(length), 0)
            except ValueError:
                declared = 0  # the HTTP parser refused it already; nothing to reserve
            if declared > self.limit:
                await self._refuse("body_limit", self._too_large(), scope, receive, send)
                return
        if not self._take(declared):  # a declared body is charged before a byte of it is read
            await self._refuse(*self._busy(), scope, receive, send)
            return
        charge.bytes = declared
        body, refusal = await self._read(receive, charge)
        if body is None:
            return  # the client went away
        if refusal is None and body and is_json_media_type(headers.get(b"content-type", b"").decode("latin-1")):
            cost = len(body) + parse_cost(body)
            if cost > self.max_in_flight:
                refusal = self._costs_too_much(cost)
            elif not self._take(cost - charge.bytes):
                refusal = self._busy()
            else:
                charge.bytes = cost
        if refusal is not None:
            del body
            await self._refuse(*refusal, scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)

    async def _read(self, receive: Receive, charge: _Charge) -> tuple[bytes | None, tuple[str, JSONResponse] | None]:
        """The body, in one buffer, charged as it comes past what was declared; or why it is refused. ``None``:
        the client went away."""
        buffer = io.BytesIO()
        if charge.bytes:  # the declared size, allocated once: no copies while the buffer grows
            buffer.seek(charge.bytes - 1)
            buffer.write(b"\0")
            buffer.seek(0)
        with anyio.move_on_after(self.timeout_s) as deadline:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None, None
                piece = message.get("body", b"")
                held = buffer.tell() + len(piece)
                if held > self.limit:
                    return b"", ("body_limit", self._too_large())
                if held > charge.bytes:  # more than declared (a chunked body): charged as it comes
                    if not self._take(held - charge.bytes):
                        return b"", self._busy()
                    charge.bytes = held
                buffer.write(piece)
                more = bool(message.get("more_body", False))
        if deadline.cancelled_caught:
            return b"", ("body_timeout", error_response(
                p.ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within {self.timeout_s:g} s",
                {"body_timeout_s": self.timeout_s}, headers=_CLOSE))
        return buffer.getvalue(), None  # the buffer itself, no copy: it was written to and never read


class _Charge:
    """Bytes one request has charged to the budget."""

    bytes = 0


def give_back_freed_memory() -> None:
    """Hand the memory freed since the last call back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    glibc keeps freed memory for reuse: after sixteen 8 MiB bodies ckptd stayed 50-400 MB above where it began,
    though Python had freed everything. Called when no body is in memory any more, after at least
    ``TRIM_AFTER_BYTES`` of them (1-5 ms on the event loop, measured)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim() -> Any:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` whole once, then what ``receive`` gives (the disconnect, as the server
    would say it)."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def limit_worker_threads(threads: int) -> None:
    """Run at most ``threads`` synchronous handlers at once (anyio's pool of the running event loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = threads


__all__ = ["BodySizeLimit", "limit_worker_threads", "parse_cost", "replay"]
