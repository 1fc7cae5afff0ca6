"""The autopilot against fixed periods on failure traces: goodput of each strategy on the same traces, through the
real decision code (trainer_client.core.planning) and the costs `make bench` measured (bench/autopilot_costs.py).

Why it exists: "the autopilot chooses better periods" is a claim about runs, and runs with failures take weeks. The
harness replays four traces (bench/autopilot_traces.py: steady, falling MTBF, bursts, a slow storage day) through a
run model (bench/autopilot_sim.py) in seconds, and reports goodput for:

* ``autopilot``: ``Autopilot`` over the ckptd tiers (replica snapshots, shared memory, storage persisted from it),
  starting from a prior of a 12 h MTBF and shares of failures that are not the trace's, and re-choosing after every
  recovery and every 10 minutes from the costs it measured and the failures it saw;
* ``oracle``: the best fixed periods for that trace over the same tiers, found in hindsight by a search over the
  periods (coordinate descent on a geometric grid, coarse to fine);
* ``advise once``: the model's choice from the prior, kept fixed (what ``ckptd advise`` before the run would say);
* ``MaxText``: MaxText's defaults: an async Orbax save to storage every 10,000 steps, no local tier
  (``checkpoint_period: 10_000``, ``enable_emergency_checkpoint: False``, ``local_checkpoint_period: 0`` in
  src/MaxText/configs/base.yml of AI-Hypercomputer/maxtext at 003b41698f6eca8280cd600919dc6e5a65686ece);
* ``continuous``: MaxText with ``enable_continuous_checkpointing: True`` (Orbax's ContinuousCheckpointingPolicy:
  the next save starts as soon as the last one finished), to storage, no local tier.

Usage: ``.venv/bin/python -m bench.autopilot [--days 14] [--seed 0] [--trace NAME ...] [--json PATH]``. It prints the
costs and their sources, a markdown table (docs/planning.md quotes it) and whether the targets hold: the autopilot
within 1 point of the oracle on every trace, and ahead of both MaxText strategies on the traces whose MTBF changes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.autopilot_costs import DETECT_S, KEYS, Profile, load
from bench.autopilot_sim import Periods, World, simulate
from bench.autopilot_traces import HOUR, Trace, traces
from trainer_client.core.planning import Autopilot, FailureHistory, FailurePrior, PlanInputs, choose

PRIOR = FailurePrior(mtbf_s=12 * HOUR, weight=1.0, shares=(0.5, 0.3, 0.2))
MAXTEXT_CHECKPOINT_PERIOD = 10_000
CHANGING = ("falling", "bursts")  # the traces whose MTBF changes
WITHIN = 0.01  # the autopilot's target: within 1 point of the oracle
STRATEGIES = ("autopilot", "oracle", "advise once", "MaxText", "continuous")


class Fixed:
    ticks = False

    def __init__(self, name: str, periods: Periods) -> None:
        self.name, self.periods = name, periods

    def start(self, world: World) -> Periods:
        return self.periods

    def decide(self, t: float, world: World, periods: Periods, failures: Sequence[tuple[float, int]]) -> Periods:
        return self.periods


class Continuous:
    """Every tier saves as soon as its last save finished: its period the measured copy time, in whole steps."""

    name, ticks = "continuous", True

    def start(self, world: World) -> Periods:
        return self._periods(world, world.measured(0.0, None))

    def decide(self, t: float, world: World, periods: Periods, failures: Sequence[tuple[float, int]]) -> Periods:
        return self._periods(world, world.measured(t, periods))

    @staticmethod
    def _periods(world: World, costs: Sequence[Any]) -> Periods:
        return tuple(max(1, math.ceil(c.copy_s / world.step_s)) for c in costs)


class Pilot:
    """The autopilot as the runner would drive it: the running time and each failure (the fastest tier that
    survived it) go to its ``FailureHistory``; it decides from the costs measured so far."""

    name, ticks = "autopilot", True

    def __init__(self, prior: FailurePrior = PRIOR) -> None:
        self.prior = prior
        self.decisions = 0

    def start(self, world: World) -> Periods:
        self.history = FailureHistory(self.prior)
        self.pilot = Autopilot(self.history)
        self.last = 0.0
        return self._decide(world, world.measured(0.0, None))

    def decide(self, t: float, world: World, periods: Periods, failures: Sequence[tuple[float, int]]) -> Periods:
        for when, cls in failures:
            self.history.ran(when - self.last)
            self.history.failed(cls)
            self.last = when
        self.history.ran(t - self.last)
        self.last = t
        return self._decide(world, world.measured(t, periods))

    def _decide(self, world: World, costs: Sequence[Any]) -> Periods:
        self.decisions += 1
        return self.pilot.decide(world.step_s, costs, detect_s=world.detect_s).plan.periods


def worlds(profile: Profile, trace: Trace) -> tuple[World, World]:
    """The ckptd run (three tiers) and the MaxText run (storage alone) facing ``trace``."""
    ckptd = World(profile.step_s, profile.tiers, (0, 1, 2), profile.persist_s, DETECT_S, trace)
    orbax = World(profile.step_s, (profile.orbax,), (2,), profile.orbax.copy_s - profile.orbax.block_s, DETECT_S,
                  trace)
    return ckptd, orbax


def advised(world: World, prior: FailurePrior = PRIOR) -> Periods:
    """The model's choice from the prior alone (what the autopilot starts with)."""
    tiers = Autopilot(FailureHistory(prior)).inputs(world.step_s, world.measured(0.0, None))[0].tiers
    return choose(PlanInputs(world.step_s, tiers, prior.mtbf_s, world.detect_s)).periods


