"""The one owner of committing multi-host steps (docs/multihost.md, section 5): a daemon thread that, for every
job the catalog knows and this sidecar leads, commits the claimed steps whose host parts are all durable.

It used to be the memory-tier keeper's job, queued only for the jobs found in the leader's own shared-memory
directory: a leader whose host held no snapshot of the job (a sidecar started without ``CKPTD_SHM_DIR``, a
replaced node whose trainer has not started yet, a sidecar serving only reads) never committed the job's
steps although every part was durable on storage. The pass starts from the catalog instead, so it does not
depend on any host's memory; it is the only caller of ``PartSaves.commit_ready`` in a server, on one thread,
so no two commits of one step run at once in one sidecar (and the lease keeps the other sidecars out).

The merge (``_METADATA``, ``_sharding``, ...) needs jax and Orbax, so it runs in a persist worker child
(``python -m ckptd.catalog.persist_worker --serve``) this pass starts lazily, on the first step that is
ready to commit here: a follower, or a leader of jobs without claims, never starts one. Cost: a leader (every
sidecar when no lease is on) lists each job's claims directory once a pass, beside the refresher's listing.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ckptd.catalog.part_commit import PartSaves
from ckptd.catalog.snapshots import DEFAULT_NICE, ask_persist_worker, start_persist_worker, stop_persist_worker
from trainer_client.core.errors import StorageError
from trainer_client.core.format.parts import CLAIMS_DIR
from trainer_client.core.storage import Storage

_log = logging.getLogger(__name__)


class LazyWorker:
    """A persist worker child started on the first request (restarted after a crash), one request at a time."""

    def __init__(self, *, nice: int = DEFAULT_NICE, devices: int | None = None, timeout_s: float = 3600.0) -> None:
        self.nice = nice
        self.devices = devices
        self.timeout_s = timeout_s
        self._worker: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def started(self) -> bool:
        return self._worker is not None

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                return {"ok": False, "error": "ckptd is shutting down"}
            if self._worker is None or self._worker.poll() is not None:
                try:
                    self._worker = start_persist_worker(nice=self.nice, devices=self.devices)
                except OSError as exc:
                    return {"ok": False, "error": f"cannot start the persist worker: {exc}"}
            return ask_persist_worker(self._worker, request, self.timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            if self._worker is not None:
                stop_persist_worker(self._worker, timeout_s)


class CommitPass:
    """Every ``interval_s``: for each job of ``jobs()`` that ``writes(job)`` (leads) and has claims, commit what
    is ready (``PartSaves.commit_ready``); ``on_committed(job, step)`` after each commit. The merge goes to
    ``ask`` (tests: in process), else to ``worker`` (default: a ``LazyWorker`` with the worker's defaults)."""

    def __init__(self, storage: Storage, *, jobs: Callable[[], Iterable[str]], writes: Callable[[str], bool],
                 interval_s: float, ask: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 worker: LazyWorker | None = None, on_committed: Callable[[str, int], object] | None = None) -> None:
        self.worker = (worker or LazyWorker()) if ask is None else None  # closed by stop
        self.parts = PartSaves(storage, ask or self.worker.ask, writes=writes)  # type: ignore[union-attr]
        self._jobs = jobs
        self.interval_s = interval_s
        self.on_committed = on_committed
        self.commits = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one pass at a time, whoever calls run_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-commit-pass", daemon=True)

    def run_once(self) -> list[tuple[str, int]]:
        """One pass over every job; the (job, step) pairs committed now."""
        done: list[tuple[str, int]] = []
        with self._lock:
            for job in sorted(set(self._jobs())):
                if self._stop.is_set() and self._thread.is_alive():
                    break
                try:
                    if not self.parts.writes(job):
                        continue  # a follower lists nothing
                    self.parts.storage.invalidate(self.parts.storage.join(job, CLAIMS_DIR))  # claims of others
                    if not self.parts.claims(job):
                        continue
                    steps = self.parts.commit_ready(job)
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
        the lease is released only after this)."""
        self._stop.set()
        started = self._thread.ident is not None
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if started and not self._thread.is_alive():
            try:
                self.run_once()
            except Exception:  # shutting down: reported, the next leader commits
                _log.exception("last commit pass failed")
        if self.worker is not None:
            self.worker.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # never let the thread die
                _log.exception("commit pass failed")


__all__ = ["CommitPass", "LazyWorker"]
