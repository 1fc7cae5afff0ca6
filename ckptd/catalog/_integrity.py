"""Turning a committed step into a good one, or quarantining it: ckptd's writes to storage for integrity.

For every newly committed step ckptd

* honours a quarantine record any ckptd left (``ckptd_quarantine.json``): the step stays quarantined;
* adopts a step written by plain Orbax (no manifest): checksums every file at first sight and writes a
  manifest marked ``adopted``;
* quick-validates the manifest (names, sizes, GCS checksums) and quarantines the step when it fails —
  files are never deleted, the record is on storage so every ckptd sees it after any restart;
* seals the manifest with the two files Orbax finished after it (``_CHECKPOINT_METADATA``, the marker);
* records the verdict (``ckptd_verified.json``), so a later start catalogues the step from that small file
  (``from_verified_record``); the verdict's identity (the fingerprints the record keeps) goes with the step's row,
  so the catalog can tell when a new save took the step's name (``ckptd/catalog/_identity.py``);
* on a local disk, fsyncs the commit marker, the final metadata, ckptd's files and the directory entries
  (the step directory and the job directory that received the rename) before reporting the step good —
  all at once from a few threads (one journal commit for all of them, not one each), then the sealed
  manifest and the directory entry of its rename.

This is ckptd's *first sight* of a step (docs/operations.md, "First sight"): what it checks and what it
costs (``first_sight_ms_per_step``, docs/benchmarks.md).

A write that fails (read-only storage, a storage error) leaves the step ``committed``: never served,
retried at the next refresh.

With ``read_only`` (a job or root watched read-only, docs/protocol.md "Read-only adoption") the same records
are written to the side prefix ``<root>/.ckptd/<job>/<step>/`` (``trainer_client/core/format/_records.py``)
and nothing is written or synced inside the step: quarantine is a record there, the step stays as it is. Side
records made for an earlier save of the step are moved aside first (``ckptd/catalog/_side_records.py``).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptd.catalog._identity import Judged, identity_of
from ckptd.catalog._job_workers import DaemonPool
from ckptd.catalog._side_records import METADATA_CRC, metadata_crc, move_side_records_aside, of_an_earlier_save
from trainer_client.core import (
    Entry,
    Level,
    Storage,
    StorageError,
    ValidationResult,
    join_path,
    parse_quarantine,
    read_quarantine,
    sync_paths,
    validate_step,
    write_json_file,
)
from trainer_client.core.format import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    VERIFIED_FILE,
    RecordPlace,
    StepInspection,
    build_manifest,
    contradiction_summary,
    fingerprints,
    newest_file_time,
    parse_step_name,
    quarantine_record,
    read_verified_record,
    record_paths,
    seal_manifest,
    stored_contradictions,
    write_manifest,
    write_verified_record,
)
from trainer_client.core.protocol import StepState

_log = logging.getLogger(__name__)


_T = TypeVar("_T")
_R = TypeVar("_R")

FOLLOWER_REASON = "not verified yet: another ckptd leads this job and writes its records (docs/multihost.md)"


@dataclass(frozen=True)
class Settled:
    state: StepState
    reason: str | None
    identity: str | None = None  # of a verified step: the fingerprints its verified record keeps


def quarantine(storage: Storage, step_path: str, reason: str, problems: list[str], *, read_only: bool = False) -> None:
    """Record on storage that a step is bad (on the side prefix when ``read_only``), with the CRC32C of the
    ``_CHECKPOINT_METADATA`` of the save it is about. Its files stay where they are."""
    record = json.loads(quarantine_record(storage.url_of(step_path), reason, problems))
    if (crc := metadata_crc(storage, step_path)) is not None:
        record[METADATA_CRC] = crc
    write_json_file(storage, RecordPlace(step_path, read_only).write_path(QUARANTINE_FILE),
                    json.dumps(record, indent=1))
    _log.warning("quarantined %s: %s (%s)", storage.url_of(step_path), reason, "; ".join(problems[:5]))


_THREADS = 6
_pool: DaemonPool | None = None
_pool_lock = threading.Lock()


def _threads() -> DaemonPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = DaemonPool(_THREADS, "ckptd-settle")
        return _pool


_STEPS_AT_ONCE = 4  # steps settled at a time (first sight of many steps: a start without records)
_STEP_CALLERS = 4  # jobs settling at once (the refresher's job workers): each gets its own four threads
_steps_pool: DaemonPool | None = None


def each_step(look: Callable[[_T], _R], items: list[_T]) -> Iterator[tuple[_T, _R | StorageError]]:
    """``look(item)`` for each item, ``_STEPS_AT_ONCE`` at a time (one step's reads and fsyncs wait while another
    step's metadata is parsed), in order; a ``StorageError`` is handed back in place of that item's result, any
    other exception raised — and then no further item is started (at most the few already running finish),
    as the loop over the steps stopped before. The threads (daemons: a SIGTERM does not wait for them) are
    shared by ``_STEP_CALLERS`` jobs' scans at once, each running at most ``_STEPS_AT_ONCE`` of its steps: one
    job's slow steps do not hold another's (``ckptd/catalog/_refresher.py``)."""
    global _steps_pool

    def guarded(item: _T) -> _R | StorageError:
        try:
            return look(item)
        except StorageError as exc:
            return exc

    if len(items) <= 1 or _STEPS_AT_ONCE <= 1:
        yield from ((item, guarded(item)) for item in items)
        return
    with _pool_lock:
        if _steps_pool is None:
            _steps_pool = DaemonPool(_STEPS_AT_ONCE * _STEP_CALLERS, "ckptd-first-sight")
        pool = _steps_pool
    pending: deque[tuple[_T, Future[_R | StorageError]]] = deque()  # started, in order, not handed back yet
    started = 0
    try:
        while True:
            running = [future for _, future in pending if not future.done()]
            # at most _STEPS_AT_ONCE running, and a few finished ahead of a slow one, not the whole job
            while started < len(items) and len(running) < _STEPS_AT_ONCE and len(pending) < 2 * _STEPS_AT_ONCE:
                pending.append((items[started], pool.submit(guarded, items[started])))
                running.append(pending[-1][1])
                started += 1
            if not pending:
                return
            done, future = pending[0]
            if not future.done():
                wait(running, return_when=FIRST_COMPLETED)
                continue
            pending.popleft()
            yield done, future.result()
    finally:
        for _, future in pending:  # an exception, or the caller stopped: start nothing more
            future.cancel()


def _sync_together(paths: list[str]) -> None:
    """fsync ``paths`` concurrently (``sync_paths`` each: missing ones skipped); the first failure is raised.
    The file system serves concurrent fsyncs with one journal commit: ~the cost of one, not of six."""
    pool = _threads()
    others = [pool.submit(sync_paths, path) for path in paths[1:]]
    try:
        if paths:
            sync_paths(paths[0])  # one in this thread: a hand-off fewer
    finally:
        for done in others:
            done.result()


def _read_records(storage: Storage, step_path: str, *, manifest: bool) -> tuple[bytes | None, bytes]:
    """The step's quarantine record (None: none) and, when ``manifest``, its manifest (``b""``: none), each
    from the side prefix when there is one there, else from the step (``records.py``). On an object store
    the reads go out at once (each is a round trip; most find nothing); on a local disk they are read one
    after the other, the manifest only when there is no quarantine record."""
    if not storage.is_remote:
        listed: dict[str, set[str] | None] = {}  # each record directory listed once for both records
        quarantined = _read_local_record(storage, step_path, QUARANTINE_FILE, listed)
        if quarantined is not None or not manifest:
            return quarantined, b""
        return None, _read_local_record(storage, step_path, CKPTD_MANIFEST, listed) or b""
    paths = [*record_paths(step_path, QUARANTINE_FILE), *(record_paths(step_path, CKPTD_MANIFEST) if manifest else ())]
    reads = [_threads().submit(storage.read_bytes, path) for path in paths]
    got: list[bytes | None] = []
    for read in reads:
        try:
            got.append(read.result())
        except FileNotFoundError:
            got.append(None)
    got += [None, None]  # no manifest asked for
    quarantine_raw = got[0] if got[0] is not None else got[1]
    manifest_raw = got[2] if got[2] is not None else got[3]
    return quarantine_raw, manifest_raw if manifest_raw is not None else b""


def _read_local_record(storage: Storage, step_path: str, name: str, listed: dict[str, set[str] | None]) -> bytes | None:
    """``read_record`` on a local disk, reading only where a listing shows the file (the step directory and
    its side directory, each listed once into ``listed``: cheaper than reads that find nothing). Read through
    ``storage``, so a link leading out of the root is still not there."""
    for path in record_paths(step_path, name):
        directory = posixpath.dirname(path)
        if directory not in listed:
            try:
                with os.scandir(directory) as children:
                    listed[directory] = {child.name for child in children}
            except FileNotFoundError:
                listed[directory] = set()
            except OSError:
                listed[directory] = None  # cannot list: try the reads themselves
        names = listed[directory]
        if names is None or name in names:
            try:
                return storage.read_bytes(path)
            except FileNotFoundError:
                continue
    return None


def _durable(step_path: str, sealed_tmp: str) -> None:
    """Orbax's files, the manifest, both directory entries (the step's rename into the job directory) and the
    sealed manifest written beside (``sealed_tmp``), all before that is renamed over the manifest: a sealed
    manifest means the step is durable. Nothing after the rename: if a power cut loses the rename itself, the
    step keeps its unsealed manifest and is sealed again at the next first sight."""
    step_path = step_path.rstrip("/")
    _sync_together([
        join_path(step_path, COMMIT_MARKER),
        join_path(step_path, CHECKPOINT_METADATA),
        join_path(step_path, CKPTD_MANIFEST),
        step_path,
        posixpath.dirname(step_path),
        sealed_tmp,
    ])


def settle(storage: Storage, inspection: StepInspection, *, adopt_after_s: float = 0.0,
           read_only: bool = False, write: bool = True) -> Settled:
    """Verify (adopting and sealing as needed) or quarantine a committed step.

    A step without a manifest is adopted only once none of its files changed for ``adopt_after_s``: a
    directory copied in by a tool may show its marker before its other files (Orbax writes it last).
    ``write=False`` (a follower: another sidecar leads the job, ``ckptd/lease/_lease.py``) writes nothing: the
    step stays committed, never served, until the leader's verified or quarantine record is there."""
    path = inspection.path
    try:
        if read_only and of_an_earlier_save(storage, path):  # the old save's records: not this save's verdict
            if not write:
                return Settled(StepState.COMMITTED, FOLLOWER_REASON)
            move_side_records_aside(storage, path)
        quarantine_raw, manifest_raw = _read_records(storage, path, manifest=write)
        if quarantine_raw is not None:
            record = parse_quarantine(quarantine_raw)
            return Settled(StepState.QUARANTINED, str(record.get("reason", "quarantined")))
        if not write:
            return Settled(StepState.COMMITTED, FOLLOWER_REASON)
        result = validate_step(storage, path, "quick", recorded_training=inspection.training,
                               manifest_bytes=manifest_raw)
        if result.problems == ["no manifest"]:
            newest = newest_file_time(storage, path)
            if adopt_after_s > 0 and (newest is None or time.time() - newest < adopt_after_s):
                return Settled(StepState.COMMITTED, f"not verified yet: adopting once unchanged for {adopt_after_s:g}s")
            contradictions = stored_contradictions(storage, path)  # before it counts (_stored_extents.py)
            if contradictions:
                reason = contradiction_summary(contradictions)
                quarantine(storage, path, reason, contradictions, read_only=read_only)
                return Settled(StepState.QUARANTINED, reason)
            manifest = build_manifest(
                storage, path, step=inspection.step, writer="adopted",
                arrays=inspection.training.arrays if inspection.training else None, training=inspection.training,
            )
            write_manifest(storage, path, manifest, read_only=read_only)
            result = validate_step(storage, path, "quick", recorded_training=inspection.training)
        if not result.ok:
            reason = "quick validation failed: " + "; ".join(result.problems[:5])
            quarantine(storage, path, reason, result.problems, read_only=read_only)
            return Settled(StepState.QUARANTINED, reason)
        verified = result.manifest
        if verified is not None and verified.sealed is None:
            # Durable first, then sealed: a sealed manifest means a ckptd already made this step durable,
            # so a restart does not fsync every step again. A step ckptd may not write into is made durable
            # by its writer, not synced here; an object store's writes are durable when they return.
            local = not read_only and not storage.is_remote
            verified = seal_manifest(storage, path, verified, read_only=read_only, listed=result.listed,
                                     sync=(lambda tmp: _durable(path, tmp)) if local else None)
        identity = None
        if verified is not None:  # the verdict, for every later start: one small file instead of a re-check
            kept = write_verified_record(storage, path, verified, inspection.committed_at, read_only=read_only)
            identity = identity_of(kept.fingerprints)
    except (OSError, StorageError, ValueError) as exc:
        return Settled(StepState.COMMITTED, f"not verified yet: {type(exc).__name__}: {exc}")
    writer = result.manifest.writer if result.manifest else None
    return Settled(StepState.VERIFIED, "adopted: manifest written by ckptd" if writer == "adopted" else None, identity)


