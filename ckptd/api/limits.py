"""Limits that protect the service from load and hostile input, outside the route handlers.

* ``BodySizeLimit``: an ASGI middleware that refuses a request body larger than ``max_body_bytes`` with
  ``413 PAYLOAD_TOO_LARGE`` (the one error body) before the application reads it: at once when
  ``Content-Length`` says so, else as soon as the streamed (chunked) body passes the limit. Smaller
  bodies are buffered (the route would read them whole anyway) and handed on unchanged.
* ``limit_worker_threads``: how many threads run the synchronous route handlers. Handlers are CPU-bound
  on a local root; every extra thread competes for the GIL with the event loop, so under load a big pool
  makes every request, ``/healthz`` included, wait on all the others (measured in the load test).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio.to_thread
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api.errors import error_response
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)


def _too_large(limit: int) -> JSONResponse:
    return error_response(p.ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is larger than {limit} bytes",
                          {"max_body_bytes": limit}, headers={"Connection": "close"})


class BodySizeLimit:
    """``app.add_middleware(BodySizeLimit, max_body_bytes=N, on_refused=callback)``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.on_refused = on_refused

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_refused is not None:
            self.on_refused()
        _log.info("refused a request body over %d bytes: %s %s", self.limit, scope.get("method"), scope.get("path"))
        await _too_large(self.limit)(scope, receive, send)

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
                await self._refuse(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(body)
            more = bool(message.get("more_body", False))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would say it

        await self.app(scope, replay, send)


def limit_worker_threads(threads: int) -> None:
    """Run at most ``threads`` synchronous handlers at once (anyio's pool of the running event loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = threads


__all__ = ["BodySizeLimit", "limit_worker_threads"]
