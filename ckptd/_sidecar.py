"""The sidecar's composition root: the catalog and the workers that keep it current, built from ``Settings``
and started and stopped together.

``Settings`` is read from the environment once, by ``ckptd serve``, and each part gets its own group here (the
catalog ``storage``, the retention ``retention``, the event store ``events``, the memory tier ``memory_tier``, the
peer channel ``peer``); none of them reads the environment or the whole ``Settings`` itself.

One place wires the process (docs/architecture.md, "Package map"): ``ckptd serve`` builds a ``Sidecar`` here and
hands it to ``create_app`` (``ckptd/api/_app.py``), whose lifespan starts it once the server runs and stops it
at SIGTERM. The HTTP package receives what this module built and wires nothing of its own beyond what its
routes hold per app (caches, the advice threads); the catalog, config and metrics modules know nothing of
either. Tests build several sidecars in one process: nothing here is global.

The rooms it wires import only downwards (events, lease and persist, then the catalog, then the multi-host
commit, then the memory tier), so what crosses upwards is handed in here: the leader's commit pass of multi-host
steps runs beside the catalog's refresher as a worker of its own (``commit_pass``), the catalog's retention
cleans the multi-host saves never completed through the ``clean_parts`` it is given, and the memory tier's keeper
reports its persists falling behind through ``keeper_reports`` (stored as the job's events, counted in the metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptd._metrics import Metrics
from ckptd._peer_lists import hosts_named
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._commit_tracker import CommitTracker
from ckptd.catalog._refresher import Refresher
from ckptd.catalog._retention import Decision, RetentionPolicy, prune, record_retention
from ckptd.catalog._settings import RetentionSettings, StorageSettings
from ckptd.config import Settings
from ckptd.events._events import EventLimits, EventStore
from ckptd.lease._lease import LeaseBoard
from ckptd.memory_tier._snapshots import SnapshotKeeper
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._commit_pass import CommitPass
from ckptd.peers import PeerService, build_peers
from ckptd.persist._worker_client import PersistWorker, PersistWorkerClient
from trainer_client.core import Storage
from trainer_client.core.protocol import ElasticEvent


@dataclass
class Sidecar:
    """The catalog of one root and its workers: the refresher (scans, retention), the leader's commit pass of
    multi-host steps, the commit tracker (metrics and events from storage), the host-memory tier and the lease,
    when configured."""

    settings: Settings
    catalog: Catalog
    metrics: Metrics
    events: EventStore
    tracker: CommitTracker
    refresher: Refresher
    commits: CommitPass  # the leader's commits of multi-host steps, over the catalog's jobs (ckptd/multihost)
    keeper: SnapshotKeeper | None = None  # with CKPTD_SHM_DIR (ckptd/memory_tier/_snapshots.py)
    lease: LeaseBoard | None = None  # with CKPTD_LEASE_TTL_S: which jobs this sidecar writes (ckptd/lease/_lease.py)
    peers: PeerService | None = None  # with CKPTD_PEER_PORT: copies of the parts among hosts (ckptd/peers)

    def start(self) -> None:
        if self.keeper is not None:
            self.keeper.start()
        if self.lease is not None:
            self.lease.start()
        self.refresher.start()
        self.commits.start()
        self.tracker.start()
        if self.peers is not None:
            self.peers.start()

    def stop(self) -> None:
        if self.peers is not None:
            self.peers.stop()
        if self.keeper is not None:  # accepted saves reach storage while the catalog still confirms them
            self.keeper.stop(self.settings.memory_tier.drain_timeout_s)
        self.tracker.stop()
        self.refresher.stop()
        self.commits.stop()  # one last pass: the keeper's drain may just have written the last parts
        if self.lease is not None:  # last: the other workers are done writing
            self.lease.stop()


def open_catalog(storage: StorageSettings) -> Catalog:
    """The catalog over ``storage.root``, its SQLite cache in ``storage.catalog_path()``."""
    return Catalog(Storage(storage.root), storage.catalog_path(), save_timeout_s=storage.save_timeout_s,
                   adopt_after_s=storage.adopt_after_s, revalidate_after_s=storage.revalidate_after_s,
                   max_jobs=storage.max_jobs, read_only=storage.read_only,
                   read_only_jobs=storage.read_only_job_names())


def retention_policy(retention: RetentionSettings) -> RetentionPolicy:
    """What the server's retention keeps (CKPTD_KEEP_*, CKPTD_CLEAN_ABANDONED)."""
    return RetentionPolicy(keep_last=retention.keep_last, keep_every=retention.keep_every,
                           keep_newer_than_s=retention.keep_newer_than_s, clean_abandoned=retention.clean_abandoned)


