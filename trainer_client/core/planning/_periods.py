"""The period of every checkpoint tier from its measured costs and the failure rate: the one model that both
``ckptd advise`` (its first-order periods) and the runner's autopilot (its live choice) use.

Why it exists: a save period trades the loop time every save costs against the work a failure loses, and with
several tiers (replica snapshots, shared memory, storage) each tier serves the failures it survives and the next
faster tier does not. The model is Young's (1974) per tier: a tier whose saves cost ``b`` of loop time and that
serves the failures arriving every ``M_j`` on average (the job's MTBF over the share of failures it is the fastest
surviving tier for) is saved every ``sqrt(2 b M_j)``, never more often than its copy allows (one save in flight)
or the storage's bandwidth and request rate allow. Periods do not decrease from the fastest tier to the slowest
(a slower tier saved more often would serve the faster one's failures with newer saves); where the per-tier optima
would, the tiers are saved together as one block at the block's own optimum (the exact optimum of the
ordered problem: every split of the tiers into consecutive blocks is tried). Restore and first-step times enter
the expected goodput, not the periods (Daly 2006: the restart time scales the expected run time, not the optimum).
A bound on the steps lost per failure shortens every period as a higher failure rate would (its Lagrange
multiplier). docs/planning.md writes the model down.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from trainer_client.core.planning._inputs import PlanInputs, TierCosts

IDLE_MULTIPLE = 64  # a tier no failure rolls back to is saved this many times less often than the tier before it
MAX_PERIOD_STEPS = 10**9


def young_daly(save_cost: float, mtbf: float) -> float:
    """First-order optimum period: sqrt(2 x save cost x MTBF) (Young 1974)."""
    return 0.0 if save_cost == 0 else math.sqrt(2.0 * save_cost * mtbf)


def daly(save_cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum; equals the MTBF when the save cost reaches 2 x MTBF."""
    if save_cost >= 2.0 * mtbf:
        return mtbf
    x = math.sqrt(save_cost / (2.0 * mtbf))
    return young_daly(save_cost, mtbf) * (1.0 + x / 3.0 + x * x / 9.0) - save_cost


@dataclass(frozen=True)
class Block:
    """Consecutive tiers saved at one period (one tier, or several saved at the same steps)."""

    tiers: tuple[str, ...]
    young_daly_s: float  # sqrt(2 x save cost x MTBF of the failures it serves); inf when it serves none
    period_s: float  # after the floors (copy, storage bandwidth, requests): the first-order period
    save_cost_s: float  # the loop time one save of the block costs
    mtbf_s: float  # between the failures that roll back to it
    daly_s: float  # Daly's higher-order estimate
    bound: str | None  # what set the period where Young/Daly did not: "copy", "storage bandwidth", ... or "idle"


@dataclass(frozen=True)
class TierPlan:
    """One tier's period: ``period_steps`` (None: off), the first-order period it was rounded from, the share of
    failures it recovers and what bound its period, if anything did."""

    name: str
    period_steps: int | None
    first_order_s: float | None = None
    share: float = 0.0
    bound: str | None = None


@dataclass(frozen=True)
class Expected:
    """The expected goodput of a plan and where the rest of the wall time goes (fractions adding up to 1)."""

    goodput: float
    overhead: float  # loop time the saves cost
    lost: float  # work redone after failures
    recovery: float  # detection, restore and first step
    lost_steps: float  # steps a failure loses on average
    failures_per_day: float


@dataclass(frozen=True)
class Plan:
    """Periods for every tier, their expected goodput, and what they break (``problems``: empty when feasible)."""

    tiers: tuple[TierPlan, ...]
    expected: Expected
    blocks: tuple[Block, ...] = ()
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def periods(self) -> tuple[int | None, ...]:
        return tuple(t.period_steps for t in self.tiers)

    @property
    def feasible(self) -> bool:
        return not self.problems

    def tier(self, name: str) -> TierPlan:
        return next(t for t in self.tiers if t.name == name)

    def block(self, name: str) -> Block:
        """The first-order block ``name`` belongs to (``choose`` only)."""
        return next(b for b in self.blocks if name in b.tiers)

    def describe(self) -> str:
        """The periods in one line: ``replicas every 24, memory every 900, storage every 900 steps``."""
        return ", ".join(f"{t.name} {'off' if t.period_steps is None else f'every {t.period_steps}'}"
                         for t in self.tiers) + " steps"


