"""Every peer operation has a deadline, and one slow job or peer never holds up another's (docs/multihost.md,
"Peer copies"): a holder of one job's copies that accepts and never answers (a tarpit, named by a record
planted under ``<root>/<job>/.ckptd/peers/``) neither stalls another job's copy nor a trainer's fetch of
another job's part, and the copy or fetch it holds ends at its deadline (the trainer told why, so that it
restores from storage). Real sockets on 127.0.0.1, two ``PeerService``s."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from ckptd.peers import PeerService
from tests.server.peers.conftest import Tarpit
from tests.support.helpers import wait_until
from tests.support.peer_parts import write_part
from trainer_client.core.format._peer_copies import copies_dir, request_fetch, wait_fetch

SLOW, FAST = "joba", "jobb"  # sorted: the slow job's work comes first in every pass


def plant_holder(service: PeerService, job: str, index: int, address: str) -> None:
    """Host ``index``'s sidecar of ``job`` registered at ``address`` (what anyone who can write the root can do)."""
    root = Path(service.listener.store.shm_dir).parent / "root"
    record = root / job / ".ckptd" / "peers" / f"process_{index}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"address": address}))


def set_options(service: PeerService, **changes: object) -> None:
    service.copier.options = dataclasses.replace(service.copier.options, **changes)  # type: ignore[arg-type]


def test_a_tarpit_holding_one_jobs_copy_holds_up_no_other_jobs_copy(
        pair: tuple[list[PeerService], list[Path]], tarpit: Tarpit) -> None:
    (s0, _), (shm0, shm1) = pair
    plant_holder(s0, SLOW, 1, tarpit.address)
    write_part(shm1, FAST, 10, index=1)  # host 1's sidecar registers itself for the fast job
    write_part(shm0, SLOW, 10, index=0)
    wait_until(lambda: tarpit.held() >= 1, timeout=20, what="the slow job's copy held by the tarpit")
    write_part(shm0, FAST, 10, index=0)
    wait_until(lambda: (copies_dir(shm1, FAST, 0) / "10").is_dir(), timeout=20,
               what="the other job's copy, while the tarpit holds the first")
    assert tarpit.held() >= 1  # landed while the slow copy still waited: not after it gave up


def test_a_copy_to_a_peer_that_trickles_ends_at_its_deadline(
        pair: tuple[list[PeerService], list[Path]]) -> None:
    (s0, _), (shm0, _) = pair
    slow = Tarpit(trickle_s=0.1)  # a byte per 100 ms: no timeout per read ever fires; the handshake takes 7 s
    try:
        set_options(s0, timeout_s=0.5)
        plant_holder(s0, SLOW, 1, slow.address)
        write_part(shm0, SLOW, 10, index=0)
        wait_until(lambda: "deadline" in (s0.snapshot()["last_failure"] or ""), timeout=20,
                   what="the copy given up at its deadline")
        assert slow.accepted >= 1 and s0.snapshot()["copy_failures"] >= 1
    finally:
        slow.close()


def test_a_fetch_from_a_tarpit_holds_up_no_other_fetch(
        pair: tuple[list[PeerService], list[Path]], tarpit: Tarpit) -> None:
    (s0, _), (shm0, shm1) = pair
    set_options(s0, refill=False)  # the trainers' requests are the only fetches
    write_part(shm1, FAST, 10, index=1)
    write_part(shm0, FAST, 10, index=0)
    wait_until(lambda: (copies_dir(shm1, FAST, 0) / "10").is_dir(), timeout=20)
    shutil.rmtree(shm0 / FAST)  # host 0's memory wiped

    plant_holder(s0, SLOW, 1, tarpit.address)
    request_fetch(shm0, SLOW, 10, source=1, origin=0, count=2, save_id="ab-10")
    wait_until(lambda: tarpit.held() >= 1, timeout=20, what="the slow job's fetch held by the tarpit")
    request_fetch(shm0, FAST, 10, source=1, origin=0, count=2, save_id="ab-10")
    assert wait_fetch(shm0, FAST, 10, timeout_s=20) is None
    assert tarpit.held() >= 1 and (shm0 / FAST / "10").is_dir()


def test_a_fetch_from_a_peer_that_trickles_is_answered_at_its_deadline(
        pair: tuple[list[PeerService], list[Path]]) -> None:
    (s0, _), (shm0, _) = pair
    slow = Tarpit(trickle_s=0.1)
    try:
        set_options(s0, timeout_s=0.5, refill=False)
        plant_holder(s0, SLOW, 1, slow.address)
        request_fetch(shm0, SLOW, 10, source=1, origin=0, count=2, save_id="ab-10")
        error = wait_fetch(shm0, SLOW, 10, timeout_s=20)  # the trainer's wait: answered, it takes storage
        assert error is not None and "deadline" in error
        assert s0.snapshot()["fetch_failures"] == 1
    finally:
        slow.close()
