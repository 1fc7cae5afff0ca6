"""The peer data channel's wire: a mutual HMAC handshake over a shared secret, then every header and every body
authenticated with a key of the connection's own; bounded JSON headers, raw byte bodies sent at a bounded rate
(docs/multihost.md, "Peer copies").

A connection is one request. The listener speaks first:

```
listener -> caller   b"CKPTDP2\\n" + 32 random bytes (its nonce)
caller   -> listener 32 random bytes (the caller's nonce) + HMAC-SHA256(secret, b"caller" + nonces)
listener -> caller   HMAC-SHA256(secret, b"listener" + nonces)       (both sides now know the other has the secret)
both                 key = HMAC-SHA256(secret, b"session" + nonces)  (never sent)
then frames, each followed by its 32-byte tag, HMAC-SHA256(key, direction + kind + sequence + length + bytes):
  a header: 4-byte big-endian length (at most MAX_HEADER_BYTES) + a JSON object, then its tag
  a body:   the raw bytes a header announced, then its tag (computed as the bytes go, over the mapped file)
```

The direction (``C>L``/``L>C``) and a per-direction sequence number inside every tag mean a frame cannot be
altered, reflected, replayed, reordered or dropped without the receiver noticing: a frame whose tag does not
match ends the request (``PeerError``), and what was received of it is discarded by the caller (``_store``). A
peer of another wire version (another magic line) is refused at the first bytes.

Everything read from the wire is hostile until checked: a header longer than ``MAX_HEADER_BYTES``, failing its
tag or not a JSON object ends the connection; the object a header carries is parsed into its typed request or
answer, every field bounded, by ``_headers`` (this module frames and authenticates it, nothing more). The tags
prove who sent the bytes; the receiver still checks every shard against the XXH3 checksum the snapshot records
before the copy is used (``_store``): what the sender's memory held may have decayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from trainer_client.core import CkptdError

MAGIC = b"CKPTDP2\n"
MAGIC_FAMILY = b"CKPTDP"  # any version of this channel
TAG_BYTES = 32
NONCE_BYTES = 32
MAX_HEADER_BYTES = 64 << 10
CHUNK = 1 << 20


class PeerError(CkptdError):
    """The peer broke the protocol, failed the handshake, or refused the request."""


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def arm(sock: socket.socket, deadline: float | None, timeout_s: float | None, what: str) -> None:
    """Before one read or write of ``sock``: its timeout the time left before ``deadline`` (``time.monotonic``),
    at most ``timeout_s``; ``PeerError`` once the deadline has passed. A peer that sends a byte now and then can
    hold a read past a timeout per read, never past a deadline."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerError(f"{what} not finished by its deadline")
    sock.settimeout(left if timeout_s is None else min(left, timeout_s))


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None, what: str = "the request") -> bytes:
    """``n`` bytes, or ``PeerError`` when the peer closes first or ``deadline`` (``time.monotonic``) passes."""
    buf = bytearray()
    timeout_s = sock.gettimeout()
    while len(buf) < n:
        arm(sock, deadline, timeout_s, what)
        try:
            chunk = sock.recv(min(n - len(buf), CHUNK))
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise PeerError(f"{what} not finished by its deadline") from None
            raise
        if not chunk:
            raise PeerError(f"the peer closed the connection ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def listener_handshake(sock: socket.socket, secret: bytes, deadline_s: float) -> Channel:
    """The listener's side: ``PeerError`` unless the caller proves it holds ``secret`` within ``deadline_s`` of
    the start (however it spreads its bytes); the socket's own timeout is back in place after."""
    timeout_s = sock.gettimeout()
    deadline = time.monotonic() + deadline_s
    mine = secrets.token_bytes(NONCE_BYTES)
    arm(sock, deadline, timeout_s, "the handshake")
    sock.sendall(MAGIC + mine)  # 40 bytes: into the socket's buffer whether the caller reads or not
    caller = recv_exact(sock, NONCE_BYTES + 32, deadline, "the handshake")
    theirs, proof = caller[:NONCE_BYTES], caller[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"caller", mine, theirs)):
        raise PeerError("the caller does not hold the peer secret")
    arm(sock, deadline, timeout_s, "the handshake")
    sock.sendall(_mac(secret, b"listener", theirs, mine))
    sock.settimeout(timeout_s)
    return Channel(sock, _mac(secret, b"session", mine, theirs), caller=False)


