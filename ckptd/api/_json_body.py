"""``JsonBodyRoute``: FastAPI's route, reading a JSON request body without copying it.

FastAPI reads a body through Starlette's ``Request``: ``body()`` joins the pieces it received into a new
bytes object (a copy of the body, even when it came whole) and ``json()`` decodes that to a ``str`` before
``json.loads`` parses it (another copy, up to four times the body's size: a body of ASCII with one emoji is
decoded to four bytes a character). With 8 MiB bodies, each request held three to six copies at once
(docs/operations.md, "Security"). Here ``body()`` keeps a body that came in one piece as it is (what
``BodySizeLimit``, ckptd/api/_limits.py, hands on) and ``json()`` parses the bytes themselves with
pydantic-core's parser (jiter), the one pydantic validates JSON with: the parsed values are the only thing
made beside the body. What parsing costs beyond that is charged to the body budget before the route runs
(``limits.parse_cost``).

A body that is not JSON raises ``json.JSONDecodeError`` as ``json.loads`` would (FastAPI answers it
``422``, ckptd/api/_errors.py says where), its position in bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic_core import from_json

_WHERE = re.compile(r"^(?P<reason>.*) at line (?P<line>\d+) column (?P<column>\d+)$", re.S)


def _decode_error(message: str, body: bytes) -> json.JSONDecodeError:
    """jiter's ``<reason> at line L column C`` (C counts bytes) as ``json.loads``' error: the reason, and the
    byte offset of the place."""
    match = _WHERE.match(message)
    if match is None:
        return json.JSONDecodeError(message, "", 0)
    line, column = int(match["line"]), int(match["column"])
    start = 0
    for _ in range(line - 1):
        start = body.find(b"\n", start) + 1
    return json.JSONDecodeError(match["reason"], "", start + max(column - 1, 0))


class _JsonRequest(Request):
    """Starlette's request with a body that is not copied and is parsed from its bytes."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            chunks = [chunk async for chunk in self.stream() if chunk]
            self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = from_json(body)
            except ValueError as exc:
                raise _decode_error(str(exc), body) from None
        return self._json


class JsonBodyRoute(APIRoute):
    """``APIRouter(route_class=JsonBodyRoute)``: its routes read JSON bodies through ``_JsonRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return handle


__all__ = ["JsonBodyRoute"]
