"""What the peer-channel tests share: two sidecars' ``PeerService``s on 127.0.0.1 (``pair``), their settings, ckptd's
HTTP API over a sidecar with a given peer channel (``api_of``, ``api0``: what a trainer asks its part back through,
``fetch``), a TCP proxy that alters one byte of the stream after the handshake (``FlipProxy``: an attacker on the
path without the secret, docs/multihost.md, "Peer copies"), and a peer that accepts and never answers
(``Tarpit``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptd._sidecar import build_sidecar
from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.config import Settings
from ckptd.peers import PeerService, build_peers
from ckptd.peers._protocol import MAGIC, NONCE_BYTES
from tests.support.helpers import make_settings
from tests.support.peer_parts import SECRET
from trainer_client.core import Storage
from trainer_client.core import protocol as p

JOB = "peerjob"
# bytes of the handshake in each direction: the magic line and a nonce; a nonce and a proof; a proof
HANDSHAKE_BYTES = {"C>L": 32 + 32, "L>C": 8 + 32 + 32}


def settings(tmp: Path, k: int, root: Path, **extra: object) -> Settings:
    return Settings(root=str(root), shm_dir=str(tmp / f"shm{k}"), state_dir=str(tmp / f"state{k}"), peer_port=0,
                    peer_secret=SECRET, **extra)  # type: ignore[arg-type]


def peers_of(settings: Settings) -> PeerService | None:
    """The peer channel the composition root builds for ``settings`` (ckptd/_sidecar.py)."""
    return build_peers(settings.peer, settings.memory_tier, settings.storage.root)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[list[PeerService], list[Path]]]:
    root = tmp_path / "root"
    (root / JOB).mkdir(parents=True)
    shms = [tmp_path / "shm0", tmp_path / "shm1"]
    for shm in shms:
        shm.mkdir(mode=0o700)
    services = [peers_of(settings(tmp_path, k, root)) for k in range(2)]
    assert all(s is not None for s in services)
    started = [s for s in services if s is not None]
    for s in started:
        s.start()
    yield started, shms
    for s in started:
        s.stop()


@contextlib.contextmanager
def api_of(service: PeerService | None, tmp: Path) -> Iterator[TestClient]:
    """ckptd's HTTP API over a sidecar whose peer channel is ``service`` (None: off), for the trainer's request
    ``POST /v1/jobs/{job}/peer-fetch``; requests from several threads are answered concurrently."""
    root = tmp / "api-root"
    root.mkdir(exist_ok=True)
    settings = make_settings(root, tmp / "api-state")
    catalog = Catalog(Storage(str(root)), ":memory:")
    sidecar = build_sidecar(settings, catalog)  # no peer channel of its own (no CKPTD_PEER_PORT): given one here
    sidecar.peers = service
    try:
        with TestClient(create_app(settings, catalog, background=False, sidecar=sidecar)) as client:
            yield client
    finally:
        catalog.close()


@pytest.fixture
def api0(pair: tuple[list[PeerService], list[Path]], tmp_path: Path) -> Iterator[TestClient]:
    """Host 0's ckptd API over its peer channel (``pair``'s first)."""
    with api_of(pair[0][0], tmp_path) as api:
        yield api


def fetch(api: TestClient, job: str, step: int, *, source: int = 1, origin: int = 0, count: int = 2,
          save_id: str | None = None) -> p.PeerFetchAnswer:
    """The trainer of host ``origin`` asks for its part of ``step`` back from host ``source``'s copy; the answer."""
    asked = p.PeerFetchRequest(step=step, source=source, origin=origin, count=count, save_id=save_id)
    response = api.post(p.ROUTE_PEER_FETCH.format(job=job), json=asked.model_dump(mode="json"))
    assert response.status_code == 200, response.text
    return p.PeerFetchAnswer.model_validate_json(response.content)


def plant_holder(service: PeerService, job: str, index: int, address: str) -> None:
    """Host ``index``'s sidecar of ``job`` registered at ``address`` (what anyone who can write the root can do)."""
    root = Path(service.listener.store.shm_dir).parent / "root"
    record = root / job / ".ckptd" / "peers" / f"process_{index}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"address": address}))


def set_options(service: PeerService, **changes: object) -> None:
    service.copier.options = dataclasses.replace(service.copier.options, **changes)  # type: ignore[arg-type]


class FlipProxy:
    """Forwards every connection to ``target``; while ``flip`` is ``(direction, n)`` it flips one bit of the
    n-th byte after the handshake in that direction (``"C>L"``: caller to listener) of each connection."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.flip: tuple[str, int] | None = None
        self.flipped = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                caller, _ = self._server.accept()
            except TimeoutError:
                continue
            listener = socket.create_connection(self.target, timeout=30)
            caller.settimeout(30)
            flip = self.flip
            for src, dst, direction in ((caller, listener, "C>L"), (listener, caller, "L>C")):
                threading.Thread(target=self._pump, args=(src, dst, direction, flip), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, flip: tuple[str, int] | None) -> None:
        at = HANDSHAKE_BYTES[direction] + flip[1] if flip is not None and flip[0] == direction else -1
        seen = 0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if seen <= at < seen + len(data):
                    changed = bytearray(data)
                    changed[at - seen] ^= 0x01
                    data = bytes(changed)
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxy_to() -> Iterator[list[FlipProxy]]:
    """Proxies made by the test (``proxies.append(FlipProxy(address))``), closed after it."""
    proxies: list[FlipProxy] = []
    yield proxies
    for proxy in proxies:
        proxy.close()


class Tarpit:
    """A real listening socket that accepts every connection and never answers it (``trickle_s``: it sends the
    channel's magic line and a nonce one byte every ``trickle_s``, so that no timeout per read ever fires, and
    never a proof). ``held()``: the connections it holds that the caller has not closed."""

    def __init__(self, trickle_s: float | None = None) -> None:
        self.trickle_s = trickle_s
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            self.accepted += 1
            if self.trickle_s is not None:
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            for byte in MAGIC + bytes(NONCE_BYTES):
                if self._stop.wait(self.trickle_s):
                    return
                conn.sendall(bytes([byte]))

    def held(self) -> int:
        """Connections still open at the caller's end (reading one shows nothing, not the end of the stream)."""
        count = 0
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                try:
                    closed = conn.recv(1 << 16, socket.MSG_PEEK) == b""  # data: the caller sent its half and waits
                except BlockingIOError:
                    closed = False
                count += not closed
        return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        for conn in self._conns:
            conn.close()


@pytest.fixture
def tarpit() -> Iterator[Tarpit]:
    pit = Tarpit()
    yield pit
    pit.close()
