"""``BearerAuth``: the ASGI middleware that refuses a request without the bearer token where one is needed
(``401 UNAUTHORIZED``, constant-time comparison) and counts every answer by route template and status.

It is the outermost layer (ckptd/api/_app.py): a request without the token is refused from its headers
alone, before a byte of its body is read or buffered, and its connection is closed (the unread body
cannot be skipped cheaply). The token is compared as bytes: the header's raw bytes against the token's
UTF-8 (the settings admit printable ASCII only, which browsers and HTTP clients send unchanged).

Plain ASGI, not ``BaseHTTPMiddleware``, which re-streams every response body through a memory stream
(about a millisecond per 100 KB resume plan).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api._errors import REFUSED_BY, error_response
from trainer_client.core import protocol as p


class BearerAuth:
    """``app.add_middleware(BearerAuth, token=T, needs_token=pred, count=callback)``: ``count(route, status)``
    is called once per answer (``"auth"`` for a refusal here, the ``REFUSED_BY`` label of a limit that refused
    it, ``"unmatched"`` when no route matched)."""

    def __init__(self, app: ASGIApp, *, token: str | None, needs_token: Callable[[str], bool],
                 count: Callable[[str, int], None]) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token else None
        self.needs_token = needs_token
        self.count = count

    @staticmethod
    def carries_token(scope: Scope, token: bytes) -> bool:
        """The request's ``Authorization`` header is ``Bearer <token>`` (also for routes that only show more to
        a caller with the token: ``/readyz``)."""
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        # RFC 7235: the scheme is case-insensitive; the token is compared in constant time, bytes to bytes
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, token)

    def _authorized(self, scope: Scope) -> bool:
        return self.token is not None and self.carries_token(scope, self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token is not None and self.needs_token(scope["path"]) and not self._authorized(scope):
            refusal = error_response(p.ErrorCode.UNAUTHORIZED, "missing or wrong bearer token",
                                     headers={"WWW-Authenticate": 'Bearer realm="ckptd"', "Connection": "close"})
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
        finally:  # the router set scope["route"] in place (FastAPI's APIRoute.matches); a limit, REFUSED_BY
            self.count(getattr(scope.get("route"), "path", None) or scope.get(REFUSED_BY) or "unmatched", status[0])


__all__ = ["BearerAuth"]
