"""Every peer operation has a deadline, and one slow job or peer never holds up another's (docs/multihost.md,
"Peer copies"): a holder of one job's copies that accepts and never answers (a tarpit, named by a record
planted under ``<root>/<job>/.ckptd/peers/``) neither stalls another job's copy nor a trainer's fetch of
another job's part, and the copy or fetch it holds ends at its deadline (the trainer's request over ckptd's API
answered with why, so that it restores from storage). Real sockets on 127.0.0.1, two ``PeerService``s."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi.testclient import TestClient

from ckptd.peers import PeerService
from tests.server.peers.conftest import Tarpit, fetch, plant_holder, set_options
from tests.support.helpers import wait_until
from tests.support.peer_parts import write_part
from trainer_client.core.format._peer_copies import copies_dir
from trainer_client.core.protocol import PeerFetchAnswer

SLOW, FAST = "joba", "jobb"  # sorted: the slow job's work comes first in every pass


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
        pair: tuple[list[PeerService], list[Path]], tarpit: Tarpit, api0: TestClient) -> None:
    (s0, _), (shm0, shm1) = pair
    set_options(s0, refill=False)  # the trainers' requests are the only fetches
    write_part(shm1, FAST, 10, index=1)
    write_part(shm0, FAST, 10, index=0)
    wait_until(lambda: (copies_dir(shm1, FAST, 0) / "10").is_dir(), timeout=20)
    shutil.rmtree(shm0 / FAST)  # host 0's memory wiped

    plant_holder(s0, SLOW, 1, tarpit.address)
    with ThreadPoolExecutor(1) as pool:  # the slow job's trainer waits for its answer meanwhile
        slow = pool.submit(fetch, api0, SLOW, 10, save_id="ab-10")
        wait_until(lambda: tarpit.held() >= 1, timeout=20, what="the slow job's fetch held by the tarpit")
        assert fetch(api0, FAST, 10, save_id="ab-10") == PeerFetchAnswer(ok=True)
        assert tarpit.held() >= 1 and (shm0 / FAST / "10").is_dir() and not slow.done()
        tarpit.close()  # the slow fetch's peer goes: its trainer is answered
        assert not slow.result(timeout=60).ok


def test_a_fetch_from_a_peer_that_trickles_is_answered_at_its_deadline(
        pair: tuple[list[PeerService], list[Path]], api0: TestClient) -> None:
    (s0, _), _ = pair
    slow = Tarpit(trickle_s=0.1)
    try:
        set_options(s0, timeout_s=0.5, refill=False)
        plant_holder(s0, SLOW, 1, slow.address)
        answer = fetch(api0, SLOW, 10, save_id="ab-10")  # the trainer's wait: answered, it takes storage
        assert not answer.ok and answer.error is not None and "deadline" in answer.error
        assert s0.snapshot()["fetch_failures"] == 1
    finally:
        slow.close()
