"""A job's steps as the list route answers them: the whole list, or pages of it newest first behind a cursor.

A job of 10,000 steps lists as ~3 MB of JSON, and building it (10,000 rows parsed and serialised) holds
the GIL for about a second. So a job's listing is built once per catalog version (``Listing``): each
step's JSON kept as bytes, in both orders. The whole list (no ``limit``: what older clients ask) is
those bytes joined oldest first, as before pagination; a page is a slice newest first, found by
bisection, so a page costs its own size, never the job's.

A cursor names the last step a page gave (its step and directory name), not a position: the next page
starts just below it in the newest-first order (step descending, then directory name), so steps that
arrive between two pages (newer, hence above the cursor) or that leave (gc) never make a step appear
twice or be skipped. It is opaque to clients; every string of its pattern (``CURSOR_PATTERN``) is one, so
the route's schema refuses anything else (``422 INVALID_REQUEST``) and no cursor can cause a 500.
"""

from __future__ import annotations

import json
import posixpath
import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

from ckptd.api._conditional import Tagged, tag
from trainer_client.core import protocol as p

_Key = tuple[int, bytes]  # (-step, directory name in UTF-8): ascending is newest first, as the catalog orders names
_CURSOR_RE = re.compile(p.CURSOR_PATTERN)


def encode_cursor(key: _Key) -> str:
    """The opaque cursor that resumes after the step of ``key``: its step, ``.``, its directory name in hex."""
    return f"{-key[0]}.{key[1].hex()}"


def decode_cursor(cursor: str) -> _Key:
    """The key a cursor names; ``ValueError`` for a string that is not one (the route's pattern refuses those
    first, with ``422``: every string of ``CURSOR_PATTERN`` is a cursor)."""
    if not _CURSOR_RE.fullmatch(cursor):
        raise ValueError(f"not a cursor: {cursor[:40]!r}")
    step, _, name = cursor.partition(".")
    return -int(step), bytes.fromhex(name)


def _key(info: p.CheckpointInfo) -> _Key:
    return -info.step, posixpath.basename(info.path.rstrip("/")).encode()


@dataclass(frozen=True)
class Listing:
    """One job's steps at one catalog version, serialised once."""

    job: str
    version: int
    oldest_first: list[bytes]  # each step's JSON, in the catalog's order (step, directory name)
    newest_first: list[bytes]
    keys: list[_Key]  # of ``newest_first``, ascending

    @classmethod
    def build(cls, job: str, version: int, checkpoints: list[p.CheckpointInfo]) -> Listing:
        items = [(_key(c), c.model_dump_json().encode()) for c in checkpoints]
        ordered = sorted(items, key=lambda kv: kv[0])
        return cls(job, version, [body for _, body in items], [body for _, body in ordered],
                   [key for key, _ in ordered])

    def _body(self, items: list[bytes], next_cursor: str | None) -> bytes:
        tail = b"" if next_cursor is None else b',"next":' + json.dumps(next_cursor).encode()
        return b'{"job":' + json.dumps(self.job).encode() + b',"checkpoints":[' + b",".join(items) + b"]" + tail + b"}"

    @cached_property
    def _whole(self) -> Tagged:
        return tag(self._body(self.oldest_first, None), "list", self.job)

    def whole(self) -> Tagged:
        """Every step, oldest first, tagged: the answer without ``limit`` (``CheckpointList`` without ``next``),
        joined and digested once per version."""
        return self._whole

    def page(self, limit: int, cursor: str | None) -> bytes:
        """Up to ``limit`` steps newest first, after the step ``cursor`` names (from the newest without one)."""
        start = 0 if cursor is None else bisect_right(self.keys, decode_cursor(cursor))
        end = min(start + limit, len(self.keys))
        more = end < len(self.keys)
        return self._body(self.newest_first[start:end], encode_cursor(self.keys[end - 1]) if more else None)


__all__ = ["Listing", "decode_cursor", "encode_cursor"]
