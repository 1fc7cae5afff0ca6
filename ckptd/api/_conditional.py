"""Conditional requests: an ``ETag`` on the answers clients poll, and ``304 Not Modified`` for a tag they hold.

The tag is a digest of the answer's bytes and of what was asked (route, job, query, the resume request
with its devices alive, allow flags and identity), made when the answer is worked out. So it changes
whenever the answer does, whatever changed it (a new step verified, one quarantined or deleted by
anyone, the catalog's version, a memory snapshot), and a ``304`` is only ever sent after the answer has
been worked out afresh, with the usual checks on storage, and found equal to the one the client holds:
never for a stale answer. What a ``304`` saves is the transfer and the client's parse of the answer (a
100 KB resume plan), not the server's checks, which every answer makes.

``If-None-Match`` is compared weakly (RFC 9110, 13.1.2: a ``W/`` prefix is ignored) and ``*`` matches any
answer. A resume is a ``POST`` but a safe one (it changes nothing): it gets a ``304`` like a ``GET``.
``Cache-Control: no-cache`` tells caches on the way to revalidate every time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fastapi import Response

_MAX_TAGS = 64  # entity tags read from one If-None-Match header (the header's size is bounded below the app)


@dataclass(frozen=True)
class Tagged:
    """An answer's bytes and its entity tag."""

    body: bytes
    etag: str


def tag(body: bytes, *asked: str) -> Tagged:
    """``body`` with a strong entity tag over it and ``asked`` (what the request asked, in order)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in asked:
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(body)
    return Tagged(body, f'"{digest.hexdigest()}"')


def matches(if_none_match: str | None, etag: str) -> bool:
    """``If-None-Match`` names ``etag`` (weak comparison) or is ``*``."""
    if not if_none_match:
        return False
    for given in if_none_match.split(",", _MAX_TAGS)[:_MAX_TAGS]:
        given = given.strip()
        if given == "*" or given.removeprefix("W/") == etag:
            return True
    return False


def respond(answer: Tagged, if_none_match: str | None) -> Response:
    """``200`` with the answer and its tag, or ``304`` with the tag alone when the client holds it."""
    headers = {"ETag": answer.etag, "Cache-Control": "no-cache"}
    if matches(if_none_match, answer.etag):
        return Response(status_code=304, headers=headers)
    return Response(answer.body, media_type="application/json", headers=headers)


__all__ = ["Tagged", "matches", "respond", "tag"]
