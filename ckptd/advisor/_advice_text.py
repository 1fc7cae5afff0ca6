"""The advisor's words: the reasoning behind an ``Advice`` and its plain-text rendering for ``ckptd advise``.

Kept apart from ``ckptd.advisor._advisor`` so the numbers (sweeps, fits) and the prose that explains them can each
be read on their own; both read the sweeps' set-up (``ckptd.advisor._plan``). Every sentence quotes the numbers
it rests on.
"""

from __future__ import annotations

import math

from ckptd.advisor._plan import Plan
from trainer_client.core.protocol import Advice, AdviceInput, AdvicePolicy, PolicyAdvice

_CAUSE_WORDS = {
    "checkpoint": "save stalls", "detection": "detection", "waiting": "waiting for slices", "restore": "restores",
    "recompile": "recompiles", "lost": "lost work", "degraded": "degraded running", "scale_up": "regrowing",
}
AGREE_WITHIN = 0.10  # relative difference of the periods below which Young/Daly and the simulation agree


def dur(seconds: float) -> str:
    """A duration in the unit a person would use."""
    if seconds < 90:
        return f"{seconds:.3g} s"
    if seconds < 5400:
        return f"{seconds / 60:.3g} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} days"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def period_of(advice: PolicyAdvice) -> float:
    """The period of every save: the memory period with a memory tier, else the persistent one."""
    return advice.memory_period_s if advice.memory_period_s is not None else advice.persistent_period_s


