"""How much work one piece of advice may do: simulated failures, wall time, and a flag that stops it.

Why it exists: the simulator's cost is per failure (``ckptd.advisor._simulator``), and inputs inside their
physical ranges can still ask for millions of failures (a minute's MTBF over ten years) or a recovery that
failures keep restarting. On the server one request must not hold a thread for long (docs/planning.md,
"Bounded work"), so every answer carries a ``WorkBudget``: the advisor splits its failures over the runs it
will simulate (``share``) and shortens the simulated horizon to fit, and a run that passes twice its share
(recoveries that failures keep interrupting) ends there (``cut_short`` counts them): the answer says so; a
valid request is answered, not refused. The simulator charges every failure it simulates (``charge``): past
the deadline or when told to stop (the client left, the server is shutting down) it stops with
``503 BUSY``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ckptd.errors import Busy

_CHECK_EVERY = 256  # failures between two looks at the clock (~5 ms of simulation)


class WorkBudget:
    """``max_failures`` simulated failures in all (None: no cap) within ``timeout_s`` (None: no deadline) of
    ``clock`` (seconds; the monotonic clock unless given)."""

    def __init__(self, max_failures: int | None = None, timeout_s: float | None = None,
                 stop: threading.Event | None = None, clock: Callable[[], float] | None = None) -> None:
        self.max_failures = max_failures
        self.timeout_s = timeout_s
        self._clock = clock if clock is not None else time.monotonic
        self.deadline = None if timeout_s is None else self._clock() + timeout_s
        self.stop = stop if stop is not None else threading.Event()
        self.failures = 0
        self.per_run: float | None = None  # failures one run may simulate (``share``); a run ends at twice that
        self.cut_short = 0  # runs that ended there

    def share(self, runs: int) -> float | None:
        """Split the cap over ``runs`` runs: the failures each may simulate (``None``: no cap)."""
        self.per_run = None if self.max_failures is None else self.max_failures / runs
        return self.per_run

    def charge(self) -> None:
        """One simulated failure; raises ``Busy`` when told to stop or past the deadline (looked at every few)."""
        self.failures += 1
        if self.failures % _CHECK_EVERY == 0:
            self.check()

    def check(self) -> None:
        """Raise ``Busy`` when told to stop or past the deadline."""
        if self.stop.is_set():
            raise Busy("the advice was abandoned (the client left or ckptd is stopping)")
        if self.deadline is not None and self._clock() > self.deadline:
            raise Busy(f"the advice took longer than {self.timeout_s:g} s; try again later, or lower "
                       "min_failures or horizon_days")


__all__ = ["WorkBudget"]
