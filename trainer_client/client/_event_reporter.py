"""Reports a run's elastic events to ckptd in the background, so training never waits on the sidecar.

docs/architecture.md, invariant 5: if ckptd is down the trainer keeps training. ``report()`` only appends to a bounded
in-memory buffer and returns; one daemon thread sends the buffer in batches to
``POST /v1/jobs/{job}/events``, lingering ``linger_s`` after the first event so that a burst (a
recovery emits several events at once) is one request. When ckptd does not answer (or answers 5xx) the
batch stays in the buffer and is retried with exponential backoff; when the buffer is full the oldest
events are dropped, counted in ``dropped`` and logged (at most one line per ``log_interval_s``). A
refusal (4xx: a bad event, a wrong token) drops that batch with a log line: resending it would be
refused again. Only ``404 JOB_NOT_FOUND`` is retried like an outage: a new job's first events come before
its first save makes its directory, and ckptd takes events only for jobs on storage (unless a token says
who may create one).

``flush(timeout)`` waits until everything reported so far is sent, but gives up at the first failed
attempt: a run that ends while ckptd is down does not wait for it. ``close()`` flushes and stops the
thread; events still unsent are dropped (counted and logged). Every event carries a unique id, so a
batch resent after a lost answer is stored once. No jax, no ckptd here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import ValidationError

from trainer_client.client._http import ckptd_http
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)


class EventReporter:
    """A bounded queue of events and the thread that delivers it to one ckptd, for one job."""

    def __init__(
        self,
        settings: ClientSettings,
        job: str,
        *,
        max_buffer: int = 10_000,
        batch_size: int = 200,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        linger_s: float = 0.2,
        log_interval_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.job = job
        self.max_buffer = max(1, max_buffer)
        self.batch_size = max(1, min(batch_size, p.MAX_EVENTS_PER_BATCH))
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.linger_s = linger_s
        self.log_interval_s = log_interval_s
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self.run_id = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:12]}"
        self.sent = 0
        self.dropped = 0
        self.failures = 0  # failed delivery attempts, in total
        self._seq = 0
        self._buffer: deque[tuple[int, p.ElasticEvent]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._kicks = 0  # bumped by every flush: the thread cuts its backoff short
        self._thread: threading.Thread | None = None
        self._last_log = float("-inf")
        self._http = ckptd_http(settings, transport=transport)  # TCP, or a unix socket (unix:///PATH)
        self._url = p.ROUTE_EVENTS.format(job=job)

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._buffer)

    # ---- the training side: never blocks, never raises -------------------------------------------

    def report(self, kind: str, *, time: float, step: int | None = None, t: float | None = None,
               detail: str = "", **fields: Any) -> None:
        """Queue one event (``fields``: the optional ``ElasticEvent`` fields, e.g. ``recovery_seconds``)."""
        try:
            with self._cond:
                self._seq += 1
                seq = self._seq
            event = p.ElasticEvent(kind=kind, time=time, step=step, t=t, detail=detail[:2000],
                                   id=f"{self.run_id}:{seq}", run=self.run_id, host=self.host, pid=self.pid,
                                   **fields)
        except (ValidationError, TypeError) as exc:
            _log.warning("elastic event %r not reported: %s", kind, exc)
            return
        with self._cond:
            self._buffer.append((seq, event))
            while len(self._buffer) > self.max_buffer:
                self._buffer.popleft()
                self._drop(1, "the event buffer is full (ckptd unreachable?)")
            self._ensure_thread()
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every event reported so far is delivered (True), or until an attempt fails or
        ``timeout_s`` passes (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target, failures = self._seq, self.failures
            self._kicks += 1
            self._cond.notify_all()
            while self._buffer and self._buffer[0][0] <= target:
                if self.failures > failures or self._thread is None or not self._thread.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (as ``flush``), then stop the thread; what is still unsent is dropped. True when
        everything was delivered. A later ``report`` starts the thread again."""
        delivered = self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(1.0, self.settings.timeout_s + 1.0))
        with self._cond:
            if self._buffer:
                self._drop(len(self._buffer), "the run ended before ckptd took them", force_log=True)
                self._buffer.clear()
            self._thread = None
        return delivered

    # ---- the thread -------------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._work, name="ckptd-event-reporter", daemon=True)
            self._thread.start()

    def _drop(self, n: int, why: str, *, force_log: bool = False, refused: bool = False) -> None:
        """Count ``n`` events dropped and log it (at most once a ``log_interval_s`` unless ``force_log``): a
        WARNING once ckptd took events of this run, or when it refused some; INFO while no ckptd ever answered
        (a run without one: the run's result holds every event)."""
        self.dropped += n
        now = time.monotonic()
        if force_log or now - self._last_log >= self.log_interval_s:
            self._last_log = now
            level = logging.WARNING if self.sent or refused else logging.INFO
            no_ckptd = "" if self.sent or refused else " (no ckptd answered this run)"
            _log.log(level, "dropped %d elastic event(s) of job %r (%d in total): %s%s", n, self.job, self.dropped,
                     why, no_ckptd)

    def _work(self) -> None:
        backoff = self.initial_backoff_s
        while True:
            with self._cond:
                while not self._buffer and not self._stop:
                    self._cond.wait()
                # Linger a moment so that a burst is one request (a flush or a full batch cuts it short).
                self._cond.wait_for(self._full_or_woken(self._kicks), timeout=self.linger_s)
                if self._stop:
                    return
                batch = [entry for _, entry in zip(range(self.batch_size), self._buffer, strict=False)]
            outcome = self._send([event for _, event in batch])
            with self._cond:
                last = batch[-1][0]
                if outcome == "retry":
                    self.failures += 1
                    self._cond.notify_all()  # a flush in progress gives up
                    self._cond.wait_for(self._woken(self._kicks), timeout=backoff)
                    backoff = min(self.max_backoff_s, backoff * 2)
                    continue
                backoff = self.initial_backoff_s
                done = 0
                while self._buffer and self._buffer[0][0] <= last:  # entries dropped meanwhile are gone already
                    self._buffer.popleft()
                    done += 1
                if outcome == "sent":
                    self.sent += done
                elif done:
                    self._drop(done, "ckptd refused them", force_log=True, refused=True)
                self._cond.notify_all()

    def _full_or_woken(self, kicks: int) -> Callable[[], bool]:
        woken = self._woken(kicks)
        return lambda: woken() or len(self._buffer) >= self.batch_size

    def _woken(self, kicks: int) -> Callable[[], bool]:
        """True once the reporter stops or a flush starts (after the count of flushes was ``kicks``)."""
        return lambda: self._stop or self._kicks != kicks

    def _send(self, events: list[p.ElasticEvent]) -> str:
        """'sent', 'retry' (no answer, 5xx) or 'refused' (4xx)."""
        body = p.EventBatch(events=events).model_dump(mode="json", exclude_none=True)
        try:
            response = self._http.post(self._url, json=body)
        except httpx.HTTPError as exc:
            _log.debug("ckptd did not take the events: %s", exc)
            return "retry"
        if response.status_code >= 500 or response.status_code == 429:
            return "retry"
        if response.status_code == 404 and _error_code(response) == p.ErrorCode.JOB_NOT_FOUND.value:
            return "retry"  # a new job exists once its first save makes its directory: keep them until then
        if response.status_code >= 400:
            _log.warning("ckptd refused %d event(s) of job %r: %d %s", len(events), self.job, response.status_code,
                         response.text[:300])
            return "refused"
        return "sent"


def _error_code(response: httpx.Response) -> str | None:
    try:
        return p.ErrorBody.model_validate_json(response.content).code.value
    except ValueError:
        return None


__all__ = ["EventReporter"]
