"""ckptd's Prometheus metrics: one registry per app, and the one place that names and documents them.

Four kinds of sources, so that a scrape of ``GET /metrics`` stays fast (it reads only SQLite, memory and /proc):

* the catalog, read at scrape time: steps by state, quarantined steps, the latest good step per job, and
  with a lease (CKPTD_LEASE_TTL_S) whether this sidecar leads each job and the newest epoch it saw;
* the request path: HTTP requests, resume requests and plan latency, and the elastic events trainers
  report (``POST /v1/jobs/{job}/events``): events by kind, recovery seconds, lost steps, save stalls, and the
  replica tier's pacing and the autopilot's choice as last reported (periods, estimated MTBF, expected goodput);
* ckptd's own events of the host-memory tier (the keeper's reports, stored through the composition root): memory
  snapshots due while the job's previous persist still ran, and those superseded by a newer one, not persisted;
* the background tracker (``ckptd.catalog._commit_tracker``): commits and bytes committed (from the manifests),
  save durations, validation failures, goodput per job — everything that needs storage reads;
* /proc, read at scrape time (``ckptd._process_metrics``): the memory, CPU, file descriptors and threads of
  ckptd and of its persist worker, to size the sidecar's limits from;
* with the peer channel on (CKPTD_PEER_PORT), its numbers, read at scrape time (``watch_peers``): copies and
  bytes sent, received and brought back, failures, refusals, the bytes of other hosts' parts held, and per
  job the age of this host's newest copy at its peers.

Every per-job series carries the job's name in the label ``ckpt_job`` (``JOB_LABEL``), never ``job``.

The event metrics (events by kind, recovery seconds, lost steps, save stalls) count a job's whole stored
history: the tracker loads it once per job after a start (``load_history``, from ``EventStore.stats``:
the job's event summary and the events kept), so a restarted ckptd does not show empty recovery metrics
beside a goodput read from storage; events stored after that are counted as they arrive. The newest 256
values of each measure are replayed exactly, older ones (folded into the summary) at their mean, so
``_count`` and ``_sum`` are exact. The other counters count what this process saw since it started
(Prometheus handles the reset at a restart); steps already on storage when it started are not commits.
"""

from __future__ import annotations

import threading
from collections import Counter as Multiset
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ckptd._event_stats import EventStats, Stat, recovery_tier
from ckptd._process_metrics import ProcessTreeCollector
from trainer_client.core.protocol import EVENT_KINDS, JobInfo, StepState, StoredEvent

# The training job's label. Not ``job``: Prometheus gives every scraped series its own ``job`` label (the
# scrape job: the PodMonitoring or the Service) and renames a clashing one to ``exported_job``, so the alerts,
# the rules (deploy/k8s/rules.yaml, prometheusrule.yaml) and the dashboard (deploy/monitoring/) use this one.
JOB_LABEL = "ckpt_job"
_KNOWN_KINDS = frozenset(EVENT_KINDS)
_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_AUTOPILOT_TIERS = ("replicas", "memory", "storage")
_REPLICA_RUNS = 1024  # trainer runs whose replica counts are remembered (their reports add only what is new)
_STALL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LeaseRole(Protocol):
    """What the lease gauges read of one job's lease (``ckptd.lease._lease.LeaseView``)."""

    @property
    def role(self) -> str: ...

    @property
    def epoch(self) -> int | None: ...


class Leases(Protocol):
    def views(self) -> Mapping[str, LeaseRole]: ...


class CatalogView(Protocol):
    """What a scrape reads of the catalog (``ckptd.catalog._catalog.Catalog``): passed in, so that the metrics
    import nothing of the catalog."""

    @property
    def lease(self) -> Leases | None: ...

    def jobs(self) -> list[JobInfo]: ...

    def states(self, job: str) -> dict[str, StepState]: ...

    def lock_troubles(self) -> list[dict[str, str | float]]: ...


