"""The sidecar's HTTP service: ``create_app(settings)`` builds the FastAPI app over a catalog.

Routes and wire models come from ``trainer_client.protocol``; every failure leaves as the one
``ErrorBody`` with a stable code (``ckptd.errors``). Handlers only read the catalog (and, for a resume,
rescan that one job first), so they answer in milliseconds; array bytes never cross HTTP.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptd import __version__
from ckptd.advisor import advice_for_job
from ckptd.catalog import Catalog, Refresher
from ckptd.config import Settings
from ckptd.errors import ApiError, InvalidJobName, JobNotFound, NoGoodCheckpoint
from ckptd.retention import prune
from trainer_client import protocol as p
from trainer_client.planning import PlanningError, resume_plan
from trainer_client.saved_layout import saved_layout
from trainer_client.storage import Storage, StorageError

_log = logging.getLogger(__name__)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorBody} for status in (400, 401, 404, 409, 422, 503)
}


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ckptd_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=self.registry,
        )
        self.plan_seconds = Histogram(
            "ckptd_resume_plan_seconds", "time to answer a resume request", registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.latest_good = Gauge(
            "ckptd_latest_good_step", "newest committed step per job", ["job"], registry=self.registry
        )
        self.steps = Gauge("ckptd_steps", "catalogued steps by job and state", ["job", "state"],
                           registry=self.registry)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content=err.body().model_dump(mode="json", exclude_none=True))


def create_app(settings: Settings, catalog: Catalog | None = None, *, background: bool = True) -> FastAPI:
    """Build the ckptd app for ``settings``.

    ``catalog`` may be given (tests); otherwise one is opened over ``settings.root``. With
    ``background`` the catalog is rebuilt and refreshed by a thread started in the app's lifespan.
    """
    if catalog is None:
        catalog = Catalog(Storage(settings.root), settings.catalog_path(), save_timeout_s=settings.save_timeout_s)
    cat = catalog
    metrics = _Metrics()
    policy = settings.retention()
    refresher = Refresher(
        cat, settings.refresh_interval_s,
        maintenance=(lambda: prune(cat, policy)) if policy.prunes_good_steps or policy.clean_abandoned else None,
        maintenance_interval_s=settings.gc_interval_s,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if background:
            refresher.start()
        try:
            yield
        finally:
            if background:
                refresher.stop()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Checkpoint sidecar for elastic JAX training: where to resume, and on which mesh.",
        lifespan=lifespan,
    )
    app.state.catalog = cat
    app.state.settings = settings

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()
        ]
        return _error_response(
            ApiError(p.ErrorCode.INVALID_REQUEST, "the request does not match the API", {"errors": errors})
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: p.ErrorCode.ROUTE_NOT_FOUND, 405: p.ErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, p.ErrorCode.INVALID_REQUEST
        )
        return _error_response(ApiError(code, str(exc.detail)))

    @app.exception_handler(StorageError)
    async def _storage(_: Request, exc: StorageError) -> JSONResponse:
        return _error_response(ApiError(p.ErrorCode.STORAGE_ERROR, str(exc)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's mistake: the one error body still, without internals (Starlette
        # re-raises the exception afterwards, so the server logs it with its traceback).
        return _error_response(ApiError(p.ErrorCode.INTERNAL, "internal error; see the ckptd log"))

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if settings.token and request.url.path.startswith(p.API_PREFIX):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {settings.token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                response: Response = _error_response(
                    ApiError(p.ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")
                )
                metrics.requests.labels("auth", str(response.status_code)).inc()
                return response
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    def _job(job: str) -> str:
        if not p.is_valid_job_name(job):
            raise InvalidJobName(job)
        if not cat.ready.is_set():
            raise ApiError(p.ErrorCode.NOT_READY, "the catalog is still being built from storage; retry")
        if not cat.has_job(job):
            cat.refresh_job(job)  # a job created since the last scan
            if not cat.has_job(job):
                raise JobNotFound(job)
        return job

    @app.get(p.ROUTE_HEALTHZ, response_model=p.Health, tags=["health"])
    def healthz() -> p.Health:
        return p.Health(status="ok")

    @app.get(p.ROUTE_READYZ, response_model=p.Health, tags=["health"],
             responses={503: {"model": p.Health}})
    def readyz() -> Any:
        detail: dict[str, object] = {"root": settings.root, "last_refresh": cat.last_refresh}
        if cat.last_error:
            detail["last_error"] = cat.last_error
        if not cat.ready.is_set():
            return JSONResponse(status_code=503, content=p.Health(status="not_ready", detail=detail).model_dump())
        return p.Health(status="ok", detail=detail)

    @app.get(p.ROUTE_METRICS, tags=["health"], response_class=Response)
    def metrics_endpoint() -> Response:
        metrics.latest_good.clear()  # jobs and steps that left storage must leave the metrics too
        metrics.steps.clear()
        for job in cat.jobs():
            if job.latest_good_step is not None:
                metrics.latest_good.labels(job.name).set(job.latest_good_step)
            counts: dict[str, int] = {}
            for ck in cat.checkpoints(job.name):
                counts[ck.state.value] = counts.get(ck.state.value, 0) + 1
            for state in p.StepState:
                metrics.steps.labels(job.name, state.value).set(counts.get(state.value, 0))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(p.ROUTE_JOBS, response_model=p.JobList, responses=_ERROR_RESPONSES, tags=["jobs"])
    def list_jobs() -> p.JobList:
        if not cat.ready.is_set():
            raise ApiError(p.ErrorCode.NOT_READY, "the catalog is still being built from storage; retry")
        return p.JobList(jobs=cat.jobs())

    @app.get(p.ROUTE_CHECKPOINTS, response_model=p.CheckpointList, responses=_ERROR_RESPONSES, tags=["jobs"])
    def list_checkpoints(job: str) -> p.CheckpointList:
        return p.CheckpointList(job=_job(job), checkpoints=cat.checkpoints(job))

    @app.get(p.ROUTE_LATEST_GOOD, response_model=p.CheckpointInfo, responses=_ERROR_RESPONSES, tags=["jobs"])
    def latest_good(job: str) -> p.CheckpointInfo:
        info = cat.confirmed_latest_good(_job(job))
        if info is None:
            raise NoGoodCheckpoint(job)
        return info

    @app.post(p.ROUTE_RESUME, response_model=p.ResumePlan, responses=_ERROR_RESPONSES, tags=["jobs"])
    def resume(job: str, request: p.ResumeRequest) -> p.ResumePlan:
        started = time.perf_counter()
        _job(job)
        cat.refresh_job(job)  # the newest committed step, even if the last periodic scan missed it
        if request.step is None:
            info = cat.confirmed_latest_good(job)
            if info is None:
                raise NoGoodCheckpoint(job)
        else:
            info = cat.confirmed_step(job, request.step)
            if info is None:
                raise ApiError(p.ErrorCode.STEP_NOT_FOUND, f"job {job!r} has no step {request.step}")
            if info.state is not p.StepState.VERIFIED:
                raise ApiError(
                    p.ErrorCode.STEP_NOT_GOOD,
                    f"step {request.step} of job {job!r} is {info.state.value}: {info.reason}",
                )
        layout = saved_layout(cat.storage, info.path, info.training)
        try:
            plan = resume_plan(
                job=job, step=info.step, path=info.path, request=request,
                training=info.training, saved_layout=layout,
            )
        except PlanningError as exc:
            raise ApiError(exc.code, exc.message) from exc
        metrics.plan_seconds.observe(time.perf_counter() - started)
        return plan

    @app.get(p.ROUTE_ADVICE, response_model=p.Advice, responses=_ERROR_RESPONSES, tags=["jobs"])
    def advice(job: str, query: Annotated[p.AdviceQuery, Query()]) -> p.Advice:
        """Checkpoint periods and recovery policy (ckptd/advisor.py); the job's history fills the gaps."""
        return advice_for_job(job, cat.checkpoints(_job(job)), query)

    return app


__all__ = ["create_app"]
