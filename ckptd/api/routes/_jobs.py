"""The checkpoint routes: jobs, a job's steps, its latest good step, and the resume plan.

Handlers only read the catalog (and, for a resume, rescan that one job first), so they answer in
milliseconds. What they answer is worked out by ``JobAnswers`` (``ckptd/api/_answers.py``: shared rounds,
serialised once, with an ``ETag``); ``If-None-Match`` naming it gets a ``304`` (``ckptd/api/_conditional.py``).
The hot two (latest-good, resume) usually reach ``JobAnswers`` by the hot path below FastAPI's routing
(``ckptd/api/_hot_path.py``); these routes answer the rest alike and carry the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query

from ckptd.api._answers import JobAnswers
from ckptd.api._conditional import respond
from ckptd.api._errors import ERROR_RESPONSES
from ckptd.api._json_body import JsonBodyRoute
from ckptd.api._openapi import route_doc
from ckptd.api._services import Services
from trainer_client.core import protocol as p

_IfNoneMatch = Annotated[str | None, Header(
    description="entity tags (`ETag`) of answers held: `304 Not Modified` when the answer's is among them")]
_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not Modified: the answer, worked out now, is the one whose `ETag` was sent in "
          "`If-None-Match`"}}


def router(svc: Services, answers: JobAnswers) -> APIRouter:
    api = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES, route_class=JsonBodyRoute)
    cat = svc.catalog

    @api.get(p.ROUTE_JOBS, response_model=p.JobList, **route_doc("GET", p.ROUTE_JOBS))
    def list_jobs() -> p.JobList:
        svc.require_ready()
        return p.JobList(jobs=cat.jobs())

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
        answer = await answers.checkpoints(job, limit, cursor)
        return respond(answer, if_none_match)

    @api.get(p.ROUTE_LATEST_GOOD, response_model=p.CheckpointInfo, responses=_NOT_MODIFIED,
             **route_doc("GET", p.ROUTE_LATEST_GOOD))
    async def latest_good(job: str, if_none_match: _IfNoneMatch = None) -> Any:
        return respond(await answers.latest_good(job), if_none_match)

    @api.post(p.ROUTE_RESUME, response_model=p.ResumePlan, responses=_NOT_MODIFIED, **route_doc("POST", p.ROUTE_RESUME))
    async def resume(job: str, request: p.ResumeRequest, if_none_match: _IfNoneMatch = None) -> Any:
        return respond(await answers.resume(job, request), if_none_match)

    return api


__all__ = ["router"]
