"""The events' settings group (``EventSettings``), beside the event store that uses it (``_events.py``): how many
of the trainers' events ckptd keeps, per job on storage and over all jobs in memory.

``ckptd/config.py`` composes it into ``Settings``; it keeps the ``CKPTD_EVENTS_*`` variable names it always had.
This module imports nothing of the event store, so the shared layer can compose it (docs/architecture.md,
"Package map").
"""

from __future__ import annotations

from pydantic import Field

from ckptd._settings_group import SettingsGroup


class EventSettings(SettingsGroup):
    """How many of the trainers' events ckptd keeps, per job on storage and over all jobs in memory."""

    events_max_per_job: int = Field(
        default=10_000, ge=100, le=10_000_000,
        description="events kept per job on storage and in memory; older batches are folded into the job's event "
        "summary (goodput and totals keep counting them) and deleted",
    )
    events_max_bytes_per_job: int = Field(
        default=8 << 20, ge=64 << 10, description="bytes of event files kept per job (folded past it, like the events)",
    )
    events_memory_bytes: int = Field(
        default=64 << 20, ge=1 << 20,
        description="events held in memory over all jobs (file bytes + 1.5 KiB per event); the jobs used least "
        "recently are dropped first and read again when asked for",
    )


__all__ = ["EventSettings"]
