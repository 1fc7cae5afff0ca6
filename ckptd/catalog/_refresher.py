"""The refresher: a daemon thread that keeps the catalog in line with storage while ckptd serves (and runs
retention, handed in as ``maintenance``).

The commit pass of multi-host steps runs beside it, on a thread of its own, over every job the catalog knows
(``ckptd/multihost/_commit_pass.py``), but the refresher neither builds nor starts it: the composition root
(``ckptd/_sidecar.py``) does, as it does the other workers. A newcomer looking for who commits a multi-host step
finds it in the multi-host room, and the catalog, below that room, imports nothing of it.

Each job's part of a pass — its scan, the first sight of its new steps, the re-validation of its newest good
step and the read of that step's layout — runs on ``JobWorkers`` (``ckptd/catalog/_job_workers.py``), at most
one per job at a time: a job whose step takes long to read (a forged OCDBT index is read up to the reader's
deadline: docs/operations.md, "What each limit defends") delays only its own next pass, never the loop, the
other jobs' scans, the start's readiness (which waits for every job's scan, not for the layout reads) or a
SIGTERM (the workers are daemon threads, and the loop does not wait on them to stop)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from functools import partial

from ckptd.catalog._catalog import Catalog
from ckptd.catalog._job_workers import JobWorkers

_log = logging.getLogger(__name__)

JOB_WORKERS = 4  # jobs scanned at once (each scan settles up to four steps at once: ckptd/catalog/_integrity.py)


class Refresher:
    """A daemon thread that rebuilds the catalog once, then refreshes it every ``interval_s`` (listing every
    step again every ``full_every`` passes) and runs ``maintenance`` (retention) every
    ``maintenance_interval_s``."""

    def __init__(
        self,
        catalog: Catalog,
        interval_s: float,
        *,
        maintenance: Callable[[], object] | None = None,
        maintenance_interval_s: float = 300.0,
        on_refresh: Callable[[], object] | None = None,
        full_every: int = 30,
        job_workers: int = JOB_WORKERS,
    ) -> None:
        self.catalog = catalog
        self.full_every = full_every
        self.on_refresh = on_refresh
        self.interval_s = interval_s
        self.maintenance = maintenance
        self.maintenance_interval_s = maintenance_interval_s
        self._last_maintenance = time.monotonic()
        self._stop = threading.Event()
        self._jobs = JobWorkers(job_workers)
        self._thread = threading.Thread(target=self._run, name="ckptd-refresher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._jobs.close()  # a job's pass still running is left to finish, or to end with the process

    def busy_jobs(self) -> list[str]:
        """The jobs whose pass is running or waits for a worker."""
        return self._jobs.busy()

    def _job_pass(self, job: str, quick: bool, scanned: Callable[[], None]) -> None:
        """One job's part of a pass: its scan (``scanned`` when done, failed or not), then its newest good
        step's re-validation and layout. A failure is this job's: reported on /readyz, the other jobs go on."""
        try:
            try:
                self.catalog.refresh_job(job, quick=quick)
            finally:
                scanned()
            if not self._stop.is_set():
                self.catalog.revalidate_job(job)
        except Exception as exc:
            self.catalog.last_error = f"{job}: {type(exc).__name__}: {exc}"
            _log.warning("refreshing job %r failed: %s: %s", job, type(exc).__name__, exc)

    def _pass(self, *, quick: bool, first: bool = False) -> None:
        """List the jobs and start each one's pass (a job whose last pass still runs is skipped). The first
        pass returns once every job's scan is done (or ckptd stops): what readiness means."""
        jobs = self.catalog.list_jobs()
        self.catalog.last_error = None
        scans: list[Future[None]] = []
        for job in jobs:
            scanned: Future[None] = Future()
            if self._jobs.submit(job, partial(self._job_pass, job, quick, partial(scanned.set_result, None))):
                scans.append(scanned)
        self.catalog.last_refresh = time.time()
        while first and scans and not self._stop.is_set():
            scans = list(wait(scans, timeout=0.2).not_done)

    def _run(self) -> None:
        first = True
        passes = 0
        while not self._stop.is_set():
            try:
                if first:
                    self.catalog.rebuild(scan=lambda: self._pass(quick=False, first=True))
                    first = False
                    # What is alive now lives as long as the process: keep it out of the cyclic collector's
                    # full passes (~100k objects: ~65 ms each, a stall of every answer in flight).
                    gc.collect()
                    gc.freeze()
                else:  # listing 10,000 steps every pass would take the GIL from answers: mostly quick passes
                    passes += 1
                    self._pass(quick=passes % self.full_every != 0)
                if self.on_refresh is not None:
                    self.on_refresh()
                due = time.monotonic() - self._last_maintenance >= self.maintenance_interval_s
                if self.maintenance is not None and due:
                    self._last_maintenance = time.monotonic()
                    self.maintenance()
            except Exception as exc:  # keep serving the last good view; report it on /readyz
                self.catalog.last_error = f"{type(exc).__name__}: {exc}"
                _log.warning("catalog refresh failed: %s", self.catalog.last_error)
            self._stop.wait(self.interval_s)


__all__ = ["Refresher"]
