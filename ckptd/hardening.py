"""Protections of the HTTP service against load and hostile input that sit outside the route handlers.

* ``BodySizeLimit``: an ASGI middleware that refuses a request body larger than ``max_body_bytes`` with
  ``413 PAYLOAD_TOO_LARGE`` (the one error body) before the application reads it: at once when
  ``Content-Length`` says so, else as soon as the streamed (chunked) body passes the limit. Smaller
  bodies are buffered (the route would read them whole anyway) and handed on unchanged.
* ``BearerAuth``: an ASGI middleware that refuses a request without the bearer token where one is needed
  (``401 UNAUTHORIZED``, constant-time comparison) and counts every answer by route template and status.
  Plain ASGI, not ``BaseHTTPMiddleware``, which re-streams every response body through a memory stream
  (about a millisecond per 100 KB resume plan).
* ``document_errors``: the app's OpenAPI says what every route can answer: the ``{job}`` path parameter's
  pattern (a name that fails it gets ``400 INVALID_JOB_NAME``), and the ``ErrorBody`` of every error status
  a route can give (401 without the token, 413, 422, 500, ...), so clients and schema-driven tests
  (schemathesis, tests/test_hostile.py) know them.
* ``limit_worker_threads``: how many threads run the synchronous route handlers. Handlers are CPU-bound
  on a local root; every extra thread competes for the GIL with the event loop, so under load a big pool
  makes every request, ``/healthz`` included, wait on all the others (measured in tests/test_load.py).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from starlette.responses import JSONResponse

from ckptd.errors import ApiError
from trainer_client import protocol as p

_log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BearerAuth:
    """``app.add_middleware(BearerAuth, token=T, needs_token=pred, count=callback)``: ``count(route, status)``
    is called once per answer (``"auth"`` for a refusal here, ``"unmatched"`` when no route matched)."""

    def __init__(self, app: ASGIApp, *, token: str | None, needs_token: Callable[[str], bool],
                 count: Callable[[str, int], None]) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.needs_token = needs_token
        self.count = count

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
        scheme, _, given = header.decode("latin-1").partition(" ")
        # RFC 7235: the scheme is case-insensitive; the token is compared in constant time
        return self.token is not None and scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token is not None and self.needs_token(scope["path"]) and not self._authorized(scope):
            err = ApiError(p.ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")
            body = err.body().model_dump(mode="json", exclude_none=True)
            refusal = JSONResponse(status_code=err.status, content=body,
                                   headers={"WWW-Authenticate": 'Bearer realm="ckptd"'})
            self.count("auth", err.status)
            await refusal(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:  # the router set scope["route"] in place (FastAPI's APIRoute.matches)
            self.count(getattr(scope.get("route"), "path", "unmatched"), status[0])


def _too_large(limit: int) -> JSONResponse:
    err = ApiError(
        p.ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is larger than {limit} bytes", {"max_body_bytes": limit}
    )
    return JSONResponse(
        status_code=err.status,
        content=err.body().model_dump(mode="json", exclude_none=True),
        headers={"Connection": "close"},
    )


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


_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
_ANY_ROUTE = (413, 500)  # a body over the limit; a bug (never the caller's mistake, still the error body)
_V1_ROUTE = (401, 404, 422, 503)  # no or a wrong token; unknown job; bad input; catalog not ready / storage
_JOB_ROUTE = (400,)  # the {job} segment is not a job name


def _describe(status: int) -> str:
    codes = sorted(c.value for c, s in p.ERROR_STATUS.items() if s == status)
    return "Error: " + ", ".join(codes) if codes else "Error"


def document_errors(app: FastAPI, *, metrics_require_token: bool = False) -> None:
    """Complete the OpenAPI schema of ``app`` (once, when it is first generated): the job-name pattern on
    every ``{job}`` parameter, and an ``ErrorBody`` response for every error status a route can give."""
    generate = app.openapi
    documented: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI caches it in app.openapi_schema: the same dict until that is reset
        if documented and documented[-1] is schema:
            return schema
        schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(
            "ErrorBody", p.ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        )
        for path, item in schema.get("paths", {}).items():
            for operation in item.values():
                if not isinstance(operation, dict) or "responses" not in operation:
                    continue
                statuses = list(_ANY_ROUTE)
                if path.startswith(p.API_PREFIX):
                    statuses += _V1_ROUTE
                if path == p.ROUTE_METRICS and metrics_require_token:
                    statuses.append(401)
                for param in operation.get("parameters", []):
                    if param.get("in") == "path" and param.get("name") == "job":
                        param.setdefault("schema", {}).update(pattern=p.JOB_NAME_PATTERN, maxLength=128)
                        statuses += _JOB_ROUTE
                for status in statuses:
                    operation["responses"].setdefault(
                        str(status), {"description": _describe(status), "content": _ERROR_REF}
                    )
        documented[:] = [schema]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def limit_worker_threads(threads: int) -> None:
    """Run at most ``threads`` synchronous handlers at once (anyio's pool of the running event loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = threads


__all__ = ["BearerAuth", "BodySizeLimit", "document_errors", "limit_worker_threads"]
