"""First sight settles several steps at a time (``ckptd.catalog._integrity.each_step``): results in order, a
storage error hides only its own step, any other error stops the loop as the one-at-a-time loop stopped."""

from __future__ import annotations

import threading
import time

import pytest

from ckptd.catalog import _integrity as integrity
from tests.support.helpers import wait_until
from trainer_client.core._errors import StorageError


def test_each_step_keeps_order_and_hands_back_storage_errors() -> None:
    running = 0
    most = 0
    lock = threading.Lock()
    two_done = threading.Event()

    def look(item: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        if item == 1:  # finish out of order: 1 ends after 2, which runs meanwhile (waited for, not slept on)
            assert two_done.wait(10), "step 2 never ran while step 1 was running"
        with lock:
            running -= 1
        if item == 2:
            two_done.set()
        if item == 5:
            raise StorageError("unreadable")
        return item * 10

    got = list(integrity.each_step(look, list(range(12))))
    assert [item for item, _ in got] == list(range(12))
    assert [r for _, r in got if not isinstance(r, StorageError)] == [i * 10 for i in range(12) if i != 5]
    assert isinstance(dict(got)[5], StorageError)
    assert 1 < most <= integrity._STEPS_AT_ONCE


def test_each_step_stops_starting_steps_after_another_error() -> None:
    started: list[int] = []

    def look(item: int) -> int:
        started.append(item)
        if item == 2:
            raise KeyError("a bug")
        time.sleep(0.02)
        finished.append(item)
        return item

    finished: list[int] = []
    with pytest.raises(KeyError):
        list(integrity.each_step(look, list(range(200))))
    # what was already running finishes (waited for); the rest was cancelled before the error reached here
    wait_until(lambda: len(finished) == len(started) - 1, timeout=10, what="the steps already running to end")
    assert len(started) <= 3 * integrity._STEPS_AT_ONCE
