"""What the period model is given: each tier's measured costs, the failure rate, the run's constraints.

Apart from the model (``trainer_client.core.planning._periods``) so that its callers (the advisor, the runner's
autopilot, the trace harness) build inputs without the solver, and so that every input is checked once: a cost is
finite and not negative, a fraction is a fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class TierCosts:
    """One checkpoint tier, as measured (seconds unless said).

    ``block_s``: the loop time one save of this tier costs, all told (the stall, and the steps it slows). For a
    ``nested`` tier (saved from the next faster tier's snapshot at the same step, as ckptd persists a shared-memory
    snapshot) it is what the save adds to that snapshot; when the faster tier is off, the save takes its own
    snapshot and costs both. ``copy_s``: from the save's start until it is usable (its copy to the host, or its
    persist); one save of a tier is in flight at a time, so the period is never shorter. ``restore_s`` and
    ``first_step_s``: what a recovery from this tier costs, up to the first step done after it. ``survives``: the
    fraction of failures after which this tier's newest save is still usable (host memory kept, the replica's slice
    alive); a slower tier survives at least what a faster one does, and the slowest survives every failure.
    ``optional``: the tier may be left off (its host memory does not fit the budget, or it does not pay for itself).
    ``host_bytes``: host memory the tier holds while on; ``write_bytes`` and ``requests``: what one save writes to
    storage (the bandwidth and request-rate constraints). ``min_period_s`` and ``max_period_s``: bounds the run puts
    on the period (a user's bounds, a period the user fixed, the replica tier's overhead budget; ``min_reason`` names
    the lower one in the plan); the lower bound wins where they cross, as the copy's floor does.
    """

    name: str
    block_s: float
    copy_s: float = 0.0
    restore_s: float = 0.0
    first_step_s: float = 0.0
    survives: float = 1.0
    nested: bool = False
    optional: bool = False
    host_bytes: float = 0.0
    write_bytes: float = 0.0
    requests: float = 0.0
    min_period_s: float = 0.0
    max_period_s: float | None = None
    min_reason: str = "bound"

    def __post_init__(self) -> None:
        for name in ("block_s", "copy_s", "restore_s", "first_step_s", "host_bytes", "write_bytes", "requests",
                     "min_period_s"):
            _check(name, getattr(self, name))
        if self.max_period_s is not None and not (math.isfinite(self.max_period_s) and self.max_period_s > 0):
            raise ValueError(f"max_period_s must be finite and > 0, got {self.max_period_s!r}")
        if not 0.0 <= self.survives <= 1.0:
            raise ValueError(f"survives must be in [0, 1], got {self.survives!r}")

    @property
    def recovery_s(self) -> float:
        """A recovery from this tier, restore to first step done."""
        return self.restore_s + self.first_step_s


@dataclass(frozen=True)
class Constraints:
    """The run's limits; ``None``: no limit.

    ``host_memory_bytes``: what the host-memory tiers may hold together (a tier that does not fit is off).
    ``storage_Bps`` and ``storage_requests_per_s``: the storage a run may use on average (each bounds the period of
    the tiers that write: a save's bytes or requests over the period). ``max_lost_steps``: the user's bound on the
    steps a failure loses on average (it shortens every period alike, see ``docs/planning.md``).
    """

    host_memory_bytes: float | None = None
    storage_Bps: float | None = None
    storage_requests_per_s: float | None = None
    max_lost_steps: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_memory_bytes", "storage_Bps", "storage_requests_per_s", "max_lost_steps"):
            value = getattr(self, name)
            if value is not None:
                _check(name, value)
                if name != "host_memory_bytes" and value == 0:
                    raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class PlanInputs:
    """Everything a choice of periods is made from. ``tiers``: fastest first; ``mtbf_s``: the job's mean time
    between failures (the estimate the choice is made with); ``detect_s``: from a failure until its recovery
    starts (the same whichever tier recovers: it moves the goodput, not the periods)."""

    step_s: float
    tiers: tuple[TierCosts, ...]
    mtbf_s: float
    detect_s: float = 0.0
    constraints: Constraints = field(default_factory=Constraints)

    def __post_init__(self) -> None:
        if not math.isfinite(self.step_s) or self.step_s <= 0:
            raise ValueError(f"step_s must be finite and > 0, got {self.step_s!r}")
        if not self.mtbf_s > 0:  # inf is allowed: no failure expected
            raise ValueError(f"mtbf_s must be > 0, got {self.mtbf_s!r}")
        _check("detect_s", self.detect_s)
        if not self.tiers:
            raise ValueError("need at least one tier")
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ValueError("tier names must differ")
        if self.tiers[0].nested:
            raise ValueError(f"the fastest tier ({self.tiers[0].name}) cannot be nested in a faster one")

    @property
    def rate(self) -> float:
        """Failures per second."""
        return 0.0 if math.isinf(self.mtbf_s) else 1.0 / self.mtbf_s

    def shares(self) -> tuple[float, ...]:
        """The fraction of failures whose fastest surviving tier is each tier (they add up to 1): from ``survives``,
        made non-decreasing from the fastest tier on, the slowest surviving every failure."""
        out, seen = [], 0.0
        for i, t in enumerate(self.tiers):
            s = 1.0 if i == len(self.tiers) - 1 else max(seen, t.survives)
            out.append(s - seen)
            seen = s
        return tuple(out)


__all__ = ["Constraints", "PlanInputs", "TierCosts"]
