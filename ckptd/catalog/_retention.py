"""Retention: which steps of a job may be deleted, and why — never the newest good step, never a step
being written, never a bad step (quarantined or corrupt steps are kept for inspection).

A good (verified) step is kept when any rule keeps it: one of the newest ``keep_last``; a multiple of
``keep_every``; committed less than ``keep_newer_than_s`` ago. With no rule set, every good step is kept.
An abandoned save (a tmp directory older than the save timeout) is cleaned; a younger one is a save in
progress and is kept. The decision is a pure function; ``collect`` carries it out on storage, and
``record_retention`` records what it deleted, or refused to, as the jobs' events (the event store below the
catalog, ``ckptd/events/_events.py``, knows nothing of retention).

A job watched read-only (docs/protocol.md, "Read-only adoption") loses nothing: every step is kept, abandoned
saves included — ckptd deletes nothing in step directories it may not write into.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from ckptd.catalog._job_lock import job_lock
from ckptd.events._events import EventStore
from trainer_client.core import (
    ListedGenerations,
    Storage,
    StorageError,
    delete_as_listed,
    join_path,
    listed_generations,
    storage_errors,
)
from trainer_client.core.format import CLAIMS_DIR, COMMIT_MARKER, PARTS_DIR
from trainer_client.core.protocol import CheckpointInfo, ElasticEvent, StepState

if TYPE_CHECKING:
    from ckptd.catalog._catalog import Catalog

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_newer_than_s: float | None = None
    clean_abandoned: bool = True

    @property
    def prunes_good_steps(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_newer_than_s))

    def describe(self) -> str:
        parts = []
        if self.keep_last is not None:
            parts.append(f"keep the last {self.keep_last}")
        if self.keep_every is not None:
            parts.append(f"keep every {self.keep_every}th step")
        if self.keep_newer_than_s is not None:
            parts.append(f"keep steps newer than {self.keep_newer_than_s:g}s")
        return ", ".join(parts) or "keep every good step"


@dataclass(frozen=True)
class Decision:
    step: int
    path: str
    state: StepState
    action: Literal["keep", "delete"]
    reasons: list[str] = field(default_factory=list)


READ_ONLY_REASON = "read-only job: ckptd deletes nothing here"


def decide(checkpoints: Iterable[CheckpointInfo], policy: RetentionPolicy, now: float | None = None,
           *, read_only: bool = False) -> list[Decision]:
    """What to keep and what to delete, with the reasons, oldest step first (all kept when ``read_only``)."""
    now = time.time() if now is None else now
    steps = sorted(checkpoints, key=lambda c: (c.step, c.path))
    if read_only:
        return [Decision(c.step, c.path, c.state, "keep", [READ_ONLY_REASON]) for c in steps]
    good = [c for c in steps if c.state is StepState.VERIFIED]
    newest_good = good[-1].step if good else None
    last_n = {c.step for c in good[-policy.keep_last:]} if policy.keep_last else set()
    out = []
    for c in steps:
        if c.state is StepState.VERIFIED:
            reasons = []
            if c.step == newest_good:
                reasons.append("newest good step")
            if c.step in last_n:
                reasons.append(f"one of the last {policy.keep_last}")
            if policy.keep_every and c.step % policy.keep_every == 0:
                reasons.append(f"multiple of {policy.keep_every}")
            if policy.keep_newer_than_s is not None and c.committed_at is not None and (
                now - c.committed_at < policy.keep_newer_than_s
            ):
                reasons.append(f"newer than {policy.keep_newer_than_s:g}s")
            if not policy.prunes_good_steps:
                reasons.append("no retention rule set")
            action: Literal["keep", "delete"] = "keep" if reasons else "delete"
            out.append(Decision(c.step, c.path, c.state, action, reasons or [f"not kept by: {policy.describe()}"]))
        elif c.state is StepState.ABANDONED and policy.clean_abandoned:
            out.append(Decision(c.step, c.path, c.state, "delete", ["abandoned save older than the save timeout"]))
        elif c.state is StepState.WRITING:
            out.append(Decision(c.step, c.path, c.state, "keep", ["being written"]))
        else:
            out.append(Decision(c.step, c.path, c.state, "keep", [f"{c.state.value}: kept for inspection"]))
    return out


def collect(storage: Storage, decisions: Iterable[Decision], *, dry_run: bool = False, job: str | None = None,
            writes: Callable[[str], bool] | None = None, save_timeout_s: float | None = None,
            refused: list[Decision] | None = None) -> list[Decision]:
    """Delete what ``decide`` said to delete (unless ``dry_run``); returns the deleted decisions. With ``job``
    and ``writes`` (a sidecar's retention): each deletion under the job's lock, and only while ``writes(job)``
    (this sidecar still leads) holds under it, so a leader paused past its decision deletes nothing once a newer
    one leads, nor while that one commits (docs/multihost.md, section 5, "Fenced writers").

    On ``gs://`` a step is deleted only as it was listed before those checks (``_delete_fenced``: docs/gcs.md,
    "Fencing on gs://"); one found changed is kept, logged and appended to ``refused`` (its reason last)."""
    deleted = []
    for d in decisions:
        if d.action != "delete":
            continue
        if not dry_run:
            listed = listed_generations(storage, d.path) if storage.is_remote else None
            with contextlib.ExitStack() as held:
                if job is not None and writes is not None and not (held.enter_context(job_lock(storage, job))
                                                                    and writes(job)):
                    _log.info("retention of %s: the job's lock is held elsewhere, or the lease moved; step %s kept "
                              "for now", job, d.step)
                    break
                if _saved_in_place(storage, d):
                    _log.info("retention of step %s: %s is a multi-host save's, written in place; its claim's cleanup "
                              "decides its fate", d.step, d.path)
                    continue
                if listed is None:
                    with storage_errors(f"cannot delete {d.path}"):
                        storage.remove(d.path, recursive=True)
                else:
                    why = _delete_fenced(storage, d, listed, save_timeout_s)
                    if why is not None:
                        _log.warning("retention of step %s refused: %s; the step is kept", d.step, why)
                        if refused is not None:
                            refused.append(replace(d, reasons=[*d.reasons, why]))
                        continue
            _log.info("retention deleted step %s (%s): %s", d.step, d.path, "; ".join(d.reasons))
        deleted.append(d)
    if deleted and not dry_run:
        storage.invalidate()
    return deleted


def _delete_fenced(storage: Storage, d: Decision, listed: ListedGenerations, save_timeout_s: float | None
                   ) -> str | None:
    """Delete step ``d`` on ``gs://`` only if it is still what ``decide`` judged and what was ``listed`` (every
    object with its generation) before the lock and lease checks: a good step still holds its commit marker,
    which goes first; an uncommitted one still holds none, and no object younger than ``save_timeout_s`` (a save
    started again in place since the catalog judged it abandoned). Then ``delete_as_listed``: listed again, each
    object deleted with its generation as precondition. None when deleted; else why nothing (more) was."""
    marker = join_path(str(storage.fs._strip_protocol(d.path)), COMMIT_MARKER)
    if (marker in listed) != (d.state is StepState.VERIFIED):
        return (f"{d.path} was {d.state.value} when decided and "
                f"{'holds' if marker in listed else 'lacks'} {COMMIT_MARKER} now (saved again, or deleted, since)")
    if d.state is not StepState.VERIFIED and save_timeout_s is not None:
        now = time.time()
        young = sorted(name for name, obj in listed.items()
                       if obj.written_at is not None and now - obj.written_at < save_timeout_s)[:3]
        if young:
            return f"{d.path} has objects written less than {save_timeout_s:g}s ago ({', '.join(young)}): a save again"
    done = delete_as_listed(storage, d.path, listed, first=marker)
    return None if done.refused is None else done.refused + (f"; {done.deleted} object(s) deleted before"
                                                              if done.deleted else "")


def _saved_in_place(storage: Storage, d: Decision) -> bool:
    """Whether ``d`` would delete an uncommitted step directory on ``gs://`` that a multi-host save writes in place
    (its step claimed, or part records in it). Retention leaves it to ``clean_abandoned_parts`` (``prune``'s
    ``clean_parts``: ckptd/multihost/_abandoned_parts.py), which decides the save's fate first: a leader paused
    past its checks here would otherwise delete what a newer leader committed since, the same save's late part or a
    restarted incarnation's save of the step (docs/multihost.md, section 5)."""
    if d.state is StepState.VERIFIED or not storage.is_remote:
        return False
    job_dir, name = posixpath.split(d.path.rstrip("/"))
    # asked of storage, not of a listing cached before a save claimed the step or landed a part (gcsfs)
    storage.invalidate(d.path)
    storage.invalidate(join_path(job_dir, CLAIMS_DIR))
    return storage.exists(join_path(d.path, PARTS_DIR)) or (
        name == str(d.step) and storage.exists(join_path(job_dir, CLAIMS_DIR, f"{d.step}.json")))


