"""The run the autopilot harness (bench/autopilot.py) replays a failure trace through: a training loop with
checkpoint tiers, their saves, the failures of the trace and the recoveries, advanced from event to event.

Why it exists, apart from the advisor's simulator (ckptd/advisor/_simulator.py): the strategies compared here change
their periods during the run, the run has three tiers that each survive different failures, and the storage's costs
change in the middle of a trace; that simulator takes one fixed schedule of two tiers. What the world does is
written here independently of the period model it judges (trainer_client/core/planning), so the model is not
graded by its own arithmetic:

- The loop runs at one step per ``step_s`` plus, per tier, its save's block every period, plus the wait when a save
  falls due before the previous one of that tier is usable; a nested tier's save off its base's steps takes a
  snapshot of its own. Within a stretch between events the loop is advanced in closed form (its saves land at
  their steps, each usable its copy time after it started).
- A failure cuts every copy in flight and empties the tiers that do not survive it; the run goes back to the newest
  save left (the fastest tier holding it), after detection, that tier's restore and its first step. A failure
  during a recovery starts it again. Time past the end of the trace is not counted.
- Goodput is the steps kept at the end of the trace times the step time, over the trace's length.
- A strategy is asked for its periods at the start, after every recovery and every ``tick_s`` (600 s) of the run;
  it measures the tiers' costs as they were when the last save of each that finished had started.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from bench.autopilot_traces import Trace
from trainer_client.core.planning import TierCosts

Periods = tuple[int | None, ...]


@dataclass(frozen=True)
class World:
    """A configuration of tiers (fastest first, ``levels``: the worst failure each survives) facing a trace.
    ``persist_s``: the part of the slowest tier's copy that a slow storage day stretches."""

    step_s: float
    tiers: tuple[TierCosts, ...]
    levels: tuple[int, ...]
    persist_s: float
    detect_s: float
    trace: Trace

    def costs_at(self, t: float) -> tuple[TierCosts, ...]:
        f = self.trace.factor(t)
        if f == 1.0:
            return self.tiers
        last = self.tiers[-1]
        slow = replace(last, copy_s=last.copy_s + (f - 1.0) * self.persist_s, restore_s=f * last.restore_s)
        return (*self.tiers[:-1], slow)

    def measured(self, t: float, periods: Periods | None) -> tuple[TierCosts, ...]:
        """Each tier's costs as the run last measured them: when its newest save that finished had started."""
        now = self.costs_at(t)
        out = []
        for j, tier in enumerate(now):
            n = periods[j] if periods is not None else None
            lag = tier.copy_s + (n * self.step_s if n is not None else 0.0)
            out.append(self.costs_at(max(0.0, t - lag))[j])
        return tuple(out)


class Strategy(Protocol):
    name: str
    ticks: bool  # asked again every tick (False: fixed periods)

    def start(self, world: World) -> Periods: ...

    def decide(self, t: float, world: World, periods: Periods, failures: Sequence[tuple[float, int]]) -> Periods:
        """The periods from ``t`` on; ``failures``: those since the last call, (time, class)."""
        ...


@dataclass
class Result:
    goodput: float
    failures: int  # of the trace, replayed
    lost_steps: list[float] = field(default_factory=list)  # per recovery (failures during one count once)
    changes: int = 0  # times the periods changed after the start
    periods: list[tuple[float, Periods]] = field(default_factory=list)  # (from, periods)

    @property
    def mean_lost_steps(self) -> float:
        return sum(self.lost_steps) / len(self.lost_steps) if self.lost_steps else 0.0


@dataclass
class _Held:
    held: float | None = None  # the step of the newest usable save
    pending: tuple[float, float] | None = None  # (step, usable at) of the save in flight


