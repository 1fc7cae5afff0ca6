"""A job's elastic events, stored on storage next to its checkpoints, so they survive any ckptd restart.

Storage is the source of truth (docs/architecture.md, invariant 1), for events as for steps. Object
stores cannot append, so every accepted batch becomes one immutable JSON object::

    <root>/<job>/.ckptd/events/<time_us>-<pid>-<seq>-<nonce>.json

The name sorts by the time ckptd received the batch; pid, a per-process sequence number and a random
nonce keep names unique when several ckptd sidecars (one per training host) write to the same job.
Orbax ignores the ``.ckptd`` directory (its name is not an integer step), ckptd's step scan ignores it
for the same reason, and no job is named ``.ckptd`` (job names cannot start with '.').

Bounded (docs/operations.md, "Events"): a job keeps at most ``max_events`` events and ``max_bytes`` bytes
of event files. Past either, the oldest files are folded into the job's summary
(``summary.json`` in the same directory, ``ckptd.events._event_summary``: counts, totals and the goodput
of the folded stretch) and deleted, down to three quarters of the limits; goodput and the totals keep
covering the whole history. In memory, the windows of the jobs used most recently are kept within
``memory_bytes`` (file bytes plus ``PER_EVENT_MEMORY`` per event); a job pushed out is read again
(at most its window) when it is next asked for. With several sidecars, each appends what it receives and
reads everyone's files; a fold first reads every file on storage (else the other sidecars' files it never
read would pass for folded), and with a lease only the job's leader folds (``writes``). Reading lists the
directory and reads only the files it has not read before (files never change). Events carry ids; a resent
batch (an answer lost on the way back) is deduplicated when the events are read, and by this process when they
are appended.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from pydantic import ValidationError

from ckptd._event_stats import EventStats
from ckptd.events._event_summary import SUMMARY_FILE, EventSummary, fold, history_goodput
from ckptd.events._event_window import EventLimits, JobWindow
from trainer_client.core import Storage, StorageError, join_path, storage_failures, write_json_file
from trainer_client.core.format import EVENTS_DIR, SIDE_EVENTS_DIR
from trainer_client.core.protocol import CheckpointInfo, ElasticEvent, Goodput, StoredEvent

_log = logging.getLogger(__name__)

EVENTS_FORMAT = "ckptd-events/1"
_SEEN_IDS = 20_000  # ids remembered per process to drop resent batches before they are written
_UNREADABLE_KEPT = 1000
_CARRY = 2500  # events a summary carries at most when only bytes are bounded
_EVENT_FILE = re.compile(r"^\d{17}-\d+-\d+-[0-9a-f]+\.json$")


class EventStore:
    """Append batches of events to a job's events directory; read them back, oldest first, within ``limits``."""

    def __init__(self, storage: Storage, limits: EventLimits | None = None, *,
                 read_only: Callable[[str], bool] | None = None, writes: Callable[[str], bool] | None = None) -> None:
        self.storage = storage
        self.read_only = read_only  # job -> whether it is watched read-only: its events go on the side
        # job -> whether this sidecar folds the job's events (Catalog.writes: its leader, docs/multihost.md §7):
        # every sidecar appends its own files, but only one rewrites summary.json and deletes what it folded
        self.writes = writes
        self.limits = limits or EventLimits()
        self._lock = threading.Lock()
        self._seq = 0
        self._nonce = secrets.token_hex(4)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._jobs: dict[str, JobWindow] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.unreadable: dict[str, str] = {}  # path -> why (shown in notes, logged once)

    def directory(self, job: str) -> str:
        if self.read_only is not None and self.read_only(job):  # nothing under <root>/<job>/ (records.py)
            return self.storage.join(SIDE_EVENTS_DIR, job)
        return self.storage.join(job, EVENTS_DIR)

    def _job(self, job: str) -> JobWindow:
        with self._lock:
            return self._jobs.setdefault(job, JobWindow())

    # ---- writing ----------------------------------------------------------------------------------

    def append(
        self,
        job: str,
        events: Iterable[ElasticEvent],
        *,
        source: Literal["trainer", "ckptd"] = "trainer",
        now: float | None = None,
    ) -> tuple[list[StoredEvent], int]:
        """Store the events not seen before as one file; returns (stored events, duplicates skipped)."""
        received = time.time() if now is None else now
        fresh: list[StoredEvent] = []
        duplicates = 0
        with self._lock:
            for event in events:
                if event.id is not None:
                    key = (job, event.id)
                    if key in self._seen:
                        duplicates += 1
                        continue
                    self._seen[key] = None
                    if len(self._seen) > _SEEN_IDS:
                        self._seen.popitem(last=False)
                fresh.append(StoredEvent(**event.model_dump(), received_at=received, source=source))
            self._seq += 1
            name = f"{int(received * 1e6):017d}-{os.getpid()}-{self._seq:06d}-{self._nonce}.json"
        if not fresh:
            return [], duplicates
        directory = self.directory(job)
        payload = json.dumps({"format": EVENTS_FORMAT, "job": job, "received_at": received, "pid": os.getpid(),
                              "events": [e.model_dump(mode="json", exclude_none=True) for e in fresh]},
                             separators=(",", ":"))
        try:
            if not self.storage.is_remote:  # never through a link out of the root (UnsafePathError)
                self.storage.fs.makedirs(self.storage.writable(directory), exist_ok=True)
            write_json_file(self.storage, join_path(directory, name), payload)
        except BaseException:
            with self._lock:  # not stored: a resend must not be taken for a duplicate
                for e in fresh:
                    if e.id is not None:
                        self._seen.pop((job, e.id), None)
            raise
        state = self._job(job)
        with state.lock:
            if state.resident:
                state.add(name, len(payload.encode()), fresh)
                state.goodput = None
                self._rotate_if_over(job, state)
            elif self.limits.rotates:
                self._sync(job, state)  # reads the window (bounded) to know whether it is over the limits
        self._evict(keep=job)
        return fresh, duplicates

    # ---- reading ----------------------------------------------------------------------------------

    def file_names(self, job: str) -> list[str]:
        """Names of the job's event files not folded into its summary, oldest first (one listing)."""
        directory = self.directory(job)
        self.storage.invalidate(directory)
        names = [e.name for e in self.storage.list_dir(directory) if not e.is_dir and _EVENT_FILE.match(e.name)]
        summary = self._job(job).summary
        return [n for n in names if summary is None or n > summary.through]

    def load(
        self, job: str, *, since: float | None = None, progress: Callable[[int], object] | None = None
    ) -> list[StoredEvent]:
        """The job's events kept (its window: the summary's carry and the files not folded; with ``since``:
        those that happened at or after it), oldest first, without duplicates. Files are read once per
        process while the job stays in memory; unreadable ones are skipped and remembered."""
        state = self._job(job)
        with state.lock:
            self._sync(job, state, progress=progress)
            events = state.window()
        self._evict(keep=job)
        return [e for e in events if since is None or e.time >= since]

    def summary(self, job: str) -> EventSummary | None:
        """The job's folded history (None until its events were first rotated), as of the last read."""
        state = self._job(job)
        with state.lock:
            self._sync(job, state)
            return state.summary

    def stats(self, job: str) -> EventStats:
        """Counts by kind and the measured quantities (recovery seconds, lost steps, save stalls) over the job's
        whole history: its summary followed by the events kept."""
        state = self._job(job)
        with state.lock:
            self._sync(job, state)
            window = EventStats().add(state.window())
            summary = state.summary
        self._evict(keep=job)
        return summary.stats.merged(window) if summary is not None else window

    def goodput(
        self,
        job: str,
        checkpoints: Sequence[CheckpointInfo] = (),
        *,
        step_time_s: float | None = None,
        since: float | None = None,
        version: object = None,
    ) -> Goodput:
        """Goodput over the job's whole history (``event_summary.history_goodput``). With ``version`` (of the
        checkpoints given), the answer is kept and given again until the job's event files or ``version``
        change: a background refresh then neither reads nor recomputes an unchanged job."""
        state = self._job(job)
        with state.lock:
            if version is not None and state.goodput is not None:
                self._sync(job, state, read=False)
                key = (state.signature, version, step_time_s, since)
                if state.goodput[0] == key:
                    return state.goodput[1].model_copy(deep=True)
            self._sync(job, state)
            result = history_goodput(job, state.summary, state.window(), checkpoints, step_time_s=step_time_s,
                                     since=since)
            if version is not None:
                state.goodput = ((state.signature, version, step_time_s, since), result.model_copy(deep=True))
        self._evict(keep=job)
        return result

    def memory(self) -> tuple[int, int]:
        """(events, bytes of event files) held in memory over all jobs, the summaries' carries included."""
        with self._lock:
            states = list(self._jobs.values())
        events = size = 0
        for state in states:
            if state.resident:
                n, b = state.counts()
                events, size = events + n, size + b
            if state.summary is not None:
                events += len(state.summary.carry)
        return events, size

    def _sync(self, job: str, state: JobWindow, *, read: bool = True, progress: Callable[[int], object] | None = None,
              fold: bool = True) -> None:
        """Bring ``state`` in line with storage: one listing; the summary when it changed; new files (with
        ``read``), folding the oldest whenever the window passes the limits."""
        directory = self.directory(job)
        self.storage.invalidate(directory)
        # Nothing is read through a link out of the root (trainer_client/core/_storage.py) either.
        listing = self.storage.list_dir(directory) if self.storage.inside(directory) else []
        if not listing:  # no events (any more): nothing kept for the job
            state.clear()
            state.summary = state.summary_key = state.signature = None
            with self._lock:
                self._resident.pop(job, None)
            return
        meta = next((e for e in listing if e.name == SUMMARY_FILE and not e.is_dir), None)
        summary_key = None if meta is None else (meta.size, meta.mtime)
        if summary_key != state.summary_key:
            state.summary = self._read_summary(job) if meta is not None else None
            state.summary_key = summary_key
        through = state.summary.through if state.summary is not None else ""
        files = [(e.name, e.size or 0) for e in listing if not e.is_dir and _EVENT_FILE.match(e.name)]
        live = [(n, s) for n, s in files if n > through]
        state.signature = hash((summary_key, tuple(live)))
        if not read:
            return
        if self.limits.rotates and len(live) < len(files) and (self.writes is None or self.writes(job)):
            # folded by a sidecar that did not get to delete them
            self._delete(job, [n for n, _ in files if n <= through])
        names = {n for n, _ in live}
        for gone in [n for n in state.files if n not in names]:  # deleted from storage by someone: gone here too
            state.drop(gone)
        for name, size in live:
            if name not in state.files:
                state.add(name, size, self._read(join_path(directory, name)))
                if fold:
                    self._rotate_if_over(job, state)
            if progress is not None:
                progress(1)
        state.resident = True
        with self._lock:
            self._resident[job] = None
            self._resident.move_to_end(job)

    def _read(self, path: str) -> list[StoredEvent]:
        try:
            body = self.storage.read_json(path)
            if not isinstance(body, dict) or body.get("format") != EVENTS_FORMAT:
                raise ValueError(f"not a {EVENTS_FORMAT} file")
            return [StoredEvent.model_validate(e) for e in body.get("events", [])]
        except FileNotFoundError:
            return []
        except (ValueError, ValidationError, UnicodeDecodeError) as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if path not in self.unreadable:
                _log.warning("skipping unreadable event file %s: %s", self.storage.url_of(path), why)
            if len(self.unreadable) >= _UNREADABLE_KEPT:
                self.unreadable.pop(next(iter(self.unreadable)))
            self.unreadable[path] = why
            return []

    def _read_summary(self, job: str) -> EventSummary | None:
        path = join_path(self.directory(job), SUMMARY_FILE)
        try:
            return EventSummary.model_validate_json(self.storage.read_bytes(path))
        except FileNotFoundError:
            return None
        except (ValueError, ValidationError, UnicodeDecodeError) as exc:  # rewritten at the next rotation
            _log.warning("unreadable event summary %s (the folded history is lost): %s", self.storage.url_of(path),
                         str(exc).splitlines()[0][:200])
            return None

    # ---- bounds -----------------------------------------------------------------------------------

    def _over(self, events: int, size: int, share: float = 1.0) -> bool:
        limits = self.limits
        return ((limits.max_events is not None and events > limits.max_events * share)
                or (limits.max_bytes is not None and size > limits.max_bytes * share))

    def _rotate_if_over(self, job: str, state: JobWindow) -> None:
        """Fold the oldest files of the window into the summary (then delete them) while it is over the limits,
        down to three quarters of them."""
        if not self._over(*state.counts()) or (self.writes is not None and not self.writes(job)):
            return  # a follower keeps its window past the limits until the leader's next fold (read at a sync)
        # Every file on storage first, the other sidecars' included, and their last fold: the files this fold
        # takes must be the oldest of all, or those it never read would pass for folded (names <= `through`).
        state.summary_key = None  # the summary read again too
        self._sync(job, state, fold=False)
        if not self._over(*state.counts()):
            return
        names = sorted(state.files)
        events, size = state.counts()
        chosen: list[str] = []
        for name in names:
            if not self._over(events, size, 0.75):
                break
            chosen.append(name)
            events, size = events - len(state.files[name][1]), size - state.files[name][0]
        kept = [e for name in names[len(chosen):] for e in state.files[name][1]]
        before = state.summary or EventSummary(job=job)
        cap = max(1, self.limits.max_events // 4) if self.limits.max_events is not None else _CARRY
        after = fold(before, [(n, state.files[n][0], state.files[n][1]) for n in chosen], kept, carry_cap=cap,
                     stale_s=self.limits.stale_s, now=time.time())
        try:
            write_json_file(self.storage, join_path(self.directory(job), SUMMARY_FILE),
                            after.model_dump_json(exclude_none=True))
        except (OSError, StorageError) as exc:  # nothing deleted: the next append tries again
            _log.warning("could not fold the events of %s into its summary: %s", job, exc)
            return
        state.summary, state.summary_key, state.goodput = after, None, None
        for name in chosen:
            state.drop(name)
        self._delete(job, chosen)

    def _delete(self, job: str, names: list[str]) -> None:
        if not names:
            return
        paths = [join_path(self.directory(job), n) for n in names]
        try:
            self.storage.remove(paths)
        except FileNotFoundError:
            pass
        except storage_failures() as exc:  # they are in the summary: deleted by the next fold that sees them
            _log.warning("could not delete %d folded event file(s) of %s: %s", len(paths), job, exc)

    def _evict(self, keep: str) -> None:
        """Forget the windows of the jobs used least recently while the memory bound is passed."""
        budget = self.limits.memory_bytes
        if budget is None:
            return
        with self._lock:
            order = [j for j in self._resident if j != keep]
            states = {j: self._jobs[j] for j in (*order, keep) if j in self._jobs}
        total = sum(s.memory() for s in states.values())
        for job in order:
            if total <= budget:
                break
            state = states[job]
            if not state.lock.acquire(blocking=False):
                continue  # in use: next time
            try:
                before = state.memory()
                state.clear()
                state.resident = False
                total -= before - state.memory()
            finally:
                state.lock.release()
            with self._lock:
                self._resident.pop(job, None)


__all__ = ["EVENTS_FORMAT", "EventLimits", "EventStore"]
