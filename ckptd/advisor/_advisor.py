"""The goodput advisor: checkpoint periods and a recovery policy from a job's measured costs.

Why it exists: a team adopting elastic training must choose how often to save (each save stalls, each
failure loses the work since the last usable save), whether to wait for a lost slice or run degraded,
and whether a hot spare pays for itself. This module answers from numbers: it resolves every input
(given, measured from the job's history, or a stated default), starts from the first-order optimum
(Young/Daly: period = sqrt(2 x save cost x MTBF)), confirms it by sweeping the simulator
(``ckptd.advisor._simulator``) under ``pause``, ``resize`` and ``spare``, and recommends the policy with the best
goodput per provisioned chip. ``ckptd advise`` and ``GET /v1/jobs/{job}/advice`` both call ``advise``; the
route passes a ``WorkBudget`` (``ckptd.advisor._budget``) that bounds the simulation's work and wall time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from ckptd.advisor._advice_text import explain
from ckptd.advisor._budget import WorkBudget
from ckptd.advisor._job_history import JobHistory, job_history
from ckptd.advisor._plan import Plan, make_plan
from ckptd.advisor._sim_model import CAUSES, DAY, POLICIES, Policy, Schedule, SimResult
from ckptd.errors import InvalidRequest, MissingInputs, ServiceError
from trainer_client.core.protocol import (
    MAX_MTBF_HOURS,
    MIN_MTBF_HOURS,
    Advice,
    AdviceInput,
    AdviceQuery,
    Badput,
    CheckpointInfo,
    PeriodPoint,
    PolicyAdvice,
    StoredEvent,
)

# Inputs without which there is no answer (one of the two failure-rate fields is required too).
REQUIRED: tuple[str, ...] = (
    "step_time_s", "save_stall_s", "persist_time_s", "restore_time_s", "recovery_time_s", "replace_time_s",
    "slices",
)
FAILURE_RATE = ("mtbf_hours", "failures_per_slice_day")

# Defaults are assumptions, and say so in the answer.
DEFAULTS: dict[str, tuple[float | bool, str]] = {
    "detect_time_s": (60.0, "assumption: a collective or heartbeat timeout at scale"),
    "spare_switch_time_s": (60.0, "assumption: a warm standby slice joins the job (measured from the events of a "
                                  "run with ElasticOptions.spare_slices)"),
    "spares": (1, "assumption: one hot spare slice in the spare policy"),
    "min_slices": (1, "assumption: a resized job runs on any number of slices"),
    "degraded_efficiency": (1.0, "assumption: throughput on k of N slices is exactly k/N"),
    "host_loss_fraction": (0.25, "assumption: a quarter of failures also lose the host-memory snapshot"),
    "persist_overhead_s": (0.0, "assumption: a background persist does not slow the accelerators"),
    "memory_tier": (True, "assumption: host-memory snapshots between persistent saves"),
    "horizon_days": (30.0, "simulated run length (longer when needed for enough failures)"),
    "min_failures": (1000, "simulated failures per sweep point"),
    "seed": (0, "random seed of the simulation"),
}

UNITS: dict[str, str] = {
    "slices": "slices", "chips_per_slice": "chips", "mtbf_hours": "h", "failures_per_slice_day": "1/day",
    "spares": "slices", "min_slices": "slices", "degraded_efficiency": "ratio", "host_loss_fraction": "ratio",
    "memory_tier": "bool", "checkpoint_period_steps": "steps", "horizon_days": "days",
    "min_failures": "failures", "seed": "",
}


# What ``ckptd advise ROOT/JOB`` assumes when the job's history cannot tell (a run that never restored from storage,
# never recovered on the same mesh, never waited for a replacement; the failure rate is never measured): a measured
# neighbour when there is one, else a stated value. The HTTP route assumes none of them (MISSING_INPUT instead).
ASSUMABLE = ("restore_time_s", "recovery_time_s", "replace_time_s", "mtbf_hours")


def assumed_inputs(out: dict[str, AdviceInput]) -> dict[str, AdviceInput]:
    """The ``ASSUMABLE`` inputs that ``out`` lacks, each labelled an assumption and sourced ``derived`` (from a
    measured neighbour) or ``default``."""
    found: dict[str, AdviceInput] = {}

    def put(name: str, value: float, note: str, like: str = "", why: str = "") -> None:
        """``name`` = ``value`` (``note``), or = the input ``like`` when ``out`` has it (``why``)."""
        if name in out:
            return
        derived = like in out
        if derived:
            value, note = float(out[like].value), f"= {like} ({why})"
        else:
            note = f"{value:g} {_unit(name)}, {note}"
        found[name] = AdviceInput(value=value, unit=_unit(name), source="derived" if derived else "default",
                                  note=f"assumption, not in the job's history: {note}")

    put("restore_time_s", 60.0, "to read the state back from storage", "persist_time_s",
        "the bytes written, read back")
    put("recovery_time_s", 60.0, "to recompile and warm up", "resize_recovery_time_s",
        "a recovery on the same mesh costs no more than on a new one")
    put("replace_time_s", 600.0, "until a replacement slice is ready")
    if not any(k in out for k in FAILURE_RATE):
        put("mtbf_hours", 24.0, "between failures (a job's history is too short to measure its failure rate)")
    return found


def missing_inputs(names: list[str]) -> MissingInputs:
    """The error for inputs neither the request nor the job's history gives (``a|b``: either one will do)."""
    words = [" or ".join(n.split("|")) for n in names]
    return MissingInputs(names, "missing advisor inputs (not given, not in the job's history): " + ", ".join(words)
                         + ("; the failure rate is not measured from the history" if "|".join(FAILURE_RATE) in names
                            else ""))