class Metrics:
    """Every metric ckptd exports, in its own registry (several apps in one process do not collide)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_*: memory, CPU, file descriptors (docs/operations.md, "Sizing")
        r.register(ProcessTreeCollector())  # threads, and the persist worker's memory and CPU
        self.requests = Counter("ckptd_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.resume_requests = Counter("ckptd_resume_requests", "resume requests by job", [JOB_LABEL], registry=r)
        self.plan_seconds = Histogram(
            "ckptd_resume_plan_seconds", "time to answer a resume request", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.latest_good = Gauge("ckptd_latest_good_step", "newest verified step per job", [JOB_LABEL], registry=r)
        self.steps = Gauge("ckptd_steps", "catalogued steps by job and state", [JOB_LABEL, "state"], registry=r)
        self.quarantined = Gauge("ckptd_quarantined_steps", "quarantined steps per job", [JOB_LABEL], registry=r)
        self.commits = Counter("ckptd_commits", "steps seen committed by Orbax (finalized)", [JOB_LABEL], registry=r)
        self.committed_bytes = Counter("ckptd_committed_bytes", "bytes of the committed steps, from their manifests",
                                       [JOB_LABEL], registry=r)
        self.save_seconds = Histogram("ckptd_save_duration_seconds", "save start until Orbax committed the step",
                                      [JOB_LABEL], registry=r, buckets=_SECONDS)
        self.save_stall = Histogram("ckptd_save_stall_seconds", "training blocked by a save (reported events)",
                                    [JOB_LABEL], registry=r, buckets=_STALL)
        self.validation_failures = Counter("ckptd_validation_failures",
                                           "steps found bad (quarantined or corrupt)", [JOB_LABEL], registry=r)
        self.elastic_events = Counter("ckptd_elastic_events", "elastic events reported by trainers, by kind",
                                      [JOB_LABEL, "kind"], registry=r)
        self.recovery_seconds = Histogram("ckptd_recovery_seconds", "failure detected until the first step after it",
                                          [JOB_LABEL], registry=r, buckets=_SECONDS)
        self.lost_steps = Counter("ckptd_lost_steps", "steps done again after recoveries", [JOB_LABEL], registry=r)
        self.recoveries = Counter("ckptd_recoveries", "recoveries by the tier the state came from (replicas, memory, "
                                  "storage; none: a fresh start)", [JOB_LABEL, "tier"], registry=r)
        # the replica snapshot tier of the job's trainer, as its last save or recovery event reported it
        self.replica_age = Gauge("ckptd_replica_snapshot_age_seconds", "age of the trainer's held replica snapshot "
                                 "when it last reported", [JOB_LABEL], registry=r)
        # counters: a trainer reports its run's counts so far, and each report adds what is new since the run's
        # previous one (``_count_replica_losses``)
        self.replica_skips = Counter("ckptd_replica_snapshot_skips", "replica snapshots the job's trainers skipped "
                                     "(the previous copy still in flight)", [JOB_LABEL], registry=r)
        self.replica_failures = Counter("ckptd_replica_snapshot_failures", "replica snapshots the job's trainers "
                                        "dropped mid-copy (a slice lost during the copy)", [JOB_LABEL], registry=r)
        self._replica_runs: OrderedDict[tuple[str, str | None], tuple[int, int]] = OrderedDict()
        self.replica_bytes = Gauge("ckptd_replica_snapshot_bytes", "bytes of the trainer host's held replica "
                                   "snapshot, as last reported", [JOB_LABEL], registry=r)
        # the replica tier's pacing (docs/concepts.md, "Pacing the replica tier"), as last reported
        self.replica_period = Gauge("ckptd_replica_snapshot_period_steps", "a replica snapshot every this many steps, "
                                    "chosen from the trainer's measured step and copy times", [JOB_LABEL], registry=r)
        self.replica_copy_rate = Gauge("ckptd_replica_snapshot_copy_bytes_per_second", "the device-to-host rate of "
                                       "the trainer's replica snapshot copies (median)", [JOB_LABEL], registry=r)
        self.replica_expected_lost = Gauge("ckptd_replica_snapshot_expected_lost_steps", "steps a failure loses on "
                                           "average at the chosen period", [JOB_LABEL], registry=r)
        self.replica_overhead = Gauge("ckptd_replica_snapshot_overhead_ratio", "the training loop's expected "
                                      "overhead from replica snapshots at the chosen period", [JOB_LABEL], registry=r)
        # the trainer's autopilot (docs/planning.md, "Autopilot in a run"), as its last decision reported it
        self.autopilot_period = Gauge("ckptd_autopilot_period_steps", "a save of the tier every this many steps, as "
                                      "the trainer's autopilot chose it (a tier that is off has no series)",
                                      [JOB_LABEL, "tier"], registry=r)
        self.autopilot_mtbf = Gauge("ckptd_autopilot_mtbf_seconds", "the job's mean time between failures as the "
                                    "trainer's autopilot estimates it (prior and failures seen)", [JOB_LABEL],
                                    registry=r)
        self.autopilot_goodput = Gauge("ckptd_autopilot_expected_goodput_ratio", "the goodput the trainer's autopilot "
                                       "expects of the periods in force", [JOB_LABEL], registry=r)
        self.goodput = Gauge("ckptd_goodput_ratio", "productive training time over wall time (reported events)",
                             [JOB_LABEL], registry=r)
        self.lease_leader = Gauge("ckptd_lease_leader", "1 when this sidecar leads the job (writes its records; "
                                  "CKPTD_LEASE_TTL_S), else 0", [JOB_LABEL], registry=r)
        self.lease_epoch = Gauge("ckptd_lease_epoch", "the newest lease epoch of the job this sidecar saw", [JOB_LABEL],
                                 registry=r)
        self.lock_blocked = Gauge("ckptd_job_lock_blocked_seconds", "seconds the job's lock has not been taken: "
                                  "refused (not a plain file at its path) or held by another process past the bound; "
                                  "no commit, cleanup or retention runs in the job meanwhile", [JOB_LABEL, "reason"],
                                  registry=r)
        # the host-memory tier's persists falling behind (ckptd's own events; docs/operations.md, "Persists that
        # fall behind"): counted as this process reports them
        self.persist_behind = Counter("ckptd_persist_behind", "memory snapshots that became due for persisting "
                                      "while the job's previous persist was still running", [JOB_LABEL], registry=r)
        self.persist_overtaken = Counter("ckptd_persist_overtaken", "memory snapshots superseded by a newer one "
                                         "while waiting to be persisted: not persisted", [JOB_LABEL], registry=r)
        self._history_lock = threading.Lock()
        self._loaded: set[str] = set()  # jobs whose stored history is counted
        self._live: dict[str, EventStats] = {}  # counted on arrival before the job's history was loaded

    def watch_peers(self, numbers: Callable[[], Mapping[str, Any]]) -> None:
        """Export the peer channel's numbers (``ckptd.peers.PeerService.snapshot``), read at each scrape."""
        self.registry.register(PeerCollector(numbers))

    def observe_events(self, job: str, events: Iterable[StoredEvent]) -> None:
        """Count newly stored events (called once per event, after deduplication)."""
        events = list(events)
        with self._history_lock:
            if job not in self._loaded:
                self._live.setdefault(job, EventStats()).add(events)
        for e in events:
            self.elastic_events.labels(job, e.kind if e.kind in _KNOWN_KINDS else "other").inc()
            if e.kind == "recovered":
                if e.recovery_seconds is not None:
                    self.recovery_seconds.labels(job).observe(e.recovery_seconds)
                if e.lost_steps:
                    self.lost_steps.labels(job).inc(e.lost_steps)
                self.recoveries.labels(job, recovery_tier(e.restored_from)).inc()
            elif e.kind == "checkpoint_started" and e.blocked_seconds is not None:
                self.save_stall.labels(job).observe(e.blocked_seconds)
            elif e.source == "ckptd" and e.kind in ("persist_behind", "persist_overtaken"):
                (self.persist_behind if e.kind == "persist_behind" else self.persist_overtaken).labels(job).inc()
            self._replica_gauges(job, e)
            self._count_replica_losses(job, e)
            if e.kind == "autopilot_decided":
                self._autopilot_gauges(job, e)

    def _count_replica_losses(self, job: str, e: StoredEvent) -> None:
        """Add to the skip and failure counters what ``e`` reports beyond its run's previous report (a trainer
        reports its run's counts so far; a run not seen before counts from zero). The runs remembered are
        bounded: the oldest is forgotten first."""
        if e.replica_skips is None and e.replica_failures is None:
            return
        with self._history_lock:
            skips, failures = self._replica_runs.pop((job, e.run), (0, 0))
            new = (max(skips, e.replica_skips or 0), max(failures, e.replica_failures or 0))
            self._replica_runs[(job, e.run)] = new
            while len(self._replica_runs) > _REPLICA_RUNS:
                self._replica_runs.popitem(last=False)
        if new[0] > skips:
            self.replica_skips.labels(job).inc(new[0] - skips)
        if new[1] > failures:
            self.replica_failures.labels(job).inc(new[1] - failures)

    def _replica_gauges(self, job: str, e: StoredEvent) -> None:
        for gauge, value in ((self.replica_age, e.replica_age_seconds), (self.replica_bytes, e.replica_bytes_held),
                             (self.replica_period, e.replica_period), (self.replica_copy_rate,
                                                                        e.replica_copy_bytes_per_second),
                             (self.replica_expected_lost, e.replica_expected_lost_steps),
                             (self.replica_overhead, e.replica_overhead)):
            if value is not None:
                gauge.labels(job).set(value)

    def _autopilot_gauges(self, job: str, e: StoredEvent) -> None:
        for tier in _AUTOPILOT_TIERS:
            period = getattr(e, f"autopilot_{tier}_period")
            if period is not None:
                self.autopilot_period.labels(job, tier).set(period)
            else:  # off now, or a run without it: no series (removing one that is not there does nothing)
                self.autopilot_period.remove(job, tier)
        if e.autopilot_mtbf_s is not None:
            self.autopilot_mtbf.labels(job).set(e.autopilot_mtbf_s)
        if e.autopilot_goodput_after is not None:
            self.autopilot_goodput.labels(job).set(e.autopilot_goodput_after)

    def history_loaded(self, job: str) -> bool:
        with self._history_lock:
            return job in self._loaded

    def load_history(self, job: str, stored: EventStats) -> None:
        """Count the job's stored history (``EventStore.stats``) once: what storage holds minus what this
        process has counted on arrival already."""
        with self._history_lock:
            if job in self._loaded:
                return
            self._loaded.add(job)
            live = self._live.pop(job, EventStats())
        for kind, n in stored.kinds.items():
            if n > live.kinds.get(kind, 0):
                self.elastic_events.labels(job, kind).inc(n - live.kinds.get(kind, 0))
        if stored.lost_steps.total > live.lost_steps.total:
            self.lost_steps.labels(job).inc(stored.lost_steps.total - live.lost_steps.total)
        for tier, n in stored.recovered_from.items():
            if n > live.recovered_from.get(tier, 0):
                self.recoveries.labels(job, tier).inc(n - live.recovered_from.get(tier, 0))
        _replay(self.recovery_seconds.labels(job), stored.recovery_seconds, live.recovery_seconds)
        _replay(self.save_stall.labels(job), stored.save_stall_seconds, live.save_stall_seconds)

    def render(self, catalog: CatalogView) -> bytes:
        """The text exposition, with the catalog gauges refreshed from SQLite first. Per-job series exist for
        the catalogued jobs only (at most ``max_jobs``): those of a job gone from the catalog are dropped."""
        self.latest_good.clear()  # jobs and steps that left storage must leave the metrics too
        self.steps.clear()
        self.quarantined.clear()
        jobs = catalog.jobs()
        self._forget_jobs_but({job.name for job in jobs})
        for job in jobs:
            if job.latest_good_step is not None:
                self.latest_good.labels(job.name).set(job.latest_good_step)
            counts: dict[str, int] = {}
            for state in catalog.states(job.name).values():  # no metadata parsed: scrapes stay cheap
                counts[state.value] = counts.get(state.value, 0) + 1
            for state in StepState:
                self.steps.labels(job.name, state.value).set(counts.get(state.value, 0))
            self.quarantined.labels(job.name).set(counts.get(StepState.QUARANTINED.value, 0))
        self.lease_leader.clear()
        self.lease_epoch.clear()
        for name, view in (catalog.lease.views() if catalog.lease is not None else {}).items():
            self.lease_leader.labels(name).set(1 if view.role == "leader" else 0)
            if view.epoch is not None:
                self.lease_epoch.labels(name).set(view.epoch)
        self.lock_blocked.clear()
        for trouble in catalog.lock_troubles():  # a handful at most: one per job whose lock is in trouble
            self.lock_blocked.labels(str(trouble["job"]), str(trouble["state"])).set(float(trouble["seconds"]))
        return generate_latest(self.registry)


    def _forget_jobs_but(self, jobs: set[str]) -> None:
        """Drop the counters' and histograms' series of jobs not in ``jobs``: the exposition stays bounded
        however many jobs come and go."""
        for metric in (self.resume_requests, self.commits, self.committed_bytes, self.save_seconds, self.save_stall,
                       self.validation_failures, self.elastic_events, self.recovery_seconds, self.lost_steps,
                       self.recoveries, self.replica_age, self.replica_skips, self.replica_failures,
                       self.replica_bytes, self.replica_period, self.replica_copy_rate, self.replica_expected_lost,
                       self.replica_overhead, self.autopilot_period, self.autopilot_mtbf, self.autopilot_goodput,
                       self.persist_behind, self.persist_overtaken):
            names = ((JOB_LABEL, "kind") if metric is self.elastic_events else (JOB_LABEL, "tier")
                     if metric in (self.recoveries, self.autopilot_period) else (JOB_LABEL,))
            stale = {tuple(sample.labels[n] for n in names) for family in metric.collect() for sample in family.samples
                     if JOB_LABEL in sample.labels and sample.labels[JOB_LABEL] not in jobs}
            for labels in stale:
                metric.remove(*labels)
        with self._history_lock:  # a job that comes back has its history loaded again
            self._loaded &= jobs
            self._live = {job: stats for job, stats in self._live.items() if job in jobs}
            for key in [key for key in self._replica_runs if key[0] not in jobs]:
                del self._replica_runs[key]