# ---- which tier serves which failures ------------------------------------------------------------------------


def _active(inputs: PlanInputs, on: Sequence[bool]) -> list[tuple[int, TierCosts]]:
    """The tiers that are on, with their costs as run: a nested tier whose base is off takes its own snapshot."""
    out = []
    for i, t in enumerate(inputs.tiers):
        if not on[i]:
            continue
        if t.nested and not on[i - 1]:
            t = replace(t, block_s=t.block_s + inputs.tiers[i - 1].block_s, nested=False)
        out.append((i, t))
    return out


def _served(inputs: PlanInputs, on: Sequence[bool]) -> list[float]:
    """The share of failures each tier recovers: those whose fastest surviving tier that is on it is."""
    out = [0.0] * len(inputs.tiers)
    for i, share in enumerate(inputs.shares()):
        out[next(j for j in range(i, len(on)) if on[j])] += share
    return out


def _floor(inputs: PlanInputs, t: TierCosts) -> tuple[float, str | None]:
    """The shortest period (seconds) the tier allows, and what sets it."""
    c = inputs.constraints
    options: list[tuple[float, str | None]] = [(t.copy_s, "copy"), (t.min_period_s, t.min_reason)]
    if c.storage_Bps is not None and t.write_bytes:
        options.append((t.write_bytes / c.storage_Bps, "storage bandwidth"))
    if c.storage_requests_per_s is not None and t.requests:
        options.append((t.requests / c.storage_requests_per_s, "storage requests"))
    value, why = max(options, key=lambda o: o[0])
    return value, why if value > 0 else None


def tier_floor(inputs: PlanInputs, tier: int) -> tuple[float, str | None]:
    """The shortest period (seconds) tier ``tier`` allows on ``inputs`` (its copy, its lower bound, the storage's
    limits), and what sets it (None: nothing)."""
    return _floor(inputs, inputs.tiers[tier])


def tier_cap(inputs: PlanInputs, tier: int) -> float:
    """The longest period (seconds) the run allows tier ``tier`` (inf: no bound)."""
    return _cap(inputs.tiers[tier])


# ---- the first-order optimum ------------------------------------------------------------------------------------


def _cap(t: TierCosts) -> float:
    """The longest period the run allows the tier (seconds; inf: no bound)."""
    return math.inf if t.max_period_s is None else t.max_period_s


def _blocks(names: Sequence[str], costs: Sequence[float], served: Sequence[float],
            floors: Sequence[tuple[float, str | None]], caps: Sequence[float], rate: float,
            step_s: float) -> list[Block]:
    """The periods minimising sum(b/T) + rate x sum(share x T/2) with periods not decreasing from the fastest tier:
    every split into consecutive blocks, each at its own optimum within its floors and caps (a floor wins where they
    cross), the cheapest whose periods keep the order (ties: more blocks)."""
    best: tuple[float, list[Block]] | None = None
    prev: float | None
    for cuts in itertools.product((True, False), repeat=len(names) - 1):
        groups: list[list[int]] = [[0]]
        for k, cut in enumerate(cuts, start=1):
            if cut:
                groups.append([k])
            else:
                groups[-1].append(k)
        blocks: list[Block] = []
        total, prev = 0.0, None
        for g in groups:
            b, phi = sum(costs[k] for k in g), sum(served[k] for k in g)
            floor, why = max((floors[k] for k in g), key=lambda f: f[0])
            cap = min(caps[k] for k in g)
            lam = rate * phi
            if lam > 0:
                mtbf = 1.0 / lam
                yd, dal = young_daly(b, mtbf), daly(b, mtbf)
                period, bound = (yd, None) if yd >= floor else (floor, why)
            else:  # no failure rolls back to it: seldom, a fixed multiple of the tier before it (of a step at least)
                mtbf = yd = dal = math.inf
                period = max(floor, IDLE_MULTIPLE * max(prev, step_s)) if prev is not None else math.inf
                bound = "idle"
            if period > cap and cap >= floor:
                period, bound = cap, "bound"
            if prev is not None and period < prev:
                break
            overhead = 0.0 if b == 0 else b / period if period > 0 else math.inf
            total += overhead + (lam * period / 2.0 if lam > 0 else 0.0)
            blocks.append(Block(tuple(names[k] for k in g), yd, period, b, mtbf, dal, bound))
            prev = period
        else:
            if best is None or total < best[0] * (1 - 1e-12):
                best = (total, blocks)
    assert best is not None  # one block for all tiers always keeps the order
    return best[1]


