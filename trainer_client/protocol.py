"""The wire contract between the ckptd sidecar and trainer_client.

One module, imported by both sides: the route templates, the JSON models of every request and response,
the error body and the stable error codes. The server builds its FastAPI routes and its OpenAPI schema
from these models; the client parses answers with the same models, so the two cannot drift apart.

This module imports neither jax nor FastAPI: the sidecar's core and the client both load it cheaply.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_PREFIX = "/v1"
ROUTE_HEALTHZ = "/healthz"
ROUTE_READYZ = "/readyz"
ROUTE_METRICS = "/metrics"
ROUTE_JOBS = f"{API_PREFIX}/jobs"
ROUTE_CHECKPOINTS = f"{API_PREFIX}/jobs/{{job}}/checkpoints"
ROUTE_LATEST_GOOD = f"{API_PREFIX}/jobs/{{job}}/checkpoints/latest-good"
ROUTE_RESUME = f"{API_PREFIX}/jobs/{{job}}/resume"
ROUTE_ADVICE = f"{API_PREFIX}/jobs/{{job}}/advice"
ROUTE_EVENTS = f"{API_PREFIX}/jobs/{{job}}/events"
ROUTE_GOODPUT = f"{API_PREFIX}/jobs/{{job}}/goodput"
ROUTE_DASHBOARD = "/"

# A job name is one path segment of the root: letters, digits, '.', '_', '-', not starting with '.'.
JOB_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)
MAX_STEP = 2**63 - 1


def is_valid_job_name(name: str) -> bool:
    """True when ``name`` is a single safe path segment (no '/', no '..', no leading '.')."""
    return bool(_JOB_NAME_RE.fullmatch(name))


class ErrorCode(StrEnum):
    """Stable error codes; each maps to one HTTP status (see ``ERROR_STATUS``)."""

    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_JOB_NAME = "INVALID_JOB_NAME"
    JOB_NOT_FOUND = "JOB_NOT_FOUND"
    STEP_NOT_FOUND = "STEP_NOT_FOUND"
    NO_GOOD_CHECKPOINT = "NO_GOOD_CHECKPOINT"
    STEP_NOT_GOOD = "STEP_NOT_GOOD"
    NOT_ENOUGH_DEVICES = "NOT_ENOUGH_DEVICES"
    NO_VALID_MESH = "NO_VALID_MESH"
    DOES_NOT_FIT = "DOES_NOT_FIT"
    ROUTE_NOT_FOUND = "ROUTE_NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    UNAUTHORIZED = "UNAUTHORIZED"
    NOT_READY = "NOT_READY"
    STORAGE_ERROR = "STORAGE_ERROR"
    INTERNAL = "INTERNAL"
    MISSING_INPUT = "MISSING_INPUT"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"


ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.INVALID_JOB_NAME: 400,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.STEP_NOT_FOUND: 404,
    ErrorCode.NO_GOOD_CHECKPOINT: 404,
    ErrorCode.STEP_NOT_GOOD: 409,
    ErrorCode.NOT_ENOUGH_DEVICES: 409,
    ErrorCode.NO_VALID_MESH: 409,
    ErrorCode.DOES_NOT_FIT: 409,
    ErrorCode.ROUTE_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_READY: 503,
    ErrorCode.STORAGE_ERROR: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.MISSING_INPUT: 422,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Model):
    """The one error body every failing request gets."""

    code: ErrorCode
    message: str
    detail: dict[str, object] | None = None


class Health(_Model):
    status: Literal["ok", "not_ready"]
    detail: dict[str, object] = Field(default_factory=dict)


class StepState(StrEnum):
    """Lifecycle states of a step directory (DESIGN: States of a step)."""

    WRITING = "writing"  # a tmp directory younger than the save timeout
    ABANDONED = "abandoned"  # a tmp directory older than the save timeout: a crashed save
    COMMITTED = "committed"  # finalized by Orbax and structurally sound, not verified yet
    VERIFIED = "verified"  # committed and its content matches its manifest: a good step
    QUARANTINED = "quarantined"  # found bad; recorded on storage, files kept, never served
    CORRUPT = "corrupt"  # finalized, but its Orbax metadata is missing or unreadable


class MeshSpec(_Model):
    """A named device mesh: ``axis_names[i]`` has ``shape[i]`` devices."""

    axis_names: list[str]
    shape: list[Annotated[int, Field(ge=1)]]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


PartitionSpecJSON = list[str | list[str] | None]


class ArraySpec(_Model):
    """One array of the saved state, as a resume plan lays it out."""

    shape: list[int] | None = None
    dtype: str | None = None
    partition_spec: PartitionSpecJSON
    changed: bool = False


class BatchPlan(_Model):
    """How the batch is processed on a mesh: what a resume plan says and every step records.

    ``global_batch`` samples make one optimizer step, processed as ``accumulation_steps`` microbatches of
    ``micro_batch`` samples (``per_device_batch`` per data-parallel device). ``base_global_batch`` is the
    job's own global batch and ``max_per_device_batch`` the per-device batch it ran with on its first mesh;
    both carry over from plan to plan so shrinking and growing never drift.
    """

    mode: Literal["keep_global_batch", "scale_batch"]
    base_global_batch: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    accumulation_steps: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    per_device_batch: int = Field(ge=1)
    max_per_device_batch: int = Field(ge=1)
    data_parallel_size: int = Field(ge=1)
    lr_scale: float = 1.0
    exact: bool = True
    note: str = ""


class TrainingMetadata(_Model):
    """What trainer_client records with every step (in Orbax's custom metadata, key ``ckptd``)."""

    step: int
    data_position: int = Field(description="global sample index the next step reads from")
    global_batch: int
    mesh: MeshSpec
    slices: list[int] = Field(default_factory=list, description="indices of the slices that saved it")
    wall_time: float
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    batch: BatchPlan | None = Field(default=None, description="the batch plan in effect when saved")


class CheckpointInfo(_Model):
    step: int
    state: StepState
    path: str
    reason: str | None = Field(default=None, description="why a step is not committed")
    committed_at: float | None = None
    training: TrainingMetadata | None = None


class JobInfo(_Model):
    name: str
    path: str
    steps: int
    latest_step: int | None
    latest_good_step: int | None


class JobList(_Model):
    jobs: list[JobInfo]


class CheckpointList(_Model):
    job: str
    checkpoints: list[CheckpointInfo]


def _integral_floats_as_ints(value: object) -> object:
    """``6.0`` -> ``6`` throughout a JSON value (bools and other floats untouched)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


class _Request(_Model):
    """Requests are strict: ``true`` or ``"6"`` is not a device count. JSON has one number type, so
    ``6.0`` is the integer 6 (as JSON Schema says); ``6.5`` is not."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: object) -> object:
        return _integral_floats_as_ints(data)


class SliceAlive(_Request):
    index: Annotated[int, Field(ge=0)]
    devices: Annotated[int, Field(ge=0)]


class BatchOptions(_Request):
    """How a resized mesh treats the batch."""

    mode: Literal["keep_global_batch", "scale_batch"] = Field(
        default="keep_global_batch",
        description="keep_global_batch: gradient accumulation keeps the global batch; "
        "scale_batch: keep the per-device batch, the global batch follows the device count",
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        default="linear", description="learning-rate rule applied when the global batch changes"
    )
    max_accumulation_steps: Annotated[int, Field(ge=1, le=4096)] = 64


class ResumeRequest(_Request):
    """Body of ``POST /v1/jobs/{job}/resume``."""

    policy: Literal["pause", "resize"] = "resize"
    alive_devices: Annotated[int, Field(ge=0, le=1_000_000)]
    slices: list[SliceAlive] | None = Field(default=None, max_length=100_000)
    step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    device_memory_bytes: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="memory of one device; when given the plan checks the state fits"
    )
    memory_headroom_bytes: Annotated[int, Field(ge=0)] = Field(
        default=0, description="per-device memory to leave free (activations, compiled programs)"
    )
    batch: BatchOptions = Field(default_factory=BatchOptions)
    use_memory_tier: bool = Field(
        default=True, description="prefer a whole host-memory snapshot at least as new as the newest good step"
    )


