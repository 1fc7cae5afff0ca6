"""The HTTP contract: route templates, job names, the stable error codes and the HTTP status of each, the
one error body, the requests and answers of the checkpoint routes, and the trainer's request for its snapshot
part back from a peer host's copy (``peer-fetch``)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from trainer_client.core.protocol._base import MAX_EXACT_INT, _Model, _Request
from trainer_client.core.protocol._stored import ArraySpec, BatchPlan, CheckpointInfo, MeshSpec, TrainingMetadata

# ckptd's default port, on both sides (ckptd/config.py, trainer_client/config.py): clear of libtpu's
# 8470-8479 on TPU VMs, which share the trainer pod's network namespace (docs/deploy.md).
DEFAULT_PORT = 9471
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
ROUTE_PEER_FETCH = f"{API_PREFIX}/jobs/{{job}}/peer-fetch"
ROUTE_DASHBOARD = "/"

# A job name is one path segment of the root: letters, digits, '.', '_', '-', not starting with '.'.
JOB_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)
# Pages of a job's steps (GET .../checkpoints?limit=N&cursor=C, docs/protocol.md "Pagination"): newest first.
DEFAULT_PAGE_LIMIT = 100  # a cursor without a limit
MAX_PAGE_LIMIT = 1000
# A cursor is opaque to clients; any string of this form is one (the step, '.', the directory name in hex).
CURSOR_PATTERN = r"^[0-9]{1,16}\.(?:[0-9a-f]{2}){0,255}$"
MAX_STEP = MAX_EXACT_INT  # far beyond any training run
# The most memory one device may be said to have, or to keep free (bytes): ~8 PiB, far beyond any accelerator;
# the plan's messages print these as floats.
MAX_DEVICE_BYTES = MAX_EXACT_INT
# Hosts (JAX processes) of one multi-host job at most: Kubernetes' limit on an Indexed Job's completions.
MAX_HOSTS = 100_000
# A multi-host save's id, equal in every host's part of it: "<job incarnation>-<step>" (docs/multihost.md).
SAVE_ID_PATTERN = r"^[0-9a-f]{1,32}-[0-9]{1,19}$"


def is_valid_job_name(name: str) -> bool:
    """True when ``name`` is a single safe path segment (no '/', no '..', no leading '.')."""
    return bool(_JOB_NAME_RE.fullmatch(name))


class Tier(StrEnum):
    """Where a step's state is restored from, fastest first (the order a tie between equal steps is broken by:
    docs/concepts.md, "Three tiers"). On the wire each is its value."""

    REPLICAS = "replicas"  # the trainer's replica snapshots in the accelerator hosts' memory
    MEMORY = "memory"  # a whole snapshot in host shared memory (ckptd's memory tier)
    STORAGE = "storage"  # a committed Orbax step on the checkpoint root


# A save's destination beside the tiers: a shared-memory snapshot that ckptd is asked to persist to storage
# (a checkpoint_started event's ``tier``).
MEMORY_AND_PERSIST = f"{Tier.MEMORY}+persist"


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
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
    HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
    MALFORMED_HTTP = "MALFORMED_HTTP"
    BUSY = "BUSY"
    JOB_LIMIT = "JOB_LIMIT"
    FOREIGN_CHECKPOINT = "FOREIGN_CHECKPOINT"
    PEER_CHANNEL_OFF = "PEER_CHANNEL_OFF"


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
    ErrorCode.MISSING_INPUT: 409,  # a valid request the job's history cannot complete: its state, not the request
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.MALFORMED_HTTP: 400,
    ErrorCode.BUSY: 503,
    ErrorCode.JOB_LIMIT: 409,
    ErrorCode.FOREIGN_CHECKPOINT: 409,  # the step is another run's, or another process count's: the job's state
    ErrorCode.PEER_CHANNEL_OFF: 409,  # a peer fetch asked of a ckptd whose peer channel is off: its state
}


class ErrorBody(_Model):
    """The one error body every failing request gets."""

    code: ErrorCode
    message: str
    detail: dict[str, object] | None = None


class Health(_Model):
    status: Literal["ok", "not_ready", "wedged"]
    detail: dict[str, object] = Field(default_factory=dict)


class JobInfo(_Model):
    name: str
    path: str
    steps: int
    latest_step: int | None
    latest_good_step: int | None


class JobList(_Model):
    jobs: list[JobInfo]


class CheckpointList(_Model):
    """A job's steps: every one, oldest first (no ``limit``), or one page of them, newest first."""

    job: str
    checkpoints: list[CheckpointInfo]
    next: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="a page's cursor for the next (older) page; absent on the last page and on the whole list",
    )


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


