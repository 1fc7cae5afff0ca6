"""The observability routes: trainers report elastic events, operators read them and the job's goodput.

``POST /v1/jobs/{job}/events`` stores a batch on storage (``ckptd.events``) and counts it in the metrics;
``GET /v1/jobs/{job}/events`` and ``GET /v1/jobs/{job}/goodput`` read the events back from storage, so
every sidecar of a job sees the events all of them stored. Wire models live in
``trainer_client.protocol``; errors are the one ``ErrorBody``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query

from ckptd.catalog import Catalog
from ckptd.errors import ApiError, InvalidJobName
from ckptd.events import EventStore
from ckptd.goodput import compute_goodput
from ckptd.metrics import Metrics
from trainer_client import protocol as p
from trainer_client.storage import StorageError

_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": p.ErrorBody} for status in (400, 401, 404, 422, 503)}


def add_event_routes(
    app: FastAPI, *, catalog: Catalog, store: EventStore, metrics: Metrics, check_job: Callable[[str], str]
) -> None:
    """Add the events and goodput routes; ``check_job`` validates a job name and that the job exists."""

    @app.post(p.ROUTE_EVENTS, response_model=p.EventAck, responses=_ERRORS, tags=["events"])
    def post_events(job: str, batch: p.EventBatch) -> p.EventAck:
        """Store a batch of events of a training run (trainer_client's reporter sends them).

        The job directory need not hold a step yet: events come before the first checkpoint. A resent
        batch is recognised by its event ids and not stored twice.
        """
        if not p.is_valid_job_name(job):
            raise InvalidJobName(job)
        try:
            stored, duplicates = store.append(job, batch.events)
        except (OSError, StorageError) as exc:
            raise ApiError(p.ErrorCode.STORAGE_ERROR, f"cannot store the events of {job!r}: {exc}") from exc
        metrics.observe_events(job, stored)
        return p.EventAck(job=job, accepted=len(stored), duplicates=duplicates)

    @app.get(p.ROUTE_EVENTS, response_model=p.EventList, responses=_ERRORS, tags=["events"],
             response_model_exclude_none=True)
    def get_events(
        job: str,
        since: Annotated[float | None, Query(description="only events at or after this Unix time")] = None,
        limit: Annotated[int, Query(ge=1, le=100_000, description="at most this many, the newest")] = 10_000,
    ) -> p.EventList:
        """The job's events, oldest first, read from storage (every sidecar's, deduplicated)."""
        events = store.load(check_job(job), since=since)
        return p.EventList(job=job, events=events[-limit:])

    @app.get(p.ROUTE_GOODPUT, response_model=p.Goodput, responses=_ERRORS, tags=["events"])
    def goodput(
        job: str,
        step_time_s: Annotated[float | None, Query(gt=0, description="a normal step's time; "
                                                   "default: measured from the events or checkpoints")] = None,
        since: Annotated[float | None, Query(description="only the window from this Unix time on")] = None,
    ) -> p.Goodput:
        """Productive training time over wall time, and the badput by cause (ckptd/goodput.py)."""
        events = store.load(check_job(job), since=since)
        result = compute_goodput(job, events, catalog.checkpoints(job), step_time_s=step_time_s)
        prefix = store.directory(job) + "/"
        skipped = [path for path in store.unreadable if path.startswith(prefix)]
        if skipped:
            result.notes.append(f"{len(skipped)} unreadable event file(s) skipped")
        return result


__all__ = ["add_event_routes"]
