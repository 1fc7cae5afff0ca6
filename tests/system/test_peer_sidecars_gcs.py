"""Peer copies between real ``ckptd serve`` processes on a ``gs://`` root (the GCS emulator), with no
``CKPTD_PEERS``: each sidecar learns where the others listen only from the registry under
``<root>/<job>/.ckptd/peers/process_<k>.json`` (docs/multihost.md, "Peer copies"). A part written on host 0 lands
as a copy on host 1, and host 0's part comes back from it once host 0's memory is wiped (``make test``); under
``make test-all``: a copy damaged at the holder is found at the fetch (the sidecar's own, or the one the
trainer asks for) and nothing of it is left, and a holder SIGKILLed mid-copy keeps nothing, then, restarted on
another port, is found again through the registry and gets the whole copy; and the multi-host demo on the
emulator (``--root gs://...``, ``--lose-host-memory 1``): host 1 resumes from host 0's copy, host 0 from its
memory, no storage read."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.peers._directory import PeerDirectory
from tests.support.gcs_emulator import GcsEmulator
from tests.support.helpers import free_port, wait_until
from tests.support.peer_parts import PeerSidecars, flip_a_bit, write_part
from tests.system.test_multihost_demo import SHORT, _demo
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE
from trainer_client.core.protocol import PeerFetchRequest

JOB = "peerjob"
BIG_COLS = 1 << 21  # host 0's part: 4 rows x 2Mi f32 = 32 MiB


def _sidecars(gcs: GcsEmulator, base: Path, bandwidth: int = 1 << 30,
              env: dict[str, str] | None = None) -> PeerSidecars:
    return PeerSidecars(base, gcs.gs(f"peers-{uuid.uuid4().hex[:10]}"), 2, bandwidth=bandwidth, env=env)


@pytest.fixture
def hosts(gcs_emulator: GcsEmulator, tmp_path: Path) -> Iterator[PeerSidecars]:
    h = _sidecars(gcs_emulator, tmp_path)
    yield h
    h.stop()


def registry(gcs: GcsEmulator, hosts: PeerSidecars) -> dict[int, str]:
    """The addresses registered on gs://, read through a client of its own (another process's view)."""
    fs = gcs.other_writer()
    base = f"{hosts.root.removeprefix('gs://')}/{JOB}/.ckptd/peers"
    return {int(Path(name).stem.removeprefix("process_")): json.loads(fs.cat(name))["address"]
            for name in fs.ls(base) if name.endswith(".json")}


def own_steps(hosts: PeerSidecars, k: int) -> list[str]:
    """What host ``k`` holds of its own part of the job (steps, staging): not the copies it
    keeps of other hosts' parts (``.peer-<j>``)."""
    job = hosts.shm[k] / JOB
    return sorted(p.name for p in job.iterdir() if not p.name.startswith(".peer-")) if job.is_dir() else []


@pytest.mark.timeout(120)
def test_a_copy_lands_through_the_gcs_registry_and_a_wiped_host_gets_its_part_back(
        gcs_emulator: GcsEmulator, hosts: PeerSidecars) -> None:
    assert "CKPTD_PEERS" not in hosts.env
    hosts.start(0)
    hosts.start(1)
    write_part(hosts.shm[1], JOB, 10, index=1)
    original = write_part(hosts.shm[0], JOB, 10, index=0)
    wait_until(lambda: hosts.copy(1, JOB, 0, 10).is_dir(), timeout=60, what="host 1's copy of host 0's part")
    wait_until(lambda: hosts.copy(0, JOB, 1, 10).is_dir(), timeout=30, what="host 0's copy of host 1's part")
    assert registry(gcs_emulator, hosts) == {k: f"127.0.0.1:{hosts.peer_ports[k]}" for k in (0, 1)}
    data = (original / SNAPSHOT_DATA_FILE).read_bytes()
    assert (hosts.copy(1, JOB, 0, 10) / SNAPSHOT_DATA_FILE).read_bytes() == data
    hosts.wipe(0)  # a replaced node: its sidecar finds its parts gone and asks its holder
    back = hosts.shm[0] / JOB / "10"
    wait_until(lambda: (back / "from_peer.json").is_file(), timeout=30, what="host 0's part brought back")
    assert (back / SNAPSHOT_DATA_FILE).read_bytes() == data
    assert json.loads((back / "from_peer.json").read_text()) == {"host": 1}
    assert "this host's part brought back from host 1" in hosts.log(0)


def test_the_registry_is_read_from_gcs_not_from_a_listing_this_process_cached_before(
        gcs_emulator: GcsEmulator) -> None:
    """gcsfs answers a file's info from its parent's cached listing: one of ``.ckptd/peers/`` taken before host 1
    registered (any listing this sidecar's file system made of the prefix) must not hide host 1's address."""
    storage = Storage(gcs_emulator.gs(f"registry-{uuid.uuid4().hex[:10]}"))
    directory = PeerDirectory(storage, {}, "127.0.0.1:7001")
    directory.register(JOB, 0)
    peers = storage.join(JOB, ".ckptd", "peers")
    assert [e.name for e in storage.list_dir(peers)] == ["process_0.json"]  # cached by this process's gcsfs
    other = gcs_emulator.other_writer()  # host 1's sidecar, another process
    other.pipe(f"{peers}/process_1.json", json.dumps({"address": "127.0.0.1:7002"}).encode())
    assert directory.address_of(JOB, 1) == "127.0.0.1:7002"
    other.pipe(f"{peers}/process_1.json", json.dumps({"address": "127.0.0.1:17002"}).encode())  # moved
    storage.list_dir(peers)
    directory.forget(JOB, 1)  # what the copier does when host 1 no longer answers there
    assert directory.address_of(JOB, 1) == "127.0.0.1:17002"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("asked", [False, True], ids=["brought back unasked", "asked by the trainer"])