def _steps(inputs: PlanInputs, active: list[tuple[int, TierCosts]], periods_s: Sequence[float]) -> list[int]:
    """First-order periods as whole steps: at least the floor, a nested tier a multiple of its base's period, no
    tier more often than the tier before it."""
    out: list[int] = []
    for k, ((_, t), period) in enumerate(zip(active, periods_s, strict=True)):
        low = max(1, math.ceil(_floor(inputs, t)[0] / inputs.step_s - 1e-9))
        n = MAX_PERIOD_STEPS if not math.isfinite(period) else max(low, round(period / inputs.step_s))
        n = min(n, MAX_PERIOD_STEPS)
        high = max(low, math.floor(_cap(t) / inputs.step_s + 1e-9)) if math.isfinite(_cap(t)) else MAX_PERIOD_STEPS
        if k and t.nested:
            base = out[k - 1]
            n = max(1, round(n / base), math.ceil(low / base)) * base
            if n > high:  # the largest multiple within the bound; none: the bound (its own snapshot, charged)
                n = high // base * base if high >= base else high
        n = min(n, high)
        if k:
            n = max(n, out[k - 1])
        out.append(n)
    return out


# ---- what a plan is worth ---------------------------------------------------------------------------------------


def _lost(t: TierCosts, period_s: float) -> float:
    """Work a failure recovered from this tier loses on average: half a period, plus the copy in flight (a save
    counts once it is usable); a period shorter than the copy is stretched to it (saves wait)."""
    return max(period_s, t.copy_s) / 2.0 + t.copy_s


def evaluate(inputs: PlanInputs, periods: Sequence[int | None], *, floor_margin: float = 0.0) -> Plan:
    """The expected goodput of ``periods`` (steps per tier, None: off) and the constraints they break. A period
    breaks its floor when shorter than the floor by more than ``floor_margin`` (a fraction; the autopilot's
    periods in force get one: a period chosen at its floor must not count as broken on the next jitter of the
    step time). The goodput counts a save that waits for the previous copy whatever the margin."""
    tiers = inputs.tiers
    if len(periods) != len(tiers) or periods[-1] is None:
        raise ValueError("one period per tier, the slowest tier on")
    on = [p is not None for p in periods]
    served = _served(inputs, on)
    step, rate = inputs.step_s, inputs.rate
    overhead = lost_s = recovery_s = 0.0
    problems: list[str] = []
    for i, t in _active(inputs, on):
        n = periods[i]
        assert n is not None
        if n < 1:
            raise ValueError(f"{t.name}: a period is at least one step, got {n}")
        period = n * step
        stall = t.block_s + max(0.0, t.copy_s - period)  # a save due before the previous is usable waits for it
        if t.nested:  # its saves off the base tier's steps take a snapshot of their own
            base = periods[i - 1]
            assert base is not None
            stall += tiers[i - 1].block_s * (1.0 - n / math.lcm(n, base))
        overhead += stall / period
        lost_s += served[i] * _lost(t, period)
        recovery_s += served[i] * t.recovery_s
        floor, why = _floor(inputs, t)
        if period < floor * (1 - max(floor_margin, 1e-9)):
            problems.append(f"{t.name} every {n} steps ({period:.3g} s) is shorter than its {why} allows "
                            f"({floor:.3g} s)")
        elif period > _cap(t) * (1 + 1e-9):
            problems.append(f"{t.name} every {n} steps ({period:.3g} s) is longer than its bound ({_cap(t):.3g} s)")
    c = inputs.constraints
    held = sum(t.host_bytes for t, o in zip(tiers, on, strict=True) if o)
    if c.host_memory_bytes is not None and held > c.host_memory_bytes:
        problems.append(f"the tiers hold {held / 1e9:.3g} GB of host memory, over the budget of "
                        f"{c.host_memory_bytes / 1e9:.3g} GB")
    lost_steps = lost_s / step
    if c.max_lost_steps is not None and lost_steps > c.max_lost_steps * (1 + 1e-9):
        problems.append(f"a failure loses {lost_steps:.1f} steps on average, over the bound of {c.max_lost_steps:g}")
    failing = rate * (lost_s + recovery_s + inputs.detect_s)
    running = max(0.0, 1.0 - failing)
    goodput = running / (1.0 + overhead)
    return Plan(
        tiers=tuple(TierPlan(t.name, p, share=served[i]) for i, (t, p) in enumerate(zip(tiers, periods, strict=True))),
        expected=Expected(goodput=goodput, overhead=running - goodput, lost=min(1.0, rate * lost_s),
                          recovery=min(1.0, rate * (recovery_s + inputs.detect_s)), lost_steps=lost_steps,
                          failures_per_day=rate * 86_400.0),
        problems=tuple(problems))


