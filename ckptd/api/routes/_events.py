"""The observability routes: trainers report elastic events, operators read them and the job's goodput.

``POST /v1/jobs/{job}/events`` stores a batch on storage (``ckptd.events._events``) and counts it in the metrics;
it creates a job only with a token configured and within ``max_jobs``. ``GET /v1/jobs/{job}/events`` (the
events kept: a bounded window) and ``GET /v1/jobs/{job}/goodput`` (over the whole history, rotated events
included) read the events back from storage, so every sidecar of a job sees the events all of them stored.
Wire models live in ``trainer_client.core.protocol``; errors are the one ``ErrorBody``.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AfterValidator, Field

from ckptd.api._json_body import JsonBodyRoute
from ckptd.api._openapi import route_doc
from ckptd.api._services import Services
from ckptd.catalog._job_admission import JOB_LIMIT_REASON
from ckptd.errors import InvalidJobName, JobLimitReached, JobNotFound
from trainer_client.core import StorageError, UnsafePathError
from trainer_client.core import protocol as p

_log = logging.getLogger(__name__)
_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": p.ErrorBody} for status in (400, 401, 404, 409, 422, 503)
}
_NO_TOKEN = ("events create a job only when ckptd has a token (CKPTD_TOKEN); without one, a job exists once its "
             "training has created its directory")


def _known_kind(kind: str) -> str:
    if kind not in p.EVENT_KINDS:
        raise ValueError(f"not an event kind ckptd knows ({', '.join(p.EVENT_KINDS)})")
    return kind


# ?kind= filters by the kinds of EVENT_KINDS (an enum in the schema: a query string cannot tell the kind
# "false" from the boolean false, which schema-driven clients send as a wrong type).
_KnownKind = Annotated[str, AfterValidator(_known_kind), Field(json_schema_extra={"enum": list(p.EVENT_KINDS)})]


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["events"], responses=_ERRORS, route_class=JsonBodyRoute)

    @api.post(p.ROUTE_EVENTS, response_model=p.EventAck, **route_doc("POST", p.ROUTE_EVENTS))
    def post_events(job: str, batch: p.EventBatch) -> p.EventAck:
        """Store a batch of events of a training run (trainer_client's reporter sends them).

        The job directory need not hold a step yet: events come before the first checkpoint. A job that is
        not on storage is created only when ckptd has a token (the request carried it), and only within
        ``max_jobs`` (409 ``JOB_LIMIT``); without a token it is 404 ``JOB_NOT_FOUND``. A resent batch is
        recognised by its event ids and not stored twice.
        """
        if not p.is_valid_job_name(job):
            raise InvalidJobName(job)
        svc.require_ready()
        if svc.catalog.has_job(job):
            stored, duplicates = _append(job, batch)
        else:
            with creating:  # one new job at a time: concurrent posts cannot pass max_jobs together
                _may_create(job)
                stored, duplicates = _append(job, batch)
                svc.catalog.refresh_job(job)  # catalogued now: it counts toward max_jobs
        svc.metrics.observe_events(job, stored)
        return p.EventAck(job=job, accepted=len(stored), duplicates=duplicates)

    creating = threading.Lock()

    def _may_create(job: str) -> None:
        """Refuse events for ``job`` (not catalogued) unless it is on storage, or may be created."""
        svc.catalog.refresh_job(job)  # a job created on storage since the last scan
        if svc.catalog.has_job(job):
            return
        why = svc.catalog.refused.get(job)
        if why == JOB_LIMIT_REASON or (why is None and svc.settings.auth.token is not None and svc.catalog.full()):
            raise JobLimitReached(job, svc.catalog.max_jobs or 0)
        if why is not None:
            raise JobNotFound(job, why)
        if svc.settings.auth.token is None:
            raise JobNotFound(job, _NO_TOKEN)

    def _append(job: str, batch: p.EventBatch) -> tuple[list[p.StoredEvent], int]:
        try:
            return svc.events.append(job, batch.events)
        except UnsafePathError as exc:  # a link out of the root inside the job: where it leads stays in the log
            _log.warning("events of %r refused: %s", job, exc)
            raise JobNotFound(job, "its events directory is a link leading out of the checkpoint root") from exc
        except (OSError, StorageError) as exc:
            raise StorageError(f"cannot store the events of {job!r}: {exc}") from exc

    @api.get(p.ROUTE_EVENTS, response_model=p.EventList, response_model_exclude_none=True,
             **route_doc("GET", p.ROUTE_EVENTS))
    def get_events(
        job: str,
        since: Annotated[float | None, Query(description="only events at or after this Unix time")] = None,
        limit: Annotated[int, Query(ge=1, le=100_000, description="at most this many, the newest")] = 10_000,
        kind: Annotated[list[_KnownKind] | None, Query(
            max_length=64, description="only events of these kinds (repeat it: kind=failure_detected&kind=recovered)",
        )] = None,
    ) -> p.EventList:
        """The job's events, oldest first, read from storage (every sidecar's, deduplicated)."""
        events = svc.events.load(svc.check_job(job), since=since)
        if kind:
            events = [e for e in events if e.kind in kind]
        return p.EventList(job=job, events=events[-limit:])

    @api.get(p.ROUTE_GOODPUT, response_model=p.Goodput, **route_doc("GET", p.ROUTE_GOODPUT))
    def goodput(
        job: str,
        step_time_s: Annotated[float | None, Query(gt=0, description="a normal step's time; "
                                                   "default: measured from the events or checkpoints")] = None,
        since: Annotated[float | None, Query(description="only the window from this Unix time on")] = None,
    ) -> p.Goodput:
        """Productive training time over wall time, and the badput by cause (ckptd/advisor/_goodput.py)."""
        result = svc.events.goodput(svc.check_job(job), svc.catalog.checkpoints(job), step_time_s=step_time_s,
                                    since=since)
        prefix = svc.events.directory(job) + "/"
        skipped = [path for path in svc.events.unreadable if path.startswith(prefix)]
        if skipped:
            result.notes.append(f"{len(skipped)} unreadable event file(s) skipped")
        return result

    return api


__all__ = ["router"]
