"""The checkpoint routes: jobs, a job's steps, its latest good step, and the resume plan.

Handlers only read the catalog (and, for a resume, rescan that one job first), so they answer in
milliseconds. Lists, latest-good and resume plans are serialised here, not by FastAPI (its response_model
would dump and validate a 1,000-array plan again on every answer); identical requests asked together
share one round of checks begun after they arrived (``ckptd/api/coalesce.py``), which also makes the
answer's ``ETag`` (``ckptd/api/conditional.py``: ``If-None-Match`` gets a ``304``). A job's list is built
once per catalog version and paged newest first (``ckptd/api/listing.py``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query

from ckptd.api.conditional import Tagged, respond, tag
from ckptd.api.errors import ERROR_RESPONSES
from ckptd.api.listing import Listing
from ckptd.api.openapi import route_doc
from ckptd.api.services import Services
from ckptd.errors import NoGoodCheckpoint, NotReady, ServiceError, StepNotFound, StepNotGood
from trainer_client.core import protocol as p
from trainer_client.core.errors import PlanningError
from trainer_client.core.format.snapshot import newest_whole
from trainer_client.core.planner import memory_snapshot_plan
from trainer_client.core.step_plan import plan_for_step

# Refusals that name no catalogued job: not counted per job (a label per unknown name would grow without bound).
_NOT_A_JOB = frozenset({p.ErrorCode.INVALID_JOB_NAME, p.ErrorCode.JOB_NOT_FOUND, p.ErrorCode.NOT_READY})
_IfNoneMatch = Annotated[str | None, Header(
    description="entity tags (`ETag`) of answers held: `304 Not Modified` when the answer's is among them")]
_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not Modified: the answer, worked out now, is the one whose `ETag` was sent in "
          "`If-None-Match`"}}


def _good_step(svc: Services, job: str, request: p.ResumeRequest, info: p.CheckpointInfo | None) -> p.CheckpointInfo:
    if info is None:
        if request.step is None:
            raise _none_yet(svc, job)
        raise StepNotFound(job, request.step)
    if info.state is p.StepState.COMMITTED:
        raise _pending(job, info.step)
    if info.state is not p.StepState.VERIFIED:
        raise StepNotGood(f"step {request.step} of job {job!r} is {info.state.value}: {info.reason}")
    return info


def _none_yet(svc: Services, job: str) -> ServiceError:
    """Why a job has no good step: none at all (404), or committed steps still being verified (503 with
    Retry-After: "no checkpoint" must mean none, never "not checked yet")."""
    pending = svc.catalog.newest(job, p.StepState.COMMITTED)
    return NoGoodCheckpoint(job) if pending is None else _pending(job, pending.step)


def _pending(job: str, step: int) -> NotReady:
    return NotReady(f"step {step} of job {job!r} is committed and still being verified; retry shortly")


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)
    cat = svc.catalog

    @api.get(p.ROUTE_JOBS, response_model=p.JobList, **route_doc("GET", p.ROUTE_JOBS))
    def list_jobs() -> p.JobList:
        svc.require_ready()
        return p.JobList(jobs=cat.jobs())

    def _listing(job: str) -> Listing:
        """The job's steps serialised once per catalog version (10,000 steps: ~3 MB, ~1 s of GIL to build;
        64 clients listing at once used to build it 64 times)."""
        svc.check_job(job)
        version = cat.version  # read before the rows: a change after it gives a newer version, never a stale hit
        kept = svc.listings.get(job)
        if kept is not None and kept.version == version:
            return kept
        kept = svc.listings[job] = Listing.build(job, version, cat.checkpoints(job))
        return kept

    def _list_answer(job: str, limit: int | None, cursor: str | None) -> Tagged:
        listing = _listing(job)
        if limit is None and cursor is None:
            return listing.whole()
        return tag(listing.page(limit or p.DEFAULT_PAGE_LIMIT, cursor), "list", job, str(limit), str(cursor))

    @api.get(p.ROUTE_CHECKPOINTS, response_model=p.CheckpointList, responses=_NOT_MODIFIED,
             **route_doc("GET", p.ROUTE_CHECKPOINTS))
    async def list_checkpoints(
        job: str,
        limit: Annotated[int | None, Query(ge=1, le=p.MAX_PAGE_LIMIT, description=(
            "page size: answer at most this many steps, newest first, with a `next` cursor when older ones "
            f"remain (without `limit` and `cursor`: every step, oldest first; a cursor alone: "
            f"{p.DEFAULT_PAGE_LIMIT})"))] = None,
        cursor: Annotated[str | None, Query(pattern=p.CURSOR_PATTERN, description=(
            "the `next` of the previous page (opaque): the page continues below the last step it gave"))] = None,
        if_none_match: _IfNoneMatch = None,
    ) -> Any:
        answer = await svc.answers.answer(("list", job, limit, cursor), lambda: _list_answer(job, limit, cursor))
        return respond(answer, if_none_match)

    def _latest_good(job: str) -> Tagged:
        info = cat.confirmed_latest_good(svc.check_job(job))
        if info is None:
            raise _none_yet(svc, job)
        return tag(info.model_dump_json().encode(), "latest-good", job)

    @api.get(p.ROUTE_LATEST_GOOD, response_model=p.CheckpointInfo, responses=_NOT_MODIFIED,
             **route_doc("GET", p.ROUTE_LATEST_GOOD))
    async def latest_good(job: str, if_none_match: _IfNoneMatch = None) -> Any:
        # Asked together, answered together: one round of checks on storage begun after the request arrived.
        answer = await svc.answers.answer(("latest-good", job), lambda: _latest_good(job))
        return respond(answer, if_none_match)

    def _answer(job: str, request: p.ResumeRequest, asked: str) -> Tagged:
        """The resume plan and its tag, from checks made now (run by a worker thread, once per round)."""
        return tag(_plan(job, request), "resume", job, asked)

    def _plan(job: str, request: p.ResumeRequest) -> bytes:
        """The resume plan's bytes, from checks made now."""
        svc.check_job(job)
        cat.refresh_job(job, quick=True)  # the newest committed step, even if the last periodic scan missed it
        shm_dir = svc.settings.shm_dir
        snapshot = newest_whole(shm_dir, job, at_most=request.step) if request.use_memory_tier else None
        if snapshot is not None and request.step is not None and snapshot[1].step != request.step:
            snapshot = None
        info = cat.confirmed_latest_good(job) if request.step is None else cat.confirmed_step(job, request.step)
        if snapshot is not None and (info is None or info.state is not p.StepState.VERIFIED
                                     or snapshot[1].step >= info.step):
            return memory_snapshot_plan(job=job, request=request, snapshot=snapshot).model_dump_json().encode()
        good = _good_step(svc, job, request, info)
        layout = cat.layout(good)  # the step's read_step_layout, read once and kept (ckptd/catalog/catalog.py)
        return svc.plans.answer(  # planned once per (step, request): ckptd/api/plan_cache.py
            good.path, request.model_dump_json(), layout,
            # the one planner `ckptd plan` and the client's fallback call too (trainer_client/core/step_plan.py)
            lambda: plan_for_step(cat.storage, good.path, request, job=job, step=good.step,
                                  layout=layout).model_dump_json().encode(),
        )

    @api.post(p.ROUTE_RESUME, response_model=p.ResumePlan, responses=_NOT_MODIFIED, **route_doc("POST", p.ROUTE_RESUME))
    async def resume(job: str, request: p.ResumeRequest, if_none_match: _IfNoneMatch = None) -> Any:
        started = time.perf_counter()
        # The hosts of a job ask together and alike: requests that arrive while the same question is being
        # answered share the next answer, worked out after they arrived. The request as asked (devices alive,
        # allow flags, identity) keys the round and is part of the answer's tag.
        asked = request.model_dump_json()
        try:
            answer = await svc.answers.answer(("resume", job, asked), lambda: _answer(job, request, asked))
        except (ServiceError, PlanningError) as exc:
            if exc.code not in _NOT_A_JOB:  # no metric label for names that are not jobs
                svc.metrics.resume_requests.labels(job).inc()
            raise
        svc.metrics.resume_requests.labels(job).inc()
        svc.metrics.plan_seconds.observe(time.perf_counter() - started)
        return respond(answer, if_none_match)

    return api


__all__ = ["router"]
