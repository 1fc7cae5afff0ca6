"""Which directories of the root the catalog takes as jobs: at most ``max_jobs``, never a link out of the root.

A job past the limit, or whose directory leads out of the root (a link on a local root), is *refused*:
listed in ``Catalog.refused`` with why, warned about once, never read or written through
(docs/operations.md, "Security" and "Events").

Which jobs the limit keeps is never decided by names (anyone who can write the root can make directories, and
a root with hundreds of old runs is normal). Directories are ranked, strongest first:

1. a directory that holds a job (a step directory, finalized or not, or the events ckptd keeps for a job)
   before one that holds none: empty or junk directories never displace a job with steps;
2. the most recently changed (the directory's modification time, on a local root: the run training now
   before old runs; an object store has no directory times);
3. one catalogued already before a new one (what is served stays served);
4. then by name, so the choice is the same at every start.

Ranking costs nothing while the root holds at most ``max_jobs`` directories. Past it, each directory is
``stat``-ed on a local root, and one that the catalog does not know to hold steps is listed (its ``.ckptd`` too,
when present) once, and again only when its modification time changes; on ``gs://`` one found without a job
is listed again at most every ``REPROBE_S``. A request naming a job not catalogued while the limit is reached
is admitted in place of the weakest catalogued job when it outranks that one (which is then refused).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

from ckptd.catalog._step_table import StepTable
from trainer_client.core import Storage
from trainer_client.core.format import EVENTS_DIR, SIDE_DIR, parse_step_name
from trainer_client.core.protocol import is_valid_job_name

_log = logging.getLogger(__name__)

JOB_LIMIT_REASON = "past the job limit (CKPTD_MAX_JOBS)"
LINK_OUT_REASON = "its directory is a link leading out of the checkpoint root"
REPROBE_S = 60.0  # on an object store, a directory found holding no job is listed again at most this often
_EVENTS_NAME = EVENTS_DIR.rsplit("/", 1)[-1]


class JobAdmission:
    """Which jobs the catalog takes (``admit`` for a scan of the root, ``refusal`` for one job), and why it refuses
    the others (``refused``); it reads which jobs are catalogued already from the catalog's table."""

    def __init__(self, storage: Storage, table: StepTable, max_jobs: int | None = None) -> None:
        self.storage = storage
        self.table = table
        self.max_jobs = max_jobs  # None: every job under the root
        self.refused: dict[str, str] = {}  # job -> why scans ignore it (a warning once each)
        self._probed: dict[str, tuple[int | None, bool, float]] = {}  # name -> (its mtime, holds a job, when)
        self._deciding = threading.Lock()  # a scan's admission and a request's swap decide one at a time

    def admit(self, found: set[str]) -> set[str]:
        """The jobs among ``found`` that a scan catalogues: the ``max_jobs`` strongest (the module's ranking);
        the others, and links out of the root, are refused (``refused``)."""
        # links out of the root: the root's listing left them out (trainer_client/core/_storage.py)
        refused = {name: LINK_OUT_REASON for name in self.storage.links_refused(self.storage.root)
                   if is_valid_job_name(name)}
        with self._deciding:
            for gone in set(self._probed) - found:
                del self._probed[gone]
            if self.max_jobs is not None and len(found) > self.max_jobs:
                for name in self.ranked(found)[self.max_jobs:]:
                    refused[name] = JOB_LIMIT_REASON
            for job in set(self.refused) - set(refused):
                del self.refused[job]
            for job, why in refused.items():
                self.refuse(job, why)
        return found - set(refused)

    def refusal(self, job: str) -> str | None:
        """Why a scan of ``job`` alone must not catalogue it, if it must not: its directory leads out of the root
        (nothing is read or written through it), or it is new, ``max_jobs`` are catalogued and it is weaker than
        each of them. A new job stronger than the weakest catalogued one takes its place (that one is refused)."""
        if not self.storage.inside(self.storage.join(job)):
            return LINK_OUT_REASON
        if self.max_jobs is None or self.table.has_job(job) or not self.full():
            return None
        with self._deciding:
            known = self.table.job_names()
            if len(known) < self.max_jobs:
                return None
            ranked = self.ranked(known | {job})
            if job in ranked[self.max_jobs:]:
                return JOB_LIMIT_REASON
            for weaker in ranked[self.max_jobs:]:
                self.table.drop_job(weaker)
                self.refuse(weaker, JOB_LIMIT_REASON)
        return None

    def ranked(self, names: Iterable[str]) -> list[str]:
        """``names``, strongest first (the module's ranking)."""
        known = self.table.job_names()
        stepped = {info.name for info in self.table.jobs() if info.steps}  # catalogued with steps: hold a job

        def key(name: str) -> tuple[bool, int, bool, str]:
            stamp = self._mtime_ns(name)
            holds = name in stepped or self._holds_job(name, stamp)
            return (not holds, -(stamp or 0), name not in known, name)

        return sorted(names, key=key)

    def refuse(self, job: str, why: str | None) -> bool:
        """Record that ``job`` is refused (a warning the first time); False (nothing recorded) when ``why`` is None."""
        if why is None:
            self.refused.pop(job, None)
            return False
        if self.refused.get(job) != why:
            _log.warning("job %r is ignored: %s", job, why)
        self.refused[job] = why
        return True

    def full(self) -> bool:
        """Whether a new job would pass ``max_jobs``."""
        return self.max_jobs is not None and self.table.job_count() >= self.max_jobs

    def _mtime_ns(self, name: str) -> int | None:
        """The job directory's modification time on a local root (None on an object store, or unreadable)."""
        if self.storage.is_remote:
            return None
        try:
            return os.stat(self.storage.join(name)).st_mtime_ns
        except OSError:
            return None

    def _holds_job(self, name: str, stamp: int | None) -> bool:
        """Whether the directory holds a step directory or a job's events (listed again only as the module says)."""
        kept = self._probed.get(name)
        now = time.monotonic()
        if kept is not None:
            kept_stamp, holds, at = kept
            if stamp is not None and kept_stamp == stamp:
                return holds
            if stamp is None and (holds or now - at < REPROBE_S):
                return holds
        holds = self._probe(self.storage.join(name))
        self._probed[name] = (stamp, holds, now)
        return holds

    def _probe(self, path: str) -> bool:
        try:
            entries = [e for e in self.storage.list_dir(path) if e.is_dir]
            if any(parse_step_name(e.name) is not None for e in entries):
                return True
            side = next((e for e in entries if e.name == SIDE_DIR), None)
            return side is not None and any(
                e.is_dir and e.name == _EVENTS_NAME for e in self.storage.list_dir(side.path))
        except OSError:  # StorageError included: unreadable now, so nothing shows it holds a job
            return False


__all__ = ["JOB_LIMIT_REASON", "LINK_OUT_REASON", "REPROBE_S", "JobAdmission"]
