"""The peer listener's limits against callers that hold no secret or send too much (docs/multihost.md, "Peer
copies"): connections that never finish their handshake cannot take the slots authenticated peers need, and
each is closed at its handshake deadline however slowly it trickles bytes. Real sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.peers._headers import Done, ListAnswer, PutAnswer, expect
from ckptd.peers._protocol import MAGIC, NONCE_BYTES, Channel, PeerError, RateLimit, connect
from ckptd.peers._server import PeerListener
from ckptd.peers._store import PartStore
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part

JOB = "peerjob"


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir(mode=0o700)
    return path


@contextlib.contextmanager
def listening(shm: Path, capacity_bytes: int | None = None, **options: object) -> Iterator[PeerListener]:
    listener = PeerListener(PartStore(shm, capacity_bytes=capacity_bytes), SECRET.encode(), host="127.0.0.1",
                            port=0, **options)  # type: ignore[arg-type]
    listener.start()
    try:
        yield listener
    finally:
        listener.stop()


def address(listener: PeerListener) -> str:
    return f"127.0.0.1:{listener.port}"


def listed(listener: PeerListener) -> list[object]:
    """A ``list`` request by a peer that holds the secret: the copies held of host 0's part."""
    with connect(address(listener), SECRET.encode(), 10) as chan:
        chan.send_header({"op": "list", "job": JOB, "origin": 0, "count": 2})
        return list(expect(chan, ListAnswer).copies)


def listed_when_free(listener: PeerListener, deadline_s: float = 30.0) -> list[object]:
    """``listed``, asked again while the listener answers "busy" (as a peer does): the slot of the request before
    is let go when its handler's thread ends, which on a loaded machine can come after the next request. An
    attacker holding the slots would keep it busy past ``deadline_s`` (a wait, not a bound)."""
    until = time.monotonic() + deadline_s
    while True:
        try:
            return listed(listener)
        except PeerError as exc:
            if "busy" not in str(exc) or time.monotonic() > until:
                raise
            time.sleep(0.05)


def greeted_or_closed(sock: socket.socket) -> bool:
    """Read what the listener sends first: its magic line and nonce (its handshake with this caller has begun) or
    the end of the stream (it closed the connection); True either way."""
    got = b""
    with contextlib.suppress(OSError):
        while len(got) < len(MAGIC) + NONCE_BYTES:
            chunk = sock.recv(64)
            if not chunk:
                break
            got += chunk
    return True


class Trickler:
    """A caller without the secret that sends one byte of its "handshake" every ``every_s`` until the listener
    closes the connection (a slowloris): ``closed`` is set then, ``sent`` says how many bytes it had sent."""

    def __init__(self, target: str, every_s: float) -> None:
        host, _, port = target.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.every_s = every_s
        self.sent = 0
        self.closed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(self.every_s)
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                self.sock.sendall(b"x")
                self.sent += 1
                try:
                    if self.sock.recv(4096) == b"":
                        break
                except TimeoutError:
                    continue
        self.closed.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close()


def test_callers_without_the_secret_never_take_the_slots_authenticated_peers_need(shm: Path) -> None:
    # more connections than the listener serves at once, and more than it keeps in their handshakes, each sending
    # one byte and then nothing: before, they held every slot and every honest request was closed unanswered
    with listening(shm, max_connections=2) as listener:
        attackers = [socket.create_connection(("127.0.0.1", listener.port), timeout=10) for _ in range(70)]
        try:
            for sock in attackers:
                sock.sendall(b"x")
                assert greeted_or_closed(sock)
            for _ in range(10):  # each answered; "busy" only while the last honest request's slot is let go
                assert listed_when_free(listener) == []
        finally:
            for sock in attackers:
                sock.close()


def test_a_caller_that_trickles_its_handshake_is_closed_at_the_handshake_deadline(shm: Path) -> None:
    # one byte every 100 ms never lets a per-read timeout of 0.5 s fire: only a deadline on the whole handshake
    # ends it, long before the 64 bytes of a handshake are in (before, it was read to its end and only then refused)
    with listening(shm, timeout_s=0.5) as listener:
        slow = Trickler(address(listener), every_s=0.1)
        try:
            wait_until(slow.closed.is_set, timeout=30, what="the listener closing a handshake past its deadline")
            assert slow.sent < 2 * NONCE_BYTES
            wait_until(lambda: any("handshake" in f for f in listener.stats.failures), timeout=10,
                       what="the listener counting the caller as refused")
            listener.handshake_s = 30.0  # the honest path still works (however busy this machine is)
            assert listed(listener) == []
        finally:
            slow.stop()