def _prune_and_record(catalog: Catalog, policy: RetentionPolicy, events: EventStore) -> int:
    """One retention pass (with the multi-host saves never completed), its deletions and its refused deletions
    recorded as the jobs' events."""
    refused: list[Decision] = []
    deleted = prune(catalog, policy, refused=refused, clean_parts=lambda job: clean_abandoned_parts(
        catalog.storage, job, catalog.save_timeout_s, writes=catalog.writes))
    return record_retention(events, deleted, refused)


def keeper_reports(events: EventStore, metrics: Metrics) -> Callable[[str, ElasticEvent], None]:
    """What the memory tier's keeper reports (a persist falling behind: ``persist_behind``, ``persist_overtaken``),
    stored as the job's event and counted in the metrics (docs/operations.md, "Persists that fall behind")."""
    def record(job: str, event: ElasticEvent) -> None:
        stored, _duplicates = events.append(job, [event], source="ckptd")
        metrics.observe_events(job, stored)
    return record


def commit_pass(catalog: Catalog, interval_s: float, worker: PersistWorker | None = None) -> CommitPass:
    """The leader's commit pass of multi-host steps over every job of ``catalog`` once its first scan is done,
    committing where it leads (``Catalog.writes``), a commit another sidecar decided redone after the catalog's
    save timeout; each commit refreshes its job. Not started."""
    return CommitPass(
        catalog.storage, jobs=lambda: [j.name for j in catalog.jobs()] if catalog.ready.is_set() else [],
        writes=catalog.writes, interval_s=interval_s, worker=worker,
        on_committed=lambda job, _step: catalog.refresh_job(job), redo_after_s=catalog.save_timeout_s)


def build_sidecar(settings: Settings, catalog: Catalog | None = None) -> Sidecar:
    """The catalog over the storage root (unless given: it then takes the storage group's ``max_jobs``) and the
    workers that keep it current, built and not started."""
    storage, memory, kept = settings.storage, settings.memory_tier, settings.events
    cat = catalog if catalog is not None else open_catalog(storage)
    cat.max_jobs = storage.max_jobs
    if storage.lease_ttl_s is not None:  # one writer per job among the sidecars on this root; none leads before
        # its first scan is done (a start's imports and scan can stall a process for seconds: it would lose the lease)
        cat.lease = LeaseBoard(cat.storage, storage.lease_ttl_s, read_only=cat.read_only_for,
                               jobs=lambda: [j.name for j in cat.jobs()] if cat.ready.is_set() else [])
    metrics = Metrics()
    events = EventStore(cat.storage, EventLimits(  # <root>/<job>/.ckptd/events/ (ckptd/events/_events.py)
        max_events=kept.events_max_per_job, max_bytes=kept.events_max_bytes_per_job,
        memory_bytes=kept.events_memory_bytes), read_only=cat.read_only_for,  # a read-only job's: on the side
        writes=cat.writes)  # with a lease only the job's leader folds its events (docs/multihost.md, section 7)
    tracker = CommitTracker(cat, metrics, events, interval_s=storage.refresh_interval_s)
    policy = retention_policy(settings.retention)
    keeper = (  # the host-memory tier, when a shared-memory directory is configured (ckptd/memory_tier/_snapshots.py)
        SnapshotKeeper(cat.storage, memory.shm_dir, max_snapshots=memory.max_snapshots,
                       compression=memory.persist_compression, nice=memory.persist_nice,
                       devices=memory.persist_devices, writes=cat.writes,
                       on_persisted=lambda job, _step: cat.refresh_job(job),
                       on_report=keeper_reports(events, metrics), bucket_writes_per_s=storage.bucket_writes_per_s,
                       hosts=settings.peer.host_count or hosts_named(settings.peer.peers))
        if memory.shm_dir else None
    )
    refresher = Refresher(
        cat, storage.refresh_interval_s,
        maintenance=(lambda: _prune_and_record(cat, policy, events))
        if policy.prunes_good_steps or policy.clean_abandoned else None,
        maintenance_interval_s=settings.retention.gc_interval_s,
        on_refresh=keeper.scan if keeper is not None else None,
    )
    # the commit pass has a persist worker child of its own, started on its first commit: a multi-host commit
    # (a few small writes) never waits behind the keeper's persist of a whole snapshot (seconds to minutes)
    commits = commit_pass(cat, storage.refresh_interval_s,
                          PersistWorkerClient(nice=memory.persist_nice, devices=memory.persist_devices))
    peers = build_peers(settings.peer, memory, storage.root)
    if peers is not None:
        metrics.watch_peers(peers.snapshot)  # the channel's numbers on /metrics (docs/operations.md)
    return Sidecar(settings=settings, catalog=cat, metrics=metrics, events=events, tracker=tracker,
                   refresher=refresher, commits=commits, keeper=keeper, lease=cat.lease, peers=peers)


__all__ = ["Sidecar", "build_sidecar", "commit_pass", "keeper_reports", "open_catalog", "retention_policy"]