class ResumePlan(_Model):
    """Where to resume and how to lay the state out on the devices alive."""

    job: str
    step: int
    path: str
    policy: Literal["pause", "resize"]
    mesh: MeshSpec
    saved_mesh: MeshSpec | None
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    data_position: int | None = Field(default=None, description="global sample index to resume reading at")
    global_batch: int | None = None
    batch: BatchPlan | None = None
    idle_devices: int = 0
    slices_used: list[int] = Field(default_factory=list, description="slices whose devices form the mesh, in order")
    idle_slices: list[SliceAlive] = Field(default_factory=list, description="alive devices left out, per slice")
    bytes_per_device: int | None = Field(default=None, description="state bytes per device on the new mesh")
    fits_memory: bool | None = None
    source: Literal["ckptd", "storage_scan"] = "ckptd"
    tier: Literal["memory", "storage"] = Field(
        default="storage", description="memory: `path` is a host-memory snapshot; storage: an Orbax step"
    )
    notes: list[str] = Field(default_factory=list)


# ---- the goodput advisor (GET /v1/jobs/{job}/advice, ``ckptd advise``) ------------------------------

AdvicePolicy = Literal["pause", "resize", "spare"]


class AdviceQuery(_Model):
    """Inputs of the goodput advisor (query parameters of ``GET /v1/jobs/{job}/advice``).

    Every value left out comes from the job's recorded history when it has one, else from a stated
    default; the advisor says which inputs are still missing. Times are seconds.
    """

    step_time_s: Annotated[float, Field(gt=0)] | None = Field(default=None, description="time of one training step")
    save_stall_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="training blocked per save (device-to-host copy)")
    persist_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="save start until it is committed on persistent storage")
    restore_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="restore from persistent storage onto the devices")
    memory_restore_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="restore from a host-memory snapshot (default: the save stall)")
    recovery_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="restored state to first step on the same mesh (pause, spare): recompile, warm-up")
    resize_recovery_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="restored state to first step on a smaller mesh (resize; default: recovery time)")
    scale_up_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="regrow when a slice returns (resize; default: memory restore + resize recovery)")
    detect_time_s: Annotated[float, Field(ge=0)] | None = Field(default=None, description="failure to exception")
    replace_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="failure until a replacement slice is ready")
    spare_switch_time_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="time to swap a hot spare slice in")
    slices: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    chips_per_slice: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(default=None, description="for display")
    mtbf_hours: Annotated[float, Field(gt=0)] | None = Field(default=None, description="mean time between job failures")
    failures_per_slice_day: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="failure rate of one slice (instead of mtbf_hours)")
    spares: Annotated[int, Field(ge=1, le=10_000)] | None = Field(default=None, description="hot spares (spare policy)")
    min_slices: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, description="fewest slices a resized job runs on")
    degraded_efficiency: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="throughput on k of N slices is k/N times this")
    host_loss_fraction: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="share of failures that also lose the host-memory snapshot")
    persist_overhead_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="training time a background persist steals (interference)")
    memory_tier: bool | None = Field(default=None, description="keep host-memory snapshots between persistent saves")
    checkpoint_period_steps: Annotated[int, Field(ge=1)] | None = Field(
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


# ---- elastic events (POST/GET /v1/jobs/{job}/events) and goodput (GET /v1/jobs/{job}/goodput) -----

# What trainer_client's ElasticRunner emits, and what ckptd records itself (``retention_deleted``).
# Other kinds matching ``EVENT_KIND_PATTERN`` are stored and served; metrics count them as ``other``.
EVENT_KINDS = (
    "start", "waiting_for_slices", "slices_ready", "plan_received", "initialized", "restored",
    "first_step_done", "checkpoint_started", "failure_detected", "scale_up_detected", "recovered",
    "finished", "aborted", "retention_deleted",
)
EVENT_KIND_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
MAX_EVENTS_PER_BATCH = 1000


class ElasticEvent(_Request):
    """One event of a training run, as trainer_client reports it (``EventBatch``)."""

    kind: str = Field(pattern=EVENT_KIND_PATTERN, description="what happened (see EVENT_KINDS)")
    time: Annotated[float, Field(ge=0)] = Field(description="wall-clock time of the event (Unix seconds)")
    step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    t: float | None = Field(default=None, description="seconds since the run started (monotonic clock)")
    detail: str = Field(default="", max_length=2000)
    id: str | None = Field(default=None, max_length=200, description="unique per event; resends are deduplicated")
    run: str | None = Field(default=None, max_length=200, description="the run (process) that emitted it")
    host: str | None = Field(default=None, max_length=255)
    pid: Annotated[int, Field(ge=0)] | None = None
    recovery_seconds: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="recovered: failure detected until the first step on the new mesh")
    lost_steps: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="recovered: steps computed since the restored step, done again")
    restored_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    mesh_before: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=16)
    mesh_after: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=16)
    blocked_seconds: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="checkpoint_started: how long the training loop was blocked by the save")