def checked_decisions(catalog: Catalog, job: str, policy: RetentionPolicy) -> list[Decision]:
    """``decide`` for a catalogued job, after checking on storage every good step it would delete or keep
    as one of the newest (``Catalog.confirmed_step``): a step verified long ago may have lost a file
    since. One that fails is quarantined, so it is kept for inspection and never deleted, and the next
    good step takes its place among the newest; then the decision is made again."""
    while True:
        infos = catalog.checkpoints(job)
        decisions = decide(infos, policy, read_only=catalog.read_only_for(job))
        if catalog.read_only_for(job):
            return decisions
        good = sorted((c for c in infos if c.state is StepState.VERIFIED), key=lambda c: c.step)
        suspects = {c.step for c in good[-(policy.keep_last or 1):]}
        suspects |= {d.step for d in decisions if d.action == "delete" and d.state is StepState.VERIFIED}
        failed = False
        for step in sorted(suspects, reverse=True):
            confirmed = catalog.confirmed_step(job, step)
            failed = failed or confirmed is None or confirmed.state is not StepState.VERIFIED
        if not failed:
            return decisions


def prune(catalog: Catalog, policy: RetentionPolicy, *, refused: list[Decision] | None = None,
          clean_parts: Callable[[str], Iterable[Decision]] | None = None) -> list[Decision]:
    """Apply ``policy`` to every job of a catalog (what the server runs every ``gc_interval_s``); the deletions
    refused on ``gs://`` (``collect``) are appended to ``refused``. ``clean_parts(job)``: the multi-host saves of
    ``job`` never completed, deleted (with ``policy.clean_abandoned``, after its steps' deletions). The composition
    root hands in ``clean_abandoned_parts`` of ``ckptd/multihost/_abandoned_parts.py``: multi-host saves are the
    room above the catalog, so retention runs their cleanup without importing it."""
    deleted: list[Decision] = []
    for job in catalog.jobs():
        if catalog.read_only_for(job.name) or not catalog.writes(job.name):
            continue  # nothing is ever deleted there; another sidecar leads the job (ckptd/lease/_lease.py)
        catalog.refresh_job(job.name)
        decisions = checked_decisions(catalog, job.name, policy)
        if catalog.writes(job.name):  # asked again: the checks take time, the lease may have passed on meanwhile
            deleted += collect(catalog.storage, decisions, job=job.name, writes=catalog.writes_confirmed,
                               save_timeout_s=catalog.save_timeout_s, refused=refused)
            if policy.clean_abandoned and clean_parts is not None:  # saves from host parts never completed
                deleted += clean_parts(job.name)  # (docs/multihost.md, section 5)
        catalog.refresh_job(job.name)
    return deleted


