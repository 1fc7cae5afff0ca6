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
    autopilot_failures_seen: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="failures the estimate has seen (this run's)")
    autopilot_step_s: _Seconds = Field(default=None, description="the step time measured")
    autopilot_lost_steps: _Seconds = Field(default=None, description="steps a failure is expected to lose")
    # per tier (replicas, memory: shared memory, storage): the period chosen and the costs it was chosen from
    autopilot_replicas_period: _Period = Field(default=None, description="replicas: a save every this many steps")
    autopilot_replicas_block_s: _Seconds = Field(default=None, description="replicas: loop time one save costs")
    autopilot_replicas_copy_s: _Seconds = Field(
        default=None, description="replicas: from a save's start until it is usable")
    autopilot_replicas_recovery_s: _Seconds = Field(
        default=None, description="replicas: a recovery from it, restore to first step done")
    autopilot_replicas_survives: _Fraction = Field(
        default=None, description="replicas: share of failures after which it or a faster tier is usable")
    autopilot_memory_period: _Period = Field(default=None, description="memory: a save every this many steps")
    autopilot_memory_block_s: _Seconds = Field(default=None, description="memory: loop time one save costs")
    autopilot_memory_copy_s: _Seconds = Field(
        default=None, description="memory: from a save's start until it is usable")
    autopilot_memory_recovery_s: _Seconds = Field(
        default=None, description="memory: a recovery from it, restore to first step done")
    autopilot_memory_survives: _Fraction = Field(
        default=None, description="memory: share of failures after which it or a faster tier is usable")
    autopilot_storage_period: _Period = Field(default=None, description="storage: a save every this many steps")
    autopilot_storage_block_s: _Seconds = Field(default=None, description="storage: loop time one save costs")
    autopilot_storage_copy_s: _Seconds = Field(
        default=None, description="storage: from a save's start until it is usable")
    autopilot_storage_recovery_s: _Seconds = Field(
        default=None, description="storage: a recovery from it, restore to first step done")
    autopilot_storage_survives: _Fraction = Field(
        default=None, description="storage: share of failures after which it or a faster tier is usable")


__all__ = ["AutopilotFields"]