_OBSERVED_ONE_BY_ONE = 100_000  # at most, where the histogram's values cannot be reached


def _replay(histogram: Histogram, stored: Stat, live: Stat) -> None:
    """Observe the stored values not observed yet: the recent ones exactly, older ones at their mean."""
    recent = list((Multiset(stored.recent) - Multiset(live.recent)).elements())
    older = stored.count - live.count - len(recent)
    for value in recent:
        histogram.observe(value)
    if older > 0:
        _observe_many(histogram, max(0.0, (stored.total - live.total - sum(recent)) / older), older)


def _observe_many(histogram: Histogram, value: float, times: int) -> None:
    """``times`` observations of ``value`` at once: a count from storage (a long history, or one anyone who can
    write the root wrote) costs one step, not a loop of that many. Through the histogram's own values, as its
    ``observe`` adds one; observed one by one should prometheus_client ever lay them out otherwise."""
    total, buckets, bounds = (getattr(histogram, name, None) for name in ("_sum", "_buckets", "_upper_bounds"))
    if total is None or buckets is None or bounds is None or len(buckets) != len(bounds):
        for _ in range(min(times, _OBSERVED_ONE_BY_ONE)):
            histogram.observe(value)
        return
    total.inc(value * times)
    for bucket, bound in zip(buckets, bounds, strict=True):
        if value <= bound:
            bucket.inc(times)
            break


