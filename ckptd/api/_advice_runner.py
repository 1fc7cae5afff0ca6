"""Where advice is computed: a few threads of its own, never the pool that answers resumes.

Why it exists: an advice is a simulation (``ckptd.advisor``) that takes about a second, and hostile or
careless inputs can ask for much more. Run on the request-handler pool (``CKPTD_WORKER_THREADS``), eight
such requests once took every thread, and list, latest-good and resume timed out behind them. Here:

* at most ``workers`` computations run at once, on this runner's own threads; one more is refused at once
  with ``503 BUSY`` and ``Retry-After`` (nothing queues);
* each carries a ``WorkBudget``: at most ``max_failures`` simulated failures and ``timeout_s`` of wall
  time, then it stops (``422`` / ``503``);
* a computation stops as soon as its client disconnects, and every one stops when the app shuts down,
  so neither a gone client nor SIGTERM waits on a simulation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from starlette.requests import Request

from ckptd.advisor._budget import WorkBudget
from ckptd.errors import Busy

T = TypeVar("T")
RETRY_AFTER_S = 5  # an advice takes about a second; a few seconds later a slot is likely free


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the request's body, if any, was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AdviceRunner:
    """``await runner.run(compute, request)``: ``compute(budget)`` on one of ``workers`` threads of its own."""

    def __init__(self, workers: int, *, timeout_s: float, max_failures: int,
                 clock: Callable[[], float] | None = None) -> None:
        self.workers, self.timeout_s, self.max_failures = workers, timeout_s, max_failures
        self.clock = clock  # what each computation's deadline is read from (None: the monotonic clock)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-advice")
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._running: set[threading.Event] = set()  # the stop flag of every computation under way
        self._closed = False

    def _finished(self, stop: threading.Event) -> None:
        with self._lock:
            self._running.discard(stop)
        self._slots.release()

    def submit(self, compute: Callable[[WorkBudget], T]) -> tuple[Future[T], threading.Event]:
        """Start ``compute`` now or raise ``Busy``; returns its future and its stop flag."""
        if not self._slots.acquire(blocking=False):
            raise Busy(f"{self.workers} advice computation(s) already running; retry later",
                       retry_after_s=RETRY_AFTER_S)
        stop = threading.Event()
        with self._lock:
            if self._closed:
                self._slots.release()
                raise Busy("ckptd is stopping", retry_after_s=RETRY_AFTER_S)
            self._running.add(stop)
        try:
            future = self._pool.submit(compute, WorkBudget(self.max_failures, self.timeout_s, stop, self.clock))
        except BaseException:
            self._finished(stop)
            raise
        future.add_done_callback(lambda _: self._finished(stop))
        return future, stop

    async def run(self, compute: Callable[[WorkBudget], T], request: Request | None = None) -> T:
        """The result of ``compute``; it is told to stop when the client leaves or this coroutine is cancelled."""
        future, stop = self.submit(compute)
        result: asyncio.Future[T] = asyncio.wrap_future(future)
        watch = asyncio.ensure_future(_until_disconnected(request)) if request is not None else None
        try:
            if watch is not None:
                pending: set[asyncio.Future[object]] = {result, watch}  # type: ignore[arg-type]
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not result.done():  # the client left: nobody wants the answer
                    stop.set()
            return await result
        except asyncio.CancelledError:
            stop.set()
            raise
        finally:
            if watch is not None:
                watch.cancel()

    def close(self) -> None:
        """Stop every computation under way and refuse new ones (the app's shutdown)."""
        with self._lock:
            self._closed = True
            for stop in self._running:
                stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["RETRY_AFTER_S", "AdviceRunner"]
