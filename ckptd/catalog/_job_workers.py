"""Background work on daemon threads: a pool with ``concurrent.futures``' ``submit``, and per-job passes that
never wait on each other.

Why it exists: the refresher scanned every job one after the other on its own thread, and a job whose step
took long to read (a forged OCDBT index: docs/operations.md, "What each limit defends") held every other
job's scan, the re-validation of their newest steps, and the shutdown. Here

* ``JobWorkers`` runs each job's pass on one of a few threads, at most one pass per job at a time: a job
  whose last pass is still running is skipped, and the loop and the other jobs go on;
* ``DaemonPool`` is what both this and the first sight of steps (``ckptd/catalog/_integrity.py``) run on: its
  threads are daemons, where ``ThreadPoolExecutor``'s are joined when the interpreter exits, so a pass still
  running cannot hold ``ckptd serve`` past SIGTERM (storage is the truth: a pass cut short is done again by
  the next start).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_log = logging.getLogger(__name__)

_R = TypeVar("_R")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """``submit(fn, *args) -> Future`` run by ``workers`` daemon threads, started at once."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., _R], *args: Any) -> Future[_R]:
        future: Future[_R] = Future()
        self._tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    def close(self) -> None:
        """Let the threads end once the tasks queued before are done (nothing waits for them)."""
        for _ in self._threads:
            self._tasks.put(None)


SLOW_PASS_WARN_S = 60.0  # a job's pass that overlaps its next one is normal on a loaded machine; this long, not


class JobWorkers:
    """Each job's pass on a ``DaemonPool`` of ``workers`` threads, one pass per job at a time. A job whose pass has
    run ``warn_after_s`` when its next one is due is logged once as a warning (until a pass of it ends); a pass
    that merely overlaps the next one, as on a busy or slow machine, is a debug line."""

    def __init__(self, workers: int, name: str = "ckptd-job", *, warn_after_s: float = SLOW_PASS_WARN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = DaemonPool(workers, name)
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Future[None], float]] = {}  # the pass and when it was submitted
        self._said_busy: set[str] = set()  # jobs whose long pass was logged (once until one finishes)
        self._warn_after_s = warn_after_s
        self._clock = clock

    def submit(self, job: str, work: Callable[[], object]) -> Future[None] | None:
        """Start ``work`` (``job``'s pass) unless that job's last pass is still running or queued: then None."""
        with self._lock:
            if job in self._running:
                running_s = self._clock() - self._running[job][1]
                if running_s < self._warn_after_s:
                    _log.debug("job %r: its last scan is still running; its next one waits for it", job)
                elif job not in self._said_busy:
                    self._said_busy.add(job)
                    _log.warning("job %r: its last scan is still running after %.0f s; its next one waits for it "
                                 "(the other jobs go on)", job, running_s)
                return None
            future = self._pool.submit(self._run, job, work)
            self._running[job] = (future, self._clock())
        return future

    def _run(self, job: str, work: Callable[[], object]) -> None:
        try:
            work()  # what it raises is its future's (the caller reports its own failures)
        finally:
            with self._lock:
                self._running.pop(job, None)
                self._said_busy.discard(job)

    def busy(self) -> list[str]:
        """The jobs whose pass is running or queued."""
        with self._lock:
            return sorted(self._running)

    def close(self) -> None:
        self._pool.close()


__all__ = ["DaemonPool", "JobWorkers"]
