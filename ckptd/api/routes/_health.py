"""Probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``.

The probes are async: they run on the event loop, never queued behind busy worker threads (a liveness
probe that waits on a slow listing would get a loaded ckptd restarted). They touch no storage. Liveness
still sees a wedged pool: ``/healthz`` answers 503 once a probe task has waited ``CKPTD_WEDGED_AFTER_S``
for a handler thread (``ckptd.api._pool_watch``). ``/readyz`` shows its details (the storage root, the last
refresh, the last error, with a lease each job's leader, and each job whose lock a commit could not take:
``job_locks``) only to a caller with the bearer token when one
is configured: anyone who can reach the port may probe, not learn where the checkpoints live or what failed
reading them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ckptd.api._auth import BearerAuth
from ckptd.api._openapi import route_doc
from ckptd.api._services import Services
from trainer_client.core import protocol as p


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["health"])
    cat = svc.catalog
    token = svc.settings.auth.token.encode("utf-8") if svc.settings.auth.token else None

    @api.get(p.ROUTE_HEALTHZ, response_model=p.Health, responses={503: {"model": p.Health}},
             **route_doc("GET", p.ROUTE_HEALTHZ))
    async def healthz() -> Any:
        waited = svc.pool_watch.check()  # never waits: a loaded ckptd is slow, not dead (ckptd/api/_pool_watch.py)
        if waited is not None:
            detail: dict[str, object] = {"handler_pool_waited_s": round(waited, 3),
                                         "wedged_after_s": svc.settings.limits.wedged_after_s}
            return JSONResponse(status_code=503, content=p.Health(status="wedged", detail=detail).model_dump())
        return p.Health(status="ok")

    @api.get(p.ROUTE_READYZ, response_model=p.Health, responses={503: {"model": p.Health}},
             **route_doc("GET", p.ROUTE_READYZ))
    async def readyz(request: Request) -> Any:
        detail: dict[str, object] = {}
        if token is None or BearerAuth.carries_token(request.scope, token):  # the root and errors: the token only
            detail = {"root": svc.settings.storage.root, "last_refresh": cat.last_refresh}
            if cat.last_error:
                detail["last_error"] = cat.last_error
            troubles = cat.lock_troubles()  # refused, or held elsewhere past the bound (ckptd/catalog/_job_lock.py)
            if troubles:
                detail["job_locks"] = troubles
            if cat.lease is not None:  # per job: leader or follower, the epoch and its holder (docs/multihost.md)
                detail["lease"] = {"holder": cat.lease.holder,
                                   "jobs": {job: v.as_dict() for job, v in cat.lease.views().items()}}
        if not cat.ready.is_set():
            return JSONResponse(status_code=503, content=p.Health(status="not_ready", detail=detail).model_dump())
        return p.Health(status="ok", detail=detail)

    @api.get(p.ROUTE_METRICS, response_class=Response, **route_doc("GET", p.ROUTE_METRICS))
    def metrics_endpoint() -> Response:
        return Response(svc.metrics.render(cat), media_type=CONTENT_TYPE_LATEST)

    return api


__all__ = ["router"]