def test_a_copy_damaged_at_the_holder_is_found_at_the_fetch_and_nothing_is_left(
        gcs_emulator: GcsEmulator, tmp_path: Path, asked: bool) -> None:
    hosts = _sidecars(gcs_emulator, tmp_path, env={"CKPTD_PEER_REFILL": str(not asked).lower()})
    try:
        hosts.start(0)
        hosts.start(1)
        write_part(hosts.shm[1], JOB, 10, index=1)
        write_part(hosts.shm[0], JOB, 10, index=0)
        wait_until(lambda: hosts.copy(1, JOB, 0, 10).is_dir(), timeout=60, what="host 1's copy of host 0's part")
        flip_a_bit(hosts.copy(1, JOB, 0, 10))
        hosts.wipe(0)
        if asked:  # the agreement's path (ResumeAgreement): the trainer asks its ckptd's API and waits for the answer
            with CkptdClient(ClientSettings(url=f"http://127.0.0.1:{hosts.ports[0]}")) as client:
                answer = client.peer_fetch(JOB, PeerFetchRequest(step=10, source=1, origin=0, count=2,
                                                                 save_id="ab-10"), timeout_s=30)
            assert not answer.ok and answer.error is not None and "arrived damaged" in answer.error, answer
        else:
            wait_until(lambda: "bringing peerjob's part back from host 1 failed" in hosts.log(0), timeout=30,
                       what="the damaged copy refused")
        assert "arrived damaged" in hosts.log(0)
        assert own_steps(hosts, 0) == [], "nothing of the damaged copy is left, not even its staging"
        if not asked:
            wait_until(lambda: hosts.log(0).count("bringing peerjob's part back from host 1 failed") >= 2,
                       timeout=30, what="a second try")  # tried again: still refused, still nothing kept
            assert own_steps(hosts, 0) == []
    finally:
        hosts.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_holder_killed_mid_copy_keeps_nothing_and_is_found_again_through_the_registry(
        gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    hosts = _sidecars(gcs_emulator, tmp_path, bandwidth=8 << 20)  # 32 MiB at 8 MiB/s: a 4 s copy to land a kill in
    try:
        hosts.start(0)
        hosts.start(1)
        write_part(hosts.shm[1], JOB, 10, index=1)
        original = write_part(hosts.shm[0], JOB, 10, index=0, cols=BIG_COLS)
        staging = hosts.shm[1] / JOB / ".peer-0"
        wait_until(lambda: list(staging.glob(".in-*")) if staging.is_dir() else None, timeout=60,
                   what="a copy begun")
        hosts.kill(1)  # SIGKILL: the receive dies with its staging directory half written
        assert not hosts.copy(1, JOB, 0, 10).exists(), "a half copy is never a copy"
        moved = free_port()  # the replaced pod listens elsewhere: only the registry on gs:// says where
        hosts.start(1, peer_port=moved)
        wait_until(lambda: registry(gcs_emulator, hosts).get(1) == f"127.0.0.1:{moved}", timeout=30,
                   what="host 1's new address registered")
        wait_until(lambda: hosts.copy(1, JOB, 0, 10).is_dir(), timeout=90, what="the copy after the restart")
        assert (hosts.copy(1, JOB, 0, 10) / SNAPSHOT_DATA_FILE).read_bytes() == \
            (original / SNAPSHOT_DATA_FILE).read_bytes()
        assert not list(staging.glob(".in-*"))
        assert "peer copy of peerjob step 10 to host 1 failed" in hosts.log(0)
    finally:
        hosts.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_multihost_demo_on_gcs_resumes_a_wiped_host_from_its_peer(gcs_emulator: GcsEmulator,
                                                                      tmp_path: Path) -> None:
    root = gcs_emulator.gs(f"demo-{uuid.uuid4().hex[:10]}")
    report = _demo(tmp_path / "out", *SHORT, "--root", root, "--lose-host-memory", "1")
    assert report["root"] == root
    assert report["agreed_step"] == 25, "the memory save the trainers waited past for the kill, not storage's 15"
    assert [h["restored_from"].split(":")[0] for h in report["hosts"]] == ["memory", "peer"]
    assert report["hosts"][1]["restored_from"].startswith("peer: host 0 ")
    planned = [line for line in report["stdout"].splitlines() if " plan_received " in line]
    assert len(planned) == 2 and all("from memory_agreement" in line for line in planned), planned
    assert report["last_step_committed"] == 40 and report["final_loss"] < report["initial_loss"]
    validated = report["validate_deep"]
    assert validated["exit_code"] == 0 and 40 in [s["step"] for s in validated["steps"] if s["ok"]]
    fs = gcs_emulator.other_writer()  # the registry was on gs://, the only place the sidecars learnt addresses
    assert sorted(Path(p).name for p in fs.ls(f"{root.removeprefix('gs://')}/demo-multihost/.ckptd/peers")) == [
        "process_0.json", "process_1.json"]
