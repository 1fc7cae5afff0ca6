"""The peer data channel's wire: a mutual HMAC handshake over a shared secret, bounded JSON headers, raw byte
bodies sent at a bounded rate (docs/multihost.md, "Peer copies").

A connection is one request. The listener speaks first:

```
listener -> caller   b"CKPTDP1\\n" + 32 random bytes (its nonce)
caller   -> listener 32 random bytes (the caller's nonce) + HMAC-SHA256(secret, b"caller" + nonces)
listener -> caller   HMAC-SHA256(secret, b"listener" + nonces)       (both sides now know the other has the secret)
then frames: 4-byte big-endian length (at most MAX_HEADER_BYTES) + a JSON object, and raw bodies whose lengths
a header announced
```

Everything read from the wire is hostile until checked: a header longer than ``MAX_HEADER_BYTES`` or not a JSON
object ends the connection, and the caller of ``header_int`` bounds every number it takes. The bytes are
not protected in transit beyond TCP's checksum: the receiver checks every shard against the XXH3 checksum the
snapshot records before the copy is used (``_store``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any, BinaryIO

from trainer_client.core._errors import CkptdError

MAGIC = b"CKPTDP1\n"
NONCE_BYTES = 32
MAX_HEADER_BYTES = 64 << 10
CHUNK = 1 << 20


class PeerError(CkptdError):
    """The peer broke the protocol, failed the handshake, or refused the request."""


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or ``PeerError`` when the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), CHUNK))
        if not chunk:
            raise PeerError(f"the peer closed the connection ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def listener_handshake(sock: socket.socket, secret: bytes) -> None:
    """The listener's side: ``PeerError`` unless the caller proves it holds ``secret``."""
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + mine)
    theirs = recv_exact(sock, NONCE_BYTES)
    proof = recv_exact(sock, 32)
    if not hmac.compare_digest(proof, _mac(secret, b"caller", mine, theirs)):
        raise PeerError("the caller does not hold the peer secret")
    sock.sendall(_mac(secret, b"listener", theirs, mine))


def caller_handshake(sock: socket.socket, secret: bytes) -> None:
    """The caller's side: ``PeerError`` unless the listener proves it holds ``secret``."""
    if recv_exact(sock, len(MAGIC)) != MAGIC:
        raise PeerError("not a ckptd peer channel")
    theirs = recv_exact(sock, NONCE_BYTES)
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(mine + _mac(secret, b"caller", theirs, mine))
    if not hmac.compare_digest(recv_exact(sock, 32), _mac(secret, b"listener", mine, theirs)):
        raise PeerError("the listener does not hold the peer secret")


def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header).encode()
    if len(data) > MAX_HEADER_BYTES:
        raise PeerError(f"header of {len(data)} bytes")
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (size,) = struct.unpack(">I", recv_exact(sock, 4))
    if size > MAX_HEADER_BYTES:
        raise PeerError(f"a header of {size} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(recv_exact(sock, size))
    except ValueError as exc:
        raise PeerError(f"a header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PeerError("a header that is not a JSON object")
    return header


def header_int(header: dict[str, Any], key: str, low: int, high: int) -> int:
    """``header[key]`` as an int within ``[low, high]``, else ``PeerError``."""
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PeerError(f"{key}: {str(value)[:40]} is not an integer in [{low}, {high}]")
    return value


def expect_ok(sock: socket.socket) -> dict[str, Any]:
    """The peer's answer; ``PeerError`` with its reason unless it says ok."""
    answer = recv_header(sock)
    if answer.get("ok") is not True:
        raise PeerError(str(answer.get("error") or "refused")[:500])
    return answer


class RateLimit:
    """At most ``bytes_per_s`` through ``wait`` (all callers together), in bursts of at most a second's worth."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now - 1.0) + nbytes / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


def send_file(sock: socket.socket, f: BinaryIO, nbytes: int, limit: RateLimit) -> None:
    """``nbytes`` of ``f`` from its start, at most at ``limit``'s rate (``sendfile``: no copy through Python)."""
    sent = 0
    while sent < nbytes:
        count = min(CHUNK * 8, nbytes - sent)
        limit.wait(count)
        done = sock.sendfile(f, offset=sent, count=count)
        if done <= 0:
            raise PeerError(f"the file ended {nbytes - sent} bytes early")
        sent += done


def recv_into_file(sock: socket.socket, fd: int, nbytes: int) -> None:
    """Exactly ``nbytes`` from the peer into the open, empty file ``fd``: received straight into its pages
    (a shared mapping of the file: one copy, from the socket to shared memory)."""
    if not nbytes:
        return
    os.ftruncate(fd, nbytes)
    with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        view = memoryview(mapped)
        try:
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got: min(nbytes, got + CHUNK * 8)])
                if not n:
                    raise PeerError(f"the peer closed the connection with {nbytes - got} of {nbytes} bytes to come")
                got += n
        finally:
            view.release()


def connect(address: str, secret: bytes, timeout_s: float) -> socket.socket:
    """A connection to the listener at ``host:port``, the handshake done."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PeerError(f"not a host:port address: {address[:100]!r}")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    try:
        caller_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


__all__ = ["CHUNK", "PeerError", "RateLimit", "caller_handshake", "connect", "expect_ok", "header_int",
           "listener_handshake", "recv_exact", "recv_header", "recv_into_file", "send_file", "send_header"]
