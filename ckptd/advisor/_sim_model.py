"""What the goodput simulator is given and gives back: the job's costs (``JobModel``), the save periods
(``Schedule``), the recovery policies and where the wall time went (``SimResult``, by badput cause).

Split from ``ckptd.advisor._simulator`` (the run itself, and the model's rules in its docstring) so that the
advisor's set-up (``ckptd.advisor._plan``) and tests build inputs and read results without the event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Policy = Literal["pause", "resize", "spare"]
POLICIES: tuple[Policy, ...] = ("pause", "resize", "spare")
CAUSES: tuple[str, ...] = (
    "checkpoint", "detection", "waiting", "restore", "recompile", "lost", "degraded", "scale_up",
)
DAY = 86_400.0


@dataclass(frozen=True)
class JobModel:
    """What a job costs: its shape, its measured (or assumed) times, and how it fails over."""

    slices: int
    save_stall: float
    persist_time: float
    restore_time: float
    recovery_time: float
    replace_time: float
    detect_time: float = 60.0
    memory_restore_time: float | None = None  # default: save_stall (same bytes over the same link)
    resize_recovery_time: float | None = None  # default: recovery_time
    scale_up_time: float | None = None  # default: memory restore + resize recovery
    spare_switch_time: float = 60.0
    spares: int = 1
    min_slices: int = 1
    degraded_efficiency: float = 1.0
    host_loss_fraction: float = 0.25
    persist_overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.slices < 1 or not 1 <= self.min_slices <= self.slices or self.spares < 0:
            raise ValueError("need slices >= 1, 1 <= min_slices <= slices and spares >= 0")
        if not 0.0 < self.degraded_efficiency <= 1.0 or not 0.0 <= self.host_loss_fraction <= 1.0:
            raise ValueError("degraded_efficiency must be in (0, 1] and host_loss_fraction in [0, 1]")
        times = (self.save_stall, self.persist_time, self.restore_time, self.recovery_time, self.replace_time,
                 self.detect_time, self.spare_switch_time, self.persist_overhead, self.memory_restore,
                 self.resize_recovery, self.scale_up)
        if any(not math.isfinite(x) or x < 0 for x in times):
            raise ValueError("times must be finite and >= 0")

    @property
    def memory_restore(self) -> float:
        return self.save_stall if self.memory_restore_time is None else self.memory_restore_time

    @property
    def resize_recovery(self) -> float:
        return self.recovery_time if self.resize_recovery_time is None else self.resize_recovery_time

    @property
    def scale_up(self) -> float:
        return self.memory_restore + self.resize_recovery if self.scale_up_time is None else self.scale_up_time

    def rate(self, active: int) -> float:
        """Throughput on ``active`` slices relative to the full job."""
        if active >= self.slices:
            return 1.0
        return active / self.slices * self.degraded_efficiency


@dataclass(frozen=True)
class Schedule:
    """Save periods in work seconds. ``memory_period=None``: no memory tier, every save is persisted.

    With a memory tier the persistent period is rounded to a whole multiple of the memory period.
    """

    persistent_period: float
    memory_period: float | None = None

    def __post_init__(self) -> None:
        if not self.persistent_period > 0 or (self.memory_period is not None and not self.memory_period > 0):
            raise ValueError("periods must be > 0")

    @property
    def base(self) -> float:
        """The period of every save (memory snapshots, or the persistent saves without that tier)."""
        return self.memory_period if self.memory_period is not None else self.persistent_period

    @property
    def multiple(self) -> int:
        """Every how many saves one is persisted."""
        if self.memory_period is None:
            return 1
        return max(1, round(self.persistent_period / self.memory_period))


@dataclass
class SimResult:
    """Where the wall time of one simulated run went."""

    policy: Policy
    wall: float
    useful: float
    badput: dict[str, float]
    failures: int = 0
    interruptions: int = 0
    lost_work: list[float] = field(default_factory=list)
    restores_from_memory: int = 0
    restores_from_persistent: int = 0

    @property
    def goodput(self) -> float:
        return self.useful / self.wall if self.wall > 0 else 0.0

    def fractions(self) -> dict[str, float]:
        """Badput by cause as fractions of the wall time."""
        return {k: v / self.wall if self.wall > 0 else 0.0 for k, v in self.badput.items()}

    @property
    def lost_per_interruption(self) -> float:
        """Mean work lost by a failure that interrupted running training (seconds of work)."""
        return float(np.mean(self.lost_work)) if self.lost_work else 0.0


__all__ = ["CAUSES", "DAY", "POLICIES", "JobModel", "Policy", "Schedule", "SimResult"]
