"""One OCDBT node decoded within bounds: its header, CRC-32C and zstd body, and a cursor over the body that
stops when the read's work budget is spent.

Why it exists apart from the tree walk (``trainer_client/core/format/_ocdbt_index.py``): every byte decoded
here comes from storage nobody vouches for, and the cost of a few forged kilobytes must stay small whatever
they claim. So (docs/operations.md, "What each limit defends"):

* a zstd frame whose header states a content size past the limit is refused before any of it is decoded;
  one that states none is decoded to at most ``UNSIZED_FRAME_BYTES`` (tensorstore states it in every frame);
* a count read from a node (keys, data files, versions) cannot exceed the bytes left to hold them: a list
  of millions is refused before it is built;
* the read's ``Budget`` — a deadline, at most so many nodes, keys and inline value bytes — is checked every
  few thousand numbers decoded, so no node, however large its decoded body, runs past the deadline.

Each refusal is an ``OcdbtRefusedError``: the database is hostile or broken beyond what a real one can be,
and nothing else (tensorstore included) is asked to read it.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable

import google_crc32c

from trainer_client.core._errors import OcdbtFormatError, OcdbtRefusedError

_HEADER = struct.Struct("<Q")  # the length that follows the big-endian magic
UNSIZED_FRAME_BYTES = 1 << 20  # a zstd frame that does not state its content size decodes to at most this
_CHECK_EVERY = 4096  # numbers (or keys) decoded between two looks at the budget


class Budget:
    """What one read of a database may spend: wall time (``deadline_s`` of ``clock``, the monotonic clock unless
    given), nodes, keys and inline value bytes."""

    def __init__(self, deadline_s: float | None, max_nodes: int, max_keys: int, max_inline_bytes: int,
                 clock: Callable[[], float] | None = None) -> None:
        self.deadline_s = deadline_s
        self._clock = clock if clock is not None else time.monotonic
        self._end = math.inf if deadline_s is None else self._clock() + deadline_s
        self.nodes_left, self.keys_left, self.inline_left = max_nodes, max_keys, max_inline_bytes
        self._limits = (max_nodes, max_keys, max_inline_bytes)

    def check(self, what: str) -> None:
        if self._clock() > self._end:
            raise OcdbtRefusedError(f"{what}: the index was not read within its deadline of {self.deadline_s:g} s")

    def node(self, what: str) -> None:
        self.check(what)
        self.nodes_left -= 1
        if self.nodes_left < 0:
            raise OcdbtRefusedError(f"{what}: more than {self._limits[0]} B+tree nodes")

    def keys(self, n: int, inline_bytes: int, what: str) -> None:
        self.keys_left -= n
        self.inline_left -= inline_bytes
        if self.keys_left < 0:
            raise OcdbtRefusedError(f"{what}: more than {self._limits[1]} keys")
        if self.inline_left < 0:
            raise OcdbtRefusedError(f"{what}: more than {self._limits[2]} bytes of values stored in its nodes")


class Cursor:
    """Sequential decoding of one node's body, spending ``budget``."""

    def __init__(self, data: bytes, what: str, budget: Budget) -> None:
        self.data = data
        self.pos = 0
        self.what = what
        self.budget = budget

    def fail(self, problem: str) -> OcdbtFormatError:
        return OcdbtFormatError(f"{self.what}: {problem} at byte {self.pos}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"truncated (wanted {n} bytes)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        if self.pos >= len(self.data):
            raise self.fail("truncated (in a varint)")
        return self.varints(1)[0]

    def count(self, n: int, each: int = 1) -> int:
        """``n``, a number of entries read from the node, when its entries (``each`` bytes at least) fit in the
        bytes left; else refused before anything is built for them."""
        if n * each > len(self.data) - self.pos:
            raise OcdbtRefusedError(f"{self.what}: {n} entries claimed, {len(self.data) - self.pos} bytes left "
                                    f"at byte {self.pos}")
        return n

    def varints(self, n: int) -> list[int]:
        """``n`` varints (one loop, no call per number: an index of a million keys decodes ~6 million)."""
        self.count(n)
        data, pos, end = self.data, self.pos, len(self.data)
        out: list[int] = []
        append = out.append
        for i in range(n):
            if not i % _CHECK_EVERY:
                self.budget.check(self.what)
            value = shift = 0
            while True:
                if pos >= end:
                    self.pos = pos
                    raise self.fail("truncated (in a varint)")
                b = data[pos]
                pos += 1
                value |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
                if shift > 63:
                    self.pos = pos
                    raise self.fail("varint longer than 64 bits")
            append(value)
        self.pos = pos
        return out

    def uint64le(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} bytes left over")


def decompress(body: bytes, limit: int, what: str) -> bytes:
    """A zstd frame's content, refused when its header states more than ``limit`` bytes, or when it decodes to
    more than ``limit`` (or ``UNSIZED_FRAME_BYTES``, when it states no size) — the stated size is not trusted."""
    import zstandard

    try:
        stated = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as exc:
        raise OcdbtFormatError(f"{what}: zstd: {exc}") from exc
    if stated == zstandard.CONTENTSIZE_UNKNOWN:
        limit = min(limit, UNSIZED_FRAME_BYTES)
    elif stated > limit:
        raise OcdbtRefusedError(f"{what}: decodes to {stated} bytes, more than {limit}")
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                out += chunk
                if len(out) > limit:
                    raise OcdbtRefusedError(f"{what}: decodes to more than {limit} bytes")
    except zstandard.ZstdError as exc:
        raise OcdbtFormatError(f"{what}: zstd: {exc}") from exc
    if stated != zstandard.CONTENTSIZE_UNKNOWN and len(out) != stated:
        raise OcdbtFormatError(f"{what}: zstd frame states {stated} bytes, decodes to {len(out)}")
    return bytes(out)


def decode_node(raw: bytes, magic: int, what: str, limit: int, budget: Budget) -> Cursor:
    """Check a node's outer header and CRC-32C, and return a cursor over its (decompressed) body of at most
    ``limit`` bytes."""
    if len(raw) < 4 + 8 + 2 + 4:
        raise OcdbtFormatError(f"{what}: {len(raw)} bytes is too short")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise OcdbtFormatError(f"{what}: magic {found:#x}, expected {magic:#x}")
    (length,) = _HEADER.unpack_from(raw, 4)
    if length != len(raw):
        raise OcdbtFormatError(f"{what}: header says {length} bytes, read {len(raw)}")
    if google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise OcdbtFormatError(f"{what}: CRC-32C mismatch")
    head = Cursor(raw[:-4], what, budget)
    head.pos = 12
    version = head.varint()
    if version != 0:
        raise OcdbtFormatError(f"{what}: format version {version} (this reader knows 0)")
    compression = head.varint()
    body = raw[head.pos : -4]
    if compression == 1:
        body = decompress(body, limit, what)
    elif compression != 0:
        raise OcdbtFormatError(f"{what}: unknown compression {compression}")
    elif len(body) > limit:
        raise OcdbtRefusedError(f"{what}: {len(body)} bytes, more than {limit}")
    return Cursor(body, what, budget)


__all__ = ["UNSIZED_FRAME_BYTES", "Budget", "Cursor", "decode_node", "decompress"]
