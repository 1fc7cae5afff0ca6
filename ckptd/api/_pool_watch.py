"""Liveness that sees a wedged handler pool: ``GET /healthz`` fails when no handler thread frees up.

Why it exists: ``/healthz`` is answered on the event loop, so it stayed ``200`` while every request-handler
thread (``CKPTD_WORKER_THREADS``) was stuck and list, latest-good and resume timed out: the kubelet never
restarted a ckptd that answered nothing else. ``/healthz`` itself must not queue behind busy threads (a
loaded ckptd is slow, not dead), so it does not wait: it keeps one probe task out on the handler pool and
answers from how long that probe has waited. A probe that has not run within ``wedged_after_s`` means
no thread has finished a request for that long: ``503``.
"""

from __future__ import annotations

import asyncio
import time

import anyio.to_thread


def _noop() -> None:
    return None


class PoolWatch:
    """``waited = watch.check()`` on the event loop: None while the pool makes progress, else the seconds
    the outstanding probe has waited for a thread (more than ``wedged_after_s``)."""

    def __init__(self, wedged_after_s: float) -> None:
        self.wedged_after_s = wedged_after_s
        self._probe: asyncio.Task[None] | None = None
        self._sent_at = 0.0

    async def _run_probe(self) -> None:
        await anyio.to_thread.run_sync(_noop)  # the limiter the sync handlers share

    def check(self) -> float | None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._probe is None or self._probe.done() or self._probe.get_loop() is not loop:  # a new loop: tests
            self._probe = loop.create_task(self._run_probe())
            self._sent_at = now
            return None
        waited = now - self._sent_at
        return waited if waited > self.wedged_after_s else None

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()


__all__ = ["PoolWatch"]