def caller_handshake(sock: socket.socket, secret: bytes, deadline: float | None = None) -> Channel:
    """The caller's side: ``PeerError`` unless the listener proves it holds ``secret`` (by ``deadline``,
    ``time.monotonic``, when given: the channel keeps it for everything after)."""
    timeout_s = sock.gettimeout()
    magic = recv_exact(sock, len(MAGIC), deadline, "the handshake")
    if magic != MAGIC:
        if magic.startswith(MAGIC_FAMILY):
            raise PeerError(f"the peer speaks another version of the peer channel ({magic.strip()!r}, this sidecar "
                            f"{MAGIC.strip()!r}): run the same ckptd release on every host")
        raise PeerError("not a ckptd peer channel")
    theirs = recv_exact(sock, NONCE_BYTES, deadline, "the handshake")
    mine = secrets.token_bytes(NONCE_BYTES)
    arm(sock, deadline, timeout_s, "the handshake")
    sock.sendall(mine + _mac(secret, b"caller", theirs, mine))
    if not hmac.compare_digest(recv_exact(sock, 32, deadline, "the handshake"),
                               _mac(secret, b"listener", mine, theirs)):
        raise PeerError("the listener does not hold the peer secret")
    sock.settimeout(timeout_s)
    return Channel(sock, _mac(secret, b"session", theirs, mine), caller=True, deadline=deadline)


class _TagBehind:
    """Feeds a tag the ranges of a mapped file on a thread of its own, in order, while the caller moves the next
    bytes through the socket (hashing and the socket both run without the GIL: the tag costs the transfer
    little time)."""

    def __init__(self, tagger: hmac.HMAC, view: memoryview) -> None:
        self.tagger = tagger
        self._view = view
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckptd-peer-tag", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._ranges.get()) is not None:
            self.tagger.update(self._view[item[0]: item[1]])

    def add(self, start: int, end: int) -> None:
        self._ranges.put((start, end))

    def finish(self) -> None:
        """Wait until every range given is in the tag (always called before the view is released)."""
        self._ranges.put(None)
        self._thread.join()


