"""How ckptd's requests to GCS back off when the bucket refuses them (``429``, ``503`` and gcsfs's other retriable
failures): exponential back-off with full jitter, bounded in time, in place of gcsfs's own (docs/gcs.md, "Many hosts
on one bucket").

gcsfs retries a request five times, sleeping ``2^(n-1)`` s plus at most 1 s before the n-th retry (1-2, 2-3, 4-5,
8-9, 16-17 s): every client the bucket refused at one moment comes back within the same second each time, however
many they are, and each gives up after 31-36 s. Through the shaping proxy of the tests
(``tests/support/gcs_shaper.py``), 200 writers at once against a bucket taking 10 writes/s: 57 of the 200 writes
failed, after 755 refusals. Here the n-th retry waits a uniform draw from ``[0, min(cap, base * 2^n))`` (full
jitter: the clients refused together spread over a window that doubles each time, so the bucket sees about the
rate it takes), and retries go on until ``deadline_s`` since the first try has passed (about as long as gcsfs's
five retries take at their slowest; a storage that stays down is still reported within the bounds ckptd promises).
The same 200 writers: all land, the last after 22.6 s (the bucket's rate allows 19 s). The cap is 8 s, not gcsfs's
32: in a simulation of these schedules against the shaper's token bucket (``tests/core/test_gcs_pacing.py``) a 16 s
cap left the last of 6,000 writes at once against 1,000/s landing at 17.5 s, an 8 s cap at 10.7 s (gcsfs: 9.7 s;
the rate allows 5 s). Back-off alone leaves such a tail; pacing the hosts of a job together is what removes it.

``WriteShare`` is that pacing: one writer's share of the bucket's write budget (``CKPTD_BUCKET_WRITES_PER_S``, GCS's
starting 1,000 writes/s by default) when the writers of a job are known. N host parts of one step: each host's
sidecar starts its part's writes at a point drawn within its own N-th of the window they take at ``budget / N`` a
second, so N hosts neither write in lockstep nor ask more together than the bucket takes. A writer alone (N of 1) is
not paced. Refusals are still backed off from, request by request, as above.

``pace(fs)`` puts this in front of one gcsfs file system (an instance: every ``Storage`` on it, in this process, is
paced; other instances keep gcsfs's retry). It calls gcsfs's request without its retry (``__wrapped__``), decides
what is retriable as gcsfs does (``gcsfs.retry.is_retriable``) and logs each retry as gcsfs does, to its logger
(``ckptd.cli._reach`` shows the last one). Nothing is imported here: a file system that is no gcsfs one, or a
gcsfs whose request is not wrapped as expected, is left as it is.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_gcsfs_log = logging.getLogger("gcsfs")  # the backend's own logger: its retries are read there (ckptd.cli._reach)
PACED = "_ckptd_paced"  # set on a file system once paced


@dataclass(frozen=True)
class Backoff:
    """The n-th retry (from 0) waits ``uniform(0, min(cap_s, base_s * 2^n))``; no retry starts once ``deadline_s``
    has passed since the first try."""

    base_s: float = 1.0
    cap_s: float = 8.0
    deadline_s: float = 30.0

    def window(self, retry: int) -> float:
        """The n-th retry's wait is drawn from ``[0, window(n))``."""
        return min(self.cap_s, self.base_s * 2.0 ** min(retry, 62))

    def delay(self, retry: int, draw: Callable[[float, float], float] = random.uniform) -> float:
        return draw(0.0, self.window(retry))


BACKOFF = Backoff()
BUCKET_WRITES_PER_S = 1000.0  # GCS's documented starting write rate of one bucket (CKPTD_BUCKET_WRITES_PER_S)


