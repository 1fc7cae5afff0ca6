"""The peer channel's listener: takes copies of other hosts' parts into this host's shared memory (``put``),
drops them when their originals go (``held``), and hands a copy back to the host it came from (``get``)
(docs/multihost.md, "Peer copies").

``list`` names the copies held of a host's part (a host that lost its memory asks before it fetches), ``jobs``
the jobs of which copies of a host's part are held (a sidecar on a new node asks before it knows a job). A thread
per connection. A connection first has ``handshake_s`` in all to prove it holds the secret (a deadline on the
whole handshake, not a timeout per read: a caller trickling a byte now and then is closed at it), in one of
``max_handshakes`` places; when they are all taken, a new connection takes the place of the oldest one still in
its handshake (closed). Only a caller that proved the secret takes one of the ``max_connections`` slots its
request is served in (when they are all busy it is answered ``busy``): callers without the secret never hold a
slot an authenticated peer needs. A caller that fails the handshake is closed without an answer. An
authenticated request has a deadline too: ``timeout_s`` in all, plus its body's bytes at ``MIN_BYTES_S`` for a
``put`` or a ``get`` (a peer that trickles a part holds a slot no longer). Every field of a request is checked
before anything is written (each request parsed into its typed header, ``ckptd/peers/_headers.py``): the job
name, the host indexes, the step, and sizes bounded by the snapshot format's limits and by the room this host
has, charged before a byte is received (``PartStore.reserve``: concurrent copies never pass the capacity
together).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ckptd.peers._headers import (
    MAX_JOBS_LISTED,
    Done,
    GetAnswer,
    GetRequest,
    HeldAnswer,
    HeldRequest,
    JobsAnswer,
    JobsRequest,
    ListAnswer,
    ListRequest,
    PutAnswer,
    PutRequest,
    Refusal,
    receive_request,
    send,
)
from ckptd.peers._protocol import Channel, PeerError, RateLimit, listener_handshake, lower_this_thread
from ckptd.peers._store import PartStore

_log = logging.getLogger(__name__)
HANDSHAKE_S = 5.0  # a connection's whole handshake, at most (an honest one takes a round trip)
MAX_HANDSHAKES = 64  # connections in their handshake at once; a new one takes the oldest one's place
MIN_BYTES_S = 1 << 20  # a request's body may take its bytes at this rate plus ``timeout_s``, no longer
WARN_EVERY_S = 10.0  # failed handshakes: one warning per this, the others at debug (a flood never floods the log)


@dataclass
class ListenerStats:
    """What the listener did since it started (docs/operations.md, "Peer copies")."""

    received: int = 0
    received_bytes: int = 0
    refused: int = 0
    served: int = 0
    served_bytes: int = 0
    failures: list[str] = field(default_factory=list)  # the last few, newest last

    def failed(self, what: str) -> None:
        self.failures = [*self.failures[-9:], f"{time.strftime('%H:%M:%S')} {what}"[:300]]


class PeerListener:
    """Accepts peer connections on ``host:port`` (port 0: any free one; ``address`` says which)."""

    def __init__(self, store: PartStore, secret: bytes, *, host: str, port: int, max_connections: int = 8,
                 timeout_s: float = 30.0, nice: int = 0, handshake_s: float | None = None,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        self.store = store
        self.instance = secrets.token_hex(16)  # this listener's; its own sidecar's copier sends it as ``sender``
        self.nice = nice  # a copy received (put) runs this many nice steps lower: the host's trainer comes first
        self.secret = secret
        self.timeout_s = timeout_s
        self.handshake_s = min(HANDSHAKE_S, timeout_s) if handshake_s is None else handshake_s
        self.stats = ListenerStats()
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_handshakes = max_handshakes
        self._handshaking: OrderedDict[int, socket.socket] = OrderedDict()  # oldest first
        self._open: dict[int, tuple[threading.Thread, socket.socket]] = {}  # every connection being served
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._warned_at = float("-inf")
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ckptd-peer-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end the requests in progress (their connections shut: a copy being received is
        discarded, as any cut-short copy is) and wait for their threads, at most ``timeout_s`` in all: once this
        returns, no request of this listener writes into the host's shared memory."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._sock.close()
        with self._lock:
            serving = list(self._open.values())
        for _, conn in serving:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread, _ in serving:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            key = next(self._ids)
            with self._lock:
                oldest = None
                if len(self._handshaking) >= self.max_handshakes:
                    oldest = self._handshaking.popitem(last=False)[1]
                self._handshaking[key] = conn
            if oldest is not None:  # its thread reads the end of the stream, and closes it
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            thread = threading.Thread(target=self._serve, args=(conn, peer, key), name="ckptd-peer-conn", daemon=True)
            with self._lock:
                self._open[key] = (thread, conn)
            thread.start()

    def _authenticate(self, conn: socket.socket, peer: Any, key: int) -> Channel | None:
        """The channel of a caller that proved the secret within the handshake deadline, holding a slot; None
        (the caller counted as refused) otherwise. The caller that proved it but finds every slot busy is told."""
        try:
            conn.settimeout(self.timeout_s)
            chan = listener_handshake(conn, self.secret, self.handshake_s)
        except (PeerError, OSError) as exc:
            with self._lock:
                displaced = self._handshaking.pop(key, None) is None
            reason = "displaced by newer connections while in its handshake" if displaced else str(exc)
            self._refuse(peer, f"handshake: {reason}")
            return None
        with self._lock:
            displaced = self._handshaking.pop(key, None) is None
        if displaced:
            self._refuse(peer, "handshake: displaced by newer connections while in its handshake")
            return None
        if not self._slots.acquire(blocking=False):
            self._refuse(peer, f"busy: {self.max_connections} requests in progress")
            with contextlib.suppress(OSError, PeerError):
                send(chan, Refusal.of(f"busy: {self.max_connections} requests in progress, try again"))
            return None
        return chan

    def _refuse(self, peer: Any, reason: str) -> None:
        """A connection closed before its request was read: counted, logged (a flood of them at debug)."""
        self.stats.refused += 1
        self.stats.failed(f"from {peer[0]}: {reason}")
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            _log.warning("peer connection from %s refused: %s (more such refusals in the next %.0f s logged at "
                         "debug)", peer[0], reason, WARN_EVERY_S)
        else:
            _log.debug("peer connection from %s refused: %s", peer[0], reason)

    def _serve(self, conn: socket.socket, peer: Any, key: int) -> None:
        try:
            chan = self._authenticate(conn, peer, key)
            if chan is not None:
                try:
                    self._answer(chan, peer)
                finally:
                    self._slots.release()
        finally:
            conn.close()
            with self._lock:
                self._open.pop(key, None)

    def _answer(self, chan: Channel, peer: Any) -> None:
        try:
            chan.until(time.monotonic() + self.timeout_s)  # the request and a small answer: one timeout in all
            request = receive_request(chan)
            if isinstance(request, PutRequest):
                self._put(chan, request)
            elif isinstance(request, HeldRequest):
                self._held(chan, request)
            elif isinstance(request, GetRequest):
                self._get(chan, request)
            elif isinstance(request, ListRequest):
                send(chan, ListAnswer(copies=self.store.listing(request.job, request.origin)))
            else:  # jobs: a sidecar on a new node, its memory empty, asks what to bring back
                self._jobs(chan, request)
        except (PeerError, OSError, ValueError) as exc:
            self.stats.refused += 1
            self.stats.failed(f"from {peer[0]}: {exc}")
            _log.warning("peer request from %s refused: %s", peer[0], exc)
            with contextlib.suppress(OSError, PeerError):
                send(chan, Refusal.of(exc))

    def _not_from_itself(self, request: PutRequest | HeldRequest) -> None:
        """``PeerError`` when the request comes from this sidecar's own copier: a peer is never the origin."""
        if request.sender == self.instance:
            raise PeerError("a copy sent by this sidecar to its own listener: a peer is never the origin (its "
                            "address names this host's own listener)")

    def _put(self, chan: Channel, request: PutRequest) -> None:
        self._not_from_itself(request)
        job, origin, step = request.job, request.origin, request.step
        self.store.prune(job, origin, {*request.held, step})  # first: the originals gone make room for the new one
        if self.store.copy_path(job, origin, step).exists():
            send(chan, PutAnswer(have=True, holder=self.instance))
            return
        nbytes = request.meta + request.data
        with self.store.reserve(nbytes, copy=True):  # charged before the answer, atomically
            chan.until(time.monotonic() + self.timeout_s + nbytes / MIN_BYTES_S)
            send(chan, PutAnswer(have=False, holder=self.instance))
            lower_this_thread(self.nice)  # receiving and checking a copy is background work (a get is a restore)
            self.store.receive(chan, job, origin=origin, count=request.count, step=step, meta_bytes=request.meta,
                               data_bytes=request.data, own=False)
        self.stats.received += 1
        self.stats.received_bytes += request.data
        send(chan, Done())

    def _held(self, chan: Channel, request: HeldRequest) -> None:
        self._not_from_itself(request)
        dropped = self.store.prune(request.job, request.origin, set(request.held))
        send(chan, HeldAnswer(dropped=dropped, holder=self.instance))

    def _jobs(self, chan: Channel, request: JobsRequest) -> None:
        send(chan, JobsAnswer(jobs=self.store.jobs_holding(request.origin, request.count, MAX_JOBS_LISTED)))

    def _get(self, chan: Channel, request: GetRequest) -> None:
        step = request.step
        raw, meta, data = self.store.open_part(self.store.copy_path(request.job, request.origin, step))
        with data:
            if request.save_id is not None and meta.save_id != request.save_id:
                raise PeerError(f"the copy of step {step} is of save {meta.save_id}, not {request.save_id}")
            chan.until(time.monotonic() + self.timeout_s + (len(raw) + meta.nbytes) / MIN_BYTES_S)
            send(chan, GetAnswer(meta=len(raw), data=meta.nbytes))
            chan.send_bytes(raw)
            chan.send_file(data, meta.nbytes, RateLimit(None))  # a restore waits for it: not rate-bounded
        self.stats.served += 1
        self.stats.served_bytes += meta.nbytes


__all__ = ["ListenerStats", "PeerListener"]
