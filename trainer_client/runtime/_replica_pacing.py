"""How often the replica tier snapshots, and into which host memory: chosen from what the run measures.

Why it exists: a snapshot's cost is a fact of the hardware (docs/concepts.md, "Pacing the replica tier"). On a
TPU v5e chip a 5.22 GB state crosses to pinned host memory in ~5.6 s while a step takes 0.27 s, so a snapshot
after every step cannot be held (at most one copy is in flight) and must not be waited for. What a snapshot
costs the loop is:

* ``blocking_s``: the extra time of the step right after a snapshot (the on-device copy it is queued behind,
  the dispatch);
* ``interference``: the fraction by which steps run slower while a copy to the host is in flight (the copy
  shares the chip's memory system and the host's);
* ``copy_s``: how long the copy to the host takes (it must end before the next snapshot is due).

For a period of ``p`` steps of ``step_s`` seconds the loop's overhead is
``(blocking_s + interference * min(copy_s, p * step_s)) / (p * step_s)``; the pacer picks the smallest ``p``
that keeps it within the budget (2% by default) and leaves the copy time to finish (``p * step_s >= copy_s``
with a margin). A failure then loses on average ``p / 2`` steps plus the steps a copy takes to land
(``expected_lost_steps``). Where the memory kind is not configured, the first snapshot is copied to each kind
(pinned and unpinned host memory), and the kind with the least expected time lost per failure (the steps
lost, plus the restore at that kind's host-to-device rate) is kept.

Everything here is plain arithmetic on measured numbers (no jax): the tier and the runner gather them
(``PaceMeter``), ``choose`` decides, and a new choice replaces the current one only when it differs by more
than ``HYSTERESIS`` or the current one breaks the budget.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

DEFAULT_BUDGET = 0.02  # the loop's overhead a paced tier may cost
COPY_MARGIN = 1.25  # a copy is given this much more than its measured time before the next is due
HYSTERESIS = 0.25  # a new period replaces the current one only when it differs by more than this fraction
MAX_PERIOD = 100_000
WARMUP_STEPS = 3  # steps timed before the first paced snapshot (the first after a start compiles)
_WINDOW = 64  # samples kept of each measurement


@dataclass(frozen=True)
class KindCosts:
    """What a snapshot into one host memory kind was measured to cost."""

    kind: str
    copy_s: float  # device -> host, the whole snapshot
    interference: float  # steps' slowdown while the copy is in flight (0.02 = 2% slower)
    restore_Bps: float | None = None  # host -> device, bytes per second (None: not measured)


@dataclass(frozen=True)
class PaceChoice:
    """The period and memory kind chosen, with the numbers they were chosen from (event and metric fields)."""

    period: int
    kind: str
    step_s: float
    blocking_s: float
    copy_s: float
    copy_Bps: float
    interference: float
    overhead: float  # the loop's expected overhead at this period
    expected_lost_steps: float  # steps a failure loses on average
    reason: str

    def fields(self) -> dict[str, object]:
        """As event fields (``ElasticEvent.replica_*``)."""
        return {"replica_period": self.period, "replica_memory_kind": self.kind,
                "replica_copy_seconds": round(self.copy_s, 4),
                "replica_copy_bytes_per_second": float(round(self.copy_Bps)),
                "replica_overhead": round(self.overhead, 5),
                "replica_expected_lost_steps": round(self.expected_lost_steps, 2)}


def overhead(period: int, step_s: float, blocking_s: float, copy_s: float, interference: float) -> float:
    """The loop's overhead with a snapshot every ``period`` steps (fraction of the step time)."""
    cycle = period * step_s
    return (blocking_s + interference * min(copy_s, cycle)) / cycle


def expected_lost_steps(period: int, step_s: float, copy_s: float) -> float:
    """Steps a failure at a random moment loses: half a period on average, plus the steps a copy takes to be
    held (the snapshot in flight does not count until it is whole)."""
    return period / 2 + copy_s / step_s