# ---- the choice -------------------------------------------------------------------------------------------------


def _plan_at(inputs: PlanInputs, on: Sequence[bool], rate: float) -> tuple[list[Block], list[int | None]]:
    active = _active(inputs, on)
    served = _served(inputs, on)
    blocks = _blocks([t.name for _, t in active], [t.block_s for _, t in active], [served[i] for i, _ in active],
                     [_floor(inputs, t) for _, t in active], [_cap(t) for _, t in active], rate, inputs.step_s)
    period_of = {name: b.period_s for b in blocks for name in b.tiers}
    steps = _steps(inputs, active, [period_of[t.name] for _, t in active])
    periods: list[int | None] = [None] * len(inputs.tiers)
    for (i, _), n in zip(active, steps, strict=True):
        periods[i] = n
    return blocks, periods


def _plan_for(inputs: PlanInputs, on: Sequence[bool]) -> Plan:
    """The best periods with the tiers ``on``: Young/Daly per block; under a bound on the steps lost, the failure
    rate the periods are chosen for is raised until the bound holds (its smallest such value, by bisection)."""
    rate = inputs.rate
    blocks, periods = _plan_at(inputs, on, rate)
    notes: list[str] = []
    bound = inputs.constraints.max_lost_steps
    if bound is not None and evaluate(inputs, periods).expected.lost_steps > bound:
        lo, hi = max(rate, 1e-12), max(rate, 1e-12) * 2.0
        while evaluate(inputs, _plan_at(inputs, on, hi)[1]).expected.lost_steps > bound and hi < 1e12 * lo:
            hi *= 2.0
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            if evaluate(inputs, _plan_at(inputs, on, mid)[1]).expected.lost_steps > bound:
                lo = mid
            else:
                hi = mid
        blocks, periods = _plan_at(inputs, on, hi)
        notes.append(f"periods chosen as if failures came {hi / max(rate, 1e-300):.3g}x as often, to keep the steps "
                     f"a failure loses within {bound:g}")
    plan = evaluate(inputs, periods)
    by_name = {name: b for b in blocks for name in b.tiers}
    tiers = tuple(replace(t, first_order_s=by_name[t.name].period_s, bound=by_name[t.name].bound)
                  if t.name in by_name else t for t in plan.tiers)
    off = [t.name for t, o in zip(inputs.tiers, on, strict=True) if not o]
    if off:
        notes.append(f"{', '.join(off)} off")
    return replace(plan, tiers=tiers, blocks=tuple(blocks), notes=tuple(notes))


def choose(inputs: PlanInputs) -> Plan:
    """The periods with the best expected goodput that the constraints allow. Optional tiers (all but the slowest)
    may be off: each combination that fits the host-memory budget is tried, every tier on first (it wins ties)."""
    n = len(inputs.tiers)
    optional = [i for i, t in enumerate(inputs.tiers) if t.optional and i < n - 1]
    best: tuple[tuple[bool, float], Plan] | None = None
    for mask in itertools.product((True, False), repeat=len(optional)):
        on = [True] * n
        for i, keep in zip(optional, mask, strict=True):
            on[i] = keep
        plan = _plan_for(inputs, on)
        key = (plan.feasible, plan.expected.goodput)
        if best is None or key > best[0]:
            best = (key, plan)
    assert best is not None
    return best[1]


__all__ = ["IDLE_MULTIPLE", "MAX_PERIOD_STEPS", "Block", "Expected", "Plan", "TierPlan", "choose", "daly",
           "evaluate", "tier_cap", "tier_floor", "young_daly"]
