"""Where a simulated run's failures come from: sampled (Poisson per slice) or replayed from a trace.

Split from ``ckptd.advisor._simulator`` so a new failure model (a Weibull, a correlated-rack model, a trace parser)
is one class with two methods: when is the next failure, given how many slices are exposed; and that one
was taken.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import numpy as np

_EPS = 1e-9


class FailureSource(Protocol):
    """Where failures come from: the time of the next one given how many slices are exposed."""

    def next_failure(self, t: float, exposed: int) -> float: ...

    def consume(self) -> None: ...


class PoissonFailures:
    """Each exposed slice fails independently at ``rate_per_slice`` per second (exponential gaps).

    Memoryless, so the next failure is drawn afresh whenever the simulator asks (the number of exposed
    slices may have changed since).
    """

    def __init__(self, rate_per_slice: float, seed: int = 0) -> None:
        if not rate_per_slice >= 0:
            raise ValueError("rate_per_slice must be >= 0")
        self.rate_per_slice = rate_per_slice
        self._rng = np.random.default_rng(seed)
        self._draws: list[float] = []

    @classmethod
    def from_mtbf(cls, mtbf_s: float, slices: int, seed: int = 0) -> PoissonFailures:
        """Failures with a job-level mean time between failures of ``mtbf_s`` on ``slices`` slices."""
        return cls(1.0 / (mtbf_s * slices), seed)

    def next_failure(self, t: float, exposed: int) -> float:
        if exposed <= 0 or self.rate_per_slice == 0.0:
            return math.inf
        if not self._draws:
            self._draws = self._rng.standard_exponential(4096).tolist()
        return t + self._draws.pop() / (self.rate_per_slice * exposed)

    def consume(self) -> None:
        pass


class TraceFailures:
    """Failures replayed at the given times (seconds since the start), whatever the slice count."""

    def __init__(self, times: Iterable[float]) -> None:
        self._times = sorted(float(x) for x in times)
        self._i = 0

    def next_failure(self, t: float, exposed: int) -> float:
        while self._i < len(self._times) and self._times[self._i] < t - _EPS:
            self._i += 1  # a failure time that fell inside an overrun at the end: dropped
        return self._times[self._i] if self._i < len(self._times) else math.inf

    def consume(self) -> None:
        self._i += 1


__all__ = ["FailureSource", "PoissonFailures", "TraceFailures"]
