"""Peer copies with three hosts (docs/multihost.md, "Peer copies"): by the default stride host k's part is kept
by host k+1 (modulo 3), so host 1's is on host 2. In ``make test``: three real ``ckptd serve`` processes
(addresses from the registry on the root) pass each part to the next host; host 1 wiped gets its part back from
host 2; hosts 1 and 2 both wiped: host 2's part comes back from host 0, host 1's from nowhere. Under
``make test-all``: the multi-host demo with three JAX processes (``--hosts 3``): ``--lose-host-memory 1`` resumes
host 1 from host 2's copy and hosts 0 and 2 from their memory, one step, no storage read;
``--lose-host-memory 1,2`` (a host and the holder of its part) sends every host to storage."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import wait_until
from tests.support.peer_parts import PeerSidecars, write_part
from tests.system.test_multihost_demo import SHORT, _demo
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE

JOB = "peerjob"


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[PeerSidecars]:
    (tmp_path / "root" / JOB).mkdir(parents=True)
    h = PeerSidecars(tmp_path, str(tmp_path / "root"), 3)
    yield h
    h.stop()


@pytest.mark.timeout(120)
def test_three_sidecars_pass_each_part_to_the_next_host_and_bring_a_wiped_host_s_part_back(
        hosts: PeerSidecars) -> None:
    for k in range(3):
        hosts.start(k)
    data = [(write_part(hosts.shm[k], JOB, 10, index=k, count=3) / SNAPSHOT_DATA_FILE).read_bytes()
            for k in range(3)]
    for k in range(3):
        holder = (k + 1) % 3
        wait_until(lambda k=k, holder=holder: hosts.copy(holder, JOB, k, 10).is_dir(), timeout=60,
                   what=f"host {holder}'s copy of host {k}'s part")
        assert not hosts.copy((k + 2) % 3, JOB, k, 10).exists(), "one copy (K=1), on the next host only"
    hosts.wipe(1)
    back = hosts.shm[1] / JOB / "10"
    wait_until(lambda: (back / "from_peer.json").is_file(), timeout=30, what="host 1's part brought back")
    assert json.loads((back / "from_peer.json").read_text()) == {"host": 2}
    assert (back / SNAPSHOT_DATA_FILE).read_bytes() == data[1]
    # Now a host and the holder of its part: host 2's own part comes back from host 0. Host 1's sidecar is paused
    # across both wipes, else a refill of its own between them could bring its part back from host 2 first.
    paused = hosts.procs[1]
    assert paused is not None
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        hosts.wipe(1)
        hosts.wipe(2)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    again = hosts.shm[2] / JOB / "10"
    wait_until(lambda: (again / "from_peer.json").is_file(), timeout=30, what="host 2's part brought back")
    assert json.loads((again / "from_peer.json").read_text()) == {"host": 0}
    assert (again / SNAPSHOT_DATA_FILE).read_bytes() == data[2]
    # Host 1's sidecar asks host 2 again every 2 s, and host 2 holds nothing of host 1's any more: two more of its
    # refills finished (the second begun after this look, so after host 2's wipe) however long they take, and
    # nothing came back. Counted, not slept: a loaded machine could have run none in a fixed wait.
    refills = _peer_counter(hosts, 1, "refills")
    wait_until(lambda: _peer_counter(hosts, 1, "refills") >= refills + 2, timeout=60,
               what="two more refills on host 1")
    assert not back.exists(), "host 1's part is nowhere: nothing comes back"


def _peer_counter(hosts: PeerSidecars, k: int, name: str) -> float:
    """Host ``k``'s sidecar's ``ckptd_peer_<name>_total`` on its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{hosts.ports[k]}/metrics", timeout=30).text
    found = re.search(rf"^ckptd_peer_{name}_total (\S+)$", text, re.M)
    assert found, f"no ckptd_peer_{name}_total on host {k}'s /metrics"
    return float(found.group(1))


def _three_hosts(out: Path, *extra: str) -> dict[str, Any]:
    report = _demo(out, *SHORT, "--hosts", "3", *extra)
    hosts = report["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1, 2]
    assert all(h["pid_after"] != h["pid_before"] for h in hosts)
    assert {h["resume_step"] for h in hosts} == {report["agreed_step"]}, "one step for every host"
    assert report["final_step"] == 40 and report["last_step_committed"] == 40
    assert report["final_loss"] < report["initial_loss"]
    validated = report["validate_deep"]
    assert validated["exit_code"] == 0 and validated["steps"] and all(s["ok"] for s in validated["steps"])
    return report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_hosts_a_wiped_host_resumes_from_the_next_host_s_copy(tmp_path: Path) -> None:
    report = _three_hosts(tmp_path / "out", "--lose-host-memory", "1")
    assert report["agreed_step"] == 25, "the memory save the trainers waited past for the kill, not storage's 15"
    assert [h["restored_from"].split(":")[0] for h in report["hosts"]] == ["memory", "peer", "memory"]
    assert report["hosts"][1]["restored_from"].startswith("peer: host 2 ")
    planned = [line for line in report["stdout"].splitlines() if " plan_received " in line]
    assert len(planned) == 3 and all("from memory_agreement" in line for line in planned), planned


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_hosts_a_wiped_host_and_the_holder_of_its_part_send_every_host_to_storage(tmp_path: Path) -> None:
    report = _three_hosts(tmp_path / "out", "--lose-host-memory", "1,2")
    assert report["agreed_step"] == 15, "the newest step on storage before the kill"
    assert all(h["restored_from"].startswith("storage: ") for h in report["hosts"])
    assert report["lost_host_memory"] == [1, 2]


@pytest.mark.timeout(120)
def test_a_wiped_holder_is_sent_the_copies_it_kept_again_before_their_hosts_save_anew(hosts: PeerSidecars) -> None:
    for k in range(3):
        hosts.start(k)
    for k in range(3):
        write_part(hosts.shm[k], JOB, 10, index=k, count=3)
    for k in range(3):
        wait_until(lambda k=k: hosts.copy((k + 1) % 3, JOB, k, 10).is_dir(), timeout=60, what=f"host {k}'s copy")
    hosts.wipe(1)  # host 1 kept host 0's part: host 0 saves nothing new, and must send it again
    wait_until(lambda: hosts.copy(1, JOB, 0, 10).is_dir(), timeout=30, what="host 0's copy on host 1 again")