def oracle(world: World, start: Periods) -> tuple[Periods, float, int]:
    """The best fixed (replicas, memory, storage) periods for ``world``'s trace: coordinate descent over the
    replica period, the memory period and storage's multiple of it, on geometric grids from x4 down to x1.1 steps.
    Returns the periods, their goodput and the runs it took."""
    r, m, s = start
    assert r is not None and m is not None and s is not None
    point = [r, m, max(1, round(s / m))]
    runs = 0
    cache: dict[tuple[int, ...], float] = {}

    def goodput(p: list[int]) -> float:
        nonlocal runs
        key = tuple(p)
        if key not in cache:
            runs += 1
            cache[key] = simulate(world, Fixed("oracle", (p[0], p[1], p[2] * p[1]))).goodput
        return cache[key]

    best = goodput(point)
    for scale in (4.0, 2.0, 1.4, 1.1):
        improved = True
        while improved:
            improved = False
            for c in range(3):
                values = {max(1, round(point[c] * scale ** (i / 4))) for i in range(-4, 5)}
                for v in sorted(values):
                    trial = [*point[:c], v, *point[c + 1:]]
                    g = goodput(trial)
                    if g > best + 1e-12:
                        best, point, improved = g, trial, True
    return (point[0], point[1], point[2] * point[1]), best, runs


def run_trace(profile: Profile, trace: Trace) -> dict[str, Any]:
    """Every strategy on ``trace``: goodput, periods, and the autopilot's changes."""
    started = time.perf_counter()
    ckptd, orbax = worlds(profile, trace)
    pilot = Pilot()
    auto = simulate(ckptd, pilot)
    once = advised(ckptd)
    best, best_goodput, runs = oracle(ckptd, once)
    results = {
        "autopilot": auto,
        "advise once": simulate(ckptd, Fixed("advise once", once)),
        "MaxText": simulate(orbax, Fixed("MaxText", (MAXTEXT_CHECKPOINT_PERIOD,))),
        "continuous": simulate(orbax, Continuous()),
    }
    row: dict[str, Any] = {
        "trace": trace.name, "what": trace.what, "days": trace.horizon_s / 86_400, "failures": len(trace.failures),
        "goodput": {name: r.goodput for name, r in results.items()} | {"oracle": best_goodput},
        "lost_steps": {name: r.mean_lost_steps for name, r in results.items()},
        "periods": {"oracle": best, "advise once": once, "MaxText": (MAXTEXT_CHECKPOINT_PERIOD,),
                    "autopilot": [(round(t / HOUR, 2), p) for t, p in auto.periods]},
        "autopilot_changes": auto.changes, "autopilot_decisions": pilot.decisions, "oracle_runs": runs,
    }
    row["seconds"] = time.perf_counter() - started
    return row


def targets(rows: Sequence[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The claims, each checked on the rows: the autopilot within 1 point of the oracle on every trace, and ahead
    of MaxText's defaults and of continuous saving on every trace whose MTBF changes."""
    out = []
    for row in rows:
        g = row["goodput"]
        out.append((f"{row['trace']}: autopilot {100 * (g['autopilot'] - g['oracle']):+.2f} points against the "
                    f"oracle (target: within {100 * WITHIN:g})", g["autopilot"] >= g["oracle"] - WITHIN))
        if row["trace"] in CHANGING:
            for other in ("MaxText", "continuous"):
                out.append((f"{row['trace']}: autopilot {100 * (g['autopilot'] - g[other]):+.2f} points against "
                            f"{other} (target: ahead)", g["autopilot"] > g[other]))
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The goodput table, a row per trace, as docs/planning.md shows it."""
    head = ("| trace | failures | " + " | ".join(STRATEGIES) + " | autopilot - oracle |\n"
            "|---|---|" + "---|" * (len(STRATEGIES) + 1))
    lines = [head]
    for row in rows:
        g = row["goodput"]
        cells = [f"{100 * g[s]:.2f}%" for s in STRATEGIES]
        top = max(range(len(cells)), key=lambda k: g[STRATEGIES[k]])
        cells[top] = f"**{cells[top]}**"
        lines.append(f"| {row['trace']} ({row['what']}) | {row['failures']} | " + " | ".join(cells)
                     + f" | {100 * (g['autopilot'] - g['oracle']):+.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.autopilot", description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=14.0, help="length of each trace (default 14)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="append", help="only this trace (repeatable)")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    profile = load()
    chosen = [t for t in traces(args.days, args.seed) if not args.trace or t.name in args.trace]
    if not chosen:
        ap.error(f"no trace named {args.trace}")
    out("costs: " + "\n  ".join(profile.describe()))
    out("from: " + "; ".join(f"{k}: {v}" for k, v in KEYS.items()))
    rows = []
    for trace in chosen:
        rows.append(run_trace(profile, trace))
        r = rows[-1]
        out(f"{trace.name}: {r['failures']} failures, {r['seconds']:.1f} s; autopilot changed its periods "
            f"{r['autopilot_changes']} times in {r['autopilot_decisions']} decisions; oracle {r['periods']['oracle']} "
            f"({r['oracle_runs']} runs); advise once {r['periods']['advise once']}")
    out("")
    out(table(rows))
    out("")
    held = targets(rows)
    for line, ok in held:
        out(f"{'holds' if ok else 'MISSED'}: {line}")
    if args.json:
        args.json.write_text(json.dumps({"days": args.days, "seed": args.seed, "profile": profile.sources,
                                         "rows": rows, "targets": held}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
