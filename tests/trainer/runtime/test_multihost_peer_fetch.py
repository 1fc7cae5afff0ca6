"""A wiped host's trainer asks its own ckptd for its part back through the client the resume agreement already has
(``CkptdClient.peer_fetch``: ``POST /v1/jobs/{job}/peer-fetch``, docs/multihost.md, "Peer copies"): over a unix
socket (``CKPTD_URL=unix:///...``) the part comes back and both hosts plan the agreed memory step; a ckptd whose
peer channel is off says so, and the wiped host takes the storage step (every host does, at the restore).

Two ``ResumeAgreement``s on threads stand in for the job's two processes (the coordination service's key-value
store in one process); the sidecars are real: host 1's ckptd served on a unix socket, host 0's peer channel."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from ckptd.config import Settings
from ckptd.peers import PeerService, build_peers
from tests.support.helpers import make_settings, wait_until
from tests.support.kv_store import InProcessKeyValueStore
from tests.support.peer_parts import SECRET, write_part
from tests.support.server import ServerHandle, new_socket_dir, start_server
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._ckptd_url import unix_url
from trainer_client.core.format._peer_copies import brought_from, copies_dir
from trainer_client.core.protocol import MeshSpec, ResumePlan, ResumeRequest, Tier
from trainer_client.errors import NoCheckpointError
from trainer_client.runtime.multihost._multihost import ResumeAgreement

JOB = "peerjob"
REQUEST = ResumeRequest(policy="pause", alive_devices=8, process_count=2)


class StorageAnswer:
    """Process 0's client as far as the agreement asks it: the storage step, or none."""

    def __init__(self, plan: ResumePlan | None) -> None:
        self.plan = plan

    def resume(self, job: str, request: ResumeRequest) -> ResumePlan:
        if self.plan is None:
            raise NoCheckpointError("no committed step")
        return self.plan


def agree(shm: list[Path], clients: list[object]) -> tuple[list[ResumeAgreement], dict[int, ResumePlan | None]]:
    """Both processes' agreement on the resume step: their agreements and the plan each made."""
    store = InProcessKeyValueStore()
    agreements = [ResumeAgreement(JOB, str(shm[k]), cast(CkptdClient, clients[k]), process_index=k, process_count=2,
                                  store=store) for k in range(2)]
    plans: dict[int, ResumePlan | None] = {}
    threads = [threading.Thread(target=lambda k=k: plans.__setitem__(k, agreements[k].plan(REQUEST)))
               for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(plans) == {0, 1}, "an agreement did not finish"
    return agreements, plans


@pytest.fixture
def hosts(tmp_path: Path) -> list[Path]:
    root = tmp_path / "root"
    (root / JOB).mkdir(parents=True)
    shm = [tmp_path / f"shm{k}" for k in range(2)]
    for path in shm:
        path.mkdir(mode=0o700)
    return shm


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = new_socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve_host_1(tmp_path: Path, shm: Path, sock_dir: Path, **peer: object) -> ServerHandle:
    """Host 1's ckptd, on a unix socket (its peer channel as ``peer`` says: off without a port)."""
    return start_server(tmp_path / "root", tmp_path / "state1", shm_dir=str(shm), uds=str(sock_dir / "ckptd.sock"),
                        **peer)


@pytest.mark.needs_tcp  # the peer channel between the sidecars is TCP
def test_a_wiped_host_gets_its_part_back_over_ckptd_s_api_on_a_unix_socket(
        tmp_path: Path, hosts: list[Path], sock_dir: Path) -> None:
    settings0: Settings = make_settings(tmp_path / "root", tmp_path / "state0", shm_dir=str(hosts[0]), peer_port=0,
                                        peer_secret=SECRET)
    host0 = build_peers(settings0.peer, settings0.memory_tier, settings0.storage.root)
    assert isinstance(host0, PeerService)
    host0.start()
    host1 = serve_host_1(tmp_path, hosts[1], sock_dir, peer_port=0, peer_secret=SECRET,
                         peer_refill=False)  # the trainer's request is the only way back
    try:
        assert host1.url.startswith("unix:///")
        write_part(hosts[1], JOB, 10, index=1)
        original = (write_part(hosts[0], JOB, 10, index=0) / "data.bin").read_bytes()
        wait_until(lambda: (copies_dir(hosts[1], JOB, 0) / "10").is_dir() and
                   (copies_dir(hosts[0], JOB, 1) / "10").is_dir(), timeout=30, what="each host's copy at the other")
        mine = (hosts[1] / JOB / "10" / "data.bin").read_bytes()
        shutil.rmtree(hosts[1] / JOB / "10")  # host 1's memory wiped (the copy it keeps of host 0's part stays)
        with CkptdClient(ClientSettings(url=unix_url(str(sock_dir / "ckptd.sock")))) as client1:
            agreements, plans = agree(hosts, [StorageAnswer(None), client1])
        assert agreements[0].decision == agreements[1].decision
        assert agreements[1].decision is not None and agreements[1].decision["sources"] == {"1": 0}
        for k in (0, 1):
            plan = plans[k]
            assert plan is not None and (plan.tier, plan.step) == (Tier.MEMORY, 10), plan
        assert agreements[1].peer_source == 0 and agreements[1]._fetch_error is None
        back = hosts[1] / JOB / "10"
        assert (back / "data.bin").read_bytes() == mine and brought_from(back) == 0
        assert (hosts[0] / JOB / "10" / "data.bin").read_bytes() == original
        assert host0.snapshot()["copies_served"] == 1
        assert "peer_fetch_s" in agreements[1].timings
    finally:
        host1.stop()
        host0.stop()


def test_a_ckptd_whose_peer_channel_is_off_sends_the_wiped_host_to_storage(
        tmp_path: Path, hosts: list[Path], sock_dir: Path) -> None:
    write_part(hosts[0], JOB, 10, index=0)
    held = copies_dir(hosts[0], JOB, 1)  # host 0 keeps a copy of host 1's part: the decision names it
    held.mkdir(mode=0o700)
    write_part(tmp_path / "scratch", JOB, 10, index=1).rename(held / "10")
    stored = ResumePlan(job=JOB, step=5, path=str(tmp_path / "root" / JOB / "5"), policy="pause",
                        mesh=MeshSpec(axis_names=["replica", "data"], shape=[4, 2]), saved_mesh=None)
    host1 = serve_host_1(tmp_path, hosts[1], sock_dir)  # no CKPTD_PEER_PORT: the channel is off
    try:
        with CkptdClient(ClientSettings(url=host1.url)) as client1:
            agreements, plans = agree(hosts, [StorageAnswer(stored), client1])
    finally:
        host1.stop()
    assert agreements[1].decision is not None and agreements[1].decision["tier"] == Tier.MEMORY
    plan0, plan1 = plans[0], plans[1]
    assert plan0 is not None and plan0.tier == Tier.MEMORY  # host 0 planned its memory; at the restore it hears
    assert plan1 is not None and (plan1.tier, plan1.step) == (Tier.STORAGE, 5)  # host 1 failed and takes storage
    assert "PEER_CHANNEL_OFF" in str(agreements[1]._fetch_error) and agreements[1].peer_source is None
    assert not (hosts[1] / JOB / "10").exists()
