"""The one way trainer_client opens its HTTP connections to ckptd: over TCP for an ``http(s)://`` URL, over a unix
domain socket for a ``unix:///ABS/PATH`` one (trainer_client/core/_ckptd_url.py parses both).

The resume client and the event reporter both build their ``httpx.Client`` here, so both reach the sidecar the
same way, with the same bearer token (it is sent over a socket too: ckptd checks it whatever carries the request).
A socket's transport never goes through a proxy from the environment (``HTTP_PROXY`` means nothing there).
"""

from __future__ import annotations

import httpx

from trainer_client.config import ClientSettings
from trainer_client.core._ckptd_url import parse_ckptd_url


def ckptd_http(settings: ClientSettings, *, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """An HTTP client of the ckptd at ``settings.url``, with its token and per-request timeout (``transport``: one
    given by a test, used as is)."""
    address = parse_ckptd_url(settings.url)
    if transport is None and address.uds is not None:
        transport = httpx.HTTPTransport(uds=address.uds)
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    return httpx.Client(base_url=address.base_url, timeout=httpx.Timeout(settings.timeout_s), headers=headers,
                        transport=transport)


__all__ = ["ckptd_http"]