class EventBatch(_Request):
    """Body of ``POST /v1/jobs/{job}/events``."""

    events: list[ElasticEvent] = Field(min_length=1, max_length=MAX_EVENTS_PER_BATCH)


class EventAck(_Model):
    """Answer of ``POST /v1/jobs/{job}/events``."""

    job: str
    accepted: int = Field(description="events stored")
    duplicates: int = Field(description="events this ckptd had already stored (same id), skipped")


class StoredEvent(ElasticEvent):
    """An event as ckptd stored it, on storage next to the job's checkpoints."""

    model_config = ConfigDict(extra="forbid", strict=False)

    received_at: float
    source: Literal["trainer", "ckptd"] = "trainer"


class EventList(_Model):
    job: str
    events: list[StoredEvent] = Field(description="oldest first")


class GoodputCauses(_Model):
    """Badput by cause (seconds, or fractions of the wall time)."""

    checkpoint: float = Field(description="training blocked by checkpoint saves")
    waiting: float = Field(description="failure detected until enough slices are healthy")
    restore: float = Field(description="slices ready until the state is restored (plan + restore)")
    recompile: float = Field(description="first step after a restore minus a normal step")
    lost: float = Field(description="steps computed since the restored checkpoint, done again")
    startup: float = Field(description="run start until its first step (initialization, first compile)")
    down: float = Field(description="no run of the job alive (between runs)")


