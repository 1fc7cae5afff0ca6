"""How much work one piece of advice may do: simulated failures, wall time, and a flag that stops it.

Why it exists: the simulator's cost is per failure (``ckptd.advisor.simulator``), and inputs inside their
physical ranges can still ask for millions of failures (a minute's MTBF over ten years) or a recovery that
failures keep restarting. On the server one request must not hold a thread for long (docs/planning.md,
"Bounded work"), so every answer carries a ``WorkBudget``: the advisor refuses up front what it can
estimate (``reserve``: ``422 INVALID_REQUEST`` naming the inputs to lower), and the simulator charges
every failure it simulates (``charge``): past twice the estimate it stops the same way, past the deadline
or when told to stop (the client left, the server is shutting down) with ``503 BUSY``.
"""

from __future__ import annotations

import threading
import time

from ckptd.errors import Busy, InvalidRequest

_CHECK_EVERY = 256  # failures between two looks at the clock (~5 ms of simulation)


class WorkBudget:
    """``max_failures`` simulated failures in all (None: no cap) within ``timeout_s`` (None: no deadline)."""

    def __init__(self, max_failures: int | None = None, timeout_s: float | None = None,
                 stop: threading.Event | None = None) -> None:
        self.max_failures = max_failures
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.stop = stop if stop is not None else threading.Event()
        self.failures = 0

    def reserve(self, estimated: float, runs: int) -> None:
        """Refuse before simulating when ``runs`` runs of ``estimated`` failures each exceed the cap."""
        if self.max_failures is not None and estimated * runs > self.max_failures:
            raise InvalidRequest(
                f"these inputs need about {estimated * runs:.3g} simulated failures ({runs} runs of "
                f"{estimated:.3g}: the horizon over the MTBF); ckptd simulates at most {self.max_failures} per "
                "answer: lower min_failures or horizon_days, or give a longer MTBF",
                {"estimated_failures": round(estimated * runs), "max_failures": self.max_failures})

    def charge(self) -> None:
        """One simulated failure; raises once the budget is spent."""
        self.failures += 1
        if self.max_failures is not None and self.failures > 2 * self.max_failures:
            raise InvalidRequest(
                f"the simulation passed {2 * self.max_failures} failures (recoveries that failures keep "
                "interrupting: detection, restore or recompile times close to the MTBF); lower them or give a "
                "longer MTBF", {"max_failures": self.max_failures})
        if self.failures % _CHECK_EVERY == 0:
            self.check()

    def check(self) -> None:
        """Raise ``Busy`` when told to stop or past the deadline."""
        if self.stop.is_set():
            raise Busy("the advice was abandoned (the client left or ckptd is stopping)")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Busy(f"the advice took longer than {self.timeout_s:g} s; try again later, or lower "
                       "min_failures or horizon_days")


__all__ = ["WorkBudget"]
