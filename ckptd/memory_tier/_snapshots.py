"""ckptd's side of the host-memory tier: persist the snapshots trainers leave in shared memory, and keep
memory bounded.

Every few seconds the keeper looks at ``<shm_dir>/<job>/<step>/``. A whole snapshot marked ``persist`` that is not
on storage yet is written there by a child process (``ckptd.persist._persist_worker``, asked through
``ckptd.persist._worker_client``: Orbax's layout, the manifest before the commit marker; one long-lived child, so jax
and Orbax load once) — whether or not the trainer that made it is still alive. Once the step is committed the
snapshot is marked persisted and may be evicted; beyond ``max_snapshots`` per job the oldest evictable snapshots are
dropped, never the newest (a resume may be reading it). A snapshot that is not whole is reported and dropped (it is
a copy in memory; the storage tier never loses a step this way). One host's part of a multi-process job's step
(``process_count`` > 1: only that process's shards) marked ``persist`` is written as that process's part of the step
and the step is committed by the job's leader once every host's part is durable (``ckptd.multihost._part_commit``,
docs/multihost.md section 5) — by the leader's commit pass (``ckptd.multihost._commit_pass``, a worker of the sidecar),
never by this keeper: the leader's host may hold no snapshot of the job at all; the part is marked persisted once
the step is committed. A part is never dropped as broken for lacking the other hosts' shards; one not marked
``persist`` goes beyond ``max_snapshots`` like any snapshot kept in memory only.

Storage slower than the trainer's saves (a slow storage day, GCS answering 429 and backing off) does not pile
persists up: one persist runs at a time, and a job has at most one whole snapshot waiting behind it, the newest. A
snapshot waiting when a newer one marked ``persist`` arrives is superseded (``mark_superseded``): not persisted,
and from then on evicted like a memory-only snapshot, by the tier's own rules (oldest first, beyond the limit, never
the newest), not by this decision. The persist running is never cancelled: a step is committed whole or not at
all. Each time a snapshot becomes due while the job's previous persist still runs (``persist_behind``) or is
superseded (``persist_overtaken``), ``on_report`` is told (the composition root stores it as the job's event and
counts it), and the log warns, at most once a minute per job. Parts of multi-process steps are not superseded: a
step commits only once every host's part of it is written, and one host skipping its part alone would waste every
other host's; they are persisted in order, and reported when behind alike.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.memory_tier._settings import DEFAULT_PERSIST_NICE
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import PersistWorker, PersistWorkerClient, PersistWorkerError, SnapshotDamaged
from trainer_client.core import BUCKET_WRITES_PER_S, Storage, StorageError, UnsafePathError, join_path
from trainer_client.core.format import (
    COMMIT_MARKER,
    SnapshotMeta,
    check_private_dir,
    complete_snapshots,
    drop_leftovers,
    ensure_private_dir,
    evict,
    evict_oldest,
    is_persisted,
    is_real_dir,
    is_superseded,
    job_dir,
    mark_persisted,
    mark_superseded,
    problems,
    read_meta,
    unmark_superseded,
)
from trainer_client.core.protocol import ElasticEvent, is_valid_job_name

_log = logging.getLogger(__name__)


@dataclass
class KeeperStats:
    persisted: int = 0
    failed: int = 0
    evicted: int = 0
    broken: int = 0
    last_error: str | None = None
    # the parts of multi-process steps held and not persisted (snapshot path -> why), for status and metrics
    parts: dict[str, str] = field(default_factory=dict)
    persist_seconds: list[float] = field(default_factory=list)
    parts_written: int = 0  # this host's parts of multi-process steps written to storage
    # snapshots marked persist that ckptd may not write (a read-only job, a link out of the root): path -> why;
    # kept in shared memory, never dropped for it (docs/protocol.md, "Read-only adoption")
    held: dict[str, str] = field(default_factory=dict)
    behind: int = 0  # snapshots that became due while their job's previous persist was still running
    overtaken: int = 0  # snapshots superseded by a newer one while waiting: not persisted


PART_RETRY_S = 30.0  # a host part whose write failed is tried again after this long
BEHIND_WARN_S = 60.0  # a job's persists falling behind are warned about at most this often


@dataclass(frozen=True)
class _Ask:
    """One snapshot to persist: a whole one or this host's part of a multi-process step."""

    kind: str  # "whole" or "part"
    job: str
    path: Path
    step: int
    nbytes: int