def _unit(name: str) -> str:
    return UNITS.get(name, "s")


def resolve_inputs(query: AdviceQuery, history: JobHistory | None = None, *,
                   assume: bool = False) -> dict[str, AdviceInput]:
    """Every input with its value and source: given > history > derived/default. Raises MissingInputs, for fewer
    inputs with ``assume`` (``assumed_inputs``)."""
    given = query.model_dump(exclude_none=True)
    # Rules between inputs that the query's schema cannot state are given a meaning, never refused (docs/planning.md,
    # "Inputs and their ranges"): with both failure rates the job's MTBF, what the simulation runs on, sets the rate.
    unused_rate = given.pop("failures_per_slice_day") if all(k in given for k in FAILURE_RATE) else None
    out = {k: AdviceInput(value=v, unit=_unit(k), source="given") for k, v in given.items()}
    for name, measured in (history.values() if history else {}).items():
        if name not in out:
            out[name] = AdviceInput(value=measured.value, unit=_unit(name), source="history", note=measured.note)
    for name, (value, note) in DEFAULTS.items():
        out.setdefault(name, AdviceInput(value=value, unit=_unit(name), source="default", note=note))
    if assume:
        out.update(assumed_inputs(out))
    missing = [name for name in REQUIRED if name not in out]
    if not any(k in out for k in FAILURE_RATE):
        missing.append("|".join(FAILURE_RATE))
    if missing:
        raise missing_inputs(missing)

    def derive(name: str, value: float, note: str) -> None:
        out.setdefault(name, AdviceInput(value=value, unit=_unit(name), source="derived", note=note))

    val = {k: float(v.value) for k, v in out.items()}
    slices = val["slices"]
    if val["min_slices"] > slices:  # a resized job never runs on fewer than all of its slices: it never shrinks
        out["min_slices"] = AdviceInput(value=slices, unit=_unit("min_slices"), source="derived",
                                        note=f"{val['min_slices']:g} ({out['min_slices'].source}) is more than the "
                                        f"job's {slices:g} slices: all of them (a resized job never shrinks)")
    if "mtbf_hours" in out:
        derive("failures_per_slice_day", 24.0 / (val["mtbf_hours"] * slices), "24 h / (MTBF x slices)" + (
            f"; the {unused_rate:g} given is not used: mtbf_hours, given too, sets the failure rate"
            if unused_rate is not None else ""))
    else:
        derive("mtbf_hours", 24.0 / (val["failures_per_slice_day"] * slices), "24 h / (rate x slices)")
    mtbf_hours = float(out["mtbf_hours"].value)
    bounded = min(max(mtbf_hours, MIN_MTBF_HOURS), MAX_MTBF_HOURS)
    if bounded != mtbf_hours:  # a rate and a slice count each in range can make a job's MTBF outside it
        was = out["mtbf_hours"]
        out["mtbf_hours"] = AdviceInput(
            value=bounded, unit=_unit("mtbf_hours"), source="derived",
            note=f"{mtbf_hours:.3g} h ({was.note or was.source}) is outside {MIN_MTBF_HOURS * 60:g} min .. "
            f"{MAX_MTBF_HOURS:g} h: advised at the bound")
    derive("memory_restore_time_s", val["save_stall_s"], "assumption: = save stall (same bytes, same link)")
    derive("resize_recovery_time_s", val["recovery_time_s"], "assumption: = recovery time")
    derive("scale_up_time_s", float(out["memory_restore_time_s"].value) + float(out["resize_recovery_time_s"].value),
           "assumption: memory restore + resize recovery")
    return out