# the peer channel's counters: (metric, key of PeerService.snapshot(), help)
_PEER_COUNTERS = (
    ("ckptd_peer_copies_sent", "copies_sent", "this host's parts copied to peers"),
    ("ckptd_peer_bytes_sent", "bytes_sent", "bytes of this host's parts copied to peers"),
    ("ckptd_peer_copy_failures", "copy_failures", "copies to a peer that failed (unreachable, refused, cut)"),
    ("ckptd_peer_copies_received", "copies_received", "other hosts' parts received and checked"),
    ("ckptd_peer_bytes_received", "bytes_received", "bytes of other hosts' parts received"),
    ("ckptd_peer_requests_refused", "requests_refused",
     "peer requests refused (no secret, a hostile or malformed header, no room)"),
    ("ckptd_peer_fetched", "fetched", "this host's parts brought back from a peer"),
    ("ckptd_peer_fetch_failures", "fetch_failures", "parts that could not be brought back (damaged, holder gone)"),
    ("ckptd_peer_refills", "refills",
     "times this host, holding none of its parts of a job any more, asked their holders for the newest"),
)


class PeerCollector(Collector):
    """The peer channel's numbers, read at each scrape from ``numbers()``: counters since the sidecar started,
    the bytes of other hosts' parts held, and per job the age of this host's newest copy at its peers."""

    def __init__(self, numbers: Callable[[], Mapping[str, Any]]) -> None:
        self._numbers = numbers

    def collect(self) -> Iterable[Metric]:
        numbers = self._numbers()
        families: list[Metric] = []
        for name, key, text in _PEER_COUNTERS:
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], float(numbers.get(key, 0)))
            families.append(counter)
        held = GaugeMetricFamily("ckptd_peer_copies_held_bytes", "bytes of other hosts' parts this host holds")
        held.add_metric([], float(numbers.get("copies_held_bytes", 0)))
        age = GaugeMetricFamily("ckptd_peer_copy_age_seconds",
                                "seconds since this host's newest part of the job was copied to its peers",
                                labels=[JOB_LABEL])
        for job, seconds in dict(numbers.get("copy_age_s", {})).items():
            age.add_metric([str(job)], float(seconds))
        return [*families, held, age]


__all__ = ["JOB_LABEL", "CatalogView", "Metrics", "PeerCollector"]
