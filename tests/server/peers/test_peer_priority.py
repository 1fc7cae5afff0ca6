"""The peer channel's background work runs below the trainer (docs/multihost.md, "Peer copies"): the copier's
thread and, on the holder, the thread that receives and checks a copy are lowered ``CKPTD_PERSIST_NICE`` steps;
serving a fetch (a host restoring) is not lowered."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptd.config import DEFAULT_PERSIST_NICE
from ckptd.peers import PeerService, _server
from ckptd.peers._protocol import lower_this_thread
from tests.server.peers.conftest import JOB, fetch
from tests.support.helpers import wait_until
from tests.support.peer_parts import write_part
from trainer_client.core.format._peer_copies import copies_dir


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lowering_a_thread_leaves_the_others_alone() -> None:
    seen: list[int] = []

    def lowered() -> None:
        lower_this_thread(3)
        seen.append(_nice())

    before = _nice()
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == [min(19, before + 3)] and _nice() == before


def test_a_received_copy_is_checked_below_the_trainer_and_a_fetch_is_served_at_full_priority(
        monkeypatch: pytest.MonkeyPatch, pair: tuple[list[PeerService], list[Path]], api0: TestClient) -> None:
    lowered: list[tuple[int, int]] = []  # (steps asked, the thread's nice after)
    real = _server.lower_this_thread

    def spy(steps: int) -> None:
        real(steps)
        lowered.append((steps, _nice()))

    monkeypatch.setattr(_server, "lower_this_thread", spy)
    (_, s1), (shm0, shm1) = pair
    base = _nice()
    write_part(shm1, JOB, 10, index=1)
    write_part(shm0, JOB, 10, index=0)
    wait_until(lambda: (copies_dir(shm1, JOB, 0) / "10").is_dir() and (copies_dir(shm0, JOB, 1) / "10").is_dir(),
               timeout=30)
    assert lowered and all(steps == DEFAULT_PERSIST_NICE and nice == min(19, base + steps) for steps, nice in lowered)
    puts = len(lowered)
    shutil.rmtree(shm0 / JOB)  # host 0 restores: host 1 serves the fetch, not lowered
    assert fetch(api0, JOB, 10, save_id="ab-10").ok
    assert s1.snapshot()["copies_served"] >= 1
    assert len(lowered) == puts
