"""The soak's results: ``soak/results.json`` and the Markdown table of docs/operations.md ("Recovery soak").

``summarize`` turns the trials and the samples into the JSON record (``trials``, ``successes``, ``phases``
with, per phase, the tier each slice-loss recovery restored from and the distribution of steps lost; timings
p50/p99 per recovery phase, steps lost per failure, where recoveries restored from, the process samples, each
failure's problems and every trial in short); ``markdown`` prints it as the tables the docs carry; ``flat`` says
whether the samples grew.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.common import percentile
from soak.harness import Sample
from soak.trials import PHASES, TIERS, TIMINGS, Trial

SCHEMA = "ckptd-soak/1"


def _stats(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(values), "p50": round(percentile(values, 50), 4), "p99": round(percentile(values, 99), 4),
            "max": round(max(values), 4)}


def _counts(values: Iterable[int | str]) -> dict[str, int]:
    """How many of each value, in order: steps lost 0, 1, 2, ...; tiers replicas, memory, storage (then others)."""
    found = Counter(values)
    rank = {tier: i for i, tier in enumerate(TIERS)}
    return {str(k): found[k] for k in sorted(found, key=lambda k: (rank.get(str(k), len(rank)), str(k).zfill(9)))}


def summarize(trials: Sequence[Trial], samples: Sequence[Sample], *, seed: int, started: float,
              finished: float, pid: int) -> dict[str, Any]:
    phases = {}
    for phase in PHASES:
        mine = [t for t in trials if t.phase == phase]
        phases[phase] = {"trials": len(mine), "successes": sum(t.ok for t in mine),
                         "variants": sorted({t.variant for t in mine if t.variant}),
                         "restored_from": _counts(tier for t in mine for tier in t.restored_from),
                         "lost_steps": _counts(n for t in mine for n in t.lost_steps),
                         "restores_checked": sum(v == "equal" for t in mine for _, v in t.restores),
                         "replicas_unusable": sum(t.replicas_unusable for t in mine)}
    timings = {name: _stats([v for t in trials for v in t.timings.get(name, [])]) for name in TIMINGS}
    lost = [n for t in trials for n in t.lost_steps]
    return {
        "schema": SCHEMA,
        "trials": len(trials),
        "successes": sum(t.ok for t in trials),
        "seed": seed,
        "pid": pid,
        "seconds": round(finished - started, 1),
        "phases": phases,
        "timings_s": timings,
        "steps_lost_per_failure": {"n": len(lost), "mean": round(statistics.fmean(lost), 2) if lost else None,
                                   "p50": percentile(lost, 50) if lost else None,
                                   "max": max(lost) if lost else None},
        "lost_steps": _counts(lost),
        "restored_from": _counts(tier for t in trials for tier in t.restored_from),
        "samples": [s.__dict__ for s in samples],
        "failures": [{"trial": t.index, "phase": t.phase, "variant": t.variant, "problems": t.problems}
                     for t in trials if not t.ok],
        "trial_log": [{"trial": t.index, "phase": t.phase, "variant": t.variant, "ok": t.ok, "seconds": t.seconds,
                       "recoveries": t.recoveries, "restores": [list(r) for r in t.restores]} for t in trials],
    }


def write(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def flat(samples: Sequence[Sample], *, rss_mib: float, raw_rss_mib: float | None = None, arrays: int = 0,
         executables: int = 0, threads: int = 0, files: int = 0) -> list[str]:
    """What grew beyond the tolerances given (nothing: flat): after the harness cleared JAX's caches and trimmed
    the heap, from the first sample to the last; and the RSS as the library left the process (``raw_rss_mib``,
    default ``rss_mib``), whose samples swing by tens of MiB with what JAX's caches and the allocator hold at
    that moment, by its envelope: the highest sample of the later half against the highest of the earlier half."""
    if len(samples) < 2:
        return []
    first, last = samples[0], samples[-1]
    grew = []
    if last.rss_mib - first.rss_mib > rss_mib:
        grew.append(f"RSS {first.rss_mib} -> {last.rss_mib} MiB (tolerance {rss_mib} MiB)")
    half, raw_tolerance = len(samples) // 2, rss_mib if raw_rss_mib is None else raw_rss_mib
    early, late = max(s.rss_raw_mib for s in samples[:half]), max(s.rss_raw_mib for s in samples[half:])
    if late - early > raw_tolerance:
        grew.append(f"RSS as the library left it: highest {early} -> {late} MiB from the earlier half of the "
                    f"samples to the later (tolerance {raw_tolerance} MiB)")
    for name, tolerance in (("live_arrays", arrays), ("live_executables", executables), ("threads", threads),
                            ("open_files", files)):
        a, b = getattr(first, name), getattr(last, name)
        if b - a > tolerance:
            grew.append(f"{name} {a} -> {b} (tolerance {tolerance})")
    return grew


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def _spread(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {n}" for k, n in counts.items()) or "—"


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/operations.md's "Recovery soak" section."""
    out = [f"**{results['successes']}/{results['trials']} trials recovered** (seed {results['seed']}, "
           f"{results['seconds']:.0f} s, one trainer process: pid {results['pid']}).", "",
           "| phase | trials | recovered |", "|---|---|---|"]
    for phase, p in results["phases"].items():
        variants = f" ({', '.join(p['variants'])})" if p["variants"] else ""
        out.append(f"| {phase}{variants} | {p['trials']} | {p['successes']} |")
    out += ["", "| recovery phase | n | p50 | p99 |", "|---|---|---|---|"]
    for name, st in results["timings_s"].items():
        out.append(f"| {name} | {st['n']} | {_ms(st['p50'])} | {_ms(st['p99'])} |")
    lost = results["steps_lost_per_failure"]
    out += ["", f"Steps lost per failure: mean {lost['mean']}, median {lost['p50']}, max {lost['max']} "
            f"({lost['n']} failures).", "",
            "| phase | restored from | steps lost: failures | restores checked equal |", "|---|---|---|---|"]
    for phase, p in results["phases"].items():
        out.append(f"| {phase} | {_spread(p['restored_from'])} | {_spread(p['lost_steps'])} | "
                   f"{p['restores_checked']} |")
    out += [f"| all | {_spread(results['restored_from'])} | {_spread(results['lost_steps'])} | "
            f"{sum(p['restores_checked'] for p in results['phases'].values())} |", "",
            "| after trial | RSS as left | arrays, executables as left | RSS | RSS before the trim | live arrays | "
            "live executables | threads | open files |",
            "|---|---|---|---|---|---|---|---|---|"]
    for s in results["samples"]:
        out.append(f"| {s['after_trial']} | {s.get('rss_raw_mib', 0.0):.0f} MiB | "
                   f"{s.get('live_arrays_raw', 0)}, {s.get('live_executables_raw', 0)} | {s['rss_mib']:.0f} MiB | "
                   f"{s['rss_untrimmed_mib']:.0f} MiB | {s['live_arrays']} | {s['live_executables']} | "
                   f"{s['threads']} | {s['open_files']} |")
    return "\n".join(out)


__all__ = ["SCHEMA", "flat", "markdown", "summarize", "write"]