class ReplicasHeld(_Request):
    """What the trainer's replica snapshot tier holds (docs/protocol.md, "Resume"): sent with a resume only."""

    step: Annotated[int, Field(ge=0, le=MAX_STEP)] = Field(description="the step held whole in the hosts' memory")
    slices: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=100_000)]] = Field(
        min_length=1, max_length=100_000,
        description="one entry per replica of the state: the slices it lives on (one slice each when the replica "
        "axis is across slices); a replica is whole when all its slices are among the request's `slices`",
    )
    training: TrainingMetadata | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the held step's training metadata (its mesh, arrays, batch and data position): the replicas "
        "are laid out from it; absent, from the newest step another tier holds good",
    )


class ResumeRequest(_Request):
    """Body of ``POST /v1/jobs/{job}/resume``."""

    policy: Literal["pause", "resize"] = "resize"
    alive_devices: Annotated[int, Field(ge=0, le=1_000_000)]
    slices: list[SliceAlive] | None = Field(
        default=None, max_length=100_000,
        description="the alive devices by slice (entries of one index add up); the plan is for alive_devices, and "
        "names no slice (slices_used, idle_slices empty, with a note) when these hold another number of devices",
    )
    step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    device_memory_bytes: Annotated[int, Field(ge=1, le=MAX_DEVICE_BYTES)] | None = Field(
        default=None, description="memory of one device; when given the plan checks the state fits"
    )
    memory_headroom_bytes: Annotated[int, Field(ge=0, le=MAX_DEVICE_BYTES)] = Field(
        default=0, description="per-device memory to leave free (activations, compiled programs)"
    )
    batch: BatchOptions = Field(default_factory=BatchOptions)
    use_memory_tier: bool = Field(
        default=True, description="prefer a whole host-memory snapshot at least as new as the newest good step"
    )
    replicas: ReplicasHeld | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the step the replica snapshot tier holds and the slices of each replica (absent: no such "
        "tier); the plan restores from it (`tier: \"replicas\"`) when a replica's slices are all alive and no "
        "tier holds a newer step",
    )
    # Who asks (docs/protocol.md, "Identity"); each left out of the body when unset, so older ckptd reads it.
    run_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the asking run's id (CKPTD_RUN_ID): a step saved by another run is refused unless "
        "`allow_foreign_run`",
    )
    process_count: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the asking run's JAX process count: a step saved by another count is refused unless "
        "`allow_foreign_topology` (a different mesh is never refused: that is what a resize is)",
    )
    allow_foreign_run: bool = Field(
        default=False, exclude_if=lambda v: not v, description="resume from a step another run saved (noted)"
    )
    allow_foreign_topology: bool = Field(
        default=False, exclude_if=lambda v: not v,
        description="resume from a step saved by another number of processes (noted)",
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
    items: dict[str, list[str]] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the step's Orbax items that hold arrays, each with its arrays (keys of `arrays`): e.g. "
        "MaxText's `items`. Absent when every array is in the item `default` (what trainer_client writes; "
        "older ckptd never sends it). With several items an array's key is `<item>.<leaf path>`",
    )
    data_position: int | None = Field(default=None, description="global sample index to resume reading at")
    global_batch: int | None = None
    batch: BatchPlan | None = None
    idle_devices: int = 0
    slices_used: list[int] = Field(default_factory=list, description="slices whose devices form the mesh, in order")
    idle_slices: list[SliceAlive] = Field(default_factory=list, description="alive devices left out, per slice")
    bytes_per_device: int | None = Field(default=None, description="state bytes per device on the new mesh")
    fits_memory: bool | None = None
    source: Literal["ckptd", "storage_scan", "memory_agreement"] = Field(
        default="ckptd", description="who made the plan: ckptd; the client from storage (`storage_scan`: ckptd did "
        "not answer); or the processes of a multi-controller job from their hosts' memory (`memory_agreement`)",
    )
    tier: Tier = Field(
        default=Tier.STORAGE, description="replicas: the trainer's replica snapshot tier (`path` empty); memory: "
        "`path` is a host-memory snapshot; storage: an Orbax step",
    )
    notes: list[str] = Field(default_factory=list)