def smallest_period(step_s: float, blocking_s: float, copy_s: float, interference: float,
                    budget: float = DEFAULT_BUDGET) -> int:
    """The smallest period within ``budget`` that leaves a copy time to finish (``MAX_PERIOD`` at most)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    floor = max(1, math.ceil(COPY_MARGIN * copy_s / step_s))  # p * step_s >= copy_s: min(copy_s, cycle) = copy_s
    period = min(MAX_PERIOD, max(floor, math.ceil((blocking_s + interference * copy_s) / (budget * step_s))))
    while period < MAX_PERIOD and overhead(period, step_s, blocking_s, copy_s, interference) > budget * 1.0001:
        period += 1  # rounding only: the bound above is exact
    return min(period, MAX_PERIOD)


def choose(step_s: float, blocking_s: float, kinds: list[KindCosts], nbytes: int,
           budget: float = DEFAULT_BUDGET) -> PaceChoice:
    """The period and kind with the least expected time lost per failure (steps lost at the chosen period,
    plus the restore at the kind's measured host-to-device rate), each kind's period the smallest within
    ``budget``."""
    if not kinds:
        raise ValueError("no memory kind measured")
    best: tuple[float, PaceChoice] | None = None
    for k in kinds:
        period = smallest_period(step_s, blocking_s, k.copy_s, k.interference, budget)
        lost = expected_lost_steps(period, step_s, k.copy_s)
        restore_s = nbytes / k.restore_Bps if k.restore_Bps else 0.0
        cost = lost * step_s + restore_s
        others = ", ".join(f"{o.kind} {o.copy_s:.2f}s" for o in kinds if o is not k)
        choice = PaceChoice(
            period=period, kind=k.kind, step_s=step_s, blocking_s=blocking_s, copy_s=k.copy_s,
            copy_Bps=nbytes / k.copy_s if k.copy_s > 0 else 0.0, interference=k.interference,
            overhead=overhead(period, step_s, blocking_s, k.copy_s, k.interference),
            expected_lost_steps=lost,
            reason=(f"step {step_s * 1e3:.1f} ms, snapshot blocks {blocking_s * 1e3:.1f} ms, copy to {k.kind} "
                    f"{k.copy_s:.2f} s ({nbytes / max(k.copy_s, 1e-9) / 1e9:.2f} GB/s, steps {k.interference:+.1%} "
                    f"while it runs){'; measured beside ' + others if others else ''}: every {period} step(s) "
                    f"keeps the loop within {budget:.0%}; a failure loses ~{lost:.1f} step(s)"))
        if best is None or cost < best[0]:
            best = (cost, choice)
    assert best is not None
    return best[1]


def worth_changing(current: PaceChoice | None, new: PaceChoice, budget: float = DEFAULT_BUDGET) -> bool:
    """Hysteresis: a new choice replaces the current one when the kind changed, the current period breaks the
    budget on the new measurements, or the period moved by more than ``HYSTERESIS``."""
    if current is None or current.kind != new.kind:
        return True
    if overhead(current.period, new.step_s, new.blocking_s, new.copy_s, new.interference) > budget * 1.0001:
        return True
    if current.period * new.step_s < new.copy_s:  # copies would no longer finish before the next is due
        return True
    return abs(new.period - current.period) > HYSTERESIS * current.period


@dataclass
class _Window:
    kind: str
    start: float
    end: float | None = None


@dataclass
class PaceMeter:
    """Measurements the pacer chooses from: the loop's step boundaries (``boundary``), the snapshots it
    dispatched (``dispatched``) and the tier's copies to the host (``copy_started`` / ``copy_done``), on one
    clock. Thread-safe: the tier's worker reports copies while the loop reports boundaries."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last: float | None = None
    _after_dispatch: bool = False
    _idle: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))  # step intervals, nothing in flight
    _blocking: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))  # the interval after a dispatch
    _during: dict[str, deque[float]] = field(default_factory=dict)  # intervals inside a copy, by kind
    _copies: dict[str, deque[float]] = field(default_factory=dict)  # copy durations, by kind
    _restore: dict[str, float] = field(default_factory=dict)  # host -> device bytes per second, by kind
    _windows: list[_Window] = field(default_factory=list)
    steps: int = 0

    def boundary(self, now: float) -> None:
        """A step boundary at ``now``: the interval since the last one is classified."""
        with self._lock:
            if self._last is not None:
                interval = now - self._last
                self.steps += 1
                inside = [w for w in self._windows if w.start <= self._last and (w.end is None or w.end >= now)]
                touching = [w for w in self._windows if w.start < now and (w.end is None or w.end > self._last)]
                if self._after_dispatch:
                    self._blocking.append(interval)
                elif inside:
                    self._during.setdefault(inside[0].kind, deque(maxlen=_WINDOW)).append(interval)
                elif not touching:
                    self._idle.append(interval)
            self._last = now
            self._after_dispatch = False
            self._windows = [w for w in self._windows if w.end is None or w.end > now]

    def dispatched(self) -> None:
        """A snapshot was dispatched at the boundary just reported: the next interval carries its blocking."""
        with self._lock:
            self._after_dispatch = True

    def copy_started(self, kind: str, now: float) -> None:
        with self._lock:
            self._windows.append(_Window(kind, now))

    def copy_done(self, kind: str, started: float, now: float) -> None:
        with self._lock:
            for w in self._windows:
                if w.kind == kind and w.start == started and w.end is None:
                    w.end = now
            self._copies.setdefault(kind, deque(maxlen=_WINDOW)).append(now - started)

    def restore_rate(self, kind: str, bytes_per_s: float) -> None:
        with self._lock:
            self._restore[kind] = bytes_per_s

    def reset_steps(self) -> None:
        """A new attempt (another mesh, another step): forget the step times, keep the copies' costs."""
        with self._lock:
            self._idle.clear()
            self._blocking.clear()
            self._during.clear()
            self._last = None
            self._after_dispatch = False

    # ---- what is known ------------------------------------------------------------------------------

    def step_s(self) -> float | None:
        """The median step interval with nothing in flight; None before ``WARMUP_STEPS`` of them."""
        with self._lock:
            return statistics.median(self._idle) if len(self._idle) >= WARMUP_STEPS else None

    def kinds_measured(self) -> list[str]:
        with self._lock:
            return [k for k, v in self._copies.items() if v]

    def costs(self, nbytes: int, budget: float = DEFAULT_BUDGET) -> tuple[float, float, list[KindCosts]] | None:
        """``(step_s, blocking_s, kinds)`` from the medians measured so far; None before a step time and a copy
        are known."""
        step = self.step_s()
        with self._lock:
            if step is None or not any(self._copies.values()):
                return None
            blocking = max(0.0, statistics.median(self._blocking) - step) if self._blocking else 0.0
            kinds = []
            for kind, durations in self._copies.items():
                if not durations:
                    continue
                during = self._during.get(kind)
                interference = max(0.0, statistics.median(during) / step - 1) if during else 0.0
                kinds.append(KindCosts(kind, statistics.median(durations), interference, self._restore.get(kind)))
        return step, blocking, kinds


__all__ = ["DEFAULT_BUDGET", "HYSTERESIS", "WARMUP_STEPS", "KindCosts", "PaceChoice", "PaceMeter", "choose",
           "expected_lost_steps", "overhead", "smallest_period", "worth_changing"]
