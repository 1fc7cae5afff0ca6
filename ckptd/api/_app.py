"""The sidecar's HTTP service: ``create_app(settings)`` builds the FastAPI app over a sidecar (``ckptd/_sidecar.py``:
the catalog and its workers, built by the composition root).

Routes and wire models come from ``trainer_client.core.protocol``; each route group is one router
(``ckptd/api/routes/``) made from the app's ``Services``; every failure leaves as the one ``ErrorBody``
with a stable code (``ckptd/api/_errors.py``). Handlers only read the catalog (and, for a resume, rescan
that one job first), so they answer in milliseconds; array bytes never cross HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from ckptd import __version__
from ckptd._sidecar import Sidecar, build_sidecar
from ckptd.api._answers import JobAnswers
from ckptd.api._auth import BearerAuth
from ckptd.api._docs_ui import install_docs
from ckptd.api._errors import install_error_handlers
from ckptd.api._hot_path import HotPath
from ckptd.api._limits import BodySizeLimit, limit_worker_threads
from ckptd.api._openapi import document_errors, reject_undeclared_query
from ckptd.api._services import build_services
from ckptd.api.routes import _advice as advice
from ckptd.api.routes import _dashboard as dashboard
from ckptd.api.routes import _events as events
from ckptd.api.routes import _health as health
from ckptd.api.routes import _jobs as jobs
from ckptd.api.routes import _peers as peers
from ckptd.catalog._catalog import Catalog
from ckptd.config import Settings
from trainer_client.core import protocol as p


def create_app(settings: Settings, catalog: Catalog | None = None, *, background: bool = True,
               sidecar: Sidecar | None = None) -> FastAPI:
    """Build the ckptd app for ``settings`` over ``sidecar`` (what ``ckptd serve`` built: ``ckptd/_sidecar.py``).

    Without one the composition root builds it here, over ``catalog`` when given (tests), else over a catalog
    of the storage root (``settings.storage``). With ``background`` the app's lifespan starts the sidecar's
    workers (the catalog is rebuilt, then refreshed) and stops them at shutdown. The app reads its own groups
    of ``settings``: ``auth`` and ``limits``.
    """
    if sidecar is not None and (sidecar.settings is not settings or catalog not in (None, sidecar.catalog)):
        raise ValueError("the sidecar given was built for other settings or another catalog")
    svc = build_services(sidecar if sidecar is not None else build_sidecar(settings, catalog))
    auth, limits = settings.auth, settings.limits

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limit_worker_threads(limits.worker_threads)
        if background:
            svc.start()
        try:
            yield
        finally:
            if background:
                svc.stop()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Checkpoint sidecar for elastic JAX training: where to resume, and on which mesh.",
        lifespan=lifespan,
        docs_url=None,  # served from the package by install_docs, not from a CDN
        redoc_url=None,
        dependencies=[Depends(reject_undeclared_query)],  # a query the operation does not declare: 422
    )
    app.state.services = svc
    app.state.catalog = svc.catalog
    app.state.settings = settings
    app.state.events = svc.events
    app.state.metrics = svc.metrics
    app.state.tracker = svc.tracker
    app.state.snapshots = svc.keeper
    app.state.resume_answers = svc.answers
    install_error_handlers(app)

    def count_request(route: str, status: int) -> None:  # also the connection limits' (ckptd/api/_connections.py)
        svc.metrics.requests.labels(route, str(status)).inc()

    app.state.count_request = count_request

    def _needs_token(path: str) -> bool:
        return path.startswith(p.API_PREFIX) or (auth.metrics_require_token and path == p.ROUTE_METRICS)

    # Bodies are read within bounds (size, time, memory of all requests together) before routing or parsing
    # see them; and only once the token is checked: the token check is outermost (added last). Innermost
    # (added first): the hot path answers plain latest-good and resume requests below FastAPI's routing.
    answers = JobAnswers(svc)
    app.add_middleware(HotPath, answers=answers)
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s,
                       max_in_flight=limits.max_body_bytes_in_flight)
    app.add_middleware(BearerAuth, token=auth.token, needs_token=_needs_token, count=count_request)

    for router in (health.router(svc), jobs.router(svc, answers), advice.router(svc), events.router(svc),
                   peers.router(svc), dashboard.router()):
        app.include_router(router)
    install_docs(app)
    document_errors(app, metrics_require_token=auth.metrics_require_token)
    return app


__all__ = ["create_app"]
