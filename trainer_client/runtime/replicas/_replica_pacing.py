"""How often the replica tier snapshots, and into which host memory: chosen from what the run measures.

Why it exists: a snapshot's cost is a fact of the hardware (docs/concepts.md, "Pacing the replica tier"). On a
TPU v5e chip a 5.22 GB state crosses to pinned host memory in ~6 s while a step takes 0.27 s, so a snapshot
after every step cannot be held (at most one copy is in flight) and must not be waited for. Two numbers decide
the period:

* ``cost_s``: the loop time one snapshot costs, all told: how much longer than an idle step every step took
  from the snapshot's dispatch until the step after its copy landed (the on-device copy the next step is
  queued behind, the dispatch, steps slowed while the copy runs, the host memory taken and given back). It is
  measured, not modelled: on the chip the dispatch alone blocked 16 ms while a whole cycle cost ~0.25 s.
  What a cycle cannot see is caught too: over the last ``_RECENT`` steps, everything the loop lost against an
  idle step, divided by the snapshots dispatched in them (all of one kind), is a second estimate, and the larger
  of the two is used. On the chip one run's cycles said 132 ms where, against the same loop without the tier,
  the loop lost ~190 ms a snapshot (docs/benchmarks.md, run ``e``): its period kept 1.85% by the cycles and
  cost 2.6%. Whether the second estimate closes that gap on the chip is to be measured;
* ``copy_s``: how long the copy to the host takes (it must end before the next snapshot is due).

For a period of ``p`` steps of ``step_s`` seconds the loop's overhead is ``cost_s / (p * step_s)``; the pacer
picks the smallest ``p`` that keeps it within the budget (2% by default) and leaves the copy time to finish
(``p * step_s >= copy_s`` with a margin). A failure then loses on average ``p / 2`` steps plus the steps a copy
takes to land (``expected_lost_steps``). Where the memory kind is not configured, a snapshot is copied to each
kind (pinned, then unpinned host memory), and the kind with the least expected time lost per failure (the steps
lost, plus the restore at that kind's host-to-device rate where measured) is kept.

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
_RECENT = 256  # step intervals kept for the loop's whole loss (``PaceMeter.costs``)
_RECENT_SNAPSHOTS = 2  # snapshots in that window before its estimate counts


@dataclass(frozen=True)
class KindCosts:
    """What a snapshot into one host memory kind was measured to cost."""

    kind: str
    copy_s: float  # device -> host, the whole snapshot
    cost_s: float  # the loop time one snapshot costs, all told (see the module's docstring)
    restore_Bps: float | None = None  # host -> device, bytes per second (None: not measured)


@dataclass(frozen=True)
class PaceChoice:
    """The period and memory kind chosen, with the numbers they were chosen from (event and metric fields)."""

    period: int
    kind: str
    step_s: float
    cost_s: float
    copy_s: float
    copy_Bps: float
    overhead: float  # the loop's expected overhead at this period
    expected_lost_steps: float  # steps a failure loses on average
    reason: str

    def describe(self, before: PaceChoice | None = None) -> str:
        """The choice in one line, with the one it replaces (the ``replica_paced`` event's detail)."""
        was = f" (was every {before.period} to {before.kind})" if before is not None else ""
        return f"every {self.period} step(s) to {self.kind}{was}: {self.reason}"

    def fields(self) -> dict[str, object]:
        """As event fields (``ElasticEvent.replica_*``)."""
        return {"replica_period": self.period, "replica_memory_kind": self.kind,
                "replica_copy_seconds": round(self.copy_s, 4),
                "replica_copy_bytes_per_second": float(round(self.copy_Bps)),
                "replica_overhead": round(self.overhead, 5),
                "replica_expected_lost_steps": round(self.expected_lost_steps, 2)}


def overhead(period: int, step_s: float, cost_s: float) -> float:
    """The loop's overhead with a snapshot every ``period`` steps (fraction of the step time)."""
    return cost_s / (period * step_s)


def expected_lost_steps(period: int, step_s: float, copy_s: float) -> float:
    """Steps a failure at a random moment loses: half a period on average, plus the steps a copy takes to be
    held (the snapshot in flight does not count until it is whole)."""
    return period / 2 + copy_s / step_s


def smallest_period(step_s: float, cost_s: float, copy_s: float, budget: float = DEFAULT_BUDGET) -> int:
    """The smallest period within ``budget`` that leaves a copy time to finish (``MAX_PERIOD`` at most)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 1
    floor = max(1, math.ceil(COPY_MARGIN * copy_s / step_s))
    return min(MAX_PERIOD, max(floor, math.ceil(cost_s / (budget * step_s) - 1e-9)))


def choose(step_s: float, kinds: list[KindCosts], nbytes: int, budget: float = DEFAULT_BUDGET) -> PaceChoice:
    """The period and kind with the least expected time lost per failure (steps lost at the chosen period,
    plus the restore at the kind's measured host-to-device rate), each kind's period the smallest within
    ``budget``."""
    if not kinds:
        raise ValueError("no memory kind measured")
    best: tuple[float, PaceChoice] | None = None
    for k in kinds:
        period = smallest_period(step_s, k.cost_s, k.copy_s, budget)
        lost = expected_lost_steps(period, step_s, k.copy_s)
        restore_s = nbytes / k.restore_Bps if k.restore_Bps else 0.0
        cost = lost * step_s + restore_s
        others = ", ".join(f"{o.kind} {o.copy_s:.2f}s" for o in kinds if o is not k)
        choice = PaceChoice(
            period=period, kind=k.kind, step_s=step_s, cost_s=k.cost_s, copy_s=k.copy_s,
            copy_Bps=nbytes / k.copy_s if k.copy_s > 0 else 0.0,
            overhead=overhead(period, step_s, k.cost_s), expected_lost_steps=lost,
            reason=(f"step {step_s * 1e3:.1f} ms, a snapshot costs the loop {k.cost_s * 1e3:.1f} ms, its copy to "
                    f"{k.kind} {k.copy_s:.2f} s ({nbytes / max(k.copy_s, 1e-9) / 1e9:.2f} GB/s)"
                    f"{'; measured beside ' + others if others else ''}: every {period} step(s) keeps the loop "
                    f"within {budget:.0%}; a failure loses ~{lost:.1f} step(s)"))
        if best is None or cost < best[0]:
            best = (cost, choice)
    assert best is not None
    return best[1]


def worth_changing(current: PaceChoice | None, new: PaceChoice, budget: float = DEFAULT_BUDGET) -> bool:
    """Hysteresis: a new choice replaces the current one when the kind changed, the current period breaks the
    budget on the new measurements, or the period moved by more than ``HYSTERESIS``."""
    if current is None or current.kind != new.kind:
        return True
    if overhead(current.period, new.step_s, new.cost_s) > budget * 1.0001:
        return True
    if current.period * new.step_s < new.copy_s:  # copies would no longer finish before the next is due
        return True
    return abs(new.period - current.period) > HYSTERESIS * current.period


@dataclass
class _Cycle:
    """One snapshot, from its dispatch until the boundary after its copy landed: the step intervals it touched."""

    kind: str
    start: float
    end: float | None = None
    intervals: list[float] = field(default_factory=list)


@dataclass
class PaceMeter:
    """Measurements the pacer chooses from: the loop's step boundaries (``boundary``) and the tier's copies to
    the host (``copy_started`` at a snapshot's dispatch, ``copy_done`` when it landed or failed), on one clock.
    Thread-safe: the tier's worker reports copies while the loop reports boundaries."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last: float | None = None
    _idle: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))  # step intervals, no snapshot
    _open: list[_Cycle] = field(default_factory=list)
    _cycles: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # closed: (sum of intervals, count)
    _copies: dict[str, deque[float]] = field(default_factory=dict)  # copy durations, by kind
    _restore: dict[str, float] = field(default_factory=dict)  # host -> device bytes per second, by kind
    _recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_RECENT))  # (at, interval)
    _dispatches: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=_RECENT))  # (at, kind)
    _timed: int = 0  # step intervals since the attempt began: its first ``WARMUP_STEPS`` are no snapshot's loss
    steps: int = 0
    cycles_closed: int = 0  # snapshots whose whole cost is known: a choice needs revising only after a new one

    def boundary(self, now: float) -> None:
        """A step boundary at ``now``: the interval since the last one is an idle step's, or part of the cycle of
        each snapshot it overlaps; a cycle whose copy has landed closes here."""
        with self._lock:
            if self._last is not None:
                interval = now - self._last
                self.steps += 1
                self._timed += 1
                if self._timed > WARMUP_STEPS:  # an attempt's first steps compile or wait for its restore
                    self._recent.append((now, interval))
                touching = [c for c in self._open if c.start < now]
                for c in touching:
                    c.intervals.append(interval)
                if not touching:
                    self._idle.append(interval)
            still: list[_Cycle] = []
            for c in self._open:
                if c.end is not None and c.end <= now:
                    if c.intervals:
                        self._cycles.setdefault(c.kind, deque(maxlen=_WINDOW)).append(
                            (sum(c.intervals), len(c.intervals)))
                        self.cycles_closed += 1
                else:
                    still.append(c)
            self._open = still
            self._last = now

    def copy_started(self, kind: str, now: float) -> None:
        """A snapshot into ``kind`` dispatched at ``now`` (its cycle opens)."""
        with self._lock:
            self._open.append(_Cycle(kind, now))
            self._dispatches.append((now, kind))

    def copy_done(self, kind: str, started: float, now: float, *, landed: bool = True,
                  settled: float | None = None) -> None:
        """The copy dispatched at ``started`` ended at ``now`` (``landed``: whole; else it failed); its cycle
        ends at ``settled`` (default ``now``): once what the tier does after a copy (holding it, letting the
        previous snapshot's memory go) is done too."""
        with self._lock:
            for c in self._open:
                if c.kind == kind and c.start == started and c.end is None:
                    c.end = now if settled is None else settled
            if landed:
                self._copies.setdefault(kind, deque(maxlen=_WINDOW)).append(now - started)

    def restore_rate(self, kind: str, bytes_per_s: float) -> None:
        with self._lock:
            self._restore[kind] = bytes_per_s

    def reset_steps(self) -> None:
        """A new attempt (another mesh, another step): forget the step times and the open cycles, keep the
        copies' costs."""
        with self._lock:
            self._idle.clear()
            self._open.clear()
            self._recent.clear()
            self._dispatches.clear()
            self._last = None
            self._timed = 0

    # ---- what is known ------------------------------------------------------------------------------

    def step_s(self) -> float | None:
        """The median step interval with no snapshot under way; None before ``WARMUP_STEPS`` of them."""
        with self._lock:
            return statistics.median(self._idle) if len(self._idle) >= WARMUP_STEPS else None

    def kinds_measured(self) -> list[str]:
        """The kinds with a whole cycle measured: a copy that landed and the boundary after it."""
        with self._lock:
            return [k for k, v in self._copies.items() if v and self._cycles.get(k)]

    def costs(self, nbytes: int) -> tuple[float, list[KindCosts]] | None:
        """``(step_s, kinds)`` from the medians measured so far; None before a step time and a cycle are known."""
        step = self.step_s()
        with self._lock:
            if step is None:
                return None
            kinds = []
            for kind, durations in self._copies.items():
                cycles = self._cycles.get(kind)
                if not durations or not cycles:
                    continue
                # the mean, not the median: the overhead is an average, and a few costly cycles (a host allocation
                # that held the interpreter's lock) are what a median would hide
                cost = statistics.fmean(max(0.0, total - count * step) for total, count in cycles)
                cost = max(cost, self._whole_loss(kind, step) or 0.0)
                kinds.append(KindCosts(kind, statistics.median(durations), cost, self._restore.get(kind)))
        return (step, kinds) if kinds else None

    def _whole_loss(self, kind: str, step: float) -> float | None:
        """The loop's loss against an idle step over the recent window, per snapshot dispatched in it; None
        unless ``_RECENT_SNAPSHOTS`` or more were, every one into ``kind`` (held under the lock)."""
        if not self._recent:
            return None
        since = self._recent[0][0] - self._recent[0][1]  # where the window's first interval began
        kinds = [k for at, k in self._dispatches if at >= since]
        if len(kinds) < _RECENT_SNAPSHOTS or set(kinds) != {kind}:
            return None
        lost = sum(interval for _, interval in self._recent) - len(self._recent) * step
        return max(0.0, lost) / len(kinds)


__all__ = ["DEFAULT_BUDGET", "HYSTERESIS", "WARMUP_STEPS", "KindCosts", "PaceChoice", "PaceMeter", "choose",
           "expected_lost_steps", "overhead", "smallest_period", "worth_changing"]
