"""Peer copies between real ``ckptd serve`` processes on 127.0.0.1 (docs/multihost.md, "Peer copies"): the
holder SIGKILLed in the middle of a copy keeps nothing of it, and once restarted gets the whole copy; a peer
that stops answering (SIGSTOP) never slows the sender's API, and the copy lands once it answers again; a wiped
host's trainer asks its ckptd's API for its part (``POST /v1/jobs/{job}/peer-fetch``) and gets it back."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from examples.demo import free_port, start_ckptd
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p

JOB = "peerjob"
BIG_COLS = 1 << 21  # host 0's part: 4 rows x 2Mi f32 = 32 MiB


class Hosts:
    """Two sidecars with their peer channels on fixed ports (CKPTD_PEERS: JobSet's stable names)."""

    def __init__(self, base: Path, bandwidth: int, *, refill: bool = True) -> None:
        self.base = base
        self.refill = refill
        self.shm = [base / "shm0", base / "shm1"]
        for shm in self.shm:
            shm.mkdir(mode=0o700)
        (base / "root" / JOB).mkdir(parents=True)
        self.ports = [free_port(), free_port()]
        self.peer_ports = [free_port(), free_port()]
        self.bandwidth = bandwidth
        self.procs: list[subprocess.Popen[bytes] | None] = [None, None]

    def start(self, k: int) -> None:
        env = {"CKPTD_PEER_PORT": str(self.peer_ports[k]), "CKPTD_PEER_SECRET": SECRET,
               "CKPTD_PEERS": ",".join(f"{i}=127.0.0.1:{p}" for i, p in enumerate(self.peer_ports)),
               "CKPTD_PEER_BANDWIDTH_BYTES_S": str(self.bandwidth), "CKPTD_PEER_REFILL": str(self.refill).lower()}
        self.procs[k] = start_ckptd(self.base / "root", self.base / f"state{k}", self.shm[k], self.ports[k],
                                    self.base / f"ckptd-{k}.log", env)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()

    def copy(self, holder: int, origin: int, step: int) -> Path:
        return self.shm[holder] / JOB / f".peer-{origin}" / str(step)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(tmp_path, bandwidth=4 << 20)  # 32 MiB at 4 MiB/s, a second's worth at once: 7 s to land a kill in
    yield h
    h.stop()


@pytest.mark.timeout(180)
def test_a_holder_killed_mid_copy_keeps_nothing_and_gets_the_whole_copy_after_its_restart(hosts: Hosts) -> None:
    hosts.start(0)
    hosts.start(1)
    write_part(hosts.shm[1], JOB, 10, index=1)
    original = write_part(hosts.shm[0], JOB, 10, index=0, cols=BIG_COLS)
    staging = hosts.shm[1] / JOB / ".peer-0"
    # Killed as soon as the part's bytes are arriving (its data file begun): the channel's rate keeps the rest of
    # them on the way for 7 s more, however fast the machine (a sleep here only ate into that).
    wait_until(lambda: list(staging.glob(".in-*/data.bin")) if staging.is_dir() else None, timeout=60,
               what="a copy's bytes arriving")
    victim = hosts.procs[1]
    assert victim is not None
    victim.kill()  # SIGKILL: the receive dies with its staging directory half written
    victim.wait()
    assert not hosts.copy(1, 0, 10).exists(), "a half copy is never a copy"
    assert list(staging.glob(".in-*")), "the kill left its staging behind (the restart must drop it)"
    hosts.start(1)
    wait_until(lambda: hosts.copy(1, 0, 10).is_dir(), timeout=90, what="the copy after the holder's restart")
    assert (hosts.copy(1, 0, 10) / "data.bin").read_bytes() == (original / "data.bin").read_bytes()
    assert not list(staging.glob(".in-*"))
    log = (hosts.base / "ckptd-0.log").read_text(errors="replace")
    assert "peer copy of peerjob step 10 to host 1 failed" in log  # the cut was seen, then tried again


@pytest.mark.timeout(180)
def test_a_stopped_peer_never_slows_the_sender_and_gets_the_copy_when_it_answers(tmp_path: Path) -> None:
    hosts = Hosts(tmp_path, bandwidth=1 << 30)
    try:
        hosts.start(0)
        hosts.start(1)
        write_part(hosts.shm[1], JOB, 10, index=1)
        write_part(hosts.shm[0], JOB, 10, index=0)
        wait_until(lambda: hosts.copy(1, 0, 10).is_dir(), timeout=30, what="the first copy")
        stopped = hosts.procs[1]
        assert stopped is not None
        os.kill(stopped.pid, signal.SIGSTOP)  # the kernel still accepts its connections; nobody answers
        write_part(hosts.shm[0], JOB, 20, index=0, cols=BIG_COLS)
        with httpx.Client(base_url=f"http://127.0.0.1:{hosts.ports[0]}") as http:
            # The sender's copier is waiting on the stopped peer (a request to it open; it gives up only at its
            # 30 s deadline); every /healthz must answer while that attempt is still under way, failures unchanged
            # by the end: an API that waited on the copier could not. Structural, not a time bound on the answers.
            wait_until(lambda: _callers_of(hosts.peer_ports[1]), timeout=30,
                       what="the sender's copier waiting on the stopped peer")
            failures = _copy_failures(http)
            for i in range(20):
                assert http.get("/healthz", timeout=25).status_code == 200
                write_part(hosts.shm[0], JOB, 100 + i, index=0)  # saves go on
            assert _copy_failures(http) == failures, "the copier's attempt ended while /healthz was asked"
            assert _callers_of(hosts.peer_ports[1])
        assert not hosts.copy(1, 0, 20).exists()
        os.kill(stopped.pid, signal.SIGCONT)
        newest = max(int(p.name) for p in (hosts.shm[0] / JOB).iterdir() if p.name.isdigit())
        wait_until(lambda: hosts.copy(1, 0, newest).is_dir(), timeout=90, what="the newest copy once it answers")
    finally:
        hosts.stop()


def _callers_of(port: int) -> int:
    """Established TCP connections (IPv4) to ``port`` on this machine: callers of its listener, answered or not."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
            count += 1
    return count


def _copy_failures(http: httpx.Client) -> float:
    found = re.search(r"^ckptd_peer_copy_failures(?:_total)? (\S+)$", http.get("/metrics", timeout=25).text, re.M)
    assert found, "no ckptd_peer_copy_failures on /metrics"
    return float(found.group(1))


@pytest.mark.timeout(120)
def test_a_wiped_host_s_trainer_asks_its_ckptd_over_http_and_gets_its_part_back(tmp_path: Path) -> None:
    hosts = Hosts(tmp_path, bandwidth=1 << 30, refill=False)  # the trainer's request is the only way back
    try:
        hosts.start(0)
        hosts.start(1)
        write_part(hosts.shm[1], JOB, 10, index=1)
        original = (write_part(hosts.shm[0], JOB, 10, index=0) / "data.bin").read_bytes()
        wait_until(lambda: hosts.copy(1, 0, 10).is_dir(), timeout=60, what="host 1's copy of host 0's part")
        shutil.rmtree(hosts.shm[0] / JOB / "10")  # host 0's memory wiped, its sidecar running
        url = f"http://127.0.0.1:{hosts.ports[0]}"
        malformed = httpx.post(url + p.ROUTE_PEER_FETCH.format(job=JOB), timeout=10,
                               json={"step": 10, "source": 1, "origin": 0, "count": 0})
        assert malformed.status_code == 422
        assert p.ErrorBody.model_validate_json(malformed.content).code is p.ErrorCode.INVALID_REQUEST
        with CkptdClient(ClientSettings(url=url)) as client:
            answer = client.peer_fetch(JOB, p.PeerFetchRequest(step=10, source=1, origin=0, count=2,
                                                               save_id="ab-10"))
        assert answer == p.PeerFetchAnswer(ok=True)
        back = hosts.shm[0] / JOB / "10"
        assert (back / "data.bin").read_bytes() == original and (back / "from_peer.json").is_file()
        log = (tmp_path / "ckptd-0.log").read_text(errors="replace")
        assert "this host's part brought back from host 1" in log
    finally:
        hosts.stop()