class Channel:
    """One connection after the handshake: every header and body it sends carries a tag, every one it receives
    is checked against its tag (``PeerError`` on a mismatch). A context manager that closes the socket.

    ``deadline`` (``time.monotonic``; None: none) bounds the whole request: every read and write of the socket
    gets at most the time left (and at most the socket's timeout per read), and one past it is ``PeerError``. The
    caller sets it, and may move it once it knows how many bytes are to come (``until``)."""

    def __init__(self, sock: socket.socket, key: bytes, *, caller: bool, deadline: float | None = None) -> None:
        self.sock = sock
        self.deadline = deadline
        self._timeout_s = sock.gettimeout()
        self._key = key
        self._directions = (b"C>L", b"L>C") if caller else (b"L>C", b"C>L")  # (sending, receiving)
        self._counts = [0, 0]  # frames sent, frames received

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def until(self, deadline: float) -> None:
        """The request's deadline from now on (``time.monotonic``)."""
        self.deadline = deadline

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        """One read or write of the socket, bounded by the deadline (``PeerError`` once it has passed)."""
        arm(self.sock, self.deadline, self._timeout_s, what)
        try:
            yield
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise PeerError(f"{what} not finished by its deadline") from None
            raise

    def _tagger(self, receiving: bool, kind: bytes, nbytes: int) -> hmac.HMAC:
        """The tag of the next frame in one direction: the key, the direction, the kind, its number, its length."""
        seq = self._counts[receiving]
        self._counts[receiving] += 1
        return hmac.new(self._key, self._directions[receiving] + kind + struct.pack(">QQ", seq, nbytes),
                        hashlib.sha256)

    def _check(self, tagger: hmac.HMAC, what: str) -> None:
        if not hmac.compare_digest(recv_exact(self.sock, TAG_BYTES, self.deadline), tagger.digest()):
            raise PeerError(f"{what} failed its authentication (altered in transit): discarded")

    def send_header(self, header: dict[str, Any]) -> None:
        """A header's JSON object, then its tag (``_headers.send`` sends a typed one)."""
        data = json.dumps(header).encode()
        if len(data) > MAX_HEADER_BYTES:
            raise PeerError(f"header of {len(data)} bytes")
        tagger = self._tagger(False, b"H", len(data))
        tagger.update(data)
        with self._io("the request"):
            self.sock.sendall(struct.pack(">I", len(data)) + data + tagger.digest())

    def recv_header(self) -> dict[str, Any]:
        """The next header's JSON object, checked against its tag: bounded, a JSON object, nothing more (what it
        says is checked by ``_headers``, which parses it into its request or answer)."""
        (size,) = struct.unpack(">I", recv_exact(self.sock, 4, self.deadline))
        if size > MAX_HEADER_BYTES:
            raise PeerError(f"a header of {size} bytes (at most {MAX_HEADER_BYTES})")
        data = recv_exact(self.sock, size, self.deadline)
        tagger = self._tagger(True, b"H", size)
        tagger.update(data)
        self._check(tagger, "a header")
        try:
            header = json.loads(data)
        except ValueError as exc:
            raise PeerError(f"a header that is not JSON: {exc}") from None
        except RecursionError:  # nested deeper than the parser's stack: malformed like any other
            raise PeerError("a header that is not JSON: nested too deep") from None
        if not isinstance(header, dict):
            raise PeerError("a header that is not a JSON object")
        return header

    def send_bytes(self, data: bytes) -> None:
        """A body held in memory (a part's metadata), then its tag."""
        tagger = self._tagger(False, b"B", len(data))
        tagger.update(data)
        with self._io("the request"):
            self.sock.sendall(data + tagger.digest())

    def recv_bytes(self, n: int) -> bytes:
        """A body of ``n`` bytes, checked against its tag."""
        data = recv_exact(self.sock, n, self.deadline)
        tagger = self._tagger(True, b"B", n)
        tagger.update(data)
        self._check(tagger, "a body")
        return data

    def send_file(self, f: BinaryIO, nbytes: int, limit: RateLimit) -> None:
        """``nbytes`` of ``f`` from its start, at most at ``limit``'s rate, then their tag: sent by ``sendfile``
        (no copy through Python), the tag computed over a read-only mapping of the same file."""
        tagger = self._tagger(False, b"B", nbytes)
        if nbytes:
            with mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                behind = _TagBehind(tagger, view)
                try:
                    sent = 0
                    while sent < nbytes:
                        count = min(CHUNK * 8, nbytes - sent)
                        limit.wait(count)
                        with self._io("the transfer"):
                            done = self.sock.sendfile(f, offset=sent, count=count)
                        if done <= 0:
                            raise PeerError(f"the file ended {nbytes - sent} bytes early")
                        behind.add(sent, sent + done)
                        sent += done
                finally:
                    behind.finish()
                    view.release()
        with self._io("the transfer"):
            self.sock.sendall(tagger.digest())

    def recv_into_file(self, fd: int, nbytes: int) -> None:
        """Exactly ``nbytes`` from the peer into the open, empty file ``fd``, received straight into its pages (a
        shared mapping of the file: one copy, from the socket to shared memory), then checked against their tag:
        ``PeerError`` on a mismatch (the caller deletes the file)."""
        tagger = self._tagger(True, b"B", nbytes)
        if nbytes:
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
                view = memoryview(mapped)
                behind = _TagBehind(tagger, view)
                try:
                    got = 0
                    while got < nbytes:
                        with self._io("the transfer"):
                            n = self.sock.recv_into(view[got: min(nbytes, got + CHUNK * 8)])
                        if not n:
                            raise PeerError(f"the peer closed the connection with {nbytes - got} of {nbytes} "
                                            "bytes to come")
                        behind.add(got, got + n)
                        got += n
                finally:
                    behind.finish()
                    view.release()
        self._check(tagger, "a body")


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


def connect(address: str, secret: bytes, timeout_s: float, deadline_s: float | None = None) -> Channel:
    """A connection to the listener at ``host:port``, the handshake done; with ``deadline_s``, the whole request
    (connecting included) bounded by a deadline that many seconds from now (``Channel.until`` moves it)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PeerError(f"not a host:port address: {address[:100]!r}")
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    if deadline_s is None:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    else:
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, deadline_s))
        except TimeoutError:
            raise PeerError(f"connecting to {address[:100]} not finished by its deadline") from None
        sock.settimeout(timeout_s)
    try:
        return caller_handshake(sock, secret, deadline)
    except BaseException:
        sock.close()
        raise


def lower_this_thread(steps: int) -> None:
    """Lower the calling thread's priority ``steps`` nice steps (Linux: a thread's own; threads it starts
    inherit it): background copies leave the host's cores to the trainer."""
    if steps <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + steps)
    except OSError:
        pass


__all__ = [
    "CHUNK",
    "MAGIC",
    "Channel",
    "PeerError",
    "RateLimit",
    "arm",
    "caller_handshake",
    "connect",
    "listener_handshake",
    "lower_this_thread",
    "recv_exact",
]