def _retriable_types(retry_module: Any) -> tuple[type[BaseException], ...]:
    """The exceptions gcsfs's own retry looks at (it then asks ``is_retriable``)."""
    found: list[type[BaseException]] = [retry_module.HttpError, retry_module.ChecksumError]
    for module, name in (("aiohttp", "ClientError"), ("requests.exceptions", "RequestException"),
                         ("google.auth.exceptions", "GoogleAuthError")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def pace(fs: object, backoff: Backoff = BACKOFF, *, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], Any] = asyncio.sleep) -> bool:
    """Give the gcsfs file system ``fs`` this back-off in place of gcsfs's retry (once; later calls change
    nothing). Whether ``fs`` is paced now."""
    if getattr(fs, PACED, None) is not None:
        return True
    retry_module = sys.modules.get("gcsfs.retry")
    wrapped = getattr(getattr(type(fs), "_request", None), "__wrapped__", None)
    if retry_module is None or wrapped is None or not type(fs).__module__.startswith("gcsfs"):
        return False
    retriable = _retriable_types(retry_module)

    async def request(*args: Any, **kwargs: Any) -> Any:
        started, retry = clock(), 0
        while True:
            try:
                return await wrapped(fs, *args, **kwargs)
            except retriable as exc:
                if not retry_module.is_retriable(exc):
                    raise
                if clock() - started >= backoff.deadline_s:
                    _gcsfs_log.debug("_request out of retries on exception: %s", exc)
                    raise
                _gcsfs_log.debug("_request retrying after exception: %s", exc)
                await sleep(backoff.delay(retry))
                retry += 1

    fs._request = request  # type: ignore[attr-defined]  # an instance's attribute: gcsfs's _call finds it first
    setattr(fs, PACED, backoff)
    return True


class WriteShare:
    """One writer's share of a bucket's write budget: ``budget_per_s / writers`` writes a second. ``spread(writers,
    index)`` starts a burst of writes (a part of a step) now and cuts the time from there into windows, one interval
    (``writers / budget_per_s``) a write, in the order they are taken: ``take(n)`` waits for a point within the next
    ``n`` writes' window (they then go as the writer makes them: a part's writes come one after another, and an op
    of several, such as tensorstore's files of a part, cannot be split). The point is drawn within the writer's own
    N-th of the window (``index`` of ``writers``, with jitter; the whole window when the index is not known). N
    writers that start together with the same ops fill every interval of the burst with N writes in all, each in
    its own part of its window: the bucket is asked its rate, evenly, not N writes at once. A writer held up whose
    window has begun or passed goes at once and catches up, never later than its schedule; what it may write early
    is bounded by the writes it took. ``writers`` of 1 or less, or a budget of 0: no pacing."""

    def __init__(self, budget_per_s: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = time.sleep, draw: Callable[[float, float], float] = random.uniform
                 ) -> None:
        self.budget_per_s = budget_per_s
        self.clock, self.sleep, self.draw = clock, sleep, draw
        self.interval_s = 0.0  # 0: not paced
        self.waited_s = 0.0  # in all, for the figures
        self._next = 0.0  # where the next window starts
        self._stratum = (0, 1)  # (index, writers): the writer's own part of each window
        self._lock = threading.Lock()

    def spread(self, writers: int, index: int | None = None) -> None:
        """A burst of writes starts now among ``writers`` writing the bucket at once, this one the ``index``-th
        of them (None: not known)."""
        with self._lock:
            paced = writers > 1 and self.budget_per_s > 0
            self.interval_s = writers / self.budget_per_s if paced else 0.0
            self._stratum = (0, 1) if index is None or not paced else (index % writers, writers)
            self._next = self.clock()

    def take(self, writes: int = 1) -> float:
        """Wait for the point drawn in the next ``writes`` writes' window; the wait, in seconds."""
        with self._lock:
            if self.interval_s <= 0 or writes <= 0:
                return 0.0
            now = self.clock()
            start, window = self._next, writes * self.interval_s
            self._next = start + window
            k, n = self._stratum
            wait = start + window * (k + self.draw(0.0, 1.0)) / n - now
        if wait > 0:
            self.sleep(wait)
            with self._lock:
                self.waited_s += wait
        return max(0.0, wait)


__all__ = ["BACKOFF", "BUCKET_WRITES_PER_S", "Backoff", "WriteShare", "pace"]