def send_tagged(chan: Channel, data: bytes) -> None:
    """``data`` as the next header, with its length and a valid tag: what a peer holding the secret can send."""
    tagger = chan._tagger(False, b"H", len(data))
    tagger.update(data)
    chan.sock.sendall(struct.pack(">I", len(data)) + data + tagger.digest())


@pytest.mark.parametrize("nested", [b"[" * 30_000, b'{"":' * 10_000 + b"1" + b"}" * 10_000])
def test_a_deeply_nested_header_is_refused_like_any_malformed_one(shm: Path, nested: bytes) -> None:
    # before: json's RecursionError escaped the handler, the connection was dropped without the channel's answer
    with listening(shm) as listener:
        with connect(address(listener), SECRET.encode(), 10) as chan:
            send_tagged(chan, nested)
            with pytest.raises(PeerError, match="not JSON"):
                expect(chan, Done)
        wait_until(lambda: any("not JSON" in f for f in listener.stats.failures), timeout=10,
                   what="the listener counting the header as refused")
        assert listed(listener) == []  # and it goes on serving


def test_concurrent_copies_are_charged_against_the_capacity_before_any_is_received(shm: Path, tmp_path: Path) -> None:
    # four puts of a 16 KiB part (four jobs: none evicts another) against room for two: every holder answers all
    # four headers before any body moves, so only a charge taken at the answer can keep the sum under the capacity
    part = write_part(tmp_path / "scratch", JOB, 10, index=0)
    raw = (part / "snapshot.json").read_bytes()
    nbytes = (part / "data.bin").stat().st_size
    capacity = 2 * (len(raw) + nbytes) + 1024
    with listening(shm, capacity_bytes=capacity, max_connections=4) as listener:
        chans = [connect(address(listener), SECRET.encode(), 10) for _ in range(4)]
        try:
            accepted: list[Channel] = []
            jobs: list[str] = []
            refused: list[str] = []
            for k, chan in enumerate(chans):
                chan.send_header({"op": "put", "job": f"job{k}", "origin": 0, "count": 2, "step": 10, "held": [10],
                                  "meta": len(raw), "data": nbytes})
            for k, chan in enumerate(chans):
                try:
                    answer = expect(chan, PutAnswer)
                except PeerError as exc:
                    refused.append(str(exc))
                    continue
                assert answer.have is False
                accepted.append(chan)
                jobs.append(f"job{k}")
            for chan in accepted:
                chan.send_bytes(raw)
                with (part / "data.bin").open("rb") as data:
                    chan.send_file(data, nbytes, RateLimit(None))
                expect(chan, Done)
        finally:
            for chan in chans:
                chan.sock.close()
        assert len(accepted) == 2 and len(refused) == 2
        assert all("capacity" in reason for reason in refused)
        assert listener.store.copy_bytes() == 2 * nbytes <= capacity
        assert listener.stats.received == 2
        # the charges of the copies received are released: once one goes, another fits again
        listener.store.prune(jobs[0], 0, set())
        again = next(f"job{k}" for k in range(4) if f"job{k}" not in jobs)
        with connect(address(listener), SECRET.encode(), 10) as chan:
            chan.send_header({"op": "put", "job": again, "origin": 0, "count": 2, "step": 10, "held": [10],
                              "meta": len(raw), "data": nbytes})
            assert expect(chan, PutAnswer).have is False


def test_a_peer_that_trickles_a_part_is_cut_off_at_the_requests_deadline(shm: Path, tmp_path: Path) -> None:
    # a sender holding the secret that sends one byte of a 16 KiB part every 20 ms never lets a per-read timeout of
    # 0.5 s fire; the request's deadline (0.5 s plus the bytes at 1 MiB/s) ends it long before the part is in
    part = write_part(tmp_path / "scratch", JOB, 10, index=0)
    raw = (part / "snapshot.json").read_bytes()
    nbytes = (part / "data.bin").stat().st_size
    with listening(shm, timeout_s=0.5) as listener:
        listener.handshake_s = 30.0  # the handshake is not what this test bounds
        sent = 0
        with connect(address(listener), SECRET.encode(), 10) as chan:
            chan.send_header({"op": "put", "job": JOB, "origin": 0, "count": 2, "step": 10, "held": [10],
                              "meta": len(raw), "data": nbytes})
            assert expect(chan, PutAnswer).have is False
            chan.send_bytes(raw)
            give_up = time.monotonic() + 60  # before the deadline: the listener never ended it
            with contextlib.suppress(OSError):
                while sent < nbytes and time.monotonic() < give_up and \
                        not any("deadline" in f for f in listener.stats.failures):
                    chan.sock.sendall(b"\0")
                    sent += 1
                    threading.Event().wait(0.02)
        assert sent < nbytes
        wait_until(lambda: any("deadline" in f for f in listener.stats.failures), timeout=10)
        assert listener.store.copies(JOB, 0) == []
