"""What the routes of one app share: the catalog and the workers around it, built once by ``create_app``.

Every router is made from a ``Services`` (``routes/*.py``: ``router(services) -> APIRouter``), so a route
reaches the catalog, metrics and caches of its own app and nothing global; tests build several apps in
one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd.api.advice_runner import AdviceRunner
from ckptd.api.coalesce import Coalescer
from ckptd.api.conditional import Tagged
from ckptd.api.listing import Listing
from ckptd.api.plan_cache import PlanCache
from ckptd.api.pool_watch import PoolWatch
from ckptd.catalog.catalog import Catalog
from ckptd.catalog.commit_pass import LazyWorker
from ckptd.catalog.commit_tracker import CommitTracker
from ckptd.catalog.events import EventLimits, EventStore, record_retention
from ckptd.catalog.lease import LeaseBoard
from ckptd.catalog.refresher import Refresher
from ckptd.catalog.retention import prune
from ckptd.catalog.snapshots import SnapshotKeeper
from ckptd.config import Settings
from ckptd.errors import InvalidJobName, JobNotFound, NotReady
from ckptd.metrics import Metrics
from trainer_client.core import protocol as p
from trainer_client.core.storage import Storage


@dataclass
class Services:
    settings: Settings
    catalog: Catalog
    metrics: Metrics
    events: EventStore
    tracker: CommitTracker
    refresher: Refresher
    keeper: SnapshotKeeper | None
    advice: AdviceRunner  # advice runs on threads of its own (ckptd/api/advice_runner.py)
    pool_watch: PoolWatch  # /healthz fails when the handler pool is wedged (ckptd/api/pool_watch.py)
    plans: PlanCache = field(default_factory=PlanCache)
    answers: Coalescer[Tagged] = field(default_factory=Coalescer)
    listings: dict[str, Listing] = field(default_factory=dict)  # job -> its steps at the latest version listed
    lease: LeaseBoard | None = None  # with CKPTD_LEASE_TTL_S: which jobs this sidecar writes (ckptd/catalog/lease.py)

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
        if self.keeper is not None:
            self.keeper.start()
        if self.lease is not None:
            self.lease.start()
        self.refresher.start()
        self.tracker.start()

    def stop(self) -> None:
        self.advice.close()  # first: a running simulation must not hold the shutdown up
        self.pool_watch.close()
        if self.keeper is not None:  # accepted saves reach storage while the catalog still confirms them
            self.keeper.stop(self.settings.drain_timeout_s)
        self.tracker.stop()
        self.refresher.stop()
        if self.lease is not None:  # last: the other workers are done writing
            self.lease.stop()


def build_services(settings: Settings, catalog: Catalog | None = None) -> Services:
    """The catalog over ``settings.root`` (unless given) and the workers that keep it current."""
    if catalog is None:
        catalog = Catalog(Storage(settings.root), settings.catalog_path(), save_timeout_s=settings.save_timeout_s,
                          adopt_after_s=settings.adopt_after_s, revalidate_after_s=settings.revalidate_after_s,
                          read_only=settings.read_only, read_only_jobs=settings.read_only_job_names())
    cat = catalog
    metrics = Metrics()
    cat.max_jobs = settings.max_jobs
    if settings.lease_ttl_s is not None:  # one writer per job among the sidecars on this root; none leads before
        # its first scan is done (a start's imports and scan can stall a process for seconds: it would lose the lease)
        cat.lease = LeaseBoard(cat.storage, settings.lease_ttl_s, read_only=cat.read_only_for,
                               jobs=lambda: [j.name for j in cat.jobs()] if cat.ready.is_set() else [])
    events = EventStore(cat.storage, EventLimits(  # <root>/<job>/.ckptd/events/ (ckptd/catalog/events.py)
        max_events=settings.events_max_per_job, max_bytes=settings.events_max_bytes_per_job,
        memory_bytes=settings.events_memory_bytes), read_only=cat.read_only_for,  # a read-only job's: on the side
        writes=cat.writes)  # with a lease only the job's leader folds its events (docs/multihost.md, section 7)
    tracker = CommitTracker(cat, metrics, events, interval_s=settings.refresh_interval_s)
    policy = settings.retention()
    keeper = (  # the host-memory tier, when a shared-memory directory is configured (ckptd/catalog/snapshots.py)
        SnapshotKeeper(cat.storage, settings.shm_dir, max_snapshots=settings.max_snapshots,
                       compression=settings.persist_compression, nice=settings.persist_nice,
                       devices=settings.persist_devices, writes=cat.writes,
                       on_persisted=lambda job, _step: cat.refresh_job(job))
        if settings.shm_dir else None
    )
    refresher = Refresher(
        cat, settings.refresh_interval_s,
        maintenance=(lambda: record_retention(events, prune(cat, policy)))
        if policy.prunes_good_steps or policy.clean_abandoned else None,
        maintenance_interval_s=settings.gc_interval_s,
        on_refresh=keeper.scan if keeper is not None else None,
        commit_worker=LazyWorker(nice=settings.persist_nice, devices=settings.persist_devices),  # the leader's commits
    )
    advice = AdviceRunner(settings.advice_workers, timeout_s=settings.advice_timeout_s,
                          max_failures=settings.advice_max_failures)
    return Services(settings=settings, catalog=cat, metrics=metrics, events=events, tracker=tracker,
                    refresher=refresher, keeper=keeper, advice=advice, pool_watch=PoolWatch(settings.wedged_after_s),
                    lease=cat.lease)


__all__ = ["Services", "build_services"]