class _Run:
    def __init__(self, world: World, strategy: Strategy, tick_s: float) -> None:
        self.w, self.s, self.tick_s = world, strategy, tick_s
        self.tiers = [_Held() for _ in world.tiers]
        self.tiers[-1].held = 0.0  # the initial state can always be made again
        self.t, self.k = 0.0, 0.0

    def _wall_per_step(self, periods: Periods, costs: Sequence[TierCosts]) -> float:
        step = self.w.step_s
        on = [(j, n) for j, n in enumerate(periods) if n is not None]
        base = step + sum(costs[j].block_s / n for j, n in on)
        u = step
        for j, n in on:
            c = costs[j]
            stall = c.block_s + max(0.0, c.copy_s - n * base)
            if c.nested:
                below = periods[j - 1]
                own = costs[j - 1].block_s
                stall += own if below is None else own * (1.0 - n / math.lcm(n, below))
            u += stall / n
        return u

    def _advance(self, t1: float, periods: Periods) -> None:
        costs = self.w.costs_at(self.t)
        u = self._wall_per_step(periods, costs)
        t0, k0 = self.t, self.k
        k1 = k0 + (t1 - t0) / u
        for j, n in enumerate(periods):
            st = self.tiers[j]
            if st.pending is not None and st.pending[1] <= t1:
                st.held, st.pending = st.pending[0], None
            if n is None:
                continue
            last = math.floor(k1 / n + 1e-9) * n
            if last <= k0 + 1e-9:
                continue
            copy = costs[j].copy_s
            ready = t0 + (last - k0) * u + copy
            if ready <= t1:
                st.held, st.pending = last, None
            else:
                st.pending = (last, ready)
                prev = last - n
                if prev > k0 + 1e-9 and t0 + (prev - k0) * u + copy <= t1:
                    st.held = prev
        self.t, self.k = t1, k1

    def _fail(self, cls: int) -> tuple[float, int]:
        """A failure of class ``cls`` now: what is left, and the step and tier the run goes back to."""
        for st, level in zip(self.tiers, self.w.levels, strict=True):
            st.pending = None
            if level < cls:
                st.held = None
        held = [(st.held, -j) for j, st in enumerate(self.tiers) if st.held is not None and self.w.levels[j] >= cls]
        step, j = max(held)
        return step, -j

    def run(self) -> Result:
        w, trace = self.w, self.w.trace
        periods = self.s.start(w)
        result = Result(0.0, 0, periods=[(0.0, periods)])
        failures = list(trace.failures)
        edges = sorted({x for a, b, _ in trace.slow for x in (a, b) if 0 < x < trace.horizon_s})
        i, next_tick = 0, self.tick_s if self.s.ticks else math.inf
        seen: list[tuple[float, int]] = []
        while self.t < trace.horizon_s:
            t_fail = failures[i][0] if i < len(failures) else math.inf
            t_edge = next((x for x in edges if x > self.t), math.inf)
            t_end = min(t_fail, next_tick, t_edge, trace.horizon_s)
            self._advance(t_end, periods)
            if t_end >= trace.horizon_s:
                break
            if t_end == t_fail:
                at = self.k
                step, j = self._fail(failures[i][1])
                seen.append(failures[i])
                i += 1
                while True:  # the recovery; a failure during it starts it again
                    tier = w.costs_at(self.t)[j]
                    done = self.t + w.detect_s + tier.restore_s + tier.first_step_s
                    if i < len(failures) and failures[i][0] < min(done, trace.horizon_s):
                        self.t = failures[i][0]
                        step, j = self._fail(failures[i][1])
                        seen.append(failures[i])
                        i += 1
                        continue
                    break
                result.lost_steps.append(at - step)
                self.k = step
                if done >= trace.horizon_s:
                    self.t = trace.horizon_s
                    break
                self.t = done
                while next_tick <= self.t:
                    next_tick += self.tick_s
            elif t_end == next_tick:
                next_tick += self.tick_s
            else:
                continue  # a slow window begins or ends: the costs change, the periods stay
            new = self.s.decide(self.t, w, periods, seen)
            seen = []
            if new != periods:
                periods = new
                result.changes += 1
                result.periods.append((self.t, periods))
        result.goodput = self.k * w.step_s / trace.horizon_s
        result.failures = i
        return result


def simulate(world: World, strategy: Strategy, tick_s: float = 600.0) -> Result:
    return _Run(world, strategy, tick_s).run()


__all__ = ["Periods", "Result", "Strategy", "World", "simulate"]
