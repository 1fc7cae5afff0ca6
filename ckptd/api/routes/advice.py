"""``GET /v1/jobs/{job}/advice``: checkpoint periods and recovery policy from the goodput advisor."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ckptd.advisor.advisor import advice_for_job
from ckptd.api.errors import ERROR_RESPONSES
from ckptd.api.openapi import route_doc
from ckptd.api.services import Services
from trainer_client.core import protocol as p


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)

    @api.get(p.ROUTE_ADVICE, response_model=p.Advice, **route_doc("GET", p.ROUTE_ADVICE))
    def advice(job: str, query: Annotated[p.AdviceQuery, Query()]) -> p.Advice:
        """Checkpoint periods and recovery policy (ckptd/advisor/advisor.py); the job's history fills the gaps."""
        return advice_for_job(job, svc.catalog.checkpoints(svc.check_job(job)), query)

    return api


__all__ = ["router"]