class PeerFetchRequest(_Request):
    """Body of ``POST /v1/jobs/{job}/peer-fetch``: the trainer of host ``origin`` of a ``count``-host job, its memory
    wiped, asks its own host's ckptd to bring its part of ``step`` back from host ``source``'s copy
    (docs/multihost.md, "Peer copies"). Each field is bounded on its own; hosts that cannot be (``source`` the
    asker itself, an index not below ``count``) are not refused: the fetch fails, and the answer says why."""

    step: Annotated[int, Field(ge=0, le=MAX_STEP)] = Field(description="the step whose part is brought back")
    source: Annotated[int, Field(ge=0, lt=MAX_HOSTS)] = Field(description="the host whose sidecar keeps the copy")
    origin: Annotated[int, Field(ge=0, lt=MAX_HOSTS)] = Field(
        description="the asking host, whose part it is (its JAX process index)")
    count: Annotated[int, Field(ge=2, le=MAX_HOSTS)] = Field(description="the job's hosts (its JAX process count)")
    save_id: Annotated[str, Field(pattern=SAVE_ID_PATTERN)] | None = Field(
        default=None, description="the save the part must be of (`<job incarnation>-<step>`, equal in every "
        "host's part of one save); null: whichever save of the step the copy is",
    )


class PeerFetchAnswer(_Model):
    """The answer to a peer fetch, once it is done or given up (within the fetch's deadline: docs/multihost.md,
    "Peer copies"): the part is back, or why not (the trainer then restores from storage, as every host does)."""

    ok: bool = Field(description="the part is back in this host's shared memory (`<shm>/<job>/<step>/`), every "
                     "shard checked against its checksum")
    error: str | None = Field(default=None, exclude_if=lambda v: v is None,
                              description="why the part could not be brought back (when not `ok`)")


__all__ = [
    "API_PREFIX",
    "CURSOR_PATTERN",
    "DEFAULT_PAGE_LIMIT",
    "DEFAULT_PORT",
    "ERROR_STATUS",
    "JOB_NAME_PATTERN",
    "MAX_DEVICE_BYTES",
    "MAX_HOSTS",
    "MAX_PAGE_LIMIT",
    "MAX_STEP",
    "MEMORY_AND_PERSIST",
    "ROUTE_ADVICE",
    "ROUTE_CHECKPOINTS",
    "ROUTE_DASHBOARD",
    "ROUTE_EVENTS",
    "ROUTE_GOODPUT",
    "ROUTE_HEALTHZ",
    "ROUTE_JOBS",
    "ROUTE_LATEST_GOOD",
    "ROUTE_METRICS",
    "ROUTE_PEER_FETCH",
    "ROUTE_READYZ",
    "ROUTE_RESUME",
    "SAVE_ID_PATTERN",
    "BatchOptions",
    "CheckpointList",
    "ErrorBody",
    "ErrorCode",
    "Health",
    "JobInfo",
    "JobList",
    "PeerFetchAnswer",
    "PeerFetchRequest",
    "ReplicasHeld",
    "ResumePlan",
    "ResumeRequest",
    "SliceAlive",
    "Tier",
    "is_valid_job_name",
]
