"""How often the job fails and which tier survives its failures, estimated from what the run has seen, starting
from a prior (the config's guess, or an earlier run's estimate).

Why it exists: the periods depend on the failure rate, which no one knows before the run and which changes during
it (a bad rack, a new pool of machines). The rate's estimate is a Gamma-Poisson posterior: the prior counts as
``weight`` failures seen over ``weight x MTBF`` of running before the run; each failure adds one failure and the
running time before it. To follow a rate that changes, every failure discounts what came before it by ``keep``
(0.75 by default: the estimate stands on about the last 1 / (1 - keep) = 4 failures, and the prior fades the same
way), while the running time since the last failure counts in full (a quiet spell lengthens the estimate at once).
The shares of failures by the fastest tier that survived them are a Dirichlet posterior over the prior's shares
(``share_weight`` pseudo-failures), not discounted: what survives a failure is a property of the job's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_KEEP = 0.75
MIN_WEIGHT = 0.5  # a spell without failures says only that the MTBF is longer than about twice that spell


@dataclass(frozen=True)
class FailurePrior:
    """The guess the estimate starts from: ``mtbf_s``, worth ``weight`` failures; ``shares``: per tier (fastest
    first), the fraction of failures whose fastest surviving tier it is, worth ``share_weight`` failures."""

    mtbf_s: float
    weight: float = 1.0
    shares: tuple[float, ...] | None = None
    share_weight: float = 4.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mtbf_s) and self.mtbf_s > 0):
            raise ValueError(f"mtbf_s must be finite and > 0, got {self.mtbf_s!r}")
        if not (self.weight > 0 and self.share_weight >= 0):
            raise ValueError("weight must be > 0 and share_weight >= 0")
        if self.shares is not None and (any(s < 0 for s in self.shares) or not math.isclose(sum(self.shares), 1.0)):
            raise ValueError(f"shares must be >= 0 and add up to 1, got {self.shares!r}")


@dataclass(frozen=True)
class EarlierRuns:
    """What the job's earlier runs saw, as ckptd's history of its events tells it (``GET .../goodput``): the
    seconds some run of the job was alive, and the failures recovered in a run's process. A run that ended
    (a crash, a relaunch) is not counted a failure: its events cannot tell one from a planned stop."""

    running_s: float
    failures: int

    @classmethod
    def from_goodput(cls, wall_s: float, down_s: float, recoveries: int) -> EarlierRuns:
        return cls(running_s=max(0.0, wall_s - down_s), failures=max(0, recoveries))

    def describe(self) -> str:
        return f"{self.failures} failure(s) in {self.running_s / 3600:.3g} h of the job's earlier runs (ckptd)"


@dataclass(frozen=True)
class FailureEstimate:
    """The current estimate: the MTBF, the failures seen, how much of the estimate is still the prior, and per tier
    the share of failures it is the fastest survivor of (``survives``: cumulative, what ``TierCosts`` takes)."""

    mtbf_s: float
    failures: int
    weight: float  # the (discounted) failures the MTBF stands on, the prior's included
    prior_part: float  # the prior's part of that weight, 0..1
    shares: tuple[float, ...] | None

    @property
    def survives(self) -> tuple[float, ...] | None:
        if self.shares is None:
            return None
        out, total = [], 0.0
        for s in self.shares:
            total += s
            out.append(min(1.0, total))
        return tuple(out)

    @property
    def source(self) -> str:
        """``prior`` until the failures seen outweigh it, then ``history``."""
        return "prior" if self.prior_part >= 0.5 else "history"

    def describe(self) -> str:
        return (f"MTBF {self.mtbf_s / 3600:.3g} h from {self.failures} failure(s) seen and the prior "
                f"({self.prior_part:.0%} of the estimate)")


class FailureHistory:
    """The running estimate: ``ran`` for time trained (or waited) without a failure, ``failed`` for each failure
    (with the index of the fastest tier it was recovered from, when known), ``estimate`` for the numbers."""

    def __init__(self, prior: FailurePrior, *, keep: float = DEFAULT_KEEP) -> None:
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {keep!r}")
        self.prior = prior
        self.keep = keep
        self._prior_weight = prior.weight  # discounted with the failures that come after it
        self._failures = 0.0  # discounted count
        self._exposure = prior.weight * prior.mtbf_s  # discounted running time, the prior's included
        self._open = 0.0  # running time since the last failure (counted in full)
        self._seen = 0
        self._counts = [0.0] * len(prior.shares) if prior.shares is not None else None

    def ran(self, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._open += seconds

    def failed(self, tier: int | None = None) -> None:
        """A failure, recovered from tier index ``tier`` (the fastest that survived it; None: not known)."""
        k = self.keep
        # the interval that ended here and its failure count in full; all before them (prior included) x keep
        self._exposure = k * self._exposure + self._open
        self._prior_weight *= k
        self._failures = k * self._failures + 1.0
        self._open = 0.0
        self._seen += 1
        if tier is not None and self._counts is not None:
            if not 0 <= tier < len(self._counts):
                raise ValueError(f"tier index {tier} out of range")
            self._counts[tier] += 1.0

    def estimate(self) -> FailureEstimate:
        weight = self._prior_weight + self._failures
        mtbf = (self._exposure + self._open) / max(weight, MIN_WEIGHT)
        shares = None
        if self.prior.shares is not None and self._counts is not None:
            w = self.prior.share_weight
            total = w + sum(self._counts)
            shares = tuple((w * p + c) / total for p, c in zip(self.prior.shares, self._counts, strict=True))
        return FailureEstimate(mtbf_s=mtbf, failures=self._seen, weight=weight,
                               prior_part=self._prior_weight / weight, shares=shares)


__all__ = ["DEFAULT_KEEP", "EarlierRuns", "FailureEstimate", "FailureHistory", "FailurePrior"]
