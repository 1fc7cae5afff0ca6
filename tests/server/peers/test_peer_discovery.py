"""A sidecar started on a new node (its shared memory empty, no part ever seen) that knows its host index from its
environment (``CKPTD_HOST_INDEX``, else Kubernetes' ``JOB_COMPLETION_INDEX``) and the host count
(``CKPTD_HOST_COUNT``, else the hosts ``CKPTD_PEERS`` names) asks its holders which jobs they keep its part of
and brings the part back at once, with no trainer asking (docs/multihost.md, "Peer copies")."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from ckptd.config import Settings
from ckptd.peers import PeerService
from ckptd.peers._store import PartStore
from tests.server.peers.conftest import JOB, peers_of, settings
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.core.format._peer_copies import FROM_PEER_FILE, brought_from, copies_dir
from trainer_client.core.format._private_files import ensure_private_dir, write_private
from trainer_client.core.format._snapshot import problems


def replace_node_0(pair: tuple[list[PeerService], list[Path]]) -> tuple[Path, bytes]:
    """Host 0's part copied to host 1, then host 0's node replaced: its sidecar gone, its memory empty."""
    (s0, _), (shm0, shm1) = pair
    write_part(shm1, JOB, 10, index=1)  # host 1 registers its address once it sees its first part
    write_part(shm0, JOB, 10, index=0)
    original = (write_part(shm0, JOB, 20, index=0) / "data.bin").read_bytes()
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "20").is_dir(), timeout=20, what="host 0's copy on host 1")
    s0.stop()
    shutil.rmtree(shm0)
    shm0.mkdir(mode=0o700)
    return shm0, original


def start_fresh(tmp_path: Path, **extra: object) -> PeerService:
    service = peers_of(settings(tmp_path, 0, tmp_path / "root", **extra))
    assert service is not None
    service.start()
    return service


def brought_back(shm0: Path, original: bytes, fresh: PeerService) -> None:
    back = shm0 / JOB / "20"
    wait_until(lambda: back.is_dir(), timeout=20, what="host 0's part brought back unasked")
    assert (back / "data.bin").read_bytes() == original and problems(back) == [] and brought_from(back) == 1
    wait_until(lambda: fresh.snapshot()["fetched"] == 1, timeout=5)


def test_a_fresh_sidecar_with_its_host_index_brings_its_part_back_from_the_registry(
        pair: tuple[list[PeerService], list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm0, original = replace_node_0(pair)
    monkeypatch.setenv("CKPTD_HOST_INDEX", "0")
    monkeypatch.setenv("CKPTD_HOST_COUNT", "2")
    fresh = start_fresh(tmp_path)  # the holders' addresses from <root>/<job>/.ckptd/peers/
    try:
        assert fresh.copier.options.host == (0, 2)
        brought_back(shm0, original, fresh)
    finally:
        fresh.stop()


def test_a_fresh_sidecar_learns_its_index_from_the_indexed_job_and_the_count_from_its_peers(
        pair: tuple[list[PeerService], list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (_, s1), _ = pair
    shm0, original = replace_node_0(pair)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")  # what an Indexed Job's pod gets
    fresh = start_fresh(tmp_path, peers=f"0=127.0.0.1:1,1={s1.address}")  # no registry read
    try:
        assert fresh.copier.options.host == (0, 2) and fresh.copier.directory.storage is None
        brought_back(shm0, original, fresh)
    finally:
        fresh.stop()


def test_the_host_index_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert Settings().peer.host_index == 3
    monkeypatch.setenv("CKPTD_HOST_INDEX", "1")  # explicit wins
    assert (Settings().peer.host_index, Settings().peer.host_count) == (1, None)
    for name, value, message in (("CKPTD_HOST_INDEX", "one", "CKPTD_HOST_INDEX"),
                                 ("CKPTD_HOST_INDEX", "-1", "CKPTD_HOST_INDEX"),
                                 ("CKPTD_HOST_COUNT", "0", "CKPTD_HOST_COUNT")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(ValidationError, match=message):
                Settings()
    with monkeypatch.context() as env:
        env.setenv("CKPTD_HOST_COUNT", "1")
        with pytest.raises(ValidationError, match=r"host index 1 .* not below the host count 1"):
            Settings()
    monkeypatch.delenv("CKPTD_HOST_INDEX")
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    # the count from CKPTD_PEERS only when it names hosts 0..N-1; an index outside them is refused
    peers = "0=a:1,1=b:1,2=c:1"
    assert Settings(host_index=2, peers=peers).peer.this_host() == (2, 3)
    assert Settings(host_index=2, peers="0=a:1,2=c:1").peer.this_host() is None
    assert Settings(host_index=2, host_count=4).peer.this_host() == (2, 4)
    assert Settings(peers=peers).peer.this_host() is None
    with pytest.raises(ValidationError, match="not below the host count 3"):
        Settings(host_index=3, peers=peers)
    # a malformed list is refused at startup, naming the item (not at the peer channel's start)
    for field, value, message in (("peers", "0=a:1,b:2", r"CKPTD_PEERS: 'b:2' is not INDEX=HOST:PORT"),
                                  ("peers", "0=a b:1", "CKPTD_PEERS"),
                                  ("peer_map", "0:1,1:x", r"CKPTD_PEER_MAP: '1:x' is not ORIGIN:HOLDER")):
        with pytest.raises(ValidationError, match=message):
            Settings(**{field: value})


def test_a_holder_names_only_the_jobs_of_as_many_hosts_as_the_asker(tmp_path: Path) -> None:
    """A new node's ``jobs`` question says its host count: copies of a job that ran on another number of hosts
    (an ended job's, a differently sized one's) are not brought back to it."""
    shm = ensure_private_dir(tmp_path / "shm")
    for job, count in (("two-hosts", 2), ("four-hosts", 4), ("also-two", 2)):
        part = write_part(tmp_path / "made", job, 5, index=0, count=count)
        ensure_private_dir(shm / job)
        os.rename(part, ensure_private_dir(copies_dir(shm, job, 0)) / "5")
    store = PartStore(shm)
    assert store.jobs_holding(0, 2, 256) == ["also-two", "two-hosts"]
    assert store.jobs_holding(0, 4, 256) == ["four-hosts"]
    assert store.jobs_holding(0, 3, 256) == [] and store.jobs_holding(1, 2, 256) == []
    assert store.jobs_holding(0, 2, 1) == ["also-two"]
    (copies_dir(shm, "two-hosts", 0) / "5" / "data.bin").write_bytes(b"cut short")
    assert store.jobs_holding(0, 2, 256) == ["also-two"]  # a copy not intact names no job


def test_a_peer_port_without_a_shared_memory_directory_says_the_channel_is_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ckptd.peers"):
        assert peers_of(Settings(root=str(tmp_path), state_dir=str(tmp_path / "state"), shm_dir=None, peer_port=0,
                                 peer_secret=SECRET)) is None
    [line] = [r for r in caplog.records if "CKPTD_PEER_PORT" in r.getMessage()]
    assert line.levelno == logging.WARNING and "CKPTD_SHM_DIR" in line.getMessage() and "off" in line.getMessage()


@pytest.mark.parametrize("body", [b'{"host": 1e400}', b'{"host": Infinity}', b'{"host": NaN}', b'{"host": -1}',
                                  b'{"host": true}', b'{"host": 1' + b"0" * 400 + b"}", b'{"host": "1"}', b"[1]"])
def test_a_from_peer_mark_that_names_no_host_is_none(tmp_path: Path, body: bytes) -> None:
    part = ensure_private_dir(tmp_path / "20")
    write_private(part / FROM_PEER_FILE, body)
    assert brought_from(part) is None  # not an OverflowError out of the restore that asks
    (part / FROM_PEER_FILE).unlink()
    write_private(part / FROM_PEER_FILE, b'{"host": 3}')
    assert brought_from(part) == 3
