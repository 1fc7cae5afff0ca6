"""A job's elastic events, stored on storage next to its checkpoints, so they survive any ckptd restart.

Storage is the source of truth (docs/architecture.md, invariant 1), for events as for steps. Object
stores cannot append, so every accepted batch becomes one immutable JSON object::

    <root>/<job>/.ckptd/events/<time_us>-<pid>-<seq>-<nonce>.json

The name sorts by the time ckptd received the batch; pid, a per-process sequence number and a random
nonce keep names unique when several ckptd sidecars (one per training host) write to the same job.
Orbax ignores the ``.ckptd`` directory (its name is not an integer step), ckptd's step scan ignores it
for the same reason, and no job is named ``.ckptd`` (job names cannot start with '.').

Reading lists the directory and reads only files it has not read before (files never change), so a
refreshed read costs one listing. Events carry ids; a resent batch (an answer lost on the way back)
is deduplicated when the events are read, and by this process when they are appended.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import ValidationError

from ckptd.catalog.retention import Decision
from trainer_client.core.errors import StorageError
from trainer_client.core.format.files import EVENTS_DIR
from trainer_client.core.format.manifest import write_json_file
from trainer_client.core.protocol import ElasticEvent, StoredEvent
from trainer_client.core.storage import Storage, join_path

_log = logging.getLogger(__name__)

EVENTS_FORMAT = "ckptd-events/1"
_SEEN_IDS = 100_000  # ids remembered per process to drop resent batches before they are written


class EventStore:
    """Append batches of events to a job's events directory; read them back, oldest first."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._seq = 0
        self._nonce = secrets.token_hex(4)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._files: dict[str, dict[str, list[StoredEvent]]] = {}  # job -> file name -> its events
        self.unreadable: dict[str, str] = {}  # path -> why (shown in notes, logged once)

    def directory(self, job: str) -> str:
        return self.storage.join(job, EVENTS_DIR)

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
        payload = {"format": EVENTS_FORMAT, "job": job, "received_at": received, "pid": os.getpid(),
                   "events": [e.model_dump(mode="json", exclude_none=True) for e in fresh]}
        try:
            if not self.storage.is_remote:
                self.storage.fs.makedirs(directory, exist_ok=True)
            write_json_file(self.storage, join_path(directory, name), json.dumps(payload, separators=(",", ":")))
        except BaseException:
            with self._lock:  # not stored: a resend must not be taken for a duplicate
                for e in fresh:
                    if e.id is not None:
                        self._seen.pop((job, e.id), None)
            raise
        with self._lock:
            self._files.setdefault(job, {})[name] = fresh
        return fresh, duplicates

    # ---- reading ----------------------------------------------------------------------------------

    def file_names(self, job: str) -> list[str]:
        """Names of the job's event files, oldest first (one listing of storage)."""
        directory = self.directory(job)
        self.storage.invalidate(directory)
        return [e.name for e in self.storage.list_dir(directory) if not e.is_dir and e.name.endswith(".json")]

    def load(
        self, job: str, *, since: float | None = None, progress: Callable[[int], object] | None = None
    ) -> list[StoredEvent]:
        """Every event of the job (with ``since``: those that happened at or after it), oldest first, without
        duplicates. Files are read once per process; unreadable ones are skipped and remembered."""
        names = self.file_names(job)
        with self._lock:
            cached = dict(self._files.get(job, {}))
        directory = self.directory(job)
        for name in names:
            if name not in cached:
                cached[name] = self._read(join_path(directory, name))
            if progress is not None:
                progress(1)
        with self._lock:
            known = self._files.setdefault(job, {})
            for name in names:
                known.setdefault(name, cached[name])
            for gone in set(known) - set(names):  # deleted from storage by someone: gone here too
                del known[gone]
        out: list[StoredEvent] = []
        ids: set[str] = set()
        for name in names:
            for event in cached[name]:
                if since is not None and event.time < since:
                    continue
                if event.id is not None:
                    if event.id in ids:
                        continue
                    ids.add(event.id)
                out.append(event)
        out.sort(key=lambda e: (e.time, e.received_at))
        return out

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
            self.unreadable[path] = why
            return []


def record_retention(store: EventStore, deleted: Iterable[Decision]) -> int:
    """Record the steps retention deleted as ``retention_deleted`` events of their jobs (the steps are
    gone from storage; the events keep them on the dashboard). Ids are derived from the step
    directory, so several sidecars deleting the same step record it once. Returns the events stored."""
    by_job: dict[str, list[ElasticEvent]] = {}
    now = time.time()
    for d in deleted:
        step_dir = d.path.rstrip("/")
        job, dirname = posixpath.basename(posixpath.dirname(step_dir)), posixpath.basename(step_dir)
        by_job.setdefault(job, []).append(ElasticEvent(
            kind="retention_deleted", time=now, step=d.step, id=f"ckptd:retention_deleted:{dirname}",
            detail=f"{d.state.value} step deleted by retention: {'; '.join(d.reasons)}"[:2000],
        ))
    stored = 0
    for job, events in by_job.items():
        try:
            stored += len(store.append(job, events, source="ckptd", now=now)[0])
        except (OSError, StorageError) as exc:  # the deletion happened; only its record is missing
            _log.warning("could not record retention deletions of %s: %s", job, exc)
    return stored


__all__ = [ "EVENTS_FORMAT", "EventStore", "record_retention"]
