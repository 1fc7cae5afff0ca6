"""``GET /v1/jobs/{job}/advice``: checkpoint periods and recovery policy from the goodput advisor.

The route is async: the job's history (its steps and its events) is read on the handler pool like any other
route's reads, and the simulation runs on the advice runner's own threads under a work budget
(ckptd/api/_advice_runner.py), so advice never holds the threads that answer resumes, and never runs without end.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Query, Request

from ckptd.advisor._advisor import advice_for_job
from ckptd.advisor._budget import WorkBudget
from ckptd.api._errors import ERROR_RESPONSES
from ckptd.api._openapi import route_doc
from ckptd.api._services import Services
from trainer_client.core import protocol as p
from trainer_client.core.protocol import CheckpointInfo, StoredEvent


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)

    @api.get(p.ROUTE_ADVICE, response_model=p.Advice, **route_doc("GET", p.ROUTE_ADVICE))
    async def advice(job: str, query: Annotated[p.AdviceQuery, Query()], request: Request) -> p.Advice:
        """Checkpoint periods and recovery policy (ckptd/advisor/_advisor.py); the job's history fills the gaps."""

        def history() -> tuple[list[CheckpointInfo], list[StoredEvent]]:
            checked = svc.check_job(job)
            return svc.catalog.checkpoints(checked), svc.events.load(checked)

        checkpoints, events = await anyio.to_thread.run_sync(history)

        def compute(budget: WorkBudget) -> p.Advice:
            return advice_for_job(job, checkpoints, query, events=events, budget=budget)

        return await svc.advice.run(compute, request)

    return api


__all__ = ["router"]
