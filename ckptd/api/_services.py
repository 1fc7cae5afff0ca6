"""What the routes of one app share: the sidecar it serves (``ckptd/_sidecar.py``: the catalog and its workers,
built by the composition root) and what the HTTP layer keeps per app (caches, the advice threads).

Every router is made from a ``Services`` (``routes/*.py``: ``router(services) -> APIRouter``), so a route
reaches the catalog, metrics and caches of its own app and nothing global; tests build several apps in
one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd._metrics import Metrics
from ckptd._sidecar import Sidecar
from ckptd.api._advice_runner import AdviceRunner
from ckptd.api._coalesce import Coalescer
from ckptd.api._conditional import Tagged
from ckptd.api._listing import Listing
from ckptd.api._plan_cache import PlanCache
from ckptd.api._pool_watch import PoolWatch
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._commit_tracker import CommitTracker
from ckptd.config import Settings
from ckptd.errors import InvalidJobName, JobNotFound, NotReady
from ckptd.events._events import EventStore
from ckptd.lease._lease import LeaseBoard
from ckptd.memory_tier._snapshots import SnapshotKeeper
from trainer_client.core import protocol as p


@dataclass
class Services:
    sidecar: Sidecar  # built by the composition root; started and stopped by the app's lifespan
    advice: AdviceRunner  # advice runs on threads of its own (ckptd/api/_advice_runner.py)
    pool_watch: PoolWatch  # /healthz fails when the handler pool is wedged (ckptd/api/_pool_watch.py)
    plans: PlanCache = field(default_factory=PlanCache)
    answers: Coalescer[Tagged] = field(default_factory=Coalescer)
    listings: dict[str, Listing] = field(default_factory=dict)  # job -> its steps at the latest version listed

    @property
    def settings(self) -> Settings:
        return self.sidecar.settings

    @property
    def catalog(self) -> Catalog:
        return self.sidecar.catalog

    @property
    def metrics(self) -> Metrics:
        return self.sidecar.metrics

    @property
    def events(self) -> EventStore:
        return self.sidecar.events

    @property
    def tracker(self) -> CommitTracker:
        return self.sidecar.tracker

    @property
    def keeper(self) -> SnapshotKeeper | None:
        return self.sidecar.keeper

    @property
    def lease(self) -> LeaseBoard | None:
        return self.sidecar.lease

    def require_ready(self) -> None:
        if not self.catalog.ready.is_set():
            raise NotReady()

    def check_job(self, job: str) -> str:
        """``job`` when it is a valid name of a catalogued job (rescanned once if it is new); else the error."""
        if not p.is_valid_job_name(job):
            raise InvalidJobName(job)
        self.require_ready()
        if not self.catalog.has_job(job):
            self.catalog.refresh_job(job)  # a job created since the last scan
            if not self.catalog.has_job(job):
                raise JobNotFound(job, self.catalog.refused.get(job))
        return job

    def start(self) -> None:
        self.sidecar.start()

    def stop(self) -> None:
        self.advice.close()  # first: a running simulation must not hold the shutdown up
        self.pool_watch.close()
        self.sidecar.stop()


def build_services(sidecar: Sidecar) -> Services:
    """What the routes of one app share, over ``sidecar``."""
    settings = sidecar.settings.advice
    advice = AdviceRunner(settings.advice_workers, timeout_s=settings.advice_timeout_s,
                          max_failures=settings.advice_max_failures)
    return Services(sidecar=sidecar, advice=advice, pool_watch=PoolWatch(sidecar.settings.limits.wedged_after_s))


__all__ = ["Services", "build_services"]
