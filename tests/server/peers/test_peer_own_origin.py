"""A copy never lands on its own origin (docs/multihost.md, "Peer copies"): a registry record that names a host's
own listener as the holder of its part is refused by the sender and, were the sender fooled, by the listener;
what the sidecar reports as sent is where the copy is held. Real sockets on 127.0.0.1, two ``PeerService``s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.peers import PeerService
from ckptd.peers._headers import PutAnswer, expect
from ckptd.peers._protocol import PeerError, connect
from tests.server.peers.conftest import JOB
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.core.format._peer_copies import copies_dir


def plant_holder(service: PeerService, job: str, index: int, address: str) -> None:
    root = Path(service.listener.store.shm_dir).parent / "root"
    record = root / job / ".ckptd" / "peers" / f"process_{index}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"address": address}))


@pytest.mark.parametrize("alias", [False, True])
def test_a_record_naming_the_origins_own_listener_puts_no_copy_there(
        pair: tuple[list[PeerService], list[Path]], alias: bool) -> None:
    (s0, s1), (shm0, shm1) = pair
    own = s0.address.replace("127.0.0.1", "localhost") if alias else s0.address  # another name for it, or its own
    plant_holder(s0, JOB, 1, own)  # "host 1 of the job listens at host 0's own listener"
    write_part(shm0, JOB, 10, index=0)
    wait_until(lambda: "own" in (s0.snapshot()["last_failure"] or ""), timeout=20,
               what="the sender refusing to copy its part to itself")
    assert not copies_dir(shm0, JOB, 0).exists() or list(copies_dir(shm0, JOB, 0).iterdir()) == []
    assert s0.snapshot()["copies_sent"] == 0 and s0.snapshot()["copy_holders"] == {}

    plant_holder(s0, JOB, 1, s1.address)  # the true record: the copy lands on host 1, and is reported there
    s0.copier.directory.forget(JOB, 1)
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "10").is_dir(), timeout=20)
    wait_until(lambda: s0.snapshot()["copy_holders"].get(JOB), timeout=10)
    assert s0.snapshot()["copy_holders"][JOB] == [s1.address]


def test_the_listener_refuses_a_copy_from_itself(pair: tuple[list[PeerService], list[Path]], tmp_path: Path) -> None:
    (s0, _), (shm0, _) = pair
    part = write_part(tmp_path / "scratch", JOB, 10, index=0)
    raw = (part / "snapshot.json").read_bytes()
    with connect(s0.address, SECRET.encode(), 10) as chan, pytest.raises(PeerError, match="own"):
        chan.send_header({"op": "put", "job": JOB, "origin": 0, "count": 2, "step": 10, "held": [10],
                          "meta": len(raw), "data": (part / "data.bin").stat().st_size,
                          "sender": s0.listener.instance})
        expect(chan, PutAnswer)
    assert not copies_dir(shm0, JOB, 0).exists()