def record_retention(store: EventStore, deleted: Iterable[Decision], refused: Iterable[Decision] = ()) -> int:
    """Record the steps retention deleted as ``retention_deleted`` events of their jobs (the steps are
    gone from storage; the events keep them on the dashboard), and the deletions it refused (on ``gs://``, a
    step changed since it was decided: docs/gcs.md, "Fencing on gs://") as ``retention_refused``. Ids of
    deletions are derived from the step directory, so several sidecars deleting the same step record it once;
    a refusal's from the directory and its time (each refusal is one). Returns the events stored."""
    by_job: dict[str, list[ElasticEvent]] = {}
    now = time.time()
    for kind, decisions, verb in (("retention_deleted", deleted, "deleted"), ("retention_refused", refused, "kept")):
        for d in decisions:
            step_dir = d.path.rstrip("/")
            job, dirname = posixpath.basename(posixpath.dirname(step_dir)), posixpath.basename(step_dir)
            unique = dirname if kind == "retention_deleted" else f"{dirname}:{now:.6f}"
            by_job.setdefault(job, []).append(ElasticEvent(
                kind=kind, time=now, step=d.step, id=f"ckptd:{kind}:{unique}",
                detail=f"{d.state.value} step {verb} by retention: {'; '.join(d.reasons)}"[:2000],
            ))
    stored = 0
    for job, events in by_job.items():
        try:
            stored += len(store.append(job, events, source="ckptd", now=now)[0])
        except (OSError, StorageError) as exc:  # the deletion happened (or was refused); only its record is missing
            _log.warning("could not record retention's deletions of %s: %s", job, exc)
    return stored


__all__ = ["READ_ONLY_REASON", "Decision", "RetentionPolicy", "checked_decisions", "collect", "decide", "prune",
           "record_retention"]