def fit_optimum(periods: list[float], goodputs: list[float]) -> float:
    """The period that maximizes goodput: the minimum of badput = a/T + b*T + c fitted by least squares
    around the best simulated point (less noisy than the best point alone); that point if the fit fails."""
    best = int(np.argmax(goodputs))
    lo, hi = max(0, best - 3), min(len(periods), best + 4)
    x = np.asarray(periods[lo:hi], dtype=float)
    y = 1.0 - np.asarray(goodputs[lo:hi], dtype=float)
    if len(x) >= 3:
        a, b, _ = np.linalg.lstsq(np.stack([1.0 / x, x, np.ones_like(x)], axis=1), y, rcond=None)[0]
        if a > 0 and b > 0 and x[0] <= math.sqrt(a / b) <= x[-1]:
            return float(math.sqrt(a / b))
    return float(periods[best])


def _grid(plan: Plan, points: int = 13) -> list[float]:
    """Periods around the first-order optimum, x 1/4 ... x 4, whole steps, no duplicates."""
    half = points // 2
    return sorted({plan.snap(plan.yd.period_s * 2.0 ** (k / (half / 2))) for k in range(-half, half + 1)})


def optimize(plan: Plan, policy: Policy, *, points: int = 13) -> PolicyAdvice:
    """Sweep the save period (then, with a memory tier, the persistent multiple) for one policy."""
    grid = _grid(plan, points)
    runs = [plan.run(policy, plan.schedule(t)) for t in grid]
    sweep = [PeriodPoint(period_s=t, persistent_period_s=plan.schedule(t).persistent_period, goodput=r.goodput)
             for t, r in zip(grid, runs, strict=True)]
    at_yd = runs[grid.index(plan.snap(plan.yd.period_s))].goodput  # the middle of the grid
    best = plan.snap(fit_optimum(grid, [r.goodput for r in runs]))
    schedule = plan.schedule(best)
    if plan.memory_tier:
        first = schedule.multiple
        # (a filter, not a set of range(4 * first): a save stall of 0 makes ``first`` ~1e10, and that set took
        # every byte of memory the host had)
        multiples = sorted(m for m in {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, first} if m <= 4 * first + 1)
        tried = [(plan.run(policy, plan.schedule(best, j)).goodput, -j) for j in multiples]
        schedule = plan.schedule(best, -max(tried)[1])
    final = plan.run(policy, schedule)
    return _policy_advice(plan, policy, schedule, final, at_yd, sweep)


