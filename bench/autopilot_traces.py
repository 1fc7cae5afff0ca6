"""The failure traces the autopilot harness (bench/autopilot.py) replays, generated from fixed seeds: the same
trace every run, any length.

Why it exists: the autopilot is judged against fixed periods on the situations that make a fixed period wrong. Each
trace is a list of failures (the time, and the fastest tier that survives it: 0 replicas, 1 shared memory, 2 only
storage, drawn with ``bench.autopilot_costs.SHARES``) and the windows in which storage is slow:

* ``steady``: an MTBF of 4 h throughout;
* ``falling``: 8 h for the first half of the run, 1 h for the second;
* ``bursts``: 8 h between bursts, and six bursts per two weeks of five failures each within half an hour;
* ``slow storage``: 4 h throughout, and one day (a quarter of a short run) from 40% of the run on during which
  persists and restores from storage take ten times as long.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.autopilot_costs import SHARES

HOUR = 3600.0
DAY = 86_400.0
SLOW_FACTOR = 10.0


@dataclass(frozen=True)
class Trace:
    """Failures as (seconds since the start, index of the fastest tier that survives it), and the slow-storage
    windows as (start, end, factor)."""

    name: str
    horizon_s: float
    failures: tuple[tuple[float, int], ...]
    slow: tuple[tuple[float, float, float], ...]
    what: str

    def factor(self, t: float) -> float:
        """How much longer persists and restores from storage take at ``t``."""
        return next((f for a, b, f in self.slow if a <= t < b), 1.0)


def _poisson(rng: random.Random, start: float, end: float, mtbf: float) -> list[float]:
    out: list[float] = []
    t = start
    while True:
        t += rng.expovariate(1.0 / mtbf)
        if t >= end:
            return out
        out.append(t)


def _with_classes(rng: random.Random, times: list[float]) -> tuple[tuple[float, int], ...]:
    return tuple((t, rng.choices(range(len(SHARES)), weights=SHARES)[0]) for t in sorted(times))


def traces(days: float = 14.0, seed: int = 0) -> list[Trace]:
    """The four traces over ``days`` of running, each from its own seed."""
    h = days * DAY
    out = []
    rng = random.Random(seed * 16 + 1)
    out.append(Trace("steady", h, _with_classes(rng, _poisson(rng, 0, h, 4 * HOUR)), (), "MTBF 4 h"))
    rng = random.Random(seed * 16 + 2)
    times = _poisson(rng, 0, h / 2, 8 * HOUR) + _poisson(rng, h / 2, h, 1 * HOUR)
    out.append(Trace("falling", h, _with_classes(rng, times), (), "MTBF 8 h, then 1 h from mid-run"))
    rng = random.Random(seed * 16 + 3)
    times = _poisson(rng, 0, h, 8 * HOUR)
    for _ in range(max(1, round(6 * days / 14))):
        start = rng.uniform(0, h - HOUR)
        times += [start + rng.uniform(0, HOUR / 2) for _ in range(5)]
    out.append(Trace("bursts", h, _with_classes(rng, times), (), "MTBF 8 h, bursts of 5 failures in 30 min"))
    rng = random.Random(seed * 16 + 4)
    start = 0.4 * h
    slow = ((start, start + min(DAY, h / 4), SLOW_FACTOR),)
    out.append(Trace("slow storage", h, _with_classes(rng, _poisson(rng, 0, h, 4 * HOUR)), slow,
                     f"MTBF 4 h, storage {SLOW_FACTOR:g}x slower for {min(DAY, h / 4) / HOUR:g} h"))
    return out


__all__ = ["DAY", "HOUR", "SLOW_FACTOR", "Trace", "traces"]
