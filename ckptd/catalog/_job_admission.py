"""Which directories of the root the catalog takes as jobs: at most ``max_jobs``, never a link out of the root.

A job past the limit, or whose directory leads out of the root (a link on a local root), is *refused*:
listed in ``Catalog.refused`` with why, warned about once, never read or written through
(docs/operations.md, "Security").
"""

from __future__ import annotations

import logging

from ckptd.catalog._step_table import StepTable
from trainer_client.core._storage import Storage
from trainer_client.core.protocol import is_valid_job_name

_log = logging.getLogger(__name__)

JOB_LIMIT_REASON = "past the job limit (CKPTD_MAX_JOBS)"
LINK_OUT_REASON = "its directory is a link leading out of the checkpoint root"


class JobAdmission:
    """Which jobs the catalog takes (``admit`` for a scan of the root, ``refusal`` for one job), and why it refuses
    the others (``refused``); it reads which jobs are catalogued already from the catalog's table."""

    def __init__(self, storage: Storage, table: StepTable, max_jobs: int | None = None) -> None:
        self.storage = storage
        self.table = table
        self.max_jobs = max_jobs  # None: every job under the root
        self.refused: dict[str, str] = {}  # job -> why scans ignore it (a warning once each)

    def admit(self, found: set[str]) -> set[str]:
        """The jobs among ``found`` that a scan catalogues: within ``max_jobs``, those catalogued already first,
        then by name; the others, and links out of the root, are refused (``refused``)."""
        # links out of the root: the root's listing left them out (trainer_client/core/_storage.py)
        refused = {name: LINK_OUT_REASON for name in self.storage.links_refused(self.storage.root)
                   if is_valid_job_name(name)}
        if self.max_jobs is not None and len(found) > self.max_jobs:
            known = self.table.job_names()
            for name in sorted(found, key=lambda n: (n not in known, n))[self.max_jobs:]:
                refused[name] = JOB_LIMIT_REASON
        for job in set(self.refused) - set(refused):
            del self.refused[job]
        for job, why in refused.items():
            self.refuse(job, why)
        return found - set(refused)

    def refusal(self, job: str) -> str | None:
        """Why a scan of ``job`` alone must not catalogue it, if it must not: its directory leads out of the root
        (nothing is read or written through it), or it is new and ``max_jobs`` are catalogued."""
        if not self.storage.inside(self.storage.join(job)):
            return LINK_OUT_REASON
        if self.max_jobs is not None and not self.table.has_job(job) and self.full():
            return JOB_LIMIT_REASON
        return None

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


__all__ = ["JOB_LIMIT_REASON", "LINK_OUT_REASON", "JobAdmission"]
