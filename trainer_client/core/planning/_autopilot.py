"""The live choice of every tier's period: the period model re-run as costs and failures are measured, and a new
choice put in force only when it is worth the change.

Why it exists: the runner measures each tier's costs as it saves and sees each failure as it recovers; the best
periods move with both. Recomputing them is cheap (``choose`` is closed-form arithmetic), but changing a period
is not free (a pacer's measurements start again, the operator sees the run change its mind) and first-order
estimates are noisy. So the choice has hysteresis: the periods in force are re-evaluated on the new inputs, and
replaced only when the best choice is expected to gain more than ``min_gain`` of goodput (0.1 point by default) or
when the periods in force break a constraint (a copy no longer fits its period by more than ``FLOOR_MARGIN``, a
bound on steps lost). A tier's floor (its copy's time, the pacer's period, a storage limit) moves with how busy the
machine is, and the model prices a period just under its floor as a loop that waits for the copy, so a floor
jittering across a period's step claimed a large gain each way: the floor the model is given is the highest
measured (in steps) over the last ``FLOOR_WINDOW`` decisions, within the tier's upper bound. A floor that rises is
followed at once, one that falls after ``FLOOR_WINDOW`` decisions. Each
decision carries its inputs and the expected goodput before and after, for the event that reports it. jax-free:
the runner calls it at step boundaries, the trace harness (bench/autopilot.py) replays failure traces through it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from trainer_client.core.planning._failures import FailureEstimate, FailureHistory
from trainer_client.core.planning._inputs import Constraints, PlanInputs, TierCosts
from trainer_client.core.planning._periods import Plan, choose, evaluate, tier_cap, tier_floor

DEFAULT_MIN_GAIN = 0.001  # expected goodput (a fraction): 0.1 point
# how far below its floor (a copy's time, the pacer's period, a storage limit) a period in force may fall before it
# counts as broken: a period chosen at its floor flipped with a step time that moved a few percent
FLOOR_MARGIN = 0.1
# how many decisions a tier's floor is held for: the model is given the highest floor measured (in steps) over the
# last this many decisions, so a floor that moves with the machine's load does not move the period back and forth
# (a floor 1% over a period priced the wait for the copy as loop time: +0.66 point to lengthen it, then +0.36 to
# shorten it again when the floor was 1.5% under); a floor that rises is followed at once
FLOOR_WINDOW = 8


@dataclass(frozen=True)
class Decision:
    """One decision: the plan in force after it (``plan``), the model's best for these inputs (``best``), the
    periods in force before evaluated on the same inputs (``before``; None at the first decision)."""

    plan: Plan
    best: Plan
    before: Plan | None
    changed: bool
    reason: str
    inputs: PlanInputs
    failures: FailureEstimate

    @property
    def goodput_before(self) -> float | None:
        return None if self.before is None else self.before.expected.goodput

    @property
    def goodput_after(self) -> float:
        return self.plan.expected.goodput

    def describe(self) -> str:
        was = f" (was {self.before.describe()})" if self.before is not None and self.changed else ""
        return f"{self.plan.describe()}{was}: {self.reason}; {self.failures.describe()}"

    def fields(self) -> dict[str, object]:
        """The decision as flat event fields: its periods, its inputs (the constraints in force among them) and the
        expected goodput before and after."""
        limits = self.inputs.constraints
        out: dict[str, object] = {
            "autopilot_changed": self.changed,
            "autopilot_reason": self.reason,
            "autopilot_goodput_before": None if self.goodput_before is None else round(self.goodput_before, 5),
            "autopilot_goodput_after": round(self.goodput_after, 5),
            "autopilot_mtbf_s": round(self.inputs.mtbf_s, 1),
            "autopilot_mtbf_source": self.failures.source,
            "autopilot_failures_seen": self.failures.failures,
            "autopilot_step_s": self.inputs.step_s,
            "autopilot_lost_steps": round(self.plan.expected.lost_steps, 2),
            # the constraints in force (None: no limit)
            "autopilot_max_lost_steps": limits.max_lost_steps,
            "autopilot_host_memory_bytes": limits.host_memory_bytes,
            "autopilot_storage_bytes_per_s": limits.storage_Bps,
            "autopilot_storage_requests_per_s": limits.storage_requests_per_s,
        }
        for tier, costs in zip(self.plan.tiers, self.inputs.tiers, strict=True):
            out[f"autopilot_{tier.name}_period"] = tier.period_steps
            out[f"autopilot_{tier.name}_block_s"] = round(costs.block_s, 4)
            out[f"autopilot_{tier.name}_copy_s"] = round(costs.copy_s, 4)
            out[f"autopilot_{tier.name}_recovery_s"] = round(costs.recovery_s, 4)
            out[f"autopilot_{tier.name}_survives"] = round(costs.survives, 4)
            out[f"autopilot_{tier.name}_host_bytes"] = costs.host_bytes
            out[f"autopilot_{tier.name}_write_bytes"] = costs.write_bytes
            out[f"autopilot_{tier.name}_requests"] = costs.requests
            out[f"autopilot_{tier.name}_bound"] = tier.bound  # None: Young/Daly's, or the periods kept
        return out


class Autopilot:
    """Holds the periods in force; ``decide`` re-chooses them from the latest costs and the failure estimate of
    ``history`` (which the caller keeps up to date: ``ran``, ``failed``)."""

    def __init__(self, history: FailureHistory, *, min_gain: float = DEFAULT_MIN_GAIN) -> None:
        if not min_gain >= 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain!r}")
        self.history = history
        self.min_gain = min_gain
        self.current: Plan | None = None
        # per decision, per tier: its floor in steps and what set it (the last FLOOR_WINDOW decisions)
        self._floors: deque[tuple[tuple[float, str | None], ...]] = deque(maxlen=FLOOR_WINDOW)
        self._floor_names: tuple[str, ...] = ()

    @property
    def periods(self) -> tuple[int | None, ...] | None:
        return None if self.current is None else self.current.periods

    def inputs(self, step_s: float, tiers: Sequence[TierCosts], *, detect_s: float = 0.0,
               constraints: Constraints | None = None) -> tuple[PlanInputs, FailureEstimate]:
        """The model's inputs: the costs given, the MTBF and the shares of failures by tier from ``history``
        (where the prior gives shares; else each tier's own ``survives``)."""
        estimate = self.history.estimate()
        survives = estimate.survives
        if survives is not None:
            if len(survives) != len(tiers):
                raise ValueError(f"the prior has shares for {len(survives)} tiers, the costs {len(tiers)}")
            tiers = [replace(t, survives=s) for t, s in zip(tiers, survives, strict=True)]
        return PlanInputs(step_s=step_s, tiers=tuple(tiers), mtbf_s=estimate.mtbf_s, detect_s=detect_s,
                          constraints=constraints or Constraints()), estimate

    def held_floors(self, inputs: PlanInputs) -> PlanInputs:
        """``inputs`` with each tier's floor raised to the highest measured (in steps) over the last
        ``FLOOR_WINDOW`` decisions, this one's among them, but not over the tier's upper bound: the floor's noise
        held off. A floor measured now is never lowered, so a period far under it is still a broken constraint."""
        names = tuple(t.name for t in inputs.tiers)
        if names != self._floor_names:
            self._floors.clear()
            self._floor_names = names
        step = inputs.step_s
        now = tuple((floor / step, why) for floor, why in (tier_floor(inputs, i) for i in range(len(names))))
        self._floors.append(now)
        tiers = list(inputs.tiers)
        for i, (steps, _) in enumerate(now):
            held, why = max((f[i] for f in self._floors), key=lambda f: f[0])
            held = min(held, tier_cap(inputs, i) / step)
            if held > steps * (1 + 1e-9) and math.isfinite(held):
                t = tiers[i]
                tiers[i] = replace(t, min_period_s=max(t.min_period_s, held * step), min_reason=why or t.min_reason)
        return replace(inputs, tiers=tuple(tiers))

    def decide(self, step_s: float, tiers: Sequence[TierCosts], *, detect_s: float = 0.0,
               constraints: Constraints | None = None) -> Decision:
        """Choose again, on the floors held (``held_floors``); the periods in force change only when the best is
        worth ``min_gain`` more, or when they break a constraint the best does not."""
        inputs, estimate = self.inputs(step_s, tiers, detect_s=detect_s, constraints=constraints)
        inputs = self.held_floors(inputs)
        best = choose(inputs)
        before = None if self.current is None else evaluate(inputs, self.current.periods, floor_margin=FLOOR_MARGIN)
        if before is None:
            changed, reason = True, "the first choice"
        elif best.periods == before.periods:
            changed, reason = False, "the best periods are the ones in force"
        elif before.problems and (best.feasible or len(best.problems) < len(before.problems)):
            changed, reason = True, "the periods in force break a constraint: " + "; ".join(before.problems)
        else:
            gain = best.expected.goodput - before.expected.goodput
            changed = gain > self.min_gain
            reason = (f"{'+' if gain >= 0 else ''}{100 * gain:.2f} points of expected goodput "
                      f"({'more' if changed else 'not more'} than the {100 * self.min_gain:.2g} a change needs)")
        if changed:
            self.current = best
        plan = best if changed or before is None else replace(before, blocks=best.blocks)
        return Decision(plan=plan, best=best, before=before, changed=changed, reason=reason, inputs=inputs,
                        failures=estimate)


__all__ = ["DEFAULT_MIN_GAIN", "FLOOR_MARGIN", "FLOOR_WINDOW", "Autopilot", "Decision"]
