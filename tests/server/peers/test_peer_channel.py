"""The peer data channel between two sidecars' ``PeerService``s on 127.0.0.1 (real sockets, real shared-memory
directories under the test's tmp): a whole part is copied to the host that holds copies of it, evicted with
its original, brought back into a wiped host's memory checked shard by shard when its trainer asks over ckptd's
API (``POST /v1/jobs/{job}/peer-fetch``); a damaged copy, a caller without the secret and hostile headers are
refused and leave nothing behind (docs/multihost.md, "Peer copies")."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import struct
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from ckptd._metrics import Metrics
from ckptd.config import Settings
from ckptd.peers import PeerService
from ckptd.peers._directory import holders_of, parse_map
from ckptd.peers._headers import PutAnswer, expect
from ckptd.peers._protocol import PeerError, caller_handshake, connect
from tests.server.peers.conftest import JOB, fetch
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.core.format._peer_copies import brought_from, copies_dir, held_copies
from trainer_client.core.format._snapshot import problems
from trainer_client.core.protocol import PeerFetchAnswer


def test_a_whole_part_is_copied_evicted_with_its_original_and_brought_back(
        pair: tuple[list[PeerService], list[Path]], api0: TestClient) -> None:
    (s0, s1), (shm0, shm1) = pair
    write_part(shm1, JOB, 10, index=1)  # host 1's sidecar registers its address once it sees its first part
    part = write_part(shm0, JOB, 10, index=0)
    copy = copies_dir(shm1, JOB, 0) / "10"
    wait_until(lambda: copy.is_dir(), timeout=20)
    assert (copy / "data.bin").read_bytes() == (part / "data.bin").read_bytes()
    assert [(o, m.step) for o, _, m in held_copies(str(shm1), JOB)] == [(0, 10)]
    assert json.loads((Path(s0.listener.store.shm_dir).parent / "root" / JOB / ".ckptd" / "peers" /
                       "process_0.json").read_text())["address"] == s0.address

    write_part(shm0, JOB, 20, index=0)  # a newer save, then the older one evicted: its copy goes too
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "20").is_dir(), timeout=20)
    shutil.rmtree(part)
    wait_until(lambda: not copy.exists(), timeout=20)
    assert s0.snapshot()["copies_sent"] == 2 and s1.snapshot()["copies_received"] == 2
    assert s1.snapshot()["copies_sent"] == 1 and (copies_dir(shm0, JOB, 1) / "10").is_dir()  # and the other way
    # the same numbers on /metrics, read at the scrape
    metrics = Metrics()
    metrics.watch_peers(s0.snapshot)
    exported = {(x.name, tuple(x.labels.items())): x.value
                for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                for x in family.samples}
    assert exported[("ckptd_peer_copies_sent_total", ())] == 2
    assert exported[("ckptd_peer_bytes_sent_total", ())] == s0.snapshot()["bytes_sent"] > 0
    assert 0 <= exported[("ckptd_peer_copy_age_seconds", (("ckpt_job", JOB),))] < 60

    original = (shm0 / JOB / "20" / "data.bin").read_bytes()
    shutil.rmtree(shm0 / JOB)  # host 0's memory wiped: its trainer asks for its part of 20 back from host 1
    assert fetch(api0, JOB, 20, save_id="ab-20") == PeerFetchAnswer(ok=True)
    assert (shm0 / JOB / "20" / "data.bin").read_bytes() == original and problems(shm0 / JOB / "20") == []
    left = sorted(p.name for p in (shm0 / JOB).iterdir() if not p.name.startswith(".peer-1"))  # host 1's copies
    assert left == ["20"]  # no staging left, nothing else written
    # brought back once: by the sidecar itself when it saw the wipe, or at the request (then held already)
    assert s0.snapshot()["fetched"] >= 1 and s1.snapshot()["copies_served"] == 1


def test_a_damaged_copy_is_refused_and_leaves_nothing(pair: tuple[list[PeerService], list[Path]],
                                                      api0: TestClient) -> None:
    (s0, s1), (shm0, shm1) = pair
    # the trainer's request is the only fetch: a refill of the sidecar's own, trying the damaged copy again every
    # 2 s, would leave a staging directory for a moment whenever the check below looked
    s0.copier.options = dataclasses.replace(s0.copier.options, refill=False)
    write_part(shm1, JOB, 10, index=1)
    write_part(shm0, JOB, 10, index=0)
    copy = copies_dir(shm1, JOB, 0) / "10"
    wait_until(lambda: copy.is_dir() and (copies_dir(shm0, JOB, 1) / "10").is_dir(), timeout=20)
    s1.copier.stop()  # host 1 sends host 0 nothing more (it would send its copy again once host 0's memory is gone)
    with (copy / "data.bin").open("r+b") as f:  # one flipped bit in a shard: sizes still right
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    shutil.rmtree(shm0 / JOB)
    answer = fetch(api0, JOB, 10, save_id="ab-10")
    assert not answer.ok and answer.error is not None and "damaged" in answer.error
    assert not (shm0 / JOB / "10").exists()
    assert list((shm0 / JOB).iterdir()) == []


def test_a_fetch_of_a_copy_nobody_holds_fails_fast(pair: tuple[list[PeerService], list[Path]],
                                                    api0: TestClient) -> None:
    (s0, s1), (_, shm1) = pair
    write_part(shm1, JOB, 10, index=1)
    wait_until(lambda: s1.copier.directory._registered, timeout=10)
    started = time.monotonic()
    answer = fetch(api0, JOB, 30, save_id="ab-30")
    assert not answer.ok and answer.error is not None and "no intact part" in answer.error
    assert time.monotonic() - started < 10 and s0.snapshot()["fetch_failures"] == 1


def test_a_fetch_from_hosts_that_cannot_be_is_answered_without_asking_anyone(
        pair: tuple[list[PeerService], list[Path]], api0: TestClient) -> None:
    """Valid fields each, no meaning together (the source is the asker, an index past the hosts): the request is
    answered, not refused, and no peer is asked."""
    (_, s1), (shm0, _) = pair
    for source, origin, count in ((0, 0, 2), (2, 0, 2), (1, 2, 2)):
        answer = fetch(api0, JOB, 10, source=source, origin=origin, count=count)
        assert not answer.ok and answer.error is not None and "cannot hold a copy" in answer.error, answer
    assert s1.snapshot()["copies_served"] == 0 and s1.listener.stats.refused == 0
    assert not (shm0 / JOB).exists()


def test_callers_without_the_secret_and_hostile_headers_are_refused(
        pair: tuple[list[PeerService], list[Path]]) -> None:
    (_, s1), (_, shm1) = pair
    with pytest.raises(PeerError):  # the listener does not prove itself to a caller with another secret
        connect(s1.address, b"another-secret-of-the-same-size!", 5)
    wait_until(lambda: any("secret" in f for f in s1.listener.stats.failures), timeout=5)

    def ask(header: bytes | dict[str, object]) -> dict[str, object]:
        host, _, port = s1.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            chan = caller_handshake(sock, SECRET.encode())
            if isinstance(header, bytes):
                sock.sendall(header)
            else:  # well-formed and tagged: only its fields are hostile
                chan.send_header(header)
            return chan.recv_header()

    assert ask(struct.pack(">I", 1 << 30))["ok"] is False  # refused without reading a gigabyte
    bads: list[dict[str, object]] = [
        {"op": "put", "job": "../x", "origin": 0, "count": 2, "step": 1, "held": [], "meta": 10, "data": 10},
        {"op": "put", "job": JOB, "origin": 5, "count": 2, "step": 1, "held": [], "meta": 10, "data": 10},
        {"op": "put", "job": JOB, "origin": 0, "count": 2, "step": -1, "held": [], "meta": 10, "data": 10},
        {"op": "put", "job": JOB, "origin": 0, "count": 2, "step": 1, "held": [], "meta": 10, "data": 1 << 50},
        {"op": "get", "job": JOB, "origin": 0, "count": 2, "step": 1},
        {"op": "rm", "job": JOB}]
    for bad in bads:
        answer = ask(bad)
        assert answer["ok"] is False, bad
    assert not (shm1 / "x").exists() and not list(shm1.glob("*/.peer-*/*"))


def test_a_sender_killed_mid_copy_leaves_no_copy(pair: tuple[list[PeerService], list[Path]]) -> None:
    (_, s1), (_, shm1) = pair
    with connect(s1.address, SECRET.encode(), 5) as chan:
        chan.send_header({"op": "put", "job": JOB, "origin": 0, "count": 2, "step": 7, "held": [7],
                          "meta": 100, "data": 4096})
        assert expect(chan, PutAnswer).have is False
        chan.sock.sendall(b"{" * 50)  # half the metadata, then the connection drops
    wait_until(lambda: s1.listener.stats.refused >= 1, timeout=10)
    assert list(copies_dir(shm1, JOB, 0).iterdir()) == []  # neither the copy nor its staging directory


def test_the_mapping_and_the_secret_rule() -> None:
    assert holders_of(0, 2, 1, 1) == [1] and holders_of(1, 2, 1, 1) == [0]
    assert holders_of(1, 8, 2, 4) == [5] and holders_of(0, 8, 1, 4) == [4]  # another slice of 4 hosts
    assert holders_of(0, 4, 2, 1) == [1, 2]
    assert holders_of(0, 4, 1, 1, parse_map("0:3,1:2")) == [3]
    with pytest.raises(ValidationError, match="PEER_SECRET"):
        Settings(peer_port=0, shm_dir="/tmp")
    with pytest.raises(ValidationError, match="PEER_SECRET"):
        Settings(peer_port=0, shm_dir="/tmp", peer_secret="short")


def test_a_sidecar_whose_memory_was_wiped_brings_its_newest_part_back_unasked(
        pair: tuple[list[PeerService], list[Path]]) -> None:
    (s0, _), (shm0, shm1) = pair
    write_part(shm1, JOB, 10, index=1)
    write_part(shm0, JOB, 10, index=0)
    original = (write_part(shm0, JOB, 20, index=0) / "data.bin").read_bytes()
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "20").is_dir(), timeout=20)
    shutil.rmtree(shm0 / JOB)  # no trainer asks: the sidecar saw its parts and sees none now
    back = shm0 / JOB / "20"
    wait_until(lambda: back.is_dir(), timeout=20, what="the part brought back")
    assert (back / "data.bin").read_bytes() == original and problems(back) == []
    assert brought_from(back) == 1 and brought_from(copies_dir(shm1, JOB, 0) / "20") is None
    wait_until(lambda: s0.snapshot()["fetched"] >= 1, timeout=5)  # counted once the fetch returns
