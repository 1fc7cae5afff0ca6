"""Multi-host persist and commit on ckptd's side (docs/multihost.md, section 5), jax-free: the persist worker
child does the Orbax writes (``trainer_client.checkpoint_io._part_writer``, asked through
``ckptd.persist._worker_client``); this module decides what to write and when.

Host k's sidecar persists its own part of step S: it claims S for the part's save (``<job>/.ckptd/claims/
<S>.json``, create-only: one save per step number), has the worker write the part into the step (staged under
``<job>/.ckptd/staging/<S>.<save_id>/`` on a local root, in place on ``gs://``), then creates the part record
``<S>/ckptd_parts/process_<k>.json`` (create-only) once the part is durable. Exactly one party commits: the
job's leader (``Catalog.writes``; the one sidecar when no lease is on), for each claimed uncommitted step whose N
part records are all there with the claim's save id: the worker's finalize (merge, ``_METADATA``,
``_sharding``, ``_CHECKPOINT_METADATA``), ckptd's manifest, then the create-only commit marker, and on a local
root the rename of the staging directory to ``<job>/<S>``. Every action before the marker is a rewrite of
the same content, so a leader that dies mid-commit is replaced and the next one redoes it. A step missing a
part is never committed, so never served; a claim older than ``save_timeout_s`` without a commit is reported
abandoned and deleted, staged files included, by ``clean_abandoned``. A commit and a cleanup exclude each other
under the job's flock locally; on ``gs://`` each first decides the save's fate (``format/_fates.py``), so a
leader paused past its checks never deletes what a newer one committed (docs/multihost.md, "Fenced writers").

On ``gs://`` each host paces its part's writes at its share of the bucket's write budget (``WriteShare``: the
budget over the job's writers, the host count when the sidecar knows it, else the part's process count): the part
starts at a point drawn within the process's own N-th of the window its writes take at that share, then writes
them one after another, so N hosts ask together, evenly, what the bucket takes instead of all at once
(docs/gcs.md, "Many hosts on one bucket"). The leader's commit is not paced.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ckptd.catalog._job_lock import job_lock
from ckptd.lease._lease_records import default_holder
from ckptd.multihost._in_place import delete_listed, record_standing
from ckptd.persist._worker_client import PersistWorker, PersistWorkerError
from trainer_client.core import (
    BUCKET_WRITES_PER_S,
    Storage,
    StorageError,
    WriteShare,
    listed_generations,
    step_identity,
    sync_paths,
)
from trainer_client.core.format import (
    CLAIMS_DIR,
    COMMIT_MARKER,
    DEFAULT_SAVE_TIMEOUT_S,
    UNMANIFESTED,
    Claim,
    Fate,
    FileEntry,
    Manifest,
    PartInfo,
    SaveParts,
    SnapshotMeta,
    changed_files,
    claimed_steps,
    decide_fate,
    file_entry,
    incarnation_of,
    list_files,
    listed_parts,
    make_claim,
    read_claim,
    read_fate,
    read_fate_record,
    read_part,
    record_bytes,
    record_path,
    report_refused,
    save_parts,
    spans,
    staged_saves,
    step_path_for,
    take_over_claim,
    write_manifest,
)

_log = logging.getLogger(__name__)

# The time one pass over a job's claims may take, commits aside (a commit started is finished): past it the
# pass moves on to the next job (docs/operations.md, "What each limit defends").
JOB_BUDGET_S = 5.0
RECORD_READERS = 16  # part records read at once by a pass over a save's records and by the commit's re-read
# the writes of the smallest part: its claim, its OCDBT data file and manifest, its array metadatas, its record
PART_WRITES = 5
Spent = Callable[[], bool]  # whether the time a caller allowed is spent (asked between records and steps)
PartState = Literal["committed", "written", "todo", "claimed by another save"]
CommitOutcome = Literal["committed", "not committed", "out of time"]


@dataclass(frozen=True)
class Abandoned:
    job: str
    step: int
    save_id: str
    age_s: float
    missing: list[int]


class PartSaves:
    """Persists this host's parts and, where this sidecar leads the job, commits the steps whose parts are all
    durable. ``worker`` does the Orbax writes (``ckptd.persist._worker_client``); ``writes(job)``: whether this
    sidecar leads. ``bucket_writes_per_s``: the bucket's write budget, shared by the job's writers on ``gs://``
    (0: not paced); ``hosts``: the job's host count when this sidecar knows it (else a part's process count)."""

    def __init__(self, storage: Storage, worker: PersistWorker, *,
                 writes: Callable[[str], bool] = lambda _job: True, sidecar: str = "",
                 redo_after_s: float = DEFAULT_SAVE_TIMEOUT_S, bucket_writes_per_s: float = BUCKET_WRITES_PER_S,
                 hosts: int | None = None) -> None:
        self.storage = storage
        self.share = WriteShare(bucket_writes_per_s if storage.is_remote else 0.0)
        self.hosts = hosts
        self.redo_after_s = redo_after_s  # gs://: another party's commit or cleanup is redone after this long
        self.worker = worker
        self.writes = writes
        self.sidecar = sidecar or default_holder()  # unique per start: a pod recreated under its name and pid 1 is not
        self.commits = 0
        self._resume_at: dict[str, int] = {}  # job -> the claim a pass out of time stopped at
        self._checked: dict[tuple[str, int, str], int] = {}  # (job, step, save) -> its records below this are good

    def final_path(self, job: str, step: int) -> str:
        return self.storage.join(job, str(step))

    def committed(self, job: str, step: int, save_id: str) -> bool:
        """Whether ``step`` is committed from the parts of ``save_id``."""
        final = self.final_path(job, step)
        if not self.storage.exists(posixpath.join(final, COMMIT_MARKER)):
            return False
        first = read_part(self.storage, final, 0)
        return first is not None and first.save_id == save_id

    def state(self, job: str, meta: SnapshotMeta) -> PartState:
        """Where this host's part of a save stands on storage. A step already committed is ``committed``
        whichever save committed it (this save's parts, another save's before a restart, or a direct Orbax
        save when a tier was full): a consistent state of the run, never overwritten; the part is done."""
        assert meta.save_id is not None
        if self.storage.exists(posixpath.join(self.final_path(job, meta.step), COMMIT_MARKER)):
            return "committed"
        claim = read_claim(self.storage, job, meta.step)
        if claim is not None and claim.save_id != meta.save_id and not self.stale(job, claim, meta):
            return "claimed by another save"
        where = step_path_for(self.storage, job, meta.step, meta.save_id)
        part = read_part(self.storage, where, meta.process_index)
        return "written" if part is not None and part.save_id == meta.save_id else "todo"

    def stale(self, job: str, claim: Claim, meta: SnapshotMeta) -> bool:
        """Whether ``claim`` (of ``meta``'s step, another save's) belongs to a dead incarnation of the job, so
        this part's save takes it over at once instead of waiting for ``save_timeout_s``: it is another
        incarnation's (the save id's prefix), made before this part's snapshot was taken (an incarnation
        runs only once every process of the one before is gone: the coordination service dies with the
        job), the step is not committed, and some part record of its save is absent (a save whose every
        part is durable is the commit pass's). Local roots and ``gs://`` alike (``take_over_claim``)."""
        assert meta.save_id is not None
        if incarnation_of(claim.save_id) == incarnation_of(meta.save_id):
            return False
        if claim.created_at >= meta.created_at:
            return False
        if self.storage.exists(posixpath.join(self.final_path(job, meta.step), COMMIT_MARKER)):
            return False
        listed = listed_parts(self.storage, step_path_for(self.storage, job, meta.step, claim.save_id))
        return not set(range(claim.process_count)) <= listed

    def persist_part(self, job: str, snapshot: str, meta: SnapshotMeta) -> str:
        """Claim the step for this save and write this host's part (a redo rewrites it whole); the part
        record is created once it is durable. Returns what happened (``written``, ``committed``, or why not)."""
        assert meta.save_id is not None
        # this part's writes, one after another: at a point of their window in the bucket's budget, this process's
        # own share of it (so N hosts' parts go evenly, at the bucket's rate)
        self.share.spread(self.hosts or meta.process_count, meta.process_index)
        self.share.take(PART_WRITES)
        claim = make_claim(self.storage, job, meta.step, meta.save_id, meta.process_count)
        if claim is None:
            return "claim unreadable"
        if claim.save_id != meta.save_id and self.stale(job, claim, meta):
            if take_over_claim(self.storage, job, meta.step, claim, meta.save_id, meta.process_count):
                _log.warning("step %s of %s: took the claim of save %s over for save %s (another incarnation's, "
                             "made before this save's snapshot, some parts missing)", meta.step, job,
                             claim.save_id, meta.save_id)
            claim = read_claim(self.storage, job, meta.step) or claim
        if claim.save_id != meta.save_id:
            return self.state(job, meta)
        where = step_path_for(self.storage, job, meta.step, meta.save_id)
        standing = record_standing(self.storage, job, meta, where)
        if standing is not None:
            return standing  # an earlier try of this sidecar finished, or another save's record is there
        record = self.worker.write_part(snapshot, self.storage.url_of(self.storage.writable(where)))
        info = PartInfo.model_validate({**record, "sidecar": self.sidecar})
        if self.storage.is_remote:  # written in place: was the save taken over or cleaned meanwhile?
            self.storage.invalidate(self.storage.join(job, CLAIMS_DIR))
            if read_claim(self.storage, job, meta.step) != claim or read_fate(
                    self.storage, job, meta.step, meta.save_id) == "retire":
                return "claimed by another save"  # too late: no record of it beside the new save's
        path = record_path(where, meta.process_index)
        if self.storage.create_new(path, record_bytes(info)):
            return "written"
        # a record landed first: ours from an earlier try, or a late one of the save taken over (cleared once)
        standing = record_standing(self.storage, job, meta, where)
        if standing is None and self.storage.create_new(path, record_bytes(info)):
            return "written"
        return standing or "part record of another save in place"

    def claims(self, job: str) -> list[int]:
        return claimed_steps(self.storage, job)

    def commit_ready(self, job: str, *, spent: Spent = lambda: False) -> list[int]:
        """The leader's pass: commit every claimed step of ``job`` whose parts are all durable. Returns the
        steps committed now. Once ``spent()`` (asked between claims and between records) says the time allowed
        is up, the pass stops; the next one goes on from that claim and record, and every pass gets through one
        record at least, so claims that cost much (forged ones) delay the others by some passes, never for
        good, and hold up no other job."""
        done: list[int] = []
        steps = self.claims(job)
        first = self._resume_at.pop(job, None)
        if first is not None:  # where the last pass ran out of time; round the end
            steps = [s for s in steps if s >= first] + [s for s in steps if s < first]
        self._checked = {key: k for key, k in self._checked.items() if key[0] != job or key[1] in steps}
        for n, step in enumerate(steps):
            if not self.writes(job):
                break  # asked again before each commit: the lease may have moved
            outcome = "out of time" if n and spent() else self._commit_if_ready(job, step, spent)
            if outcome == "out of time":
                self._resume_at[job] = step
                _log.info("committing the host parts of %s: out of time for this pass at step %s; the next pass "
                          "goes on from there", job, step)
                break
            if outcome == "committed":
                done.append(step)
        return done

    def _commit_if_ready(self, job: str, step: int, spent: Spent) -> CommitOutcome:
        """Commit ``step`` when every part record of its claim's save is there and good. What a pass out of
        time found good is not read again by the next (``_checked``: records are create-only)."""
        claim = read_claim(self.storage, job, step)
        if claim is None or self.committed(job, step, claim.save_id):
            return "not committed"
        where = step_path_for(self.storage, job, step, claim.save_id)
        key = (job, step, claim.save_id)
        held = save_parts(self.storage, where, claim.save_id, claim.process_count, first_gap=True,
                          start=self._checked.get(key, 0), spent=spent, readers=RECORD_READERS)
        if held.stopped is not None:
            self._checked[key] = held.stopped  # the records below it are good
            return "out of time"
        if not held.whole:
            self._checked[key] = min(held.absent + held.bad)  # the records below it are good
            return "not committed"  # a missing part: never committed, never served
        self._checked.pop(key, None)
        if self._retired(job, step, claim.save_id):
            return "not committed"  # a cleanup retired it (gs://): retention deletes it, no commit ever takes it
        if self.storage.exists(self.final_path(job, step)) and not self.storage.is_remote:
            _log.error("not committing step %s of %s from parts: %s exists already", step, job,
                       self.final_path(job, step))
            return "not committed"
        return "committed" if self.commit(job, step, where) else "not committed"

    def manifest(self, where: str, step: int, parts: list[PartInfo]) -> Manifest:
        """ckptd's manifest of the step: every file, the parts' ones with the checksums their writers
        recorded (so the leader does not read every byte again), the leader's own read and checksummed."""
        recorded = {f.path: FileEntry(size=f.size, crc32c=f.crc32c) for part in parts for f in part.files}
        on_storage = list_files(self.storage, where)
        absent = sorted(set(recorded) - set(on_storage)) or changed_files(parts, on_storage)
        if absent:  # not there, or written over in place since its record (gs://): never committed (never served)
            raise StorageError(f"step {step} at {where}: files of its parts are missing or changed: "
                               f"{', '.join(absent[:4])}")
        files = {}
        for rel, listed in sorted(on_storage.items()):
            if rel in UNMANIFESTED:
                continue
            known = recorded.get(rel)
            if known is not None and known.size == listed.size:
                files[rel] = known
            elif listed.crc32c is not None:
                files[rel] = FileEntry(size=listed.size, crc32c=listed.crc32c)
            else:
                files[rel] = file_entry(self.storage, posixpath.join(where, rel))
        training = parts[0].training  # its arrays are the manifest's (recorded once, as build_manifest does)
        return Manifest(step=step, writer="adopted", created_at=time.time(), files=files, training=training,
                        identity=step_identity(self.storage, where, training))

    def commit(self, job: str, step: int, where: str) -> bool:
        """Finalize, manifest, marker (create-only), and on a local root the rename into place, from the part
        records read whole under the job's lock (``clean`` never deletes a save being committed). Whether it
        went ahead."""
        with job_lock(self.storage, job) as held_lock:
            if not held_lock or not self.writes(job):
                _log.info("step %s of %s: the job's lock is held elsewhere, or the lease moved; not committed now",
                          step, job)
                return False
            claim = read_claim(self.storage, job, step)  # again under the lock: retention may have run meanwhile
            held = None if claim is None else self._held(job, step, claim.save_id, claim.process_count)
            if held is None or not held.whole or where != step_path_for(self.storage, job, step, held.found[0].save_id):
                _log.info("step %s of %s: its save changed before the commit; not committed now", step, job)
                return False
            if not self._decide(job, step, held.found[0].save_id, "commit"):
                return False
            return self._commit(job, step, where, held.found)

    def _commit(self, job: str, step: int, where: str, parts: list[PartInfo]) -> bool:
        first = parts[0]
        marker = posixpath.join(where, COMMIT_MARKER)
        if not self.storage.exists(marker):  # else: the marker is there, the rename was not done
            try:
                self.worker.commit_parts(self.storage.url_of(self.storage.writable(where)),
                                         first.model_dump(mode="json"))
            except PersistWorkerError as exc:
                raise type(exc)(f"commit of step {step} failed: {exc}") from exc
            write_manifest(self.storage, where, self.manifest(where, step, parts))
            if not self.writes(job):  # the lease moved while finalizing: the new leader commits
                return False
            if not self.storage.create_new(marker, f"Checkpoint commit was successful to {where}".encode()):
                _log.info("step %s of %s: another leader committed it", step, job)
        if not self.storage.is_remote:
            final = self.final_path(job, step)
            try:
                self.storage.rename(where, final)
            except FileExistsError:
                return True
            except OSError as exc:
                if os.path.exists(final):
                    return True
                raise StorageError(f"cannot move {where} to {final}: {exc}") from exc
            sync_paths(posixpath.dirname(final))
        self.storage.invalidate(self.storage.join(job))
        self.commits += 1
        _log.info("committed step %s of %s from %d host parts", step, job, first.process_count)
        return True

    def _decide(self, job: str, step: int, save_id: str, fate: Fate) -> bool:
        """On ``gs://``, where no lock spans sidecars: decide the save's fate before its first write or delete
        (``format/_fates.py``), so a leader paused past its checks while a newer one committed or cleaned stands
        down. A local root needs none: the job's flock, held here, excludes every other commit and cleanup."""
        if not self.storage.is_remote or decide_fate(self.storage, job, step, save_id, fate, self.sidecar,
                                                     redo_after_s=self.redo_after_s):
            return True
        _log.warning("step %s of %s: save %s's fate was decided otherwise, or by another sidecar less than %gs ago "
                     "(%s); not %s now", step, job, save_id, self.redo_after_s,
                     read_fate_record(self.storage, job, step, save_id), "committed" if fate == "commit" else "deleted")
        return False

    def _retired(self, job: str, step: int, save_id: str) -> bool:
        """Whether a cleanup already retired the save (``gs://``): then it is deleted even if its last part landed
        since, as no commit will ever take it."""
        return self.storage.is_remote and read_fate(self.storage, job, step, save_id) == "retire"

    def abandoned(self, job: str, older_than_s: float, now: float | None = None, *,
                  spent: Spent = lambda: False) -> list[Abandoned]:
        """Claims older than ``older_than_s`` whose step is not committed and whose parts are absent, not
        unreadable: a save with a record that is there but forged, damaged or of another save is reported and
        kept for inspection, never deleted. Stops (with what it found) once ``spent()``."""
        now = time.time() if now is None else now
        out = []
        for step in self.claims(job):
            if spent():
                break
            claim = read_claim(self.storage, job, step)
            if claim is None or now - claim.created_at < older_than_s or self.committed(job, step, claim.save_id):
                continue
            held = self._held(job, step, claim.save_id, claim.process_count, spent)
            if held.stopped is not None:
                break  # out of time: this save is looked at again next time
            if held.whole and not self._retired(job, step, claim.save_id):
                continue  # every part is durable: the commit pass's to commit, never abandoned
            if held.bad:
                report_refused(step_path_for(self.storage, job, step, claim.save_id),
                               f"an abandoned save whose part records of processes {spans(held.bad)} are "
                               "unreadable or of another save: kept for inspection, never deleted")
                continue
            out.append(Abandoned(job, step, claim.save_id, now - claim.created_at, held.absent))
        return out

    def _held(self, job: str, step: int, save_id: str, count: int, spent: Spent | None = None) -> SaveParts:
        return save_parts(self.storage, step_path_for(self.storage, job, step, save_id), save_id, count, spent=spent,
                          readers=RECORD_READERS)

    def clean(self, found: Abandoned) -> bool:
        """Delete an abandoned save: its staged (or in place, uncommitted) files, then its claim. Under the
        job's lock, which a commit holds too, and only if it is still abandoned then: a part that landed
        since ``abandoned`` looked makes the save the commit pass's (docs/multihost.md, section 5). Whether it
        was deleted (not: the lock held by another process, the lease moved, or the save no longer abandoned)."""
        with job_lock(self.storage, found.job) as held_lock:
            if not held_lock or not self.writes(found.job):
                return False  # another process holds the job (a commit, a newer leader), or this one no longer leads
            claim = read_claim(self.storage, found.job, found.step)
            if claim is None or claim.save_id != found.save_id or self.committed(found.job, found.step, found.save_id):
                return False
            held = self._held(found.job, found.step, found.save_id, claim.process_count)
            retired = self._retired(found.job, found.step, found.save_id)
            if held.bad or (held.whole and not retired):
                return False
            where = step_path_for(self.storage, found.job, found.step, found.save_id)
            if self.storage.exists(posixpath.join(where, COMMIT_MARKER)):
                return False
            claim_file = self.storage.join(found.job, CLAIMS_DIR, f"{found.step}.json")
            # gs://: the save's files and its claim as they are now, checked; only these are deleted below
            listed = [(where, listed_generations(self.storage, where)),
                      (claim_file, listed_generations(self.storage, claim_file))] if self.storage.is_remote else None
            if not self._decide(found.job, found.step, found.save_id, "retire"):
                return False  # decided otherwise, or retired by another party that may still be deleting
            refused = delete_listed(self.storage, listed) if listed is not None else None
            if listed is None:
                if self.storage.exists(where):
                    self.storage.remove(where, recursive=True)
                self.storage.remove(claim_file)
            self.storage.invalidate(self.storage.join(found.job))
            if refused is not None:  # what it listed changed since (docs/gcs.md, "Fencing on gs://"): it stands down
                _log.warning("step %s of %s: the cleanup of abandoned save %s refused: %s", found.step, found.job,
                             found.save_id, refused)
                return False
        _log.warning("deleted abandoned save %s of step %s of %s (parts missing: %s)", found.save_id, found.step,
                     found.job, spans(found.missing))
        return True

    def superseded(self, job: str, *, spent: Spent = lambda: False) -> list[tuple[int, str]]:  # local roots only
        """The staged saves of ``job`` (local root) that can never be committed: their step's claim names
        another save (taken over from a dead incarnation: ``take_over_claim``) and no commit marker is in
        them. A staged save without a claim is left to ``abandoned``'s rules. Stops once ``spent()``."""
        out = []
        for step, save_id in staged_saves(self.storage, job):
            if spent():
                break
            if self._superseded(job, step, save_id):
                out.append((step, save_id))
        return out

    def _superseded(self, job: str, step: int, save_id: str) -> bool:
        claim = read_claim(self.storage, job, step)
        where = step_path_for(self.storage, job, step, save_id)
        return (claim is not None and claim.save_id != save_id and not os.path.islink(where)
                and not self.storage.exists(posixpath.join(where, COMMIT_MARKER)))

    def clean_superseded(self, job: str, step: int, save_id: str) -> bool:
        """Delete a superseded staged save, checked again under the job's lock; whether it was deleted."""
        with job_lock(self.storage, job) as held_lock:
            if not held_lock or not self.writes(job) or not self._superseded(job, step, save_id):
                return False
            self.storage.remove(step_path_for(self.storage, job, step, save_id), recursive=True)
            self.storage.invalidate(self.storage.join(job))
        _log.warning("deleted the staged save %s of step %s of %s: its step's claim is another save's", save_id,
                     step, job)
        return True


__all__ = ["JOB_BUDGET_S", "Abandoned", "PartSaves"]
