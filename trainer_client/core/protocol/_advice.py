"""The goodput advisor's contract: ``GET /v1/jobs/{job}/advice`` and ``ckptd advise``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from trainer_client.core.protocol._base import _Model

AdvicePolicy = Literal["pause", "resize", "spare"]

# Physical ranges of the inputs (docs/planning.md, "Inputs and their ranges"): wide enough for any real job,
# narrow enough that no value makes the simulation overflow or run without end.
MAX_PHASE_S = 86_400.0  # a save, restore, recompile, detection or switch: at most a day
MAX_REPLACE_S = 30 * 86_400.0  # a slice comes back within 30 days
MIN_STEP_S = 1e-4  # a training step takes at least 0.1 ms
MIN_MTBF_HOURS = 1.0 / 60.0  # a job that fails more often than every minute does not train
MAX_MTBF_HOURS = 1e6  # ~114 years
MAX_PERIOD_STEPS = 10**9

_Phase = Annotated[float, Field(ge=0, le=MAX_PHASE_S)]


class AdviceQuery(_Model):
    """Inputs of the goodput advisor (query parameters of ``GET /v1/jobs/{job}/advice``).

    Every value left out comes from the job's recorded history when it has one, else from a stated
    default; the advisor says which inputs are still missing. Times are seconds, each within a physical
    range (``MAX_PHASE_S``, ``MAX_REPLACE_S``, ...): a value outside it is refused, never simulated.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step_time_s: Annotated[float, Field(ge=MIN_STEP_S, le=MAX_PHASE_S)] | None = Field(
        default=None, description="time of one training step")
    save_stall_s: _Phase | None = Field(
        default=None, description="training blocked per save (device-to-host copy)")
    persist_time_s: _Phase | None = Field(
        default=None, description="save start until it is committed on persistent storage")
    restore_time_s: _Phase | None = Field(
        default=None, description="restore from persistent storage onto the devices")
    memory_restore_time_s: _Phase | None = Field(
        default=None, description="restore from a host-memory snapshot (default: the save stall)")
    recovery_time_s: _Phase | None = Field(
        default=None, description="restored state to first step on the same mesh (pause, spare): recompile, warm-up")
    resize_recovery_time_s: _Phase | None = Field(
        default=None, description="restored state to first step on a smaller mesh (resize; default: recovery time)")
    scale_up_time_s: _Phase | None = Field(
        default=None, description="regrow when a slice returns (resize; default: memory restore + resize recovery)")
    detect_time_s: _Phase | None = Field(default=None, description="failure to exception")
    replace_time_s: Annotated[float, Field(ge=0, le=MAX_REPLACE_S)] | None = Field(
        default=None, description="failure until a replacement slice is ready")
    spare_switch_time_s: _Phase | None = Field(
        default=None, description="time to swap a hot spare slice in")
    slices: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    chips_per_slice: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(default=None, description="for display")
    mtbf_hours: Annotated[float, Field(ge=MIN_MTBF_HOURS, le=MAX_MTBF_HOURS)] | None = Field(
        default=None, description="mean time between job failures")
    failures_per_slice_day: Annotated[float, Field(ge=1e-6, le=1e4)] | None = Field(
        default=None, description="failure rate of one slice, instead of mtbf_hours (given both, mtbf_hours sets the "
        "rate); with slices it makes the job's MTBF, advised at its bound (1 min .. 10^6 h) when outside it")
    spares: Annotated[int, Field(ge=1, le=10_000)] | None = Field(default=None, description="hot spares (spare policy)")
    min_slices: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="fewest slices a resized job runs on (more than slices: all of them)")
    degraded_efficiency: Annotated[float, Field(ge=0.01, le=1)] | None = Field(
        default=None, description="throughput on k of N slices is k/N times this")
    host_loss_fraction: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="share of failures that also lose the host-memory snapshot")
    persist_overhead_s: _Phase | None = Field(
        default=None, description="training time a background persist steals (interference)")
    memory_tier: bool | None = Field(default=None, description="keep host-memory snapshots between persistent saves")
    checkpoint_period_steps: Annotated[int, Field(ge=1, le=MAX_PERIOD_STEPS)] | None = Field(
        default=None, description="the job's current save period, to compare with the optimum")
    horizon_days: Annotated[float, Field(gt=0, le=3650)] | None = Field(
        default=None, description="simulated run length")
    min_failures: Annotated[int, Field(ge=10, le=100_000)] | None = Field(
        default=None, description="simulate at least this many failures per point")
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None


class AdviceInput(_Model):
    """One number the advisor used, and where it came from."""

    value: float | bool
    unit: str
    source: Literal["given", "history", "default", "derived"]
    note: str = ""


class Badput(_Model):
    """Where the wall time that is not goodput goes, as fractions of the wall time."""

    checkpoint: float
    detection: float
    waiting: float
    restore: float
    recompile: float
    lost: float
    degraded: float
    scale_up: float


class PeriodPoint(_Model):
    """One simulated point of a period sweep."""

    period_s: float
    persistent_period_s: float
    goodput: float


class PolicyAdvice(_Model):
    """The best schedule found for one recovery policy, and what it yields."""

    policy: AdvicePolicy
    memory_period_s: float | None
    memory_period_steps: int | None
    persistent_period_s: float
    persistent_period_steps: int
    goodput: float
    goodput_per_chip: float = Field(description="goodput x job slices / provisioned slices (spares cost)")
    goodput_at_young_daly: float
    lost_steps_per_failure: float
    lost_seconds_per_failure: float
    downtime_per_failure_s: float = Field(description="detection + waiting + restore + recompile per failure")
    failures_simulated: int
    badput: Badput
    sweep: list[PeriodPoint] = Field(default_factory=list)


class YoungDaly(_Model):
    """The first-order optimum periods and what they assume."""

    mtbf_s: float
    save_cost_s: float
    period_s: float = Field(description="sqrt(2 x save cost x MTBF) for the saves that failures roll back to")
    daly_period_s: float = Field(description="Daly's higher-order estimate")
    persistent_period_s: float | None = Field(default=None, description="with a memory tier: the persistent one")


class Advice(_Model):
    """Checkpoint periods and recovery policy for a job, with the numbers and the reasoning."""

    job: str | None
    inputs: dict[str, AdviceInput]
    mtbf_hours: float
    young_daly: YoungDaly
    policies: list[PolicyAdvice]
    recommended: AdvicePolicy
    reasoning: list[str]
    disagreement: list[str] = Field(default_factory=list, description="why the simulation and Young/Daly differ")
    current_period_goodput: float | None = None
    simulated_days: float
    compute_seconds: float


__all__ = [
    "MAX_MTBF_HOURS",
    "MAX_PHASE_S",
    "MAX_REPLACE_S",
    "MIN_MTBF_HOURS",
    "MIN_STEP_S",
    "Advice",
    "AdviceInput",
    "AdvicePolicy",
    "AdviceQuery",
    "Badput",
    "PeriodPoint",
    "PolicyAdvice",
    "YoungDaly",
]
