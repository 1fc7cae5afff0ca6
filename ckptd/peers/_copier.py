"""The peer channel's two workers on this host: the copier sends this host's newest whole part of each job to the
hosts that keep copies of it, and the fetcher brings this host's own part back from one of them when the
trainer asks, or unasked when this host's memory was wiped (docs/multihost.md, "Peer copies").

The copier runs on a thread of its own, lowered ``nice`` steps below the sidecar (the trainer wins the host's
cores) and at most at the channel's byte rate (``RateLimit``): a slow or dead peer delays only further copies,
never a save or a training step (the trainer only writes its snapshot into shared memory). After a copy, and
whenever this host's own parts change, each holder is told which steps this host still holds, and drops the
copies of the others (a copy is evicted with its original). The trainer asks over ckptd's HTTP API
(``POST /v1/jobs/{job}/peer-fetch``, typed by ``PeerFetchRequest``: ``ckptd/api/routes/_peers.py`` hands it to
``asked``), and its request is fetched at once on a task of its own, the answer (``PeerFetchAnswer``) given when
the part is back or the fetch failed; and when this host held parts of a job and holds none any more (its memory
wiped while the sidecar ran), the fetcher's thread brings the newest copy back without waiting to be asked
(``refill_pass``), so a restarting trainer finds its part in memory. A sidecar started on a new node
has seen no part: when its settings give its host index and the host count, it asks its holders which jobs they
keep its part of (``discover``) and brings those back the same way.

Every peer operation has a deadline: a request without a body ``timeout_s`` in all (connecting and the
handshake included), a copy that plus twice its bytes at the channel's rate, a fetch that plus its bytes at
``fetch_floor_bytes_s`` (a peer slower than that loses to storage: the fetch is given up, the trainer told, and
it restores from storage). Each copy to a holder, each fetch, each refill and the discovery run as tasks of their
own (``Tasks``, ``ckptd/peers/_tasks.py``: at most one per job and holder, or per job and step), so a slow job
or peer holds up only itself, never another job's copies or a trainer's fetch. What each request sends and checks
in its answer is ``ckptd/peers/_requests.py``; this module decides what is sent, to whom, and when.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ckptd.peers._directory import PeerDirectory, holders_of
from ckptd.peers._protocol import Channel, PeerError, RateLimit, connect, lower_this_thread
from ckptd.peers._requests import ask_part, jobs_kept, newest_copy, offer_part, refuse_own, send_part, tell_held
from ckptd.peers._store import PartStore
from ckptd.peers._tasks import Tasks
from trainer_client.core import UnsafePathError
from trainer_client.core.format import SnapshotMeta, complete_snapshots, problems, read_meta
from trainer_client.core.protocol import PeerFetchAnswer, PeerFetchRequest, is_valid_job_name

_log = logging.getLogger(__name__)
RECHECK_S = 5.0  # a holder is asked again after this whether it still keeps the copy (its memory may be wiped)
DISCOVER_FIRST_S = 2.0  # a sidecar that knows its host index asks its holders for its jobs again after this,
DISCOVER_MAX_S = 60.0  # doubling up to this, for as long as its memory holds no part of its own
MAX_DISCOVER_JOBS = 64  # jobs on the storage root whose registry is read to find the holders' addresses
FETCH_FLOOR_BYTES_S = 64 << 20  # a fetch slower than this is given up: storage would bring the part back sooner


@dataclass
class CopierStats:
    """What the copier and the fetcher did since the sidecar started (docs/operations.md, "Peer copies")."""

    copies_sent: int = 0
    bytes_sent: int = 0
    copy_failures: int = 0
    fetched: int = 0
    fetch_failures: int = 0
    refills: int = 0  # refills finished (found a copy or not): this host held parts of a job and holds none now
    last_copy_at: dict[str, float] = field(default_factory=dict)  # job -> when its newest part was last copied
    last_copy_step: dict[str, int] = field(default_factory=dict)
    holders: dict[str, dict[int, str]] = field(default_factory=dict)  # job -> {host: address} holding its copy
    last_failure: str | None = None

    def failed(self, what: str) -> None:
        self.last_failure = f"{time.strftime('%H:%M:%S')} {what}"[:300]


@dataclass(frozen=True)
class PeerOptions:
    k: int = 1
    stride: int = 1
    explicit: dict[int, list[int]] | None = None
    interval_s: float = 0.2
    timeout_s: float = 30.0
    nice: int = 10
    refill: bool = True
    host: tuple[int, int] | None = None  # (this host's index, the hosts) from the settings, when both are known
    fetch_floor_bytes_s: float = FETCH_FLOOR_BYTES_S


class PeerCopier:
    """Copies this host's parts out and brings them back (one per sidecar)."""

    def __init__(self, store: PartStore, directory: PeerDirectory, secret: bytes, rate: RateLimit,
                 options: PeerOptions, *, instance: str = "") -> None:
        self.store = store
        self.instance = instance  # this sidecar's listener's (``PeerListener.instance``): never a copy's holder
        self.directory = directory
        self.secret = secret
        self.rate = rate
        self.options = options
        self.stats = CopierStats()
        self._sent: dict[tuple[str, int], tuple[int, str | None, tuple[int, ...]]] = {}
        self._checked: dict[tuple[str, int], float] = {}  # (job, holder) -> when it last said it holds the copy
        self._metas: dict[Path, tuple[int, SnapshotMeta]] = {}
        self._retry: dict[tuple[str, int], tuple[float, int]] = {}  # (job, holder) -> (not before, failures in a row)
        self._known: dict[str, tuple[int, int]] = {}  # job -> (this host's index, the job's hosts), once seen
        self._refill_at: dict[str, float] = {}  # job -> when to try bringing its part back again
        self._discover = (0.0, DISCOVER_FIRST_S)  # (not before, the wait after the next try): while no part is seen
        self._stop = threading.Event()
        self._copies = Tasks("ckptd-peer-copy")  # started from the copier's lowered thread: they inherit its nice
        self._fetches = Tasks("ckptd-peer-fetch")
        self._step_locks: dict[tuple[str, int], threading.Lock] = {}  # (job, step) -> held while it is fetched
        self._locks_lock = threading.Lock()
        self._asked: dict[tuple[str, int], Future[PeerFetchAnswer]] = {}  # (job, step) -> a trainer's, in flight
        self._threads = [threading.Thread(target=self._loop, args=(self.copy_pass, True), name="ckptd-peer-copier",
                                          daemon=True),
                         threading.Thread(target=self._loop, args=(self.refill_pass, False),
                                          name="ckptd-peer-fetcher", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.options.timeout_s)
        self._copies.join(self.options.timeout_s)
        self._fetches.join(self.options.timeout_s)

    def _loop(self, work: object, lowered: bool) -> None:
        if lowered:
            lower_this_thread(self.options.nice)
        while not self._stop.is_set():
            try:
                work()  # type: ignore[operator]
            except Exception:  # a worker never dies of one bad pass
                _log.exception("peer channel pass failed")
            self._stop.wait(self.options.interval_s if lowered else 0.05)

    def jobs(self) -> list[str]:
        try:
            return sorted(p.name for p in self.store.shm_dir.iterdir() if is_valid_job_name(p.name) and p.is_dir())
        except OSError:
            return []

    def own_parts(self, job: str) -> list[tuple[Path, SnapshotMeta]]:
        """This host's intact parts of ``job``, newest first (metadata cached per directory)."""
        try:
            held = complete_snapshots(self.store.shm_dir, job)
        except (OSError, UnsafePathError):
            return []
        out = []
        for path in reversed(held):
            try:
                stamp = os.lstat(path / "snapshot.json").st_mtime_ns
                cached = self._metas.get(path)
                if cached is None or cached[0] != stamp:
                    if problems(path):
                        continue
                    cached = (stamp, read_meta(path))
                    self._metas[path] = cached
            except (OSError, ValueError, ValidationError):
                continue
            if cached[1].is_part:
                out.append((path, cached[1]))
        self._metas = {p: m for p, m in self._metas.items() if p.exists()}
        return out

    def copy_pass(self) -> None:
        self.discover_pass()
        for job in self.jobs():
            parts = self.own_parts(job)
            if not parts:
                continue
            path, meta = parts[0]
            if self.options.host is not None and self._known.get(job, self.options.host) != (
                    meta.process_index, meta.process_count):
                _log.warning("%s: this host's part is host %d of %d, not host %d of %d as its settings say "
                             "(CKPTD_HOST_INDEX, JOB_COMPLETION_INDEX, CKPTD_HOST_COUNT): the part is believed",
                             job, meta.process_index, meta.process_count, *self.options.host)
            self._known[job] = (meta.process_index, meta.process_count)
            held = tuple(sorted(m.step for _, m in parts))
            self.directory.register(job, meta.process_index)
            for holder in holders_of(meta.process_index, meta.process_count, self.options.k, self.options.stride,
                                     self.options.explicit):
                sent = self._sent.get((job, holder))
                if sent is not None and sent[:2] == (meta.step, meta.save_id) and sent[2] == held and \
                        time.monotonic() - self._checked.get((job, holder), 0.0) < RECHECK_S:
                    continue
                if time.monotonic() < self._retry.get((job, holder), (0.0, 0))[0]:
                    continue
                self._copies.start((job, holder), functools.partial(self._copy, job, holder, path, meta, held))

    def _copy(self, job: str, holder: int, path: Path, meta: SnapshotMeta, held: tuple[int, ...]) -> None:
        """One copy task: ``job``'s newest part to ``holder`` (or only the steps held, when it has the part)."""
        sent = self._sent.get((job, holder))
        streak = self._retry.get((job, holder), (0.0, 0))[1]
        try:
            if sent is not None and sent[:2] == (meta.step, meta.save_id) and sent[2] != held:
                self._tell_held(job, holder, meta, held)
            else:
                self._send(job, holder, path, held)
            self._sent[(job, holder)] = (meta.step, meta.save_id, held)
            self._checked[(job, holder)] = time.monotonic()
            self._retry.pop((job, holder), None)
        except (PeerError, OSError, ValueError) as exc:  # tried again later, less often each time
            self.stats.copy_failures += 1
            self.stats.failed(f"copy of {job} step {meta.step} to host {holder}: {exc}")
            self.directory.forget(job, holder)
            self.stats.holders.get(job, {}).pop(holder, None)
            self._retry[(job, holder)] = (time.monotonic() + min(10.0, 0.25 * 2 ** streak), streak + 1)
            (_log.warning if streak == 0 else _log.debug)(
                "peer copy of %s step %s to host %d failed: %s", job, meta.step, holder, exc)

    def _address(self, job: str, holder: int) -> str:
        address = self.directory.address_of(job, holder)
        if address is None:
            raise PeerError(f"no address known for host {holder} of {job}")
        if address == self.directory.address:
            raise PeerError(f"host {holder}'s address for {job} ({address}) is this sidecar's own: a copy never "
                            "lands on its origin")
        return address

    def _connect(self, address: str, deadline_s: float | None = None) -> Channel:
        """A connection to ``address`` whose whole request has ``deadline_s`` (default ``timeout_s``)."""
        return connect(address, self.secret, self.options.timeout_s,
                       self.options.timeout_s if deadline_s is None else deadline_s)

    def _tell_held(self, job: str, holder: int, meta: SnapshotMeta, held: tuple[int, ...]) -> None:
        with self._connect(self._address(job, holder)) as chan:
            refuse_own(tell_held(chan, job, meta, held, self.instance), self.instance, job, holder)

    def _send(self, job: str, holder: int, path: Path, held: tuple[int, ...]) -> None:
        raw, meta, data = self.store.open_part(path)
        rate = self.rate.rate or self.options.fetch_floor_bytes_s  # the copy's bytes at the channel's rate, twice
        address = self._address(job, holder)
        with data, self._connect(address, self.options.timeout_s + 2 * meta.nbytes / rate) as chan:
            answer = offer_part(chan, job, meta, len(raw), held, self.instance)
            refuse_own(answer, self.instance, job, holder)
            if answer.have:
                self.stats.holders.setdefault(job, {})[holder] = address
                return
            started = time.monotonic()
            send_part(chan, raw, data, meta.nbytes, self.rate)
        self.stats.copies_sent += 1
        self.stats.bytes_sent += meta.nbytes
        self.stats.last_copy_at[job] = time.time()
        self.stats.last_copy_step[job] = meta.step
        self.stats.holders.setdefault(job, {})[holder] = address
        _log.info("peer copy of %s step %s (%d bytes) held by host %d at %s (%.2f s)", job, meta.step, meta.nbytes,
                  holder, address, time.monotonic() - started)

    def discover_pass(self) -> None:
        """A task of its own, started from the copier's thread: a holder slow to answer holds up neither a copy
        nor a trainer's fetch."""
        if self.options.refill and self.options.host is not None and time.monotonic() >= self._discover[0]:
            before, wait = self._discover
            self._discover = (time.monotonic() + wait, min(DISCOVER_MAX_S, wait * 2))  # before the task can end it
            if not self._copies.start(("discover",), functools.partial(self.discover, *self.options.host)):
                self._discover = (before, wait)

    def refill_pass(self) -> None:
        """A refill task for each job of which this host held parts and holds none now (every 2 s at most)."""
        for job in sorted(set(self.jobs()) | set(self._known)):  # a wiped job's directory may be gone too
            if (self.options.refill and job in self._known and time.monotonic() >= self._refill_at.get(job, 0.0)
                    and not self._fetches.busy((job, "refill")) and not self.own_parts(job)):
                self._refill_at[job] = time.monotonic() + 2.0
                self._fetches.start((job, "refill"), functools.partial(self.refill, job, *self._known[job]))

    def asked(self, job: str, request: PeerFetchRequest) -> Future[PeerFetchAnswer]:
        """The trainer's request for its part of ``request.step`` of ``job`` back from host ``request.source``'s
        copy, fetched at once on a task of its own (``fetch``: its deadline, its per-step lock); the future's
        result is the answer, never an exception. A request for a step whose fetch the trainer asked for already
        and is still running shares that fetch's answer (a client that asks again after its own timeout waits
        for the same fetch)."""
        key = (job, request.step)
        with self._locks_lock:
            running = self._asked.get(key)
            if running is not None and not running.done():
                return running
            future: Future[PeerFetchAnswer] = Future()
            future.set_running_or_notify_cancel()  # started: a caller that goes away cannot cancel it for others
            self._asked[key] = future
        if not self._fetches.start((job, "fetch", request.step), functools.partial(self._answer, job, request,
                                                                                    future)):
            self._done(job, request, future, f"busy: {self._fetches.limit} peer fetches in progress")
        return future

    def _answer(self, job: str, request: PeerFetchRequest, future: Future[PeerFetchAnswer]) -> None:
        """One fetch task: the trainer's request, answered whatever happens (within the fetch's deadline)."""
        error: str | None = "the fetch failed unexpectedly (the sidecar's log says why)"
        try:
            self.fetch(job, request.step, source=request.source, origin=request.origin, count=request.count,
                       save_id=request.save_id)
            self.stats.fetched += 1
            error = None
        except (PeerError, OSError, ValueError) as exc:
            self.directory.forget(job, request.source)  # its address is read again next time
            error = str(exc)
        finally:
            self._done(job, request, future, error)

    def _done(self, job: str, request: PeerFetchRequest, future: Future[PeerFetchAnswer], error: str | None) -> None:
        """The trainer's answer: the part is back (``error`` None), or why not (counted and logged)."""
        if error is not None:
            error = f"from host {request.source}: {error}"[:2000]
            self.stats.fetch_failures += 1
            self.stats.failed(f"fetch of {job} step {request.step} {error}")
            _log.warning("fetch of %s step %s %s", job, request.step, error)
        with self._locks_lock:
            if self._asked.get((job, request.step)) is future:
                del self._asked[(job, request.step)]
        future.set_result(PeerFetchAnswer(ok=error is None, error=error))

    def discover(self, index: int, count: int) -> list[str]:
        """This host is host ``index`` of ``count`` (its settings say) and its memory holds no part of its own
        (a new node): the jobs whose copies of its part its holders keep (``jobs``), learned as if a part had
        said so, so that ``fetch_pass`` brings each back at once. The holders are found at their static
        addresses, else through the registry of the jobs on the storage root (at most ``MAX_DISCOVER_JOBS``)."""
        if any(self.own_parts(job) for job in self.jobs()):
            self._discover = (float("inf"), DISCOVER_MAX_S)  # its parts say who this host is from now on
            return []
        found: list[str] = []
        for address in self._holder_addresses(index, count):
            try:
                with self._connect(address) as chan:
                    found += jobs_kept(chan, index, count)
            except (PeerError, OSError) as exc:
                _log.debug("asking %s which jobs it keeps host %d's part of failed: %s", address, index, exc)
        new = sorted(job for job in set(found) if job not in self._known)
        for job in new:
            self._known[job] = (index, count)
            _log.info("%s: the holders keep copies of this host's part (host %d of %d): bringing it back", job,
                      index, count)
        return new

    def _holder_addresses(self, index: int, count: int) -> list[str]:
        holders = holders_of(index, count, self.options.k, self.options.stride, self.options.explicit)
        if self.directory.static:
            return list(dict.fromkeys(self.directory.static[h] for h in holders if h in self.directory.static))
        storage = self.directory.storage
        if storage is None:
            return []
        try:
            jobs = [e.name for e in storage.list_dir(storage.root) if e.is_dir and is_valid_job_name(e.name)]
        except OSError as exc:  # StorageError is one
            _log.debug("listing the jobs on the storage root failed: %s", exc)
            return []
        addresses = (self.directory.address_of(job, h) for job in jobs[:MAX_DISCOVER_JOBS] for h in holders)
        return list(dict.fromkeys(a for a in addresses if a is not None))

    def refill(self, job: str, index: int, count: int) -> Path | None:
        """This host held parts of ``job`` and holds none now (its memory was wiped): bring the newest copy of
        its part back from the hosts that keep them, before its trainer asks (it restarts meanwhile)."""
        try:
            return self._refill(job, index, count)
        finally:
            self.stats.refills += 1

    def _refill(self, job: str, index: int, count: int) -> Path | None:
        for holder in holders_of(index, count, self.options.k, self.options.stride, self.options.explicit):
            try:
                with self._connect(self._address(job, holder)) as chan:
                    newest = newest_copy(chan, job, index, count)
                if newest is None:
                    continue
                step, save_id = newest
                path = self.fetch(job, step, source=holder, origin=index, count=count, save_id=save_id)
                self.stats.fetched += 1
                return path
            except (PeerError, OSError, ValueError, TypeError) as exc:
                self.directory.forget(job, holder)
                self.stats.fetch_failures += 1
                self.stats.failed(f"refill of {job} from host {holder}: {exc}")
                _log.warning("bringing %s's part back from host %d failed: %s", job, holder, exc)
        return None

    def fetch(self, job: str, step: int, *, source: int, origin: int, count: int, save_id: str | None) -> Path:
        """This host's part of ``step`` (host ``origin`` of ``count``), brought back from host ``source``'s copy
        into ``<shm>/<job>/<step>/``, every shard checked; ``PeerError`` when it cannot be (hosts that cannot be
        asked included: ``source`` this host itself, an index not below ``count``)."""
        if not 0 <= origin < count or not 0 <= source < count or source == origin:
            raise PeerError(f"host {source} cannot hold a copy of host {origin}'s part of a job of {count} hosts")
        with self._locks_lock:
            if len(self._step_locks) > 256:  # those no fetch holds go
                self._step_locks = {k: v for k, v in self._step_locks.items() if v.locked()}
            lock = self._step_locks.setdefault((job, step), threading.Lock())
        with lock:  # a refill and the trainer's request for the same step: one brings it, the other finds it
            return self._fetch(job, step, source=source, origin=origin, count=count, save_id=save_id)

    def _fetch(self, job: str, step: int, *, source: int, origin: int, count: int, save_id: str | None) -> Path:
        own = self.store.own_path(job, step)
        if own.exists() and not problems(own) and read_meta(own).save_id == save_id:
            return own
        started = time.monotonic()
        with self._connect(self._address(job, source)) as chan:
            meta_bytes, data_bytes = ask_part(chan, job, step, origin=origin, count=count, save_id=save_id)
            # the bytes at the slowest rate that still beats storage: a slower peer is given up on
            chan.until(time.monotonic() + self.options.timeout_s + data_bytes / self.options.fetch_floor_bytes_s)
            with self.store.reserve(meta_bytes + data_bytes, copy=False):
                path = self.store.receive(chan, job, origin=origin, count=count, step=step, meta_bytes=meta_bytes,
                                          data_bytes=data_bytes, own=True, source=source)
        if save_id is not None and read_meta(path).save_id != save_id:
            raise PeerError(f"host {source} sent another save of step {step}")
        _log.info("%s step %s: this host's part brought back from host %d (%d bytes, %.2f s)", job, step, source,
                  data_bytes, time.monotonic() - started)
        return path


__all__ = ["CopierStats", "PeerCopier", "PeerOptions"]
