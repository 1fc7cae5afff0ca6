"""The sidecar's HTTP service: ``create_app(settings)`` builds the FastAPI app over a catalog.

Routes and wire models come from ``trainer_client.protocol``; every failure leaves as the one
``ErrorBody`` with a stable code (``ckptd.errors``). Handlers only read the catalog (and, for a resume,
rescan that one job first), so they answer in milliseconds; array bytes never cross HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptd import __version__
from ckptd.advisor import advice_for_job
from ckptd.catalog import Catalog, Refresher
from ckptd.coalesce import Coalescer
from ckptd.commit_tracker import CommitTracker
from ckptd.config import Settings
from ckptd.dashboard import add_dashboard_route
from ckptd.errors import ApiError, InvalidJobName, JobNotFound, NoGoodCheckpoint
from ckptd.event_routes import add_event_routes
from ckptd.events import EventStore, record_retention
from ckptd.hardening import BearerAuth, BodySizeLimit, document_errors, limit_worker_threads
from ckptd.metrics import Metrics
from ckptd.plan_cache import PlanCache
from ckptd.retention import prune
from ckptd.route_docs import describe_routes
from ckptd.snapshots import SnapshotKeeper
from trainer_client import protocol as p
from trainer_client.planning import PlanningError, memory_snapshot_plan, resume_plan
from trainer_client.snapshot_format import newest_whole
from trainer_client.storage import Storage, StorageError

_log = logging.getLogger(__name__)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorBody} for status in (400, 401, 404, 409, 422, 503)
}


# Refusals that name no catalogued job: not counted per job (a label per unknown name would grow without bound).
_NOT_A_JOB = frozenset({p.ErrorCode.INVALID_JOB_NAME, p.ErrorCode.JOB_NOT_FOUND, p.ErrorCode.NOT_READY})


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content=err.body().model_dump(mode="json", exclude_none=True))


def create_app(settings: Settings, catalog: Catalog | None = None, *, background: bool = True) -> FastAPI:
    """Build the ckptd app for ``settings``.

    ``catalog`` may be given (tests); otherwise one is opened over ``settings.root``. With
    ``background`` the catalog is rebuilt and refreshed by a thread started in the app's lifespan.
    """
    if catalog is None:
        catalog = Catalog(Storage(settings.root), settings.catalog_path(), save_timeout_s=settings.save_timeout_s,
                          adopt_after_s=settings.adopt_after_s, revalidate_after_s=settings.revalidate_after_s)
    cat = catalog
    metrics = Metrics()  # ckptd/metrics.py
    plans = PlanCache()
    answers: Coalescer[bytes] = Coalescer()
    listings: dict[str, tuple[int, bytes]] = {}  # job -> (catalog version, list answered)
    events = EventStore(cat.storage)  # ckptd/events.py: <root>/<job>/.ckptd/events/
    tracker = CommitTracker(cat, metrics, events, interval_s=settings.refresh_interval_s)
    policy = settings.retention()
    keeper = (  # ckptd/snapshots.py: the host-memory tier, when a shared-memory directory is configured
        SnapshotKeeper(cat.storage, settings.shm_dir, max_snapshots=settings.max_snapshots,
                       compression=settings.persist_compression, nice=settings.persist_nice,
                       devices=settings.persist_devices,
                       on_persisted=lambda job, _step: cat.refresh_job(job))
        if settings.shm_dir else None
    )
    refresher = Refresher(
        cat, settings.refresh_interval_s,
        maintenance=(lambda: record_retention(events, prune(cat, policy)))
        if policy.prunes_good_steps or policy.clean_abandoned else None,
        maintenance_interval_s=settings.gc_interval_s,
        on_refresh=keeper.scan if keeper is not None else None,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limit_worker_threads(settings.worker_threads)  # ckptd/hardening.py
        if background:
            if keeper is not None:
                keeper.start()
            refresher.start()
            tracker.start()
        try:
            yield
        finally:
            if background:
                tracker.stop()
                refresher.stop()
                if keeper is not None:
                    keeper.stop()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Checkpoint sidecar for elastic JAX training: where to resume, and on which mesh.",
        lifespan=lifespan,
    )
    app.state.catalog = cat
    app.state.settings = settings
    app.state.events = events
    app.state.metrics = metrics
    app.state.tracker = tracker
    app.state.snapshots = keeper
    app.state.resume_answers = answers

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

    def _needs_token(path: str) -> bool:
        return path.startswith(p.API_PREFIX) or (settings.metrics_require_token and path == p.ROUTE_METRICS)

    app.add_middleware(BearerAuth, token=settings.token, needs_token=_needs_token,  # ckptd/hardening.py
                       count=lambda route, status: metrics.requests.labels(route, str(status)).inc())

    # Outermost (added last): an oversized body is refused before auth, routing or parsing read it.
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes,
                       on_refused=lambda: metrics.requests.labels("body_limit", "413").inc())

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

    # The probes are async: they run on the event loop, never queued behind busy worker threads (a
    # liveness probe that waits on a slow listing would get a loaded ckptd restarted). They touch no storage.
    @app.get(p.ROUTE_HEALTHZ, response_model=p.Health, tags=["health"])
    async def healthz() -> p.Health:
        return p.Health(status="ok")

    @app.get(p.ROUTE_READYZ, response_model=p.Health, tags=["health"],
             responses={503: {"model": p.Health}})
    async def readyz() -> Any:
        detail: dict[str, object] = {"root": settings.root, "last_refresh": cat.last_refresh}
        if cat.last_error:
            detail["last_error"] = cat.last_error
        if not cat.ready.is_set():
            return JSONResponse(status_code=503, content=p.Health(status="not_ready", detail=detail).model_dump())
        return p.Health(status="ok", detail=detail)

    @app.get(p.ROUTE_METRICS, tags=["health"], response_class=Response)
    def metrics_endpoint() -> Response:
        return Response(metrics.render(cat), media_type=CONTENT_TYPE_LATEST)

    @app.get(p.ROUTE_JOBS, response_model=p.JobList, responses=_ERROR_RESPONSES, tags=["jobs"])
    def list_jobs() -> p.JobList:
        if not cat.ready.is_set():
            raise ApiError(p.ErrorCode.NOT_READY, "the catalog is still being built from storage; retry")
        return p.JobList(jobs=cat.jobs())

    def _listing(job: str) -> bytes:
        """The job's list as answered, serialised once per catalog version (10,000 steps: ~3 MB, ~1 s of
        GIL to build; 64 clients listing at once used to build it 64 times)."""
        _job(job)
        version = cat.version  # read before the rows: a change after it gives a newer version, never a stale hit
        kept = listings.get(job)
        if kept is not None and kept[0] == version:
            return kept[1]
        body = p.CheckpointList(job=job, checkpoints=cat.checkpoints(job)).model_dump_json().encode()
        listings[job] = (version, body)
        return body

    @app.get(p.ROUTE_CHECKPOINTS, response_model=p.CheckpointList, responses=_ERROR_RESPONSES, tags=["jobs"])
    async def list_checkpoints(job: str) -> Any:
        # Serialized here, not by FastAPI: its response_model would dump and validate the whole list again.
        # Concurrent lists of a job share one round (ckptd/coalesce.py), from the catalog as of after they came.
        body = await answers.answer(("list", job), lambda: _listing(job))
        return Response(body, media_type="application/json")

    @app.get(p.ROUTE_LATEST_GOOD, response_model=p.CheckpointInfo, responses=_ERROR_RESPONSES, tags=["jobs"])
    def latest_good(job: str) -> p.CheckpointInfo:
        info = cat.confirmed_latest_good(_job(job))
        if info is None:
            raise NoGoodCheckpoint(job)
        return info

    def _good_step(job: str, request: p.ResumeRequest, info: p.CheckpointInfo | None) -> p.CheckpointInfo:
        if info is None and request.step is None:
            raise NoGoodCheckpoint(job)
        if info is None:
            raise ApiError(p.ErrorCode.STEP_NOT_FOUND, f"job {job!r} has no step {request.step}")
        if info.state is not p.StepState.VERIFIED:
            raise ApiError(
                p.ErrorCode.STEP_NOT_GOOD, f"step {request.step} of job {job!r} is {info.state.value}: {info.reason}"
            )
        return info

    def _answer(job: str, request: p.ResumeRequest) -> bytes:
        """The resume plan's bytes, from checks made now (run by a worker thread, once per round)."""
        _job(job)
        cat.refresh_job(job, quick=True)  # the newest committed step, even if the last periodic scan missed it
        snapshot = (
            newest_whole(settings.shm_dir, job, at_most=request.step) if request.use_memory_tier else None
        )
        if snapshot is not None and request.step is not None and snapshot[1].step != request.step:
            snapshot = None
        info = cat.confirmed_latest_good(job) if request.step is None else cat.confirmed_step(job, request.step)
        try:
            if snapshot is not None and (info is None or info.state is not p.StepState.VERIFIED
                                         or snapshot[1].step >= info.step):
                return memory_snapshot_plan(job=job, request=request, snapshot=snapshot).model_dump_json().encode()
            good = _good_step(job, request, info)
            loaded = cat.layout(good)  # the step's arrays, read once and kept (ckptd/catalog.py)
            training, layout = loaded[0] or good.training, loaded[1]
            return plans.answer(  # planned once per (step, request): ckptd/plan_cache.py
                good.path, request.model_dump_json(), loaded,
                lambda: resume_plan(job=job, step=good.step, path=good.path, request=request,
                                    training=training, saved_layout=layout).model_dump_json().encode(),
            )
        except PlanningError as exc:
            raise ApiError(exc.code, exc.message) from exc

    @app.post(p.ROUTE_RESUME, response_model=p.ResumePlan, responses=_ERROR_RESPONSES, tags=["jobs"])
    async def resume(job: str, request: p.ResumeRequest) -> Any:
        started = time.perf_counter()
        # The hosts of a job ask together and alike: requests that arrive while the same question is being
        # answered share the next answer, worked out after they arrived (ckptd/coalesce.py).
        try:
            body = await answers.answer(("resume", job, request.model_dump_json()), lambda: _answer(job, request))
        except ApiError as exc:
            if exc.code not in _NOT_A_JOB:  # no metric label for names that are not jobs
                metrics.resume_requests.labels(job).inc()
            raise
        metrics.resume_requests.labels(job).inc()
        metrics.plan_seconds.observe(time.perf_counter() - started)
        # The bytes as planned: FastAPI would validate and dump a plan of 1,000 arrays again on every answer.
        return Response(body, media_type="application/json")

    @app.get(p.ROUTE_ADVICE, response_model=p.Advice, responses=_ERROR_RESPONSES, tags=["jobs"])
    def advice(job: str, query: Annotated[p.AdviceQuery, Query()]) -> p.Advice:
        """Checkpoint periods and recovery policy (ckptd/advisor.py); the job's history fills the gaps."""
        return advice_for_job(job, cat.checkpoints(_job(job)), query)

    add_event_routes(app, catalog=cat, store=events, metrics=metrics, check_job=_job)  # ckptd/event_routes.py
    add_dashboard_route(app)  # GET /: ckptd/dashboard.py
    describe_routes(app)  # summaries for the OpenAPI schema and docs/api.md: ckptd/route_docs.py
    document_errors(app, metrics_require_token=settings.metrics_require_token)  # ckptd/hardening.py
    return app


__all__ = ["create_app"]
