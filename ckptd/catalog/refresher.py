"""The refresher: a daemon thread that keeps the catalog in line with storage while ckptd serves, and the
commit pass of multi-host steps beside it (``ckptd.catalog.commit_pass``: every job the catalog knows, not only
those in this host's shared memory)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from ckptd.catalog.catalog import Catalog
from ckptd.catalog.commit_pass import CommitPass, LazyWorker

_log = logging.getLogger(__name__)


class Refresher:
    """A daemon thread that rebuilds the catalog once, then refreshes it every ``interval_s`` (listing every
    step again every ``full_every`` passes) and runs ``maintenance`` (retention) every
    ``maintenance_interval_s``. ``commits``: the commit pass of multi-host steps over the catalog's jobs,
    committing where ``catalog.writes``, started and stopped with it; its persist worker (``commit_worker``,
    default: the worker's defaults) starts on the first step ready to commit."""

    def __init__(
        self,
        catalog: Catalog,
        interval_s: float,
        *,
        maintenance: Callable[[], object] | None = None,
        maintenance_interval_s: float = 300.0,
        on_refresh: Callable[[], object] | None = None,
        full_every: int = 30,
        commit_worker: LazyWorker | None = None,
    ) -> None:
        self.catalog = catalog
        self.full_every = full_every
        self.on_refresh = on_refresh
        self.interval_s = interval_s
        self.maintenance = maintenance
        self.maintenance_interval_s = maintenance_interval_s
        self._last_maintenance = time.monotonic()
        self.commits = CommitPass(
            catalog.storage, jobs=lambda: [j.name for j in catalog.jobs()] if catalog.ready.is_set() else [],
            writes=catalog.writes, interval_s=interval_s, worker=commit_worker,
            on_committed=lambda job, _step: catalog.refresh_job(job))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-refresher", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.commits.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.commits.stop()

    def _run(self) -> None:
        first = True
        passes = 0
        while not self._stop.is_set():
            try:
                if first:
                    self.catalog.rebuild()
                    first = False
                    # What is alive now lives as long as the process: keep it out of the cyclic collector's
                    # full passes (~100k objects: ~65 ms each, a stall of every answer in flight).
                    gc.collect()
                    gc.freeze()
                else:  # listing 10,000 steps every pass would take the GIL from answers: mostly quick passes
                    passes += 1
                    self.catalog.refresh(quick=passes % self.full_every != 0)
                self.catalog.revalidate_latest()
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