def top_losses(advice: PolicyAdvice, n: int = 2) -> str:
    causes = sorted(advice.badput.model_dump().items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{_CAUSE_WORDS[c]} {pct(x)}" for c, x in causes if x > 0) or "none"


def _schedule_words(plan: Plan, a: PolicyAdvice) -> str:
    if a.memory_period_s is None:
        return f"saves every {a.persistent_period_steps} steps ({dur(a.persistent_period_s)})"
    if a.memory_period_steps == a.persistent_period_steps:
        return f"saves every {a.persistent_period_steps} steps ({dur(a.persistent_period_s)}), each persisted"
    return (f"memory snapshots every {a.memory_period_steps} steps ({dur(a.memory_period_s)}), persisted every "
            f"{a.persistent_period_steps} steps ({dur(a.persistent_period_s)})")


def _why(plan: Plan, by: dict[AdvicePolicy, PolicyAdvice], best: PolicyAdvice) -> str:
    m = plan.model
    n = m.slices
    pause, resize, spare = by["pause"], by["resize"], by["spare"]
    resize_cost = resize.badput.recompile + resize.badput.scale_up
    if best.policy == "resize":
        return (f"Resize, because replacing a slice takes {dur(m.replace_time)} ({m.replace_time / plan.mtbf:.0%} "
                f"of the MTBF): pause idles all {n} slices that long on every failure ({pct(pause.badput.waiting)} "
                f"of the wall time), while resize keeps training on {n - 1} of {n} slices "
                f"({pct(m.rate(n - 1))} throughput, {pct(resize.badput.degraded)} lost to degraded running) and "
                f"pays {dur(m.resize_recovery)} + {dur(m.scale_up)} of recompiles per failure ({pct(resize_cost)}).")
    if best.policy == "pause":
        return (f"Pause, because running on {n - 1} of {n} slices keeps only {pct(m.rate(n - 1))} of the "
                f"throughput and resizing costs {dur(m.resize_recovery)} + {dur(m.scale_up)} of recompiles per "
                f"failure ({pct(resize.badput.degraded + resize_cost)} of the wall time in all), more than waiting "
                f"{dur(m.replace_time)} for the replacement ({pct(pause.badput.waiting)}).")
    return (f"A hot spare, because it turns the {dur(m.replace_time)} wait for a replacement into a "
            f"{dur(m.spare_switch_time)} switch ({pct(spare.badput.waiting)} of the wall time waiting instead of "
            f"{pct(pause.badput.waiting)} under pause) and avoids resize's recompiles ({pct(resize_cost)}); the "
            f"{m.spares} spare slice(s) cost {pct(m.spares / (n + m.spares))} of the provisioned chips, already "
            f"counted in goodput per provisioned chip ({pct(spare.goodput_per_chip)}).")


def disagrees(plan: Plan, a: PolicyAdvice) -> bool:
    """True when the simulated optimum period is more than AGREE_WITHIN away from Young/Daly (in whole steps)."""
    return abs(period_of(a) / plan.snap(plan.yd.period_s) - 1.0) > AGREE_WITHIN


def _disagreement(plan: Plan, policies: list[PolicyAdvice]) -> list[str]:
    """For each policy whose optimum is off Young/Daly: by how much and why; then the reasons they share."""
    yd, m = plan.yd, plan.model
    off = [a for a in policies if disagrees(plan, a)]
    if not off:
        return []
    out: list[str] = []
    for a in off:
        out.append(f"Under {a.policy} the simulated optimum ({dur(period_of(a))}) differs from Young/Daly "
                   f"({dur(yd.period_s)}) by {period_of(a) / yd.period_s - 1.0:+.0%}.")
        if a.policy == "resize" and a.badput.degraded > 0.01:
            out.append("While running degraded a period of N steps takes longer in wall time and fewer slices can "
                       "fail, so the failure rate per period differs from the full-speed MTBF.")
        noise = period_of(a) / (math.sqrt(12.0 * max(1, a.failures_simulated)) * plan.mtbf)
        if abs(a.goodput - a.goodput_at_young_daly) <= max(0.002, 3 * noise):
            out.append(f"Its goodput curve is flat near the maximum: {pct(a.goodput_at_young_daly)} at the "
                       f"Young/Daly period against {pct(a.goodput)} at the simulated optimum, within the "
                       f"simulation's noise (about {100 * noise:.2g}%); either period is fine.")
    mtbf = plan.rollback_mtbf
    shared = []
    if yd.period_s < plan.step:
        shared.append(f"The first-order period is shorter than one step ({dur(plan.step)}): saves happen only at "
                      "step boundaries.")
    elif plan.steps(yd.period_s) <= 10:
        shared.append(f"The period is only {plan.steps(yd.period_s)} steps of {dur(plan.step)}: one step more or "
                      "less already moves it by more than 10%.")
    if yd.period_s / mtbf > 0.05 or yd.daly_period_s / yd.period_s - 1.0 > 0.03:
        shared.append(f"Failures are frequent relative to the save cost: the period is {yd.period_s / mtbf:.0%} "
                      f"of the MTBF ({dur(mtbf)}), whereas Young/Daly assumes at most one failure per period; "
                      f"Daly's higher-order estimate is {dur(yd.daly_period_s)}.")
    if not plan.memory_tier and m.persist_time > 0.5 * yd.period_s:
        shared.append(f"A save cannot start before the previous one is persisted ({dur(m.persist_time)}), and a "
                      "failure before the persist finishes falls back one more period: short periods cost more "
                      "than the first-order formula counts.")
    if not shared and len(out) == len(off):
        shared.append("Effects outside the first-order formula (saves cut by failures, failures during recovery, "
                      "recovery from the persistent tier) move the optimum.")
    return out + shared


def explain(plan: Plan, inputs: dict[str, AdviceInput], policies: list[PolicyAdvice], best: PolicyAdvice,
            current: float | None) -> tuple[list[str], list[str]]:
    """The reasoning (plain sentences with their numbers) and the Young/Daly disagreement, if any."""
    m, yd = plan.model, plan.yd
    by = {a.policy: a for a in policies}
    chips = inputs.get("chips_per_slice")
    chip_words = f" of {float(chips.value):g} chips" if chips else ""
    sources = [x.source for x in inputs.values()]
    out = [
        f"The job fails every {dur(plan.mtbf)} on average ({m.slices} slices{chip_words}, "
        f"{float(inputs['failures_per_slice_day'].value):.3g} failures per slice-day).",
        f"Inputs: {sources.count('given')} given, {sources.count('history')} from the job's history, "
        f"{sources.count('derived')} derived and {sources.count('default')} defaults (assumptions; see inputs).",
    ]
    if plan.split_tiers:
        out.append(
            f"Young/Daly: snapshot host memory every sqrt(2 x {dur(m.save_stall)} stall x "
            f"{dur(plan.mtbf / (1 - m.host_loss_fraction))} between failures that keep host memory) = "
            f"{dur(yd.period_s)} ({plan.steps(yd.period_s)} steps of {dur(plan.step)}); persist every "
            f"{dur(yd.persistent_period_s or 0.0)} (a persist takes {dur(m.persist_time)} and steals "
            f"{dur(m.persist_overhead)} of training; {pct(m.host_loss_fraction)} of failures fall back to it).")
    else:
        out.append(
            f"Young/Daly: save every sqrt(2 x {dur(yd.save_cost_s)} x {dur(plan.mtbf)}) = {dur(yd.period_s)} "
            f"({plan.steps(yd.period_s)} steps of {dur(plan.step)}); Daly's higher-order estimate "
            f"{dur(yd.daly_period_s)}."
            + (f" Every snapshot is also persisted: a persist ({dur(m.persist_time)}) fits in a period and steals "
               f"{dur(m.persist_overhead)} of training." if plan.memory_tier else ""))
    for a in policies:
        out.append(
            f"{a.policy}: goodput {pct(a.goodput)} (per provisioned chip {pct(a.goodput_per_chip)}) with "
            f"{_schedule_words(plan, a)}; a failure loses {a.lost_steps_per_failure:.1f} steps and stops training "
            f"for {dur(a.downtime_per_failure_s)} on average; biggest losses: {top_losses(a)}.")
    out.append(_why(plan, by, best))
    ranked = sorted(policies, key=lambda a: -a.goodput_per_chip)
    if ranked[0].goodput_per_chip - ranked[1].goodput_per_chip < 0.002:
        out.append(f"{ranked[0].policy} and {ranked[1].policy} are within 0.2 points of each other: choose by "
                   "operational preference.")
    disagreement = _disagreement(plan, policies)
    if disagreement:
        out.append("The simulated optimum period differs from Young/Daly under "
                   + ", ".join(a.policy for a in policies if disagrees(plan, a)) + "; see disagreement.")
    else:
        snapped = "" if plan.snap(yd.period_s) == yd.period_s else f", {plan.steps(yd.period_s)} whole steps"
        out.append(f"The simulated optimum ({dur(period_of(best))} under {best.policy}) is within "
                   f"{AGREE_WITHIN:.0%} of Young/Daly ({dur(yd.period_s)}{snapped}) under every policy: the "
                   "first-order formula holds here.")
    if current is not None:
        steps = float(inputs["checkpoint_period_steps"].value)
        out.append(f"At the job's current period of {steps:g} steps (persistent saves only) goodput would be "
                   f"{pct(current)} under {best.policy}, against {pct(best.goodput)} with the schedule above.")
    return out, disagreement


def render(advice: Advice) -> str:
    """The answer as a person reads it in a terminal."""
    lines = [
        f"job          {advice.job or '(no job: given values only)'}",
        f"MTBF         {dur(advice.mtbf_hours * 3600)}",
        f"Young/Daly   every {dur(advice.young_daly.period_s)}"
        + (f", persist every {dur(advice.young_daly.persistent_period_s)}"
           if advice.young_daly.persistent_period_s else "")
        + f" (Daly: {dur(advice.young_daly.daly_period_s)})",
        "",
        f"{'POLICY':<8} {'GOODPUT':>8} {'PER-CHIP':>9} {'SAVE EVERY':>12} {'PERSIST EVERY':>14} "
        f"{'LOST/FAIL':>10} {'DOWN/FAIL':>10}  BIGGEST LOSSES",
    ]
    for a in advice.policies:
        save = f"{a.memory_period_steps or a.persistent_period_steps} steps"
        lines.append(
            f"{a.policy:<8} {pct(a.goodput):>8} {pct(a.goodput_per_chip):>9} {save:>12} "
            f"{str(a.persistent_period_steps) + ' steps':>14} {a.lost_steps_per_failure:>6.1f} st "
            f"{dur(a.downtime_per_failure_s):>10}  {top_losses(a)}")
    lines += ["", f"recommended: {advice.recommended}", ""]
    lines += [f"- {r}" for r in advice.reasoning]
    if advice.disagreement:
        lines += ["", "Young/Daly vs simulation:"] + [f"- {r}" for r in advice.disagreement]
    lines += ["", f"{'INPUT':<24} {'VALUE':>10} {'UNIT':<8} {'SOURCE':<8} NOTE"]
    for name, x in advice.inputs.items():
        value = str(x.value) if isinstance(x.value, bool) else f"{x.value:.4g}"
        lines.append(f"{name:<24} {value:>10} {x.unit:<8} {x.source:<8} {x.note}")
    lines.append(f"\nsimulated {advice.simulated_days:.0f} days per point in {advice.compute_seconds:.1f} s")
    return "\n".join(lines)


__all__ = ["AGREE_WITHIN", "disagrees", "dur", "explain", "pct", "period_of", "render", "top_losses"]
