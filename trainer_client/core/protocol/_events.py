"""Elastic events (``POST``/``GET /v1/jobs/{job}/events``) and goodput (``GET /v1/jobs/{job}/goodput``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from trainer_client.core.protocol._autopilot_event import AutopilotFields
from trainer_client.core.protocol._base import MAX_EXACT_INT, _Model, _Request
from trainer_client.core.protocol._wire import MAX_STEP

# What trainer_client's ElasticRunner emits, and what ckptd records itself (``retention_deleted``,
# ``retention_refused``: a deletion refused on gs:// because the step changed since it was decided, docs/gcs.md;
# ``persist_behind``: a memory snapshot became due for persisting while the job's previous persist was still
# running; ``persist_overtaken``: a snapshot waiting to be persisted was superseded by a newer one, not persisted).
# Other kinds matching ``EVENT_KIND_PATTERN`` are stored and served; metrics count them as ``other``.
EVENT_KINDS = (
    "start", "waiting_for_slices", "slices_ready", "plan_received", "initialized", "restored",
    "first_step_done", "checkpoint_started", "failure_detected", "scale_up_detected", "recovered",
    "finished", "aborted", "retention_deleted", "retention_refused", "replicas_unusable", "replicas_off",
    "replica_paced", "autopilot_decided", "persist_behind", "persist_overtaken",
)
EVENT_KIND_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
MAX_EVENTS_PER_BATCH = 1000
# A count or a size in an event (steps lost, snapshots skipped, bytes, a pid): metrics and goodput read it as a
# float, after the event was stored.
MAX_COUNT = MAX_EXACT_INT
_Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class _EventFields(_Request):
    """The fields of every kind of event but ``autopilot_decided``'s own (``ElasticEvent``)."""

    kind: str = Field(pattern=EVENT_KIND_PATTERN, description="what happened (see EVENT_KINDS)")
    # seconds are finite: an event at an infinite time (JSON's 1e400) would count in no goodput window
    time: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        description="wall-clock time of the event (Unix seconds)")
    step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    t: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        default=None, description="seconds since the run started (monotonic clock)")
    detail: str = Field(default="", max_length=2000)
    id: str | None = Field(default=None, max_length=200, description="unique per event; resends are deduplicated")
    run: str | None = Field(default=None, max_length=200, description="the run (process) that emitted it")
    host: str | None = Field(default=None, max_length=255)
    pid: _Count | None = None
    recovery_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="recovered: failure detected until the first step on the new mesh")
    lost_steps: _Count | None = Field(
        default=None, description="recovered: steps computed since the restored step, done again")
    restored_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    mesh_before: list[_Count] | None = Field(default=None, max_length=16)
    mesh_after: list[_Count] | None = Field(default=None, max_length=16)
    spares_used: list[_Count] | None = Field(
        default=None, max_length=1024,
        description="recovered: the hot spare slices that took lost slices' places (the mesh kept its shape)")
    blocked_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="checkpoint_started: how long the training loop was blocked by the save")
    tier: Literal["replicas", "memory", "memory+persist", "storage", "skipped"] | None = Field(
        default=None, description="checkpoint_started: where the save went; restored: where the state came from "
        "(the plan's tier: `replicas`, `memory`, `storage`)")
    restored_from: str | None = Field(
        default=None, max_length=2000,
        description="recovered: where the state came from (`replicas`, `memory: PATH`, `storage: PATH`; `none`: "
        "a fresh start)")
    # the replica snapshot tier's counters (checkpoint_started, recovered; docs/operations.md)
    replica_held_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    replica_age_seconds: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="seconds since the held replica snapshot was dispatched")
    replica_skips: _Count | None = Field(
        default=None, description="snapshots skipped so far because one was still in flight")
    replica_failures: _Count | None = Field(
        default=None, description="snapshots dropped so far because their copy failed (a slice lost mid-copy)")
    replica_bytes_held: _Count | None = Field(
        default=None, description="this host's bytes of the held replica snapshot")
    # the replica tier's pacing (replica_paced, checkpoint_started, recovered; docs/concepts.md, "Pacing the
    # replica tier")
    replica_period: Annotated[int, Field(ge=1, le=MAX_STEP)] | None = Field(
        default=None, description="a replica snapshot every this many steps (chosen from measured costs)")
    replica_memory_kind: Literal["pinned_host", "unpinned_host"] | None = Field(
        default=None, description="the host memory the replica snapshots are copied to")
    replica_copy_seconds: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="a snapshot's copy to host memory, measured (median)")
    replica_copy_bytes_per_second: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="the device-to-host rate of that copy")
    replica_overhead: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="the training loop's expected overhead at the chosen period (0.02: 2%)")
    replica_expected_lost_steps: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="steps a failure loses on average at the chosen period")
    # ckptd's persist of memory snapshots falling behind (persist_behind, persist_overtaken; docs/operations.md,
    # "Persists that fall behind"); ``step`` is the snapshot due (behind) or skipped (overtaken)
    persisting_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = Field(
        default=None, description="persist_behind, persist_overtaken: the step whose persist was still running")
    persist_running_seconds: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="persist_behind, persist_overtaken: how long that persist had been running")
    persist_bytes: _Count | None = Field(
        default=None, description="persist_behind, persist_overtaken: the bytes of the snapshot being persisted")
    superseded_by: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = Field(
        default=None, description="persist_overtaken: the newer step persisted in the skipped one's place")


class ElasticEvent(AutopilotFields, _EventFields):
    """One event of a training run, as trainer_client reports it (``EventBatch``); an ``autopilot_decided`` event
    carries the fields of ``AutopilotFields`` too."""


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
    """Productive training time over wall time, with where the rest went (ckptd/advisor/_goodput.py)."""

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
    "EVENT_KINDS",
    "EVENT_KIND_PATTERN",
    "MAX_COUNT",
    "MAX_EVENTS_PER_BATCH",
    "ElasticEvent",
    "EventAck",
    "EventBatch",
    "EventList",
    "Goodput",
    "GoodputCauses",
    "GoodputSegment",
    "StoredEvent",
]
