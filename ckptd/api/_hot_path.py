"""The hot path: ``GET .../latest-good`` and ``POST .../resume`` answered below FastAPI's routing.

When a slice fails, every host of a job asks these two at once, and a trainer polls them; under 64
clients most of a request's CPU went to the framework around the answer (routing, dependency
resolution, request parsing, exception middleware: measured with py-spy), not to the answer, which is
shared by a round of the coalescer anyway. ``HotPath`` is an ASGI layer *inside* the token check and the
body limits (``BearerAuth``, ``BodySizeLimit``: every security check still runs first) that answers a
plain request for these two routes itself, through the same ``JobAnswers`` the routes call
(``ckptd/api/_answers.py``), with the same answers, ``ETag``/``304`` and error bodies.

Anything not plain goes to the app unchanged, so FastAPI keeps answering every case it decides: a query
string (``reject_undeclared_query``), a job name that fails its pattern, another method, a body that is
not ``application/json`` or does not validate as a ``ResumeRequest`` (its 415/422 with their details),
and every unexpected error (its 500 and log line). The answer carries the route's template in the
scope's ``route`` so the request counter labels it as the route would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from ckptd.api._answers import JobAnswers
from ckptd.api._conditional import respond
from ckptd.api._errors import DOMAIN_ERRORS, domain_error_response, is_json_media_type
from ckptd.api._limits import replay
from trainer_client.core import protocol as p

_JOB = p.JOB_NAME_PATTERN.removeprefix("^").removesuffix("$")
_LATEST_GOOD = re.compile(re.escape(p.ROUTE_LATEST_GOOD).replace(re.escape("{job}"), f"({_JOB})"))
_RESUME = re.compile(re.escape(p.ROUTE_RESUME).replace(re.escape("{job}"), f"({_JOB})"))


@dataclass(frozen=True)
class _Route:
    """What the request counter reads from ``scope["route"]`` (FastAPI puts its ``APIRoute`` there)."""

    path: str


_LATEST_GOOD_ROUTE = _Route(p.ROUTE_LATEST_GOOD)
_RESUME_ROUTE = _Route(p.ROUTE_RESUME)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class HotPath:
    """``app.add_middleware(HotPath, answers=JobAnswers(...))``, innermost (after the limits are added)."""

    def __init__(self, app: ASGIApp, answers: JobAnswers) -> None:
        self.app = app
        self.answers = answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("query_string") or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and (match := _LATEST_GOOD.fullmatch(path)) is not None:
            await self._latest_good(match.group(1), scope, receive, send)
        elif method == "POST" and (match := _RESUME.fullmatch(path)) is not None:
            await self._resume(match.group(1), scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _latest_good(self, job: str, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = _LATEST_GOOD_ROUTE
        try:
            answer = await self.answers.latest_good(job)
        except DOMAIN_ERRORS as exc:
            await domain_error_response(exc)(scope, receive, send)
            return
        await respond(answer, _header(scope, b"if-none-match"))(scope, receive, send)

    async def _resume(self, job: str, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_json_media_type(_header(scope, b"content-type")):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:  # BodySizeLimit, outside, has read it within bounds and hands it over whole
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)  # one piece: the same bytes, not a copy
        del chunks
        try:
            request: p.ResumeRequest | None = p.ResumeRequest.model_validate_json(body)
        except (ValidationError, ValueError, RecursionError):
            request = None  # the error, and the values it holds, are let go before FastAPI parses the body again
        if request is None:
            await self.app(scope, replay(body, receive), send)  # FastAPI's refusal, with its details
            return
        scope["route"] = _RESUME_ROUTE
        try:
            answer = await self.answers.resume(job, request)
        except DOMAIN_ERRORS as exc:
            await domain_error_response(exc)(scope, receive, send)
            return
        await respond(answer, _header(scope, b"if-none-match"))(scope, receive, send)


__all__ = ["HotPath"]
