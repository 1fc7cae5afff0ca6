"""Limits that protect the service from load and hostile input, outside the route handlers.

* ``BodySizeLimit``: an ASGI middleware that reads a request body before the application does, within
  bounds. A body larger than ``max_body_bytes`` gets ``413 PAYLOAD_TOO_LARGE`` (at once when
  ``Content-Length`` says so, else as soon as the streamed body passes the limit); one that does not
  arrive whole within ``timeout_s`` gets ``408 REQUEST_TIMEOUT`` (a slow sender holds no worker and no
  connection for long); bodies held by all requests together stay under ``max_in_flight`` bytes, past
  which ``503 BUSY`` (with ``Retry-After``). Each refusal is the one error body and closes the connection.
  Bodies within bounds are buffered (the route would read them whole anyway) and handed on unchanged. It
  runs *inside* the token check (ckptd/api/app.py): a request without the token is refused before a
  byte of its body is read.
* ``limit_worker_threads``: how many threads run the synchronous route handlers. Handlers are CPU-bound
  on a local root; every extra thread competes for the GIL with the event loop, so under load a big pool
  makes every request, ``/healthz`` included, wait on all the others (measured in the load test).

Limits below the application (connections, request heads): ckptd/api/connections.py.
"""

from __future__ import annotations

import logging

import anyio
import anyio.to_thread
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api.errors import REFUSED_BY, error_response
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)

_CLOSE = {"Connection": "close"}  # a refusal leaves the rest of the body unread: the connection cannot go on


class BodySizeLimit:
    """``app.add_middleware(BodySizeLimit, max_body_bytes=N, timeout_s=T, max_in_flight=M)``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_s: float = 30.0,
                 max_in_flight: int | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.timeout_s = timeout_s
        self.max_in_flight = max(max_in_flight or 0, max_body_bytes)
        self.in_flight = 0  # bytes of bodies held now, every request of this app (one event loop: no lock)

    def _too_large(self) -> JSONResponse:
        return error_response(p.ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is larger than {self.limit} bytes",
                              {"max_body_bytes": self.limit}, headers=_CLOSE)

    async def _refuse(self, why: str, response: JSONResponse, scope: Scope, receive: Receive, send: Send) -> None:
        scope[REFUSED_BY] = why
        _log.info("refused a request body (%s, %d): %s %s", why, response.status_code, scope.get("method"),
                  scope.get("path"))
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                await self._refuse("body_limit", self._too_large(), scope, receive, send)
                return
        chunks: list[bytes] = []
        held = 0
        refusal: tuple[str, JSONResponse] | None = None
        try:
            with anyio.move_on_after(self.timeout_s) as deadline:
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body = message.get("body", b"")
                    if held + len(body) > self.limit:
                        refusal = ("body_limit", self._too_large())
                        break
                    if self.in_flight + len(body) > self.max_in_flight:
                        refusal = ("body_budget", error_response(
                            p.ErrorCode.BUSY, "too many request bodies in memory at once; retry",
                            {"max_body_bytes_in_flight": self.max_in_flight}, headers={**_CLOSE, "Retry-After": "1"}))
                        break
                    self.in_flight += len(body)
                    held += len(body)
                    chunks.append(body)
                    more = bool(message.get("more_body", False))
            if deadline.cancelled_caught:
                refusal = ("body_timeout", error_response(
                    p.ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within {self.timeout_s:g} s",
                    {"body_timeout_s": self.timeout_s}, headers=_CLOSE))
            if refusal is not None:
                await self._refuse(*refusal, scope, receive, send)
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()  # after the body: wait for the disconnect, as the server would say it

            await self.app(scope, replay, send)
        finally:
            self.in_flight -= held


def limit_worker_threads(threads: int) -> None:
    """Run at most ``threads`` synchronous handlers at once (anyio's pool of the running event loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = threads


__all__ = ["BodySizeLimit", "limit_worker_threads"]