class GoodputSegment(_Model):
    """A stretch of wall time that was not productive."""

    start: float
    end: float
    cause: Literal["waiting", "restore", "recompile", "startup", "down"]


class Goodput(_Model):
    """Productive training time over wall time, with where the rest went (ckptd/goodput.py)."""

    job: str
    goodput: float | None = Field(description="productive seconds / wall seconds; null without events")
    wall_seconds: float
    productive_seconds: float
    badput_seconds: GoodputCauses
    badput: GoodputCauses = Field(description="fractions of the wall time")
    window_start: float | None = None
    window_end: float | None = None
    step_time_s: float | None = None
    step_time_source: Literal["given", "events", "checkpoints"] | None = None
    runs: int = 0
    recoveries: int = 0
    lost_steps: int = 0
    events: int = 0
    segments: list[GoodputSegment] = Field(default_factory=list, description="non-productive stretches, oldest first")
    notes: list[str] = Field(default_factory=list)


__all__ = [
    "API_PREFIX",
    "ERROR_STATUS",
    "EVENT_KINDS",
    "EVENT_KIND_PATTERN",
    "JOB_NAME_PATTERN",
    "MAX_EVENTS_PER_BATCH",
    "MAX_STEP",
    "ROUTE_ADVICE",
    "ROUTE_CHECKPOINTS",
    "ROUTE_DASHBOARD",
    "ROUTE_EVENTS",
    "ROUTE_GOODPUT",
    "ROUTE_HEALTHZ",
    "ROUTE_JOBS",
    "ROUTE_LATEST_GOOD",
    "ROUTE_METRICS",
    "ROUTE_READYZ",
    "ROUTE_RESUME",
    "Advice",
    "AdviceInput",
    "AdviceQuery",
    "ArraySpec",
    "Badput",
    "BatchOptions",
    "BatchPlan",
    "CheckpointInfo",
    "CheckpointList",
    "ElasticEvent",
    "ErrorBody",
    "ErrorCode",
    "EventAck",
    "EventBatch",
    "EventList",
    "Goodput",
    "GoodputCauses",
    "GoodputSegment",
    "Health",
    "JobInfo",
    "JobList",
    "MeshSpec",
    "PeriodPoint",
    "PolicyAdvice",
    "ResumePlan",
    "ResumeRequest",
    "SliceAlive",
    "StepState",
    "StoredEvent",
    "TrainingMetadata",
    "YoungDaly",
    "is_valid_job_name",
]
