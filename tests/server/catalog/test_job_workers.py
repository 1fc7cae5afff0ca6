"""One job's slow work holds up no other job, no answer and no exit (ckptd/catalog/_job_workers.py,
ckptd/catalog/_layouts.py, the first sight of ckptd/catalog/_integrity.py). The slow work here is a function
that waits for the test to let it go: what a forged step's read looks like from outside."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ckptd.catalog import _integrity as integrity
from ckptd.catalog._job_workers import JobWorkers
from ckptd.catalog._layouts import Layouts
from ckptd.errors import Busy
from tests.support.helpers import REPO, SteppingClock, wait_until
from trainer_client.core.format._saved_layout import StepLayout


def test_a_busy_job_is_skipped_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    """A pass that overlaps its next one is skipped quietly (a loaded machine's normal); one still running a minute
    on is a warning, once."""
    release = threading.Event()
    done: list[str] = []
    clock = SteppingClock(0.0)  # moved by hand
    workers = JobWorkers(2, clock=clock, warn_after_s=60)
    try:
        assert workers.submit("stuck", release.wait) is not None
        assert workers.submit("stuck", lambda: done.append("stuck again")) is None  # its last pass still runs
        assert "still running" not in caplog.text
        clock.now += 61
        assert workers.submit("stuck", lambda: done.append("stuck again")) is None
        assert workers.submit("stuck", lambda: done.append("stuck again")) is None
        for _ in range(3):
            future = workers.submit("healthy", lambda: done.append("healthy"))
            assert future is not None
            future.result(timeout=5)
        assert done == ["healthy"] * 3 and workers.busy() == ["stuck"]
        assert caplog.text.count("job 'stuck': its last scan is still running after 61 s") == 1
        release.set()
        wait_until(lambda: not workers.busy(), timeout=5, what="the stuck pass to end")
        assert workers.submit("stuck", lambda: done.append("stuck again")) is not None
    finally:
        release.set()
        workers.close()


def test_a_job_s_slow_first_sight_leaves_another_job_s_steps_alone() -> None:
    """Two jobs' scans settle steps at once on the shared first-sight threads; one whose steps never end (all
    its four at a time taken) does not hold the other's (on four shared threads it took them all)."""
    release = threading.Event()
    entered: list[int] = []

    def never_ends(item: int) -> bool:
        entered.append(item)
        return release.wait()

    stuck = threading.Thread(target=lambda: list(integrity.each_step(never_ends, list(range(8)))), daemon=True)
    stuck.start()
    try:  # the stuck job holds all it may (waited for, not slept on: a loaded machine starts threads late)
        wait_until(lambda: len(entered) == integrity._STEPS_AT_ONCE, timeout=10, what="the stuck job's steps")
        got: list[object] = []
        healthy = threading.Thread(target=lambda: got.extend(r for _, r in integrity.each_step(
            lambda i: i * 2, list(range(20)))), daemon=True)
        healthy.start()
        healthy.join(15)  # ~ms of work: only a hang (waiting on the stuck job) takes this long
        assert got == [i * 2 for i in range(20)], "the healthy job's first sight waited on the stuck one"
    finally:
        release.set()
        stuck.join(5)


def test_work_still_running_does_not_hold_the_process_at_exit() -> None:
    """ThreadPoolExecutor's threads are joined when the interpreter exits: a pass that never ends kept
    ``ckptd serve`` alive after SIGTERM. The workers are daemons."""
    code = ("import threading\n"
            "from ckptd.catalog._job_workers import JobWorkers\n"
            "from ckptd.catalog import _integrity as integrity\n"
            "JobWorkers(1).submit('stuck', threading.Event().wait)\n"
            "integrity._threads().submit(threading.Event().wait)\n"
            "print('leaving', flush=True)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "leaving", done.stderr
    assert time.monotonic() - started < 30


def test_a_layout_is_read_once_and_an_answer_waits_for_it_only_briefly() -> None:
    release = threading.Event()
    reads: list[str] = []
    layout = StepLayout(None, None, {})

    def slow_read() -> StepLayout:
        reads.append("read")
        release.wait(10)
        return layout

    layouts = Layouts(kept=2)
    first = threading.Thread(target=layouts.get, args=("/root/job/1", slow_read), daemon=True)
    first.start()
    wait_until(lambda: reads, timeout=5, what="the first read to start")
    started = time.monotonic()
    with pytest.raises(Busy, match="still being read"):
        layouts.get("/root/job/1", slow_read, wait_s=0.2)
    assert time.monotonic() - started < 5  # waited its 0.2 s, not the read's 10 s (loose: a loaded 2-core CI)
    assert layouts.get("/root/job/2", lambda: layout) is layout  # another step is not held up
    waiting: list[StepLayout] = []
    second = threading.Thread(target=lambda: waiting.append(layouts.get("/root/job/1", slow_read)), daemon=True)
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert waiting == [layout] and reads == ["read"]  # the waiter got the one read's layout
    layouts.get("/root/job/3", lambda: layout)
    layouts.get("/root/job/4", lambda: layout)
    layouts.get("/root/job/1", slow_read)  # only the 2 most recent are kept: read again
    assert reads == ["read", "read"]