def validate_and_quarantine(
    storage: Storage, step_path: str, level: Level, *, read_only: bool = False, **kwargs: Any
) -> ValidationResult:
    """``validate_step``; a step that fails is quarantined on storage (what ``ckptd validate`` does)."""
    result = validate_step(storage, step_path, level, **kwargs)
    if not result.ok and read_quarantine(storage, step_path) is None:
        quarantine(storage, step_path, f"{level} validation failed: " + "; ".join(result.problems[:5]),
                   result.problems, read_only=read_only)
    return result


def from_verified_record(storage: Storage, entry: Entry, side: set[str]) -> Judged | None:
    """A step some ckptd verified before, from its verified record alone: committed (marker there),
    manifest there, no quarantine record (in the step, or in ``side``: its records on the side prefix), and its
    top-level files those the record fingerprints (its identity). None sends the step down the full inspection."""
    parsed = parse_step_name(entry.name)
    if parsed is None or parsed.is_tmp or not entry.is_dir:
        return None
    children = storage.list_dir(entry.path)
    names = {e.name for e in children}
    if COMMIT_MARKER not in names or not {CKPTD_MANIFEST, VERIFIED_FILE} <= names | side:
        return None
    if QUARANTINE_FILE in names | side:
        return None
    record = read_verified_record(storage, entry.path)
    if record is None or record.step != parsed.step or record.fingerprints != fingerprints(children):
        return None  # no usable verdict, or a file changed since it: verify again
    reason = "adopted: manifest written by ckptd" if record.writer == "adopted" else None
    return Judged(StepInspection(parsed.step, entry.path, StepState.VERIFIED, reason, record.committed_at,
                                 record.training), identity_of(children), entry.mtime)


__all__ = ["FOLLOWER_REASON", "Settled", "each_step", "from_verified_record", "quarantine", "settle",
           "validate_and_quarantine"]
