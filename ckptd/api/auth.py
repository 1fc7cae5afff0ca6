"""``BearerAuth``: the ASGI middleware that refuses a request without the bearer token where one is needed
(``401 UNAUTHORIZED``, constant-time comparison) and counts every answer by route template and status.

Plain ASGI, not ``BaseHTTPMiddleware``, which re-streams every response body through a memory stream
(about a millisecond per 100 KB resume plan).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api.errors import error_response
from trainer_client.core import protocol as p


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
            refusal = error_response(p.ErrorCode.UNAUTHORIZED, "missing or wrong bearer token",
                                     headers={"WWW-Authenticate": 'Bearer realm="ckptd"'})
            self.count("auth", refusal.status_code)
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


__all__ = ["BearerAuth"]
