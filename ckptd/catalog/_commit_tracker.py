"""The metrics that need storage reads, kept off the scrape path: a background thread that watches the
catalog for steps changing state and keeps the per-job goodput gauge fresh.

Each pass compares the catalog's steps with the previous pass: a step newly finalized by Orbax counts
as a commit (its manifest gives the bytes; its training metadata and Orbax's commit time give the save
duration), a step newly quarantined or corrupt counts as a validation failure. The first pass only
takes stock: steps already on storage when ckptd started are not commits it saw. Every
``goodput_interval_s`` the goodput of each job is recomputed from its events on storage; the first time a
job is seen, its stored event history is loaded into the recovery metrics (``Metrics.load_history``).
"""

from __future__ import annotations

import logging
import threading
import time

from ckptd._metrics import Metrics
from ckptd.catalog._catalog import Catalog
from ckptd.events._events import EventStore
from trainer_client.core import StorageError
from trainer_client.core.format import read_manifest
from trainer_client.core.protocol import CheckpointInfo, StepState

_log = logging.getLogger(__name__)

FINALIZED = frozenset({StepState.COMMITTED, StepState.VERIFIED, StepState.QUARANTINED, StepState.CORRUPT})
BAD = frozenset({StepState.QUARANTINED, StepState.CORRUPT})


class CommitTracker:
    """Observes the catalog every ``interval_s``; ``poll()`` runs one pass (tests call it directly)."""

    def __init__(
        self,
        catalog: Catalog,
        metrics: Metrics,
        events: EventStore,
        *,
        interval_s: float = 2.0,
        goodput_interval_s: float = 30.0,
    ) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.events = events
        self.interval_s = interval_s
        self.goodput_interval_s = goodput_interval_s
        self._states: dict[tuple[str, str], StepState] = {}
        self._version = -1
        self._checkpoints: dict[str, tuple[int, list[CheckpointInfo]]] = {}  # job -> (catalog version, steps)
        self._baselined = False
        self._last_goodput = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ckptd-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # metrics must never take the sidecar down
                _log.warning("metrics pass failed: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.interval_s)

    def poll(self, *, goodput: bool | None = None) -> None:
        """One pass; ``goodput`` forces (True) or skips (False) the goodput refresh."""
        if not self.catalog.ready.is_set():
            return
        jobs = [j.name for j in self.catalog.jobs()]
        version = self.catalog.version
        if version != self._version:  # nothing changed state since the last pass: nothing to compare
            self._compare(jobs)
            self._version = version
        due = time.monotonic() - self._last_goodput >= self.goodput_interval_s
        if goodput or (goodput is None and due):
            self._last_goodput = time.monotonic()
            self._refresh_goodput(jobs)

    def _compare(self, jobs: list[str]) -> None:
        states: dict[tuple[str, str], StepState] = {}
        for job in jobs:
            self.metrics.commits.labels(job)  # the series exist (at 0) from the first pass on
            self.metrics.validation_failures.labels(job)
            for path, state in self.catalog.states(job).items():  # no metadata parsed: 10,000 steps poll cheaply
                key = (job, path)
                states[key] = state
                before = self._states.get(key)
                if self._baselined and state != before:
                    ck = self.catalog.at_path(job, path)
                    if ck is not None:
                        self._observe(job, ck, before)
        self._states = states
        self._baselined = True

    def _observe(self, job: str, ck: CheckpointInfo, before: StepState | None) -> None:
        if ck.state in FINALIZED and before not in FINALIZED:
            self.metrics.commits.labels(job).inc()
            if ck.training is not None and ck.committed_at is not None and ck.committed_at >= ck.training.wall_time:
                self.metrics.save_seconds.labels(job).observe(ck.committed_at - ck.training.wall_time)
            try:
                manifest = read_manifest(self.catalog.storage, ck.path)
            except (OSError, StorageError, ValueError) as exc:
                _log.info("no size for step %s of %s: %s", ck.step, job, exc)
                manifest = None
            if manifest is not None:
                size = sum(f.size for f in manifest.expected_files().values())
                self.metrics.committed_bytes.labels(job).inc(size)
        if ck.state in BAD and before not in BAD:
            self.metrics.validation_failures.labels(job).inc()

    def _refresh_goodput(self, jobs: list[str]) -> None:
        values: dict[str, float] = {}
        for job in jobs:
            try:
                kept = self._checkpoints.get(job)
                if kept is None or kept[0] != self.catalog.version:  # 10,000 steps are parsed only when changed
                    kept = (self.catalog.version, self.catalog.checkpoints(job))
                    self._checkpoints[job] = kept
                result = self.events.goodput(job, kept[1], version=kept[0])  # whole history; unchanged: kept
                if not self.metrics.history_loaded(job):  # after a start: recovery metrics from storage
                    self.metrics.load_history(job, self.events.stats(job))
            except (OSError, StorageError) as exc:
                _log.info("goodput of %s not refreshed: %s", job, exc)
                continue
            if result.goodput is not None:
                values[job] = result.goodput
        self.metrics.goodput.clear()  # jobs gone from storage leave the gauge
        for job, value in values.items():
            self.metrics.goodput.labels(job).set(value)


__all__ = ["BAD", "FINALIZED", "CommitTracker"]