def _policy_advice(plan: Plan, policy: Policy, schedule: Schedule, res: SimResult, at_yd: float,
                   sweep: list[PeriodPoint]) -> PolicyAdvice:
    frac = res.fractions()
    down = sum(res.badput[c] for c in ("detection", "waiting", "restore", "recompile"))
    n = max(1, res.failures)
    provisioned = plan.model.slices + (plan.model.spares if policy == "spare" else 0)
    return PolicyAdvice(
        policy=policy,
        memory_period_s=schedule.memory_period,
        memory_period_steps=plan.steps(schedule.memory_period) if schedule.memory_period else None,
        persistent_period_s=schedule.persistent_period,
        persistent_period_steps=plan.steps(schedule.persistent_period),
        goodput=res.goodput,
        goodput_per_chip=res.goodput * plan.model.slices / provisioned,
        goodput_at_young_daly=at_yd,
        lost_steps_per_failure=res.lost_per_interruption / plan.step,
        lost_seconds_per_failure=res.lost_per_interruption,
        downtime_per_failure_s=down / n,
        failures_simulated=res.failures,
        badput=Badput(**{c: frac[c] for c in CAUSES}),
        sweep=sweep,
    )


def advise(query: AdviceQuery, history: JobHistory | None = None, *, job: str | None = None,
           points: int = 13, budget: WorkBudget | None = None, assume: bool = False) -> Advice:
    """The full answer: inputs, first-order periods, per-policy optimum, recommendation and reasoning.
    ``budget`` bounds the simulation (default: unbounded); what it refuses raises before any run. ``assume``:
    labelled assumptions for what the history cannot tell (``assumed_inputs``)."""
    started = time.perf_counter()
    inputs = resolve_inputs(query, history, assume=assume)
    plan = make_plan(inputs, budget)
    # Runs: per policy the sweep, the persistent multiples (at most 13), the final one; then the current period.
    runs = len(POLICIES) * (len(_grid(plan, points)) + (13 if plan.memory_tier else 0) + 1) + 1
    share = plan.budget.share(runs)  # failures one run may simulate; the horizon is cut to fit it
    asked = plan.horizon
    if share is not None and plan.horizon / plan.mtbf > share:
        plan = dataclasses.replace(plan, horizon=share * plan.mtbf)
    policies = [optimize(plan, policy, points=points) for policy in POLICIES]
    best = max(policies, key=lambda a: a.goodput_per_chip)
    current = None
    if "checkpoint_period_steps" in inputs:  # the job as it runs today: persistent saves only
        period = float(inputs["checkpoint_period_steps"].value) * plan.step
        current = plan.run(best.policy, Schedule(period)).goodput
    reasoning, disagreement = explain(plan, inputs, policies, best, current)
    if plan.horizon < asked:
        reasoning.append(f"Simulated {plan.horizon / DAY:.3g} days per point ({share:.0f} failures), not the "
                         f"{asked / DAY:.3g} asked (min_failures, horizon_days): ckptd simulates at most "
                         f"{plan.budget.max_failures} failures per answer (CKPTD_ADVICE_MAX_FAILURES).")
    if plan.budget.cut_short:
        reasoning.append(f"{plan.budget.cut_short} simulated runs ended early, at twice their share of failures: "
                         "recoveries that failures keep interrupting (detection, restore or recompile close to the "
                         "MTBF) leave such a job hardly training.")
    return Advice(
        job=job, inputs=dict(sorted(inputs.items())), mtbf_hours=plan.mtbf / 3600.0, young_daly=plan.yd,
        policies=policies, recommended=best.policy, reasoning=reasoning, disagreement=disagreement,
        current_period_goodput=current, simulated_days=plan.horizon / DAY,
        compute_seconds=time.perf_counter() - started,
    )


def advice_for_job(job: str, checkpoints: Sequence[CheckpointInfo], query: AdviceQuery, *,
                   events: Sequence[StoredEvent] = (), budget: WorkBudget | None = None) -> Advice:
    """``advise`` for a job: its history (steps and events) fills the gaps. Raises ``MissingInputs``,
    ``InvalidRequest`` for inputs that do not make sense together or need too much work, ``Busy`` past the
    budget's deadline."""
    try:
        return advise(query, job_history(checkpoints, events), job=job, budget=budget)
    except ServiceError:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


__all__ = [
    "ASSUMABLE",
    "DEFAULTS",
    "REQUIRED",
    "advice_for_job",
    "advise",
    "assumed_inputs",
    "fit_optimum",
    "missing_inputs",
    "optimize",
    "resolve_inputs",
]