@dataclass(frozen=True)
class _Running:
    """The persist in flight of a job: which snapshot, since when (monotonic)."""

    ask: _Ask
    started: float


@dataclass
class _Lag:
    """A job's persists falling behind, since the last warning about them."""

    warned_at: float | None = None
    behind: int = 0
    overtaken: int = 0


class SnapshotKeeper:
    """Persists and evicts host-memory snapshots for every job under ``shm_dir``."""

    def __init__(
        self,
        storage: Storage,
        shm_dir: str,
        *,
        max_snapshots: int = 2,
        compression: bool = False,
        on_persisted: Callable[[str, int], None] | None = None,
        timeout_s: float = 3600.0,
        nice: int = DEFAULT_PERSIST_NICE,
        devices: int | None = None,
        writes: Callable[[str], bool] | None = None,
        on_report: Callable[[str, ElasticEvent], None] | None = None,
        bucket_writes_per_s: float = BUCKET_WRITES_PER_S,
        hosts: int | None = None,
    ) -> None:
        self.storage = storage
        self.worker: PersistWorker = PersistWorkerClient(compression=compression, nice=nice, devices=devices,
                                                         timeout_s=timeout_s)
        # multi-host parts (written here; committed by ckptd.multihost._commit_pass); ``writes``: Catalog.writes
        # on gs://, paced at its share of the bucket's write budget (the job's hosts: ``hosts``, else a part's count)
        self.parts = PartSaves(storage, self.worker, writes=writes or (lambda _job: True),
                               bucket_writes_per_s=bucket_writes_per_s, hosts=hosts)
        self.nice = nice
        self.devices = devices
        self.shm_dir = Path(shm_dir)
        self.max_snapshots = max_snapshots
        self.compression = compression
        self.on_persisted = on_persisted
        self.on_report = on_report  # a persist falling behind: the job's event (persist_behind, persist_overtaken)
        self.timeout_s = timeout_s
        self.stats = KeeperStats()
        self._queue: queue.Queue[_Ask | None] = queue.Queue()
        self._queued: set[Path] = set()  # waiting or running
        self._waiting: dict[str, _Ask] = {}  # per job, the one whole snapshot waiting to be persisted (the newest)
        self._running: dict[str, _Running] = {}  # per job, the persist in flight
        self._lags: dict[str, _Lag] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._persist_loop, name="ckptd-persister", daemon=True)
        self._closed = threading.Event()
        self._part_retry_at: dict[Path, float] = {}  # a part whose write failed: not retried before then

    def start(self) -> None:
        try:  # made private now, so a trainer starting later finds it so (docs/operations.md, "Security")
            ensure_private_dir(self.shm_dir)
        except (UnsafePathError, OSError) as exc:
            self._refuse(str(exc))
        self._thread.start()

    def _refuse(self, why: str) -> None:
        """Say (once per reason) why the memory tier, or one job's part of it, is not used."""
        if why != self.stats.last_error:
            _log.error("memory tier refused: %s", why)
            self.stats.last_error = why

    def stop(self, drain_timeout_s: float = 0.0) -> list[str]:
        """Stop, first finishing for up to ``drain_timeout_s`` the persists already asked for and those a last
        scan finds (a trainer's last save is accepted once it is in shared memory: shutting down must not
        drop it). Returns the snapshots left unpersisted, which stay in shared memory for the next ckptd."""
        deadline = time.monotonic() + drain_timeout_s
        if self._thread.is_alive() and drain_timeout_s > 0:
            try:
                self.scan()
            except Exception as exc:  # a last scan is best effort; what is queued is still persisted
                _log.warning("last snapshot scan before shutdown failed: %s", exc)
        self._queue.put(None)
        if self._thread.is_alive():
            with self._lock:
                waiting = len(self._queued)
            if waiting:
                _log.info("shutting down: persisting %d snapshot(s) first (at most %.0fs)", waiting, drain_timeout_s)
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = sorted(str(path) for path in self._queued)
        if left:
            _log.error("shutting down with %d snapshot(s) not persisted to storage after %.0fs: %s; they stay in "
                       "shared memory, and the next ckptd on this host persists them", len(left), drain_timeout_s,
                       ", ".join(left))
        self._closed.set()  # the persist thread, if still busy, takes nothing more
        self.worker.close(0.0 if left else 10.0)
        return left

    def jobs(self) -> list[str]:
        """The jobs with a snapshot directory; none when the shm directory is not private to this user."""
        try:
            check_private_dir(self.shm_dir)
        except FileNotFoundError:
            return []
        except UnsafePathError as exc:
            self._refuse(str(exc))
            return []
        return sorted(p.name for p in self.shm_dir.iterdir() if is_valid_job_name(p.name) and is_real_dir(p))

    def scan(self) -> None:
        """Queue what needs persisting, drop what is broken or beyond the limit."""
        for job in self.jobs():
            try:
                held = complete_snapshots(self.shm_dir, job)
            except UnsafePathError as exc:
                self._refuse(str(exc))
                continue
            for path in held:
                try:
                    self._consider(job, path)
                except FileNotFoundError:
                    continue  # evicted or replaced by its trainer meanwhile
            # a trainer killed between or during saves leaves a spare file or an unfinished snapshot behind
            drop_leftovers(job_dir(self.shm_dir, job), older_than_s=self.timeout_s)
            # never the newest: older snapshots waiting to be persisted are not evictable, and the one a resume
            # takes next (the trainer may be restoring it right now) must not go in their place
            now_held = complete_snapshots(self.shm_dir, job)
            self.stats.evicted += evict_oldest(now_held, self.max_snapshots, never=now_held[-1] if now_held else None)
        self._forget_gone_parts()

    def _enqueue(self, ask: _Ask) -> None:
        """Queue ``ask`` unless it is queued already. A whole snapshot takes the place of the job's older one
        waiting (superseded: marked so, never persisted); either is reported when the job's persist in flight
        has not finished."""
        reports: list[ElasticEvent] = []
        with self._lock:
            if ask.path in self._queued:
                return
            running = self._running.get(ask.job)
            older = self._waiting.get(ask.job) if ask.kind == "whole" else None
            if older is not None and older.step > ask.step:  # a newer one waits already: this one is superseded
                self._supersede(ask, older, running, reports)
            else:
                if older is not None:
                    self._supersede(older, ask, running, reports)
                self._queued.add(ask.path)
                if ask.kind == "whole":
                    self._waiting[ask.job] = ask
                self._queue.put(ask)
                if running is not None:
                    self.stats.behind += 1
                    reports.append(self._event("persist_behind", ask.step, running, detail=(
                        f"the snapshot of step {ask.step} is due for persisting while step {running.ask.step} is "
                        "still being persisted")))
            warning = self._lagging(ask.job, reports)
        if warning is not None:
            _log.warning(*warning)
        self._tell(ask.job, reports)

    def _supersede(self, older: _Ask, newer: _Ask, running: _Running | None, reports: list[ElasticEvent]) -> None:
        """Skip ``older`` (waiting, not running) for ``newer``: marked superseded, left in shared memory to the
        eviction rules. Under the lock."""
        try:
            mark_superseded(older.path, newer.step)
        except FileNotFoundError:
            pass  # evicted meanwhile: not persisted either way
        except OSError as exc:  # unmarked, it stays unevictable until a later scan supersedes it again
            _log.warning("could not mark snapshot %s superseded: %s", older.path, exc)
        self._queued.discard(older.path)
        if self._waiting.get(older.job) == older:
            del self._waiting[older.job]
        self.stats.overtaken += 1
        still = f" (step {running.ask.step} was still being persisted)" if running is not None else ""
        reports.append(self._event("persist_overtaken", older.step, running, superseded_by=newer.step, detail=(
            f"the snapshot of step {older.step} is not persisted: the newer step {newer.step} is persisted in its "
            f"place{still}")))

    @staticmethod
    def _event(kind: str, step: int, running: _Running | None, *, detail: str,
               superseded_by: int | None = None) -> ElasticEvent:
        now = time.time()
        return ElasticEvent(
            kind=kind, time=now, step=step, id=f"ckptd:{kind}:{step}:{now:.6f}", detail=detail,
            superseded_by=superseded_by,
            persisting_step=running.ask.step if running is not None else None,
            persist_running_seconds=round(time.monotonic() - running.started, 3) if running is not None else None,
            persist_bytes=running.ask.nbytes if running is not None else None,
        )

    def _lagging(self, job: str, events: list[ElasticEvent]) -> tuple[object, ...] | None:
        """Count ``events`` in the job's lag; the warning to log (its format and arguments) at most once every
        ``BEHIND_WARN_S`` per job, with what happened since the last one. Under the lock."""
        if not events:
            return None
        lag = self._lags.setdefault(job, _Lag())
        for event in events:
            if event.kind == "persist_overtaken":
                lag.overtaken += 1
            else:
                lag.behind += 1
        now = time.monotonic()
        if lag.warned_at is not None and now - lag.warned_at < BEHIND_WARN_S:
            return None
        last = events[-1]
        running = (f"step {last.persisting_step} has been persisting for {last.persist_running_seconds or 0:.0f}s "
                   f"({(last.persist_bytes or 0) / 2**20:.1f} MiB)" if last.persisting_step is not None else
                   "none is running")
        since = "since ckptd started" if lag.warned_at is None else f"in the last {now - lag.warned_at:.0f}s"
        warning = ("persists of job %s are falling behind its snapshots (storage slower than the saves?): %s; %d "
                   "snapshot(s) due while one was still persisting and %d superseded (not persisted) %s; the newest "
                   "waiting snapshot is persisted next (docs/operations.md, \"Persists that fall behind\")", job,
                   running, lag.behind, lag.overtaken, since)
        lag.warned_at, lag.behind, lag.overtaken = now, 0, 0
        return warning

    def _tell(self, job: str, events: list[ElasticEvent]) -> None:
        """Hand ``events`` to ``on_report`` (the job's events and metrics); a failure loses the report only."""
        if self.on_report is None:
            return
        for event in events:
            try:
                self.on_report(job, event)
            except Exception as exc:
                _log.warning("could not record %s of job %s: %s", event.kind, job, exc)

    def _consider(self, job: str, path: Path) -> None:
        """Queue one snapshot for persisting, drop it when it is broken, hold it when it is one host's part."""
        bad = problems(path)
        if bad:
            if not path.exists():
                raise FileNotFoundError(path)
            _log.warning("dropping broken snapshot %s: %s", path, "; ".join(bad))
            self.stats.broken += 1
            evict(path)
            return
        meta = read_meta(path)
        refused = self.storage.write_refusal(self.storage.join(job, str(meta.step))) if meta.persist else None
        if refused is not None and not is_persisted(path):
            self._note(self.stats.held, str(path), refused)
            return
        if meta.is_part:
            self._hold_part(job, path, meta)
            return
        if meta.persist and not is_persisted(path) and not is_superseded(path):
            self._enqueue(_Ask("whole", job, path, meta.step, meta.nbytes))

    def _hold_part(self, job: str, path: Path, meta: SnapshotMeta) -> None:
        """One host's part of a multi-process step: never whole on its own. Marked ``persist``: written as
        this process's part of the step (queued), then marked persisted once the leader committed the step.
        A part of a save another save's claim blocks, or one from an older trainer_client, is listed in
        ``stats.parts`` (warned about once) and kept."""
        key = str(path)
        if not meta.persist or is_persisted(path):
            return
        if meta.save_id is None:
            self._note_part(key, f"process {meta.process_index} of {meta.process_count}: a part without a save id "
                                 "(an older trainer_client): not persisted")
            return
        try:
            state = self.parts.state(job, meta)
        except (OSError, StorageError) as exc:
            self._note_part(key, f"cannot read the step's claim or parts: {exc}")
            return
        if state == "committed":
            mark_persisted(path, self.storage.url_of(self.parts.final_path(job, meta.step)))
            self.stats.parts.pop(key, None)
        elif state == "todo" and time.monotonic() >= self._part_retry_at.get(path, 0.0):
            self._enqueue(_Ask("part", job, path, meta.step, meta.nbytes))
        elif state == "claimed by another save":
            self._note_part(key, f"step {meta.step} is claimed by another save; this part ({meta.save_id}) waits "
                                 "until that save is committed or cleaned as abandoned")

    def _note_part(self, key: str, why: str) -> None:
        self._note(self.stats.parts, key, f"{why} (docs/multihost.md)")

    def _note(self, table: dict[str, str], key: str, why: str) -> None:
        """Say once why the snapshot ``key`` is kept and not persisted (``table``: where it is listed)."""
        if table.get(key) != why:
            table[key] = why
            _log.warning("not persisting snapshot %s: %s", key, why)

    def _forget_gone_parts(self) -> None:
        for table in (self.stats.parts, self.stats.held):
            for key in [key for key in table if not Path(key).exists()]:
                del table[key]
        for path in [path for path in self._part_retry_at if not path.exists()]:
            del self._part_retry_at[path]

    def _persist_loop(self) -> None:
        while True:
            ask = self._queue.get()
            if ask is None or self._closed.is_set():
                return
            with self._lock:
                if ask.kind == "whole":
                    if self._waiting.get(ask.job) != ask:
                        continue  # superseded by a newer snapshot while it waited
                    del self._waiting[ask.job]
                self._running[ask.job] = _Running(ask, time.monotonic())
            path = ask.path
            try:
                if ask.kind == "whole":
                    self.persist(ask.job, path)
                else:
                    self._persist_part(ask.job, path)
            except Exception as exc:  # reported; a later scan tries again
                self._failed(path, f"{type(exc).__name__}: {exc}")
                if ask.kind == "part":  # not at every scan: a part that cannot be written fails alike each time
                    self._part_retry_at[path] = time.monotonic() + PART_RETRY_S
            finally:
                with self._lock:
                    self._queued.discard(path)
                    self._running.pop(ask.job, None)

    def persist(self, job: str, path: Path) -> str | None:
        """Write one snapshot to ``<root>/<job>/<step>`` through the persist worker; the step URL or None."""
        step = int(path.name)
        refused = self.storage.write_refusal(self.storage.join(job, str(step)))  # a link out, a read-only job
        if refused is not None:
            self._failed(path, refused)
            return None
        job_url = self.storage.url_of(self.storage.join(job))
        step_url = join_path(job_url, str(step))
        if self.storage.exists(self.storage.join(job, str(step), COMMIT_MARKER)):
            mark_persisted(path, step_url)  # already on storage (e.g. saved there directly)
            return step_url
        started = time.monotonic()
        try:
            self.worker.persist(str(path), job_url)
        except PersistWorkerError as exc:
            self._failed(path, str(exc))
            if isinstance(exc, SnapshotDamaged):  # damaged in memory: retrying cannot help
                self.stats.broken += 1
                evict(path)
                self._revive_superseded(job, step)
            return None
        if path.exists():
            mark_persisted(path, step_url)
        self.stats.persisted += 1
        self.stats.persist_seconds.append(time.monotonic() - started)
        _log.info("persisted snapshot %s to %s in %.2fs", path, step_url, time.monotonic() - started)
        if self.on_persisted is not None:
            self.on_persisted(job, step)
        return step_url

    def _revive_superseded(self, job: str, step: int) -> None:
        """The snapshot of ``step`` was found damaged and dropped: the newest older one still held, superseded and
        not persisted, is persisted in its place from the next scan on (else the job's newest good snapshot would
        never reach storage because a damaged one had taken its turn)."""
        try:
            held = complete_snapshots(self.shm_dir, job)
        except (OSError, UnsafePathError) as exc:
            _log.warning("cannot look for the snapshot step %d superseded in %s: %s", step, job, exc)
            return
        for older in reversed(held):
            if int(older.name) < step and is_superseded(older) and not is_persisted(older):
                try:
                    unmark_superseded(older)
                except OSError as exc:
                    _log.warning("could not take back the supersession of snapshot %s: %s", older, exc)
                    return
                _log.warning("snapshot %s is persisted after all: step %d, which had superseded it, was damaged",
                             older, step)
                return

    def _persist_part(self, job: str, path: Path) -> None:
        """Write this host's part of a multi-process step (``PartSaves.persist_part``)."""
        refused = self.storage.write_refusal(self.storage.join(job))
        if refused is not None:
            self._failed(path, refused)
            return
        started = time.monotonic()
        meta = read_meta(path)
        outcome = self.parts.persist_part(job, str(path), meta)
        if outcome == "written":
            self.stats.parts_written += 1
            self.stats.persist_seconds.append(time.monotonic() - started)
            _log.info("wrote part %s of %s of step %s (%s) in %.2fs", meta.process_index, meta.process_count,
                      meta.step, meta.save_id, time.monotonic() - started)
        elif outcome != "committed":
            self._note_part(str(path), outcome)

    def _failed(self, path: Path, why: str) -> None:
        self.stats.failed += 1
        self.stats.last_error = f"{path}: {why}"
        _log.error("persisting snapshot %s failed: %s", path, why)


__all__ = [
    "KeeperStats",
    "SnapshotKeeper",
]
