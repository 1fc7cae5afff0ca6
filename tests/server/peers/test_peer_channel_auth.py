"""The peer channel after the handshake: every header and body carries a tag of the connection's key, so an
attacker on the path without the secret (a proxy that flips one byte after the handshake) cannot alter a part
or a request unnoticed; what was received of an altered part is discarded, nothing is left in shared memory; a
peer of the previous wire version is refused at its first bytes (docs/multihost.md, "Peer copies")."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from pathlib import Path

import pytest

from ckptd.peers import PeerService
from ckptd.peers._headers import HeldAnswer, expect
from ckptd.peers._protocol import MAGIC, PeerError, connect
from tests.server.peers.conftest import JOB, FlipProxy
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.core.format._peer_copies import copies_dir
from trainer_client.core.format._snapshot import problems


def into_data(part: Path) -> int:
    """An offset after the handshake that lands inside the part's data: past the header (< 1 KiB with its tag)
    and the metadata with its tag, well before the end of the 16 KiB of data."""
    offset = (part / "snapshot.json").stat().st_size + 2048
    assert offset + 1024 < (part / "data.bin").stat().st_size
    return offset


def nothing_received(shm: Path, job: str) -> bool:
    """No part, copy or staging directory of ``job`` in ``shm``."""
    base = shm / job
    if not base.exists():
        return True
    return all(p.name.startswith(".peer-") and not any(p.iterdir()) for p in base.iterdir())


def test_a_part_altered_in_flight_is_refused_and_the_honest_path_works(
        pair: tuple[list[PeerService], list[Path]], proxy_to: list[FlipProxy], tmp_path: Path) -> None:
    (s0, s1), (shm0, shm1) = pair
    proxy = FlipProxy(s1.address)
    proxy_to.append(proxy)
    s0.copier.directory.static = {1: proxy.address}  # host 0 reaches host 1 through the attacker
    proxy.flip = ("C>L", into_data(write_part(tmp_path / "scratch", JOB, 10, index=0)))  # the same sizes
    part = write_part(shm0, JOB, 10, index=0)  # the copier sends it at once: through the proxy, altered
    wait_until(lambda: "authentication" in (s0.snapshot()["last_failure"] or ""), timeout=20,
               what="the holder refusing the altered copy, and telling the sender why")
    assert proxy.flipped >= 1 and s0.snapshot()["copy_failures"] >= 1
    assert any("a body failed its authentication" in f for f in s1.listener.stats.failures)
    assert not any("damaged" in f for f in s1.listener.stats.failures)  # the tag caught it, before the checksums
    # neither the copy nor its staging directory (the copier tries again meanwhile, less often each time)
    wait_until(lambda: nothing_received(shm1, JOB), timeout=10, what="nothing left of the altered copies")

    proxy.flip = None  # the same path, honest: the copy lands, byte for byte
    copy = copies_dir(shm1, JOB, 0) / "10"
    wait_until(lambda: copy.is_dir(), timeout=30, what="the copy through the honest proxy")
    assert (copy / "data.bin").read_bytes() == (part / "data.bin").read_bytes() and problems(copy) == []


def test_a_part_fetched_back_altered_in_flight_is_discarded(
        pair: tuple[list[PeerService], list[Path]], proxy_to: list[FlipProxy]) -> None:
    (s0, s1), (shm0, shm1) = pair
    part = write_part(shm0, JOB, 10, index=0)
    s0.copier.directory.static = {1: s1.address}
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "10").is_dir(), timeout=20)
    s0.copier.stop()  # no refill of its own: this test's fetch is the only one
    proxy = FlipProxy(s1.address)
    proxy_to.append(proxy)
    s0.copier.directory.static = {1: proxy.address}
    proxy.flip = ("L>C", into_data(part))
    shutil.rmtree(shm0 / JOB)  # host 0's memory wiped: its part comes back through the attacker
    with pytest.raises(PeerError, match="authentication"):
        s0.copier.fetch(JOB, 10, source=1, origin=0, count=2, save_id="ab-10")
    assert proxy.flipped == 1 and nothing_received(shm0, JOB)

    proxy.flip = None
    back = s0.copier.fetch(JOB, 10, source=1, origin=0, count=2, save_id="ab-10")
    assert back == shm0 / JOB / "10" and problems(back) == []


@pytest.mark.parametrize("direction", ["C>L", "L>C"])
def test_a_header_altered_in_flight_is_refused(pair: tuple[list[PeerService], list[Path]],
                                               proxy_to: list[FlipProxy], direction: str) -> None:
    (_, s1), (_, shm1) = pair
    write_part(shm1, JOB, 10, index=1)
    proxy = FlipProxy(s1.address)
    proxy_to.append(proxy)
    request = {"op": "held", "job": JOB, "origin": 0, "count": 2, "held": []}
    with connect(proxy.address, SECRET.encode(), 5) as chan:  # honest: answered
        chan.send_header(request)
        assert expect(chan, HeldAnswer).dropped == 0
    proxy.flip = (direction, 8)  # inside the JSON of the request (C>L) or of its answer (L>C)
    refused = s1.listener.stats.refused
    with connect(proxy.address, SECRET.encode(), 5) as chan, pytest.raises(PeerError, match="authentication"):
        chan.send_header(request)
        expect(chan, HeldAnswer)
    assert proxy.flipped == 1
    if direction == "C>L":  # the listener refused the request and acted on nothing
        wait_until(lambda: s1.listener.stats.refused > refused, timeout=5)
        assert any("a header failed its authentication" in f for f in s1.listener.stats.failures)


def test_a_peer_of_the_previous_wire_version_is_refused_clearly(pair: tuple[list[PeerService], list[Path]]) -> None:
    (_, s1), _ = pair
    old = socket.create_server(("127.0.0.1", 0))  # a listener of the previous release: its magic line, a nonce

    def serve() -> None:
        conn, _ = old.accept()
        with conn, contextlib.suppress(OSError):
            conn.sendall(b"CKPTDP1\n" + bytes(32))
            conn.recv(1024)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with pytest.raises(PeerError, match="another version of the peer channel"):
        connect(f"127.0.0.1:{old.getsockname()[1]}", SECRET.encode(), 5)
    old.close()
    # a caller of the previous release reads this release's magic line, which is not its own: it goes
    host, _, port = s1.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        first = sock.recv(len(MAGIC))
    assert first == MAGIC and first != b"CKPTDP1\n"
