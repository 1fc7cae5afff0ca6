"""The one owner of committing multi-host steps (docs/multihost.md, section 5): a daemon thread that, for every job
the catalog knows and this sidecar leads, commits the claimed steps whose host parts are all durable.

The pass starts from the catalog, not from the leader's own shared-memory directory: a leader whose host holds no
snapshot of the job (a sidecar started without ``CKPTD_SHM_DIR``, a replaced node whose trainer has not started
yet, a sidecar serving only reads) still commits the job's steps once every part is durable on storage, so the
commit does not depend on any host's memory; it is the only caller of ``PartSaves.commit_ready`` in a server, on
one thread, so no two commits of one step run at once in one sidecar (and the lease keeps the other sidecars out).

The merge (``_METADATA``, ``_sharding``, ...) needs jax and Orbax, so it runs in a persist worker child (``python
-m ckptd.persist._persist_worker --serve``, through ``ckptd.persist._worker_client``) started lazily, on the first
step that is ready to commit here: a follower, or a leader of jobs without claims, never starts one. Cost: a leader
(every sidecar when no lease is on) lists each job's claims directory once a pass, beside the refresher's listing.

Claims and part records are whatever storage holds, forged ones included: each job gets at most ``JOB_BUDGET_S`` of
a pass (a commit started is finished), so one job's claims never hold up another's commits, and the pass stops
between records when ckptd is stopped, so a SIGTERM is not kept waiting. A job ckptd watches read-only is skipped:
nothing is committed under it (docs/protocol.md, "Read-only adoption").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from ckptd.multihost._part_commit import JOB_BUDGET_S, PartSaves
from ckptd.persist._worker_client import PersistWorker, PersistWorkerClient
from trainer_client.core import Storage, StorageError
from trainer_client.core.format import CLAIMS_DIR, DEFAULT_SAVE_TIMEOUT_S

_log = logging.getLogger(__name__)
STOP_WAIT_S = 5.0  # a stop waits this long for a commit in progress, then as long for its last pass


def _spent(stopping: Callable[[], bool], deadline: float, clock: Callable[[], float]) -> Callable[[], bool]:
    """Whether a job's share of a pass is used up: ckptd is stopping, or ``deadline`` (of ``clock``) passed."""
    return lambda: stopping() or clock() > deadline


class CommitPass:
    """Every ``interval_s``: for each job of ``jobs()`` that ``writes(job)`` (leads) and has claims, commit what
    is ready (``PartSaves.commit_ready``), for at most ``job_budget_s`` a job; ``on_committed(job, step)`` after
    each commit. The merge goes to ``worker`` (default: a ``PersistWorkerClient`` with the worker's defaults,
    whose child starts on the first request; tests: ``InProcessWorker``), closed by ``stop``. ``redo_after_s``: on
    ``gs://``, how long a commit another sidecar decided is left to it before this one redoes it (the save
    timeout: that sidecar may be paused half-way, docs/multihost.md, section 5, "Fenced writers"). ``clock``: what
    the budgets are read from (seconds; the monotonic clock unless given: tests step it)."""

    def __init__(self, storage: Storage, *, jobs: Callable[[], Iterable[str]], writes: Callable[[str], bool],
                 interval_s: float, worker: PersistWorker | None = None,
                 on_committed: Callable[[str, int], object] | None = None,
                 job_budget_s: float = JOB_BUDGET_S, stop_wait_s: float = STOP_WAIT_S,
                 redo_after_s: float = DEFAULT_SAVE_TIMEOUT_S, clock: Callable[[], float] | None = None) -> None:
        self.worker = worker or PersistWorkerClient()
        self.parts = PartSaves(storage, self.worker, writes=writes, redo_after_s=redo_after_s)
        self._jobs = jobs
        self.interval_s = interval_s
        self.job_budget_s = job_budget_s
        self.stop_wait_s = stop_wait_s
        self._clock = clock if clock is not None else time.monotonic
        self.on_committed = on_committed
        self.commits = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one pass at a time, whoever calls run_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-commit-pass", daemon=True)

    def run_once(self, *, stopping: Callable[[], bool] = lambda: False) -> list[tuple[str, int]]:
        """One pass over every job; the (job, step) pairs committed now. It ends early once ``stopping()``."""
        done: list[tuple[str, int]] = []
        storage = self.parts.storage
        with self._lock:
            for job in sorted(set(self._jobs())):
                if stopping():
                    break
                deadline = self._clock() + self.job_budget_s
                try:
                    if not self.parts.writes(job) or storage.write_refusal(storage.join(job)) is not None:
                        continue  # a follower lists nothing; nothing is committed in a read-only job
                    storage.invalidate(storage.join(job, CLAIMS_DIR))  # claims of others
                    if not self.parts.claims(job):
                        continue
                    steps = self.parts.commit_ready(job, spent=_spent(stopping, deadline, self._clock))
                except (OSError, StorageError, RuntimeError) as exc:  # reported; the next pass tries again
                    self.last_error = f"{job}: {type(exc).__name__}: {exc}"
                    _log.error("committing the host parts of %s failed: %s", job, exc)
                    continue
                for step in steps:
                    self.commits += 1
                    done.append((job, step))
                    if self.on_committed is not None:
                        self.on_committed(job, step)
        return done

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop; first one last pass (at shutdown the keeper's drain may just have written the last parts, and
        the lease is released only after this). A pass in progress stops at its next record or claim; one busy
        in a commit is waited for ``stop_wait_s`` at most, then left (its worker is stopped: the next leader
        redoes the commit, docs/multihost.md, section 5). The last pass gets ``stop_wait_s`` too, all jobs
        together: a stop takes seconds, well within Kubernetes' default grace of 30 s."""
        self._stop.set()
        started = self._thread.ident is not None
        if self._thread.is_alive():
            self._thread.join(timeout=self.stop_wait_s)
        if started and not self._thread.is_alive():
            deadline = self._clock() + self.stop_wait_s
            try:
                self.run_once(stopping=lambda: self._clock() > deadline)
            except Exception:  # shutting down: reported, the next leader commits
                _log.exception("last commit pass failed")
        self.worker.close(self.stop_wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once(stopping=self._stop.is_set)
            except Exception:  # never let the thread die
                _log.exception("commit pass failed")


__all__ = ["CommitPass"]
