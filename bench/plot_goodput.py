"""The plots and numbers of docs/planning.md: goodput against checkpoint period, per recovery policy.

Runs the advisor (ckptd.advisor._advisor) for a 16,384-chip job at two published failure rates -- Llama 3's
pre-training (419 unexpected interruptions in 54 days on 16,384 GPUs) and Meta's cluster study (mean time
to failure 1.8 h at 16,384 GPUs) -- writes the PNGs under docs/img/ and prints the tables the document
quotes. Costs measured by ckptd on this machine are in MEASURED; the large-job costs in LARGE_JOB are
assumptions (docs/planning.md says why each). Usage:

    .venv/bin/python bench/plot_goodput.py [--out docs/img] [--failures 3000] [--points 17]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ckptd.advisor._advice_text import dur, pct, period_of
from ckptd.advisor._advisor import advise, resolve_inputs
from ckptd.advisor._plan import make_plan
from ckptd.advisor._sim_model import POLICIES
from trainer_client.core.protocol import Advice, AdviceQuery

# Measured by ckptd here (2 GiB state, 8 fake CPU devices; docs/planning.md, `make demo`).
MEASURED: dict[str, float] = {
    "save_stall_s": 0.010,  # async save(): time the loop is blocked
    "persist_time_s": 3.42,  # save until committed, zstd-1
    "restore_time_s": 2.98,  # restore, cold
    "recovery_time_s": 0.23,  # demo: regrow to the original mesh with a warm compile cache
    "resize_recovery_time_s": 1.56,  # demo: failure handled to first step on the smaller mesh
    "scale_up_time_s": 0.23,
}

# A 16,384-chip job as 64 slices of 256 chips; every time here is an assumption for that scale.
LARGE_JOB: dict[str, Any] = {
    "slices": 64,
    "chips_per_slice": 256,
    "step_time_s": 6.0,
    "save_stall_s": 2.0,
    "persist_time_s": 30.0,
    "restore_time_s": 60.0,
    "recovery_time_s": 60.0,
    "resize_recovery_time_s": 180.0,
    "scale_up_time_s": 60.0,
    "detect_time_s": 60.0,
    "replace_time_s": 1800.0,
    "spare_switch_time_s": 60.0,
}

RATES: dict[str, tuple[str, float]] = {
    "llama3": ("Llama 3: 419 interruptions in 54 days on 16,384 GPUs", 54 * 24 / 419),
    "meta": ("Meta cluster study: MTTF 1.8 h at 16,384 GPUs", 1.8),
}
COLORS = {"pause": "tab:red", "resize": "tab:blue", "spare": "tab:green"}


def plot_periods(advice: Advice, title: str, path: Path) -> None:
    """Goodput against the save period, one curve per policy, the optimum starred, Young/Daly dashed."""
    fig, ax = plt.subplots(figsize=(11, 5.0), dpi=110)
    for a in advice.policies:
        xs = [pt.period_s / 60 for pt in a.sweep]
        ax.plot(xs, [100 * pt.goodput for pt in a.sweep], marker="o", ms=4, color=COLORS[a.policy],
                label=f"{a.policy}: best {pct(a.goodput)} every {a.memory_period_steps or a.persistent_period_steps}"
                      " steps")
        if a.policy == "spare":
            share = a.goodput_per_chip / a.goodput
            ax.plot(xs, [100 * pt.goodput * share for pt in a.sweep], ls=":", color=COLORS[a.policy],
                    label=f"spare per provisioned chip: best {pct(a.goodput_per_chip)}")
        ax.plot([period_of(a) / 60], [100 * a.goodput], marker="*", ms=15, color=COLORS[a.policy], mec="black")
    yd = advice.young_daly.period_s
    ax.axvline(yd / 60, ls="--", color="grey", label=f"Young/Daly: {dur(yd)}")
    _minutes_axis(ax, [pt.period_s / 60 for a in advice.policies for pt in a.sweep])
    ax.set_xlabel(f"checkpoint period (minutes, log scale; 1 step = {dur(float(advice.inputs['step_time_s'].value))})")
    ax.set_ylabel("goodput (% of wall time training)")
    ax.set_title(f"{title}\nMTBF {dur(advice.mtbf_hours * 3600)}, 64 slices x 256 chips, slice back after "
                 f"{dur(float(advice.inputs['replace_time_s'].value))}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _minutes_axis(ax: Any, values: list[float]) -> None:
    """A log axis in minutes with plain-number ticks (0.5, 1, 2, 5, ...) over the range of ``values``."""
    ax.set_xscale("log")
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 240, 480)
             if min(values) * 0.9 <= t <= max(values) * 1.1]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def replace_time_curve(mtbf_hours: float, replace_times: list[float], failures: int) -> dict[str, list[float]]:
    """Goodput per provisioned chip at the Young/Daly period, per policy, against the replacement time."""
    out: dict[str, list[float]] = {pol: [] for pol in POLICIES}
    for replace in replace_times:
        q = AdviceQuery(**{**LARGE_JOB, "replace_time_s": replace, "mtbf_hours": mtbf_hours,
                           "min_failures": failures})
        plan = make_plan(resolve_inputs(q))
        for pol in POLICIES:
            res = plan.run(pol, plan.schedule(plan.snap(plan.yd.period_s)))
            spares = plan.model.spares if pol == "spare" else 0
            out[pol].append(res.goodput * plan.model.slices / (plan.model.slices + spares))
    return out


def plot_replace_time(curves: dict[str, dict[str, list[float]]], replace_times: list[float], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), dpi=110, sharey=True)
    for ax, (key, per_policy) in zip(axes, curves.items(), strict=True):
        for pol, ys in per_policy.items():
            ax.plot([r / 60 for r in replace_times], [100 * y for y in ys], marker="o", color=COLORS[pol],
                    label=pol + (" (per provisioned chip)" if pol == "spare" else ""))
        _minutes_axis(ax, [r / 60 for r in replace_times])
        ax.set_title(f"{RATES[key][0]}\nMTBF {dur(RATES[key][1] * 3600)}", fontsize=9)
        ax.set_xlabel("time to get a slice back (minutes, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("goodput (%) at the Young/Daly period")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def policy_map(mtbf_hours: float, replaces: list[float], recompiles: list[float], failures: int) -> str:
    """Which policy has the best goodput per provisioned chip (at the Young/Daly period), as a table."""
    rows = ["| resize recompile \\ slice back after | " + " | ".join(dur(r) for r in replaces) + " |",
            "|---" * (1 + len(replaces)) + "|"]
    for recompile in recompiles:
        cells = []
        for replace in replaces:
            q = AdviceQuery(**{**LARGE_JOB, "replace_time_s": replace, "resize_recovery_time_s": recompile,
                               "mtbf_hours": mtbf_hours, "min_failures": failures})
            plan = make_plan(resolve_inputs(q))
            scores = {}
            for pol in POLICIES:
                res = plan.run(pol, plan.schedule(plan.snap(plan.yd.period_s)))
                spares = plan.model.spares if pol == "spare" else 0
                scores[pol] = res.goodput * plan.model.slices / (plan.model.slices + spares)
            best = max(scores, key=lambda k: scores[k])
            cells.append(f"{best} {pct(scores[best])}")
        rows.append(f"| {dur(recompile)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table(advice: Advice) -> str:
    rows = ["| policy | goodput | per provisioned chip | save every | lost steps / failure | down / failure | "
            "biggest losses |", "|---|---|---|---|---|---|---|"]
    from ckptd.advisor._advice_text import top_losses

    for a in advice.policies:
        rows.append(f"| {a.policy} | {pct(a.goodput)} | {pct(a.goodput_per_chip)} | "
                    f"{a.memory_period_steps or a.persistent_period_steps} steps ({dur(period_of(a))}) | "
                    f"{a.lost_steps_per_failure:.1f} | {dur(a.downtime_per_failure_s)} | {top_losses(a, 3)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--failures", type=int, default=3000, help="simulated failures per point")
    parser.add_argument("--points", type=int, default=17)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key, (title, mtbf_hours) in RATES.items():
        for label, costs in (("large job (assumed costs)", {}), ("costs measured here", MEASURED)):
            started = time.perf_counter()
            q = AdviceQuery(**{**LARGE_JOB, **costs, "mtbf_hours": mtbf_hours, "min_failures": args.failures,
                               "horizon_days": 54})
            advice = advise(q, points=args.points)
            print(f"\n## {title} -- {label} ({time.perf_counter() - started:.1f} s)\n")
            print(f"Young/Daly {dur(advice.young_daly.period_s)} (Daly {dur(advice.young_daly.daly_period_s)}), "
                  f"recommended: {advice.recommended}, {advice.simulated_days:.0f} simulated days per point\n")
            print(table(advice))
            print()
            for line in advice.reasoning + advice.disagreement:
                print(f"- {line}")
            if not costs:
                plot_periods(advice, title, out / f"goodput_{key}.png")
    replace_times = [300.0, 900.0, 1800.0, 3600.0, 7200.0, 4 * 3600.0, 8 * 3600.0]
    curves = {key: replace_time_curve(mtbf, replace_times, args.failures) for key, (_, mtbf) in RATES.items()}
    plot_replace_time(curves, replace_times, out / "goodput_vs_replace_time.png")
    print("\n## goodput per provisioned chip at the Young/Daly period against the time to get a slice back\n")
    print("| replace | " + " | ".join(f"{k} {pol}" for k in curves for pol in POLICIES) + " |")
    print("|---" * (1 + len(curves) * len(POLICIES)) + "|")
    for i, r in enumerate(replace_times):
        print(f"| {dur(r)} | " + " | ".join(pct(curves[k][pol][i]) for k in curves for pol in POLICIES) + " |")
    print("\n## best policy at the Meta rate (MTBF 1.8 h), by resize recompile time and time to get a slice back\n")
    print(policy_map(1.8, [300.0, 900.0, 1800.0, 3600.0], [60.0, 180.0, 600.0, 1800.0], args.failures))


if __name__ == "__main__":
    main()
