"""Every failure leaves the API as the one error body (``ErrorBody``): this module is the only place
where exceptions become HTTP.

Domain code raises domain errors (``ckptd/errors.py``, and the core's ``PlanningError`` and
``StorageError``); each carries a stable ``ErrorCode``, and the status of a code comes from the wire
contract's ``ERROR_STATUS`` table (``trainer_client/core/protocol/``), which the client reads too.
Refusals that only the HTTP layer can make (no token, a body too large, an unknown route) are built here
with ``error_response``. A bug answers ``500 INTERNAL`` without internals; the server logs it.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptd.api._openapi import methods_of_path
from ckptd.errors import ServiceError
from trainer_client.core import PlanningError, StorageError
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)

# Declared on each route for the OpenAPI schema; ckptd/api/_openapi.py adds the statuses every route can give.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": p.ErrorBody} for status in (400, 401, 404, 409, 422, 503)
}


# Where a middleware that refuses a request notes why, in the ASGI scope: the request counter's route label.
REFUSED_BY = "ckptd.refused_by"


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json``, parameters (``charset``) aside."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def error_response(code: p.ErrorCode, message: str, detail: dict[str, object] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The one error body for ``code``, with the status the wire contract gives it."""
    body = p.ErrorBody(code=code, message=message, detail=detail)
    return JSONResponse(status_code=p.ERROR_STATUS[code], content=body.model_dump(mode="json", exclude_none=True),
                        headers=headers)


def raw_error_response(code: p.ErrorCode, message: str, detail: dict[str, object] | None = None) -> bytes:
    """The same answer as ``error_response``, as the bytes of an HTTP/1.1 response that closes the connection:
    for refusals made below the application, before a request exists (ckptd/api/_connections.py)."""
    status = p.ERROR_STATUS[code]
    body = p.ErrorBody(code=code, message=message, detail=detail).model_dump_json(exclude_none=True).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


DOMAIN_ERRORS = (ServiceError, PlanningError, StorageError)


def _let_go(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it chains, once it has been answered.

    A traceback keeps the frames the exception passed through, and FastAPI's request handler keeps the exception
    it raises in a local of such a frame: a reference cycle, freed by the next garbage collection only. Until then
    the request, its body (up to ``CKPTD_MAX_BODY_BYTES``) and its parsed values stayed in memory, outside the
    body budget (ckptd/api/_limits.py): six refused 8 MiB bodies held 48 MB. (Clearing the frames instead would
    also close a coroutine suspended in one of them.) Handled exceptions only: a bug's traceback is logged
    after its handler."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def domain_error_response(exc: ServiceError | PlanningError | StorageError) -> JSONResponse:
    """The answer to a domain error: its code's status and the one error body (``Retry-After`` for ``Busy``)."""
    _let_go(exc)
    if isinstance(exc, ServiceError):
        retry = getattr(exc, "retry_after_s", None)  # Busy: when to come back
        return error_response(exc.code, exc.message, exc.detail,
                              headers={"Retry-After": str(retry)} if retry is not None else None)
    if isinstance(exc, PlanningError):
        return error_response(exc.code, exc.message)
    return error_response(p.ErrorCode.STORAGE_ERROR, str(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Map domain errors, request validation, routing refusals and bugs onto the one error body."""

    @app.exception_handler(ServiceError)
    @app.exception_handler(PlanningError)
    @app.exception_handler(StorageError)
    async def _domain(_: Request, exc: ServiceError | PlanningError | StorageError) -> JSONResponse:
        return domain_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        _let_go(exc)
        content_type = request.headers.get("content-type")
        if isinstance(exc.body, bytes | bytearray) and exc.body and not is_json_media_type(content_type):
            # FastAPI reads a body as JSON only when it says it is: anything else failed as a bare string
            return error_response(p.ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                                  "the body must be JSON, sent with Content-Type: application/json",
                                  {"content_type": content_type or "(none)"})
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # the body says it is JSON and is not
                where = e.get("loc", ("body", 0))[-1]
                reason = (e.get("ctx") or {}).get("error", "not JSON")
                return error_response(p.ErrorCode.INVALID_REQUEST, f"the body is not valid JSON: {reason} "
                                      f"(at byte {where})",
                                      {"errors": [{"loc": ["body"], "msg": f"JSON: {reason} at byte {where}"}]})
        errors = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()
        ]
        return error_response(p.ErrorCode.INVALID_REQUEST, "the request does not match the API", {"errors": errors})

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        _let_go(exc)
        # A request nested hundreds deep (JSON arrays in arrays): the caller's mistake, one log line (its
        # traceback would be as deep as the input).
        _log.warning("refused a request nested too deeply to read: %s %s", request.method, request.url.path)
        return error_response(p.ErrorCode.INVALID_REQUEST, "the request is nested too deeply",
                              {"errors": [{"loc": ["body"], "msg": "nested too deeply"}]})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        _let_go(exc)
        code = {404: p.ErrorCode.ROUTE_NOT_FOUND, 405: p.ErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, p.ErrorCode.INVALID_REQUEST
        )
        if code is p.ErrorCode.METHOD_NOT_ALLOWED:
            # RFC 9110: a 405 lists in Allow every method the resource has. Starlette names only the first
            # route whose path matched; a path served by two routes (GET and POST events) has both.
            given = (exc.headers or {}).get("Allow", "")
            allowed = sorted({m.strip() for m in given.split(",") if m.strip()}
                             | methods_of_path(request.app, request.url.path))
            return error_response(code, f"the route exists, not with this method; allowed: {', '.join(allowed)}",
                                  {"allow": allowed}, headers={"Allow": ", ".join(allowed)})
        return error_response(code, str(exc.detail), headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's mistake: the one error body still, without internals (Starlette
        # re-raises the exception afterwards, so the server logs it with its traceback).
        return error_response(p.ErrorCode.INTERNAL, "internal error; see the ckptd log")


__all__ = ["DOMAIN_ERRORS", "ERROR_RESPONSES", "REFUSED_BY", "domain_error_response", "error_response",
           "install_error_handlers", "is_json_media_type", "raw_error_response"]
