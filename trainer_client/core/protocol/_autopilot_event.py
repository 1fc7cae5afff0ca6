"""The fields of an ``autopilot_decided`` event: the runner's autopilot re-chose the checkpoint periods of its tiers
(docs/planning.md, "Autopilot in a run").

Apart from ``_events`` (which ``ElasticEvent`` inherits them into) because they are many and of one concern: what
``trainer_client.core.planning.Decision.fields()`` gives, flat, so that ckptd stores, counts and exports them like
every other event field (the chosen periods and the estimated MTBF are gauges: ckptd/_metrics.py), and so that a
reader of the stored events sees each decision's inputs and the expected goodput before and after it. The tiers
are the resume plan's (``replicas``, ``memory``, ``storage``); a tier the run does not have, or that is off, has no
period. Additive: an older trainer sends none of them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from trainer_client.core.protocol._base import _Request
from trainer_client.core.protocol._wire import MAX_STEP

_Period = Annotated[int, Field(ge=1, le=MAX_STEP)] | None
_Seconds = Annotated[float, Field(ge=0)] | None
_Fraction = Annotated[float, Field(ge=0, le=1)] | None
_Amount = Annotated[float, Field(ge=0)] | None  # bytes, requests, or a rate of them
_Bound = str | None


class AutopilotFields(_Request):
    """``autopilot_decided``: the decision, its inputs and what it expects (each ``None`` on other events)."""

    autopilot_changed: bool | None = Field(default=None, description="the periods in force changed")
    autopilot_reason: str | None = Field(default=None, max_length=2000, description="why they did or did not")
    autopilot_goodput_before: _Fraction = Field(
        default=None, description="expected goodput of the periods in force before, on the new inputs")
    autopilot_goodput_after: _Fraction = Field(default=None, description="expected goodput of the periods after")
    autopilot_mtbf_s: _Seconds = Field(default=None, description="the job's estimated mean time between failures")
    autopilot_mtbf_source: Literal["prior", "history"] | None = Field(
        default=None, description="whether the estimate stands mostly on the prior or on the failures seen")
    autopilot_failures_seen: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = Field(
        default=None, description="failures the estimate has seen (this run's)")
    autopilot_step_s: _Seconds = Field(default=None, description="the step time measured")
    autopilot_lost_steps: _Seconds = Field(default=None, description="steps a failure is expected to lose")
    # the constraints in force (None: no limit) and who chose
    autopilot_max_lost_steps: _Amount = Field(default=None, description="the bound on steps lost per failure")
    autopilot_host_memory_bytes: _Amount = Field(
        default=None, description="what the host-memory tiers may hold together on a host")
    autopilot_host_memory_source: str | None = Field(
        default=None, max_length=200, description="where that budget comes from (`option`, or the file read)")
    autopilot_storage_bytes_per_s: _Amount = Field(
        default=None, description="the storage bandwidth the job's saves may use, every host together")
    autopilot_storage_requests_per_s: _Amount = Field(
        default=None, description="the storage requests per second the job's saves may make, every host together")
    autopilot_processes: Annotated[int, Field(ge=1, le=MAX_STEP)] | None = Field(
        default=None, description="the processes that apply these periods from this step (a multi-controller job's)")
    autopilot_decided_by: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = Field(
        default=None, description="the process whose measurements chose them (0 in a multi-controller job)")
    # per tier (replicas, memory: shared memory, storage): the period chosen and the costs it was chosen from
    autopilot_replicas_period: _Period = Field(default=None, description="replicas: a save every this many steps")
    autopilot_replicas_block_s: _Seconds = Field(default=None, description="replicas: loop time one save costs")
    autopilot_replicas_copy_s: _Seconds = Field(
        default=None, description="replicas: from a save's start until it is usable")
    autopilot_replicas_recovery_s: _Seconds = Field(
        default=None, description="replicas: a recovery from it, restore to first step done")
    autopilot_replicas_survives: _Fraction = Field(
        default=None, description="replicas: share of failures after which it or a faster tier is usable")
    autopilot_replicas_host_bytes: _Amount = Field(
        default=None, description="replicas: host memory it holds while on")
    autopilot_replicas_write_bytes: _Amount = Field(
        default=None, description="replicas: bytes one save writes to storage")
    autopilot_replicas_requests: _Amount = Field(default=None, description="replicas: storage requests one save makes")
    autopilot_replicas_bound: _Bound = Field(
        default=None, max_length=100, description="replicas: what set its period where Young/Daly did not (`copy`, "
        "`storage bandwidth`, `storage requests`, `bound`, ...)")
    autopilot_memory_period: _Period = Field(default=None, description="memory: a save every this many steps")
    autopilot_memory_block_s: _Seconds = Field(default=None, description="memory: loop time one save costs")
    autopilot_memory_copy_s: _Seconds = Field(
        default=None, description="memory: from a save's start until it is usable")
    autopilot_memory_recovery_s: _Seconds = Field(
        default=None, description="memory: a recovery from it, restore to first step done")
    autopilot_memory_survives: _Fraction = Field(
        default=None, description="memory: share of failures after which it or a faster tier is usable")
    autopilot_memory_host_bytes: _Amount = Field(
        default=None, description="memory: host memory it holds while on")
    autopilot_memory_write_bytes: _Amount = Field(
        default=None, description="memory: bytes one save writes to storage")
    autopilot_memory_requests: _Amount = Field(default=None, description="memory: storage requests one save makes")
    autopilot_memory_bound: _Bound = Field(
        default=None, max_length=100, description="memory: what set its period where Young/Daly did not (`copy`, "
        "`storage bandwidth`, `storage requests`, `bound`, ...)")
    autopilot_storage_period: _Period = Field(default=None, description="storage: a save every this many steps")
    autopilot_storage_block_s: _Seconds = Field(default=None, description="storage: loop time one save costs")
    autopilot_storage_copy_s: _Seconds = Field(
        default=None, description="storage: from a save's start until it is usable")
    autopilot_storage_recovery_s: _Seconds = Field(
        default=None, description="storage: a recovery from it, restore to first step done")
    autopilot_storage_survives: _Fraction = Field(
        default=None, description="storage: share of failures after which it or a faster tier is usable")
    autopilot_storage_host_bytes: _Amount = Field(
        default=None, description="storage: host memory it holds while on")
    autopilot_storage_write_bytes: _Amount = Field(
        default=None, description="storage: bytes one save writes to storage")
    autopilot_storage_requests: _Amount = Field(default=None, description="storage: storage requests one save makes")
    autopilot_storage_bound: _Bound = Field(
        default=None, max_length=100, description="storage: what set its period where Young/Daly did not (`copy`, "
        "`storage bandwidth`, `storage requests`, `bound`, ...)")


__all__ = ["AutopilotFields"]
