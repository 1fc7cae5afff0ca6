"""The catalog: a SQLite cache of what storage holds, rebuilt from storage at start and kept fresh.

Storage is the source of truth (docs/architecture.md, invariant 1): the catalog only remembers what a scan found, so
that answering ``latest-good`` or ``resume`` does not re-read every step's metadata; killing ckptd loses nothing
(the next start scans again). A refresh lists each job directory and inspects only the steps it has not yet settled
(verified or quarantined: ``ckptd.catalog._integrity``), and a settled one again only when its content changed
(``ckptd/catalog/_identity.py``); a step gone from storage leaves the catalog. A step some ckptd already verified
carries a verified record (``ckptd_verified.json``) and is catalogued from that small file alone (10,000 small reads
at a start, not gigabytes of per-array metadata). Rows keep the training metadata without its per-array part, read
when a plan needs it. The rows, and every SQL statement, are the catalog's ``StepTable``
(``ckptd/catalog/_step_table.py``); which jobs it takes, its ``JobAdmission`` (``ckptd/catalog/_job_admission.py``).

Before a step is named in an answer its commit marker is checked, the absence of a quarantine record, and that it
still holds the content its verdict is about (its identity: ``ckptd/catalog/_identity.py``; a step saved again
under its number is judged again); quick validation against its manifest when the last one is older than
``revalidate_after_s`` (the refresher re-checks each job's newest good step ahead of that). A job watched read-only
(``read_only``, ``read_only_jobs``) gets its records on the side prefix ``<root>/.ckptd/<job>/``
(``trainer_client/core/format/_records.py``). With a lease (``ckptd/lease/_lease.py``) only the job's leader
writes records; the others serve what it wrote.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ckptd.catalog._identity import Judged, directory_time_ns, identity_of, looked_again, same_content
from ckptd.catalog._integrity import each_step, from_verified_record, quarantine, settle
from ckptd.catalog._job_admission import JobAdmission
from ckptd.catalog._job_lock import lock_troubles
from ckptd.catalog._layouts import Layouts, Recent
from ckptd.catalog._step_table import FINAL_STATES, StepTable
from ckptd.lease._lease import LeaseBoard
from trainer_client.core import Entry, Storage, StorageError, extent_problems, join_path, mtime_of, validate_step
from trainer_client.core.format import (
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    Manifest,
    StepLayout,
    inspect_step,
    read_step_layout,
    record_location,
    side_dir,
    side_job_dir,
    side_records,
    step_entries,
    training_summary,
)
from trainer_client.core.protocol import CheckpointInfo, JobInfo, StepState, is_valid_job_name

_log = logging.getLogger(__name__)

_LAYOUTS_KEPT = 8  # saved layouts and manifests (all arrays of a step) kept in memory, most recently used first

Layout = StepLayout  # what a plan is made from: trainer_client/core/_step_plan.py


class Catalog:
    """What the checkpoint root holds, per job and step, with the commit rule applied: its rows in ``table`` (the
    one holder of SQL: ``ckptd/catalog/_step_table.py``), the jobs it takes decided by ``admission``."""

    def __init__(
        self,
        storage: Storage,
        db_path: Path | str,
        *,
        save_timeout_s: float = 3600.0,
        adopt_after_s: float = 0.0,
        revalidate_after_s: float = 30.0,
        max_jobs: int | None = None,
        read_only: bool = False,
        read_only_jobs: frozenset[str] = frozenset(),
    ) -> None:
        self.storage = storage
        self.read_only, self.read_only_jobs = read_only, read_only_jobs  # write nothing under any job, or these
        storage.guard_writes(self.read_only_for)  # every writer of the root is refused there (Storage.writable)
        self.save_timeout_s = save_timeout_s
        self.adopt_after_s = adopt_after_s
        self.revalidate_after_s = revalidate_after_s
        self.table = StepTable(db_path)
        self.admission = JobAdmission(storage, self.table, max_jobs)  # max_jobs None: every job under the root
        self.refused = self.admission.refused  # job -> why scans ignore it (a warning once each)
        self._scanned_mtime: dict[str, int] = {}
        self._validated_at: dict[str, float] = {}  # step path -> when quick validation last passed (monotonic)
        self._layouts = Layouts(_LAYOUTS_KEPT)  # one load per step at a time (ckptd/catalog/_layouts.py)
        self._manifests: Recent[tuple[tuple[int, float], Manifest]] = Recent(_LAYOUTS_KEPT)  # (size, mtime)
        self.ready = threading.Event()
        self.last_refresh: float | None = None
        self.last_error: str | None = None
        self._side_jobs: set[str] = set()  # jobs with records on the side prefix (a read-only ckptd's), as listed
        self.lease: LeaseBoard | None = None  # one writer per job among sidecars on one root (docs/multihost.md)

    @property
    def version(self) -> int:
        """Bumped after every write that changes a step's state or reason, or drops a step or a job."""
        return self.table.version

    @property
    def max_jobs(self) -> int | None:
        return self.admission.max_jobs

    @max_jobs.setter
    def max_jobs(self, value: int | None) -> None:
        self.admission.max_jobs = value

    def full(self) -> bool:
        """Whether a new job would pass ``max_jobs``."""
        return self.admission.full()

    def close(self) -> None:
        self.table.close()

    # ---- the table's answers, as last catalogued (ckptd/catalog/_step_table.py) -------------------

    def has_job(self, job: str) -> bool:
        return self.table.has_job(job)

    def jobs(self) -> list[JobInfo]:
        return self.table.jobs()

    def checkpoints(self, job: str) -> list[CheckpointInfo]:
        return self.table.checkpoints(job)

    def states(self, job: str) -> dict[str, StepState]:
        return self.table.states(job)

    def at_path(self, job: str, path: str) -> CheckpointInfo | None:
        return self.table.at_path(job, path)

    def latest_good(self, job: str, at_most: int | None = None) -> CheckpointInfo | None:
        return self.table.latest_good(job, at_most)

    def newest(self, job: str, state: StepState, at_most: int | None = None) -> CheckpointInfo | None:
        return self.table.newest(job, state, at_most)

    def step(self, job: str, step: int) -> CheckpointInfo | None:
        return self.table.step(job, step)

    def mark(self, job: str, step: int, state: StepState, reason: str | None) -> None:
        self.table.mark(job, step, state, reason)

    def read_only_for(self, job: str) -> bool:
        """Whether ckptd writes nothing into the step directories of ``job`` (its records go on the side)."""
        return self.read_only or job in self.read_only_jobs

    def writes(self, job: str) -> bool:
        """Whether this ckptd writes ``job``'s records (any when no lease is on; else only while it leads)."""
        return self.lease is None or self.lease.leads(job)

    def writes_confirmed(self, job: str) -> bool:
        """``writes``, with the lease asked of storage too (``LeaseBoard.confirms``): before retention's deletions."""
        return self.lease is None or self.lease.confirms(job)

    def lock_troubles(self) -> list[dict[str, str | float]]:
        """The jobs of this root whose lock a commit, cleanup or retention could not take: refused (not a plain
        file), or held by another process past the bound (``ckptd/catalog/_job_lock.py``): /readyz, /metrics."""
        return [t.as_dict() for t in lock_troubles(self.storage.root)]

    def _read_only_at(self, step_path: str) -> bool:
        return self.read_only_for(posixpath.basename(posixpath.dirname(step_path.rstrip("/"))))

    def _has_side(self, step_path: str) -> bool:
        """Whether the step's job may have records on the side prefix: it is read-only here, or its last
        listing found some (a read-only ckptd's). Elsewhere the answers' checks skip that request."""
        job = posixpath.basename(posixpath.dirname(step_path.rstrip("/")))
        return self.read_only_for(job) or job in self._side_jobs

    # ---- building -------------------------------------------------------------------------------

    def rebuild(self, scan: Callable[[], object] | None = None) -> None:
        """Forget everything and scan storage again (what every start does): ``scan``, or else ``refresh``."""
        self.table.reset()
        (scan or self.refresh)()
        self.ready.set()

    def refresh(self, *, quick: bool = False) -> None:
        """Bring the catalog in line with storage: new jobs, new steps, steps that changed or vanished.

        ``quick`` skips listing the steps of a local job directory unchanged since its last listing (see
        ``refresh_job``): the refresher's usual pass, with a full one every ``Refresher.full_every``."""
        for job in self.list_jobs():
            self.refresh_job(job, quick=quick)
        self.last_refresh = time.time()
        self.last_error = None

    def list_jobs(self) -> list[str]:
        """The jobs a scan catalogues now, in order; jobs gone from storage or refused since leave the catalog."""
        self.storage.invalidate()
        job_entries = [e for e in self.storage.list_dir(self.storage.root) if e.is_dir]
        names = self.admission.admit({e.name for e in job_entries if is_valid_job_name(e.name)})
        self.table.keep_jobs(names)
        return [entry.name for entry in job_entries if entry.name in names]

    def refresh_job(self, job: str, *, quick: bool = False) -> None:
        """Rescan one job directory; inspects (and settles) the steps not yet verified or quarantined, and those
        settled whose content is no longer the one judged (``looked_again``: a new save under the step's name).

        ``quick`` (what a resume does): on a local disk, when the job directory has not changed since the
        last scan, only the steps not yet settled are looked at again — no listing of thousands of steps."""
        job_path = self.storage.join(job)
        dir_mtime = directory_time_ns(self.storage, job_path)
        self.storage.invalidate(job_path)
        self.storage.invalidate(side_job_dir(self.storage, job))  # records another ckptd put on the side since
        if not self.storage.is_dir(job_path) or self.admission.refuse(job, self.admission.refusal(job)):
            self.table.drop_job(job)
            return
        unchanged = quick and dir_mtime is not None and self._scanned_mtime.get(job) == dir_mtime
        seen = self.table.scanned(job, unsettled_only=unchanged)  # unchanged: only its unsettled steps
        known = {name: state for name, (state, _) in seen.items()}
        if unchanged:
            if not known:
                return  # nothing new, nothing pending: no write either
            entries = [(None, Entry(name, self.storage.join(job, name), True, None)) for name in known]
            present = set(known)
        else:
            entries = step_entries(self.storage, job_path)  # type: ignore[assignment]
            present = {entry.name for _, entry in entries}
            # Taken before the listing, so a later change rescans. Directory times are coarse (a clock tick): a
            # directory that changed in the last second is not trusted to be unchanged.
            if dir_mtime is not None and time.time() - dir_mtime / 1e9 > 1.0:
                self._scanned_mtime[job] = dir_mtime
            else:
                self._scanned_mtime.pop(job, None)
        now = time.time()
        found: list[tuple[str, Judged]] = []
        todo = [entry for _, entry in entries if known.get(entry.name) not in FINAL_STATES]
        if not unchanged and not (quick and self.storage.is_remote):  # settled steps whose directory changed, or
            # (on an object store, at a full pass) quarantined ones: ckptd/catalog/_identity.py
            settled = [entry for _, entry in entries if known.get(entry.name) in FINAL_STATES]
            resaved, kept = looked_again(self.storage, settled, self.table.settledness(job), quick=quick)
            todo += resaved
            self.table.keep_listed(job, kept)
        side = side_records(self.storage, job) if todo else {}  # records on the side prefix, listed once
        if side:
            self._side_jobs.add(job)
        unseen: list[Entry] = []  # no verified record: inspected in full below
        for entry in todo:  # a record is one small read: here (handed to another thread it cost 3x)
            self._forget(self.storage.url_of(entry.path))
            try:
                recorded = from_verified_record(self.storage, entry, side.get(entry.name, set()))
            except StorageError as exc:
                self._unreadable(entry, exc)
                continue
            if recorded is None:
                unseen.append(entry)
            else:
                found.append((entry.name, recorded))
        # several steps at a time: one step's reads and fsyncs wait while another's metadata is parsed
        for entry, outcome in each_step(lambda e: self._inspect(job, e, now), unseen):
            if isinstance(outcome, StorageError):
                self._unreadable(entry, outcome)
            elif outcome is not None:
                found.append((entry.name, outcome))
        self.table.record_scan(job, self.storage.url_of(job_path), now, seen=seen, gone=set(known) - present,
                               found=found, url_of=self.storage.url_of)

    def _unreadable(self, entry: Entry, exc: StorageError) -> None:  # one unreadable step hides no other
        self.last_error = f"{entry.path}: {exc}"
        _log.warning("cannot inspect %s: %s", entry.path, exc)

    def _inspect(self, job: str, entry: Entry, now: float | None = None) -> Judged | None:
        """The commit rule and structural checks; a committed step is then verified or quarantined, and its
        verdict's identity kept with it (of a quarantined step: its top level listed now)."""
        inspection = inspect_step(self.storage, entry, save_timeout_s=self.save_timeout_s, now=now)
        if inspection is None or inspection.state is not StepState.COMMITTED:
            return None if inspection is None else Judged(inspection)
        settled = settle(self.storage, inspection, adopt_after_s=self.adopt_after_s,
                         read_only=self.read_only_for(job), write=self.writes(job))
        inspection = replace(inspection, state=settled.state, reason=settled.reason)
        identity = settled.identity
        if settled.state is StepState.VERIFIED:
            self._validated_at[self.storage.url_of(inspection.path)] = time.monotonic()
        if settled.state.value in FINAL_STATES and identity is None:
            self.storage.invalidate(inspection.path)
            identity = identity_of(self.storage.list_dir(inspection.path))
        return Judged(inspection, identity)

    def _forget(self, path: str) -> None:
        """Drop what is kept in memory about a step (it is being inspected again)."""
        self._validated_at.pop(path, None)
        self._layouts.forget(path)
        self._manifests.pop(path)

    # ---- answering ------------------------------------------------------------------------------

    def confirmed_latest_good(self, job: str, at_most: int | None = None) -> CheckpointInfo | None:
        """``latest_good``, after checking on storage that the step still holds its commit marker.

        A verified step is not re-read by refreshes; if it was deleted, is being rewritten under the same
        name, or was quarantined by another ckptd since, it is re-inspected here and the next good one tried."""
        while True:
            info = self.latest_good(job, at_most)
            if info is None or self._still_good(info):
                return info
            self._reinspect(job, info)

    def _still_good(self, info: CheckpointInfo) -> bool:
        """Checked on storage before a step is named: still committed, not quarantined by anyone, still the content
        its verdict is about (another save under its name is judged again, not against this one's manifest), every
        file its manifest lists present with its size (and, on an object store, its CRC32C): a file deleted,
        truncated or grown since is caught here however recently the step was verified, and the step
        quarantined (docs/concepts.md, "Good"). That is one listing of the step against the manifest kept in
        memory; the full quick validation (the manifest read again when it changed, the training metadata
        compared) when the last one is older than ``revalidate_after_s`` or the manifest is not kept. Cached
        listings of the step are dropped first: on ``gs://`` a quarantine record or a manifest another process
        wrote since would otherwise be invisible (or read with its old size)."""
        self.storage.invalidate(info.path)
        listed = self.storage.list_dir(info.path)  # one listing: the marker, no quarantine record, the identity
        names = {entry.name for entry in listed}
        if COMMIT_MARKER not in names or QUARANTINE_FILE in names:
            return False
        job = posixpath.basename(posixpath.dirname(info.path.rstrip("/")))
        if not same_content(self.table.identity(job, info.path), listed):
            return False  # saved again since its verdict: judged again by the caller, not against the old manifest
        if self._has_side(info.path):  # one more request only where side records may be
            self.storage.invalidate(side_dir(info.path))
            if self.storage.exists(join_path(side_dir(info.path), QUARANTINE_FILE)):
                return False
        checked = self._validated_at.get(info.path)
        kept = self._manifests.get(info.path)
        if checked is None or kept is None or time.monotonic() - checked >= self.revalidate_after_s:
            return self.revalidate(info)
        problems = extent_problems(self.storage, info.path, kept[1])
        if problems:
            self._failed(info, problems)
            return False
        return True

    def revalidate(self, info: CheckpointInfo) -> bool:
        """Quick validation of a verified step now; a step that fails is quarantined, one rewritten under the
        same name (other training metadata) is not good until re-inspected."""
        # The manifest is read again only when it changed (size or time): it is megabytes for a large model.
        try:
            where = (record_location(self.storage, info.path, CKPTD_MANIFEST) if self._has_side(info.path)
                     else join_path(info.path, CKPTD_MANIFEST))  # the side prefix's, else the step's
            stat = self.storage.fs.info(where) if where is not None else None
            key: tuple[int, float] | None = (
                (int(stat.get("size") or 0), float(mtime_of(stat) or 0.0)) if stat is not None else None)
        except (OSError, ValueError):
            key = None
        kept = self._manifests.get(info.path)
        known = kept[1] if kept is not None and key is not None and kept[0] == key else None
        result = validate_step(self.storage, info.path, "quick", manifest=known)
        if not result.ok:
            self._failed(info, result.problems)
            return False
        if result.manifest is not None and key is not None:
            self._manifests.put(info.path, (key, result.manifest))
        if result.manifest is not None and training_summary(result.manifest.training) != info.training:
            return False  # re-inspected by the caller: the catalogued metadata belongs to an older write
        self._validated_at[info.path] = time.monotonic()
        return True

    def _failed(self, info: CheckpointInfo, problems: list[str]) -> None:
        """A verified step failed a check on storage: quarantined (a follower leaves the verdict to the leader;
        the step is not served meanwhile either way)."""
        if self.writes(posixpath.basename(posixpath.dirname(info.path.rstrip("/")))):  # the step's job
            quarantine(self.storage, info.path, "quick validation failed: " + "; ".join(problems[:5]),
                       problems, read_only=self._read_only_at(info.path))

    def revalidate_latest(self) -> None:
        """Quick-validate each job's newest good step when its last check is 80% of the way to due, and load
        its arrays: what the refresher does (job by job, ``revalidate_job``), so answers do not wait for either."""
        for job in (j for j in self.jobs() if j.latest_good_step is not None):
            self.revalidate_job(job.name)

    def revalidate_job(self, job: str) -> None:
        """``revalidate_latest`` for one job."""
        info = self.latest_good(job)
        if info is not None:
            checked = self._validated_at.get(info.path)
            due = checked is None or time.monotonic() - checked > self.revalidate_after_s * 0.8
            if not due or self.revalidate(info):
                self.layout(info)
            else:
                self._reinspect(job, info)

    def layout(self, info: CheckpointInfo, wait_s: float | None = None) -> Layout:
        """The step's full training metadata (arrays included) and saved layout, read once and kept for the
        ``_LAYOUTS_KEPT`` steps planned most recently (a step re-inspected is dropped); a read by another caller is
        waited for, at most ``wait_s`` seconds, then ``Busy`` (``ckptd/catalog/_layouts.py``)."""
        return self._layouts.get(info.path, lambda: read_step_layout(self.storage, info.path), wait_s)

    def confirmed_step(self, job: str, step: int) -> CheckpointInfo | None:
        """``step``, with a committed answer checked against storage like ``confirmed_latest_good``."""
        info = self.step(job, step)
        if info is not None and info.state is StepState.VERIFIED and not self._still_good(info):
            self._reinspect(job, info)
            info = self.step(job, step)
        return info

    def _reinspect(self, job: str, info: CheckpointInfo) -> None:
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        entry = next((e for _, e in step_entries(self.storage, self.storage.join(job)) if e.name == name), None)
        self._forget(info.path)
        self.table.record_step(job, name, self._inspect(job, entry) if entry is not None else None)


__all__ = ["Catalog", "Layout"]
