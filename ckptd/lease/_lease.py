"""One writer per job among N sidecars on one root: a leadership lease kept on storage (docs/multihost.md, §7).

With ``CKPTD_LEASE_TTL_S`` set, every sidecar runs a ``LeaseBoard``: per job, the holder of the newest
epoch whose heartbeat keeps changing is the leader. Only the leader writes a job's records (manifests of
adopted steps, verified and quarantine records) and runs its retention; the others answer reads from what
the leader wrote (``Catalog.writes``). Files under ``<job>/.ckptd/leader/`` (a read-only job's: on the side
prefix, ``<root>/.ckptd/<job>/leader/``):

* ``epoch-<n, 20 digits>.json``, created with ``Storage.create_new`` (create-only: ``O_EXCL`` locally,
  ``ifGenerationMatch=0`` on GCS): ``{"holder", "ttl_s", "created_at"}``. The highest epoch is the current term;
  of two followers racing for the same epoch exactly one creates it.
* ``beat-<n>.json``: ``{"holder", "seq"}``, rewritten by the holder of epoch n at every tick (``ttl_s / 4``).
* ``released-<n>.json``: ``{"holder", "released_at"}``, created (create-only) by the holder of epoch n when it
  stops cleanly (``LeaseBoard.stop``, after the drain): it first stops leading, then creates the file, so a
  follower that sees it for the newest epoch takes the next epoch at its next tick instead of after ``ttl_s``,
  and never while the old leader still leads.

A follower times expiry on its own monotonic clock from the moment it saw (newest epoch, its beat) change:
unchanged for ``ttl_s`` -> it tries to create the next epoch. The leader fences itself: it leads only within
``FENCE`` (2/3) of ``ttl_s`` after the start of its last renewal, a renewal counts only if it finished within
that window, and once the window has passed it steps down rather than renew. So a follower that saw no beat
change for ``ttl_s`` takes over only after the old leader stopped leading (no clock has to agree with
another). Writes already in flight when the window closes are the overlap the design accepts: each is the
same content whoever writes it (docs/multihost.md); a commit or a deletion of a leader paused past this gate
is fenced at storage instead (the job's flock locally, a save's fate record on ``gs://``: docs/multihost.md,
section 5, "Fenced writers").

What counts on storage is decided by ``lease_records.py`` (names, bounds, records: anyone who can write the root
can plant files here). A name that does not count is reported once and ignored; a takeover creates the next
epoch whose name is free, never one past ``MAX_EPOCH``. An epoch at the bound, whose beat stopped, can only be
forged (no ckptd gets there): it is reported and ignored too, so a follower never waits for good.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptd.lease._lease_records import (
    LEASE_DIR,
    MAX_EPOCH,
    MAX_LEASE_TTL_S,
    HeldLease,
    LeaseListing,
    beat_name,
    default_holder,
    epoch_name,
    held_lease,
    lease_directory,
    list_lease,
    read_epoch_record,
    read_record,
    released_name,
)
from trainer_client.core import Storage, StorageError, StoredFormatError, join_path, write_json_file

_log = logging.getLogger(__name__)

FENCE = 2 / 3  # the leader stops writing this far into its lease (a follower waits the whole of it)
KEEP_EPOCHS = 2  # epoch and beat files older than the current epoch minus this are deleted by the leader
MAX_REPORTED = 256  # names a lease reports as ignored (once each); past that it stops reporting new ones


@dataclass(frozen=True)
class LeaseView:
    """What a sidecar knows of one job's lease: its role, the newest epoch seen and that epoch's holder."""

    role: str  # "leader" or "follower"
    epoch: int | None
    holder: str | None
    ttl_s: float

    def as_dict(self) -> dict[str, object]:
        return {"role": self.role, "epoch": self.epoch, "holder": self.holder, "ttl_s": self.ttl_s}


class Lease:
    """One job's lease as seen by one sidecar: ``tick`` advances its state machine, ``leads`` gates writes."""

    def __init__(self, storage: Storage, directory: str, holder: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ttl_s <= MAX_LEASE_TTL_S:  # NaN fails this too
            raise ValueError(f"the lease's ttl_s must be in (0, {MAX_LEASE_TTL_S:g}] seconds, not {ttl_s}")
        self.storage = storage
        self.directory = directory.rstrip("/")
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self.epoch: int | None = None  # ours, while we lead
        self._renewed_at: float | None = None  # start of our last renewal that counted (monotonic)
        self._seq = 0
        self._seen: tuple[int, bytes | None] | None = None  # (newest epoch, its beat) as last seen changed
        self._seen_at = 0.0
        self._top: int | None = None  # the newest epoch listed
        self._top_holder: str | None = None
        self._exhausted: set[int] = set()  # epochs at the bound whose beat stopped: ignored from then on
        self._reported: set[str] = set()  # names reported as ignored (once each)

    # ---- the gate ------------------------------------------------------------------------------

    def leads(self) -> bool:
        """Whether this sidecar may write now: it holds the newest epoch it knows and renewed it recently."""
        with self._lock:
            return self._fresh()

    def _fresh(self) -> bool:
        return (self.epoch is not None and self._renewed_at is not None
                and self.clock() - self._renewed_at < self.ttl_s * FENCE)

    def confirmed(self) -> bool:
        """``leads``, and storage agrees now: no epoch newer than ours is listed (asked of storage, not of the last
        tick). What a leader asks right before an act a newer leader must not see done twice, such as retention's
        deletions on ``gs://`` (docs/gcs.md, "Fencing on gs://"): a follower that took over early (a shorter
        ``ttl_s`` than ours, set by mistake) is seen here before our own fence would stop us."""
        with self._lock:
            ours = self.epoch if self._fresh() else None
        if ours is None:
            return False
        self.storage.invalidate(self.directory)
        epochs = self._listing().epochs
        newest = epochs[-1] if epochs else None
        if newest != ours:
            _log.warning("lease %s: epoch %s is the newest on storage, not ours (%d): acting as leader refused",
                         self.directory, newest, ours)
            return False
        return self.leads()

    def view(self) -> LeaseView:
        with self._lock:
            leading = self._fresh()
            return LeaseView("leader" if leading else "follower", self.epoch if leading else self._top,
                             self.holder if leading else self._top_holder, self.ttl_s)

    # ---- the state machine ---------------------------------------------------------------------

    def tick(self) -> None:
        """Renew (leader), or watch the leader and take over once its beat stopped for ``ttl_s`` (follower)."""
        self.storage.invalidate(self.directory)
        listing = self._listing()
        epochs, released = listing.epochs, listing.released
        top = epochs[-1] if epochs else None
        with self._lock:
            self._top = top
            if self.epoch is not None and (not self._fresh() or (top is not None and top > self.epoch)):
                _log.warning("lease %s: stepping down from epoch %d (%s)", self.directory, self.epoch,
                             "a newer epoch exists" if top is not None and top > self.epoch else "not renewed in time")
                self.epoch, self._renewed_at, self._seen = None, None, None
            leading = self.epoch
        if leading is not None:
            self._renew(leading)
            self._clean(epochs, leading)
            return
        if top is None:
            self._take_after(None, listing)
            return
        if top in released:  # its holder stopped leading, then said so: no need to wait for expiry
            _log.info("lease %s: epoch %d was released by its holder", self.directory, top)
            self._take_after(top, listing)
            return
        key = (top, self._read(beat_name(top)))
        now = self.clock()
        if key != self._seen:
            with self._lock:
                self._seen, self._seen_at = key, now
                self._top_holder = self._holder_of(top)
            return
        if now - self._seen_at >= self.ttl_s:
            self._take_after(top, listing)

    def _take_after(self, top: int | None, listing: LeaseListing) -> None:
        """Take the term after ``top`` (None: the first); when no epoch after it can be listed, ``top`` is at the
        bound, so forged: ignored from now on (the next tick watches the epoch below it)."""
        n = listing.successor(top)
        if n is not None:
            self._take(n)
            return
        assert top is not None  # successor(None) is 0 or the first free name above it, never past the bound
        _log.error("lease %s: ignoring %s: no epoch after it may be written (the bound is %d): only a forged "
                   "record gets there", self.directory, epoch_name(top), MAX_EPOCH)
        with self._lock:
            self._exhausted.add(top)
            self._seen = None

    def _take(self, n: int) -> None:
        started = self.clock()
        record = {"holder": self.holder, "ttl_s": self.ttl_s, "created_at": time.time()}
        try:
            created = self.storage.create_new(join_path(self.directory, epoch_name(n)), json.dumps(record).encode())
        except (OSError, StorageError) as exc:
            _log.warning("lease %s: cannot create epoch %d: %s", self.directory, n, exc)
            return
        with self._lock:
            self._seen = None  # look again from scratch next tick (won: lead; lost: watch the winner)
            if created and self.clock() - started < self.ttl_s * FENCE:
                self.epoch, self._renewed_at, self._seq = n, started, 0
                self._top, self._top_holder = n, self.holder
        if created and self.epoch == n:
            _log.warning("lease %s: %s leads from epoch %d", self.directory, self.holder, n)
            self._renew(n)

    def _renew(self, n: int) -> None:
        started = self.clock()
        self._seq += 1
        try:
            write_json_file(self.storage, join_path(self.directory, beat_name(n)),
                            json.dumps({"holder": self.holder, "seq": self._seq}))
        except (OSError, StorageError) as exc:
            _log.warning("lease %s: cannot renew epoch %d: %s", self.directory, n, exc)
            return
        with self._lock:  # counts only if it finished while we still led (docs above: why)
            if self.epoch == n and self._fresh():
                self._renewed_at = started
            elif self.epoch == n:
                _log.warning("lease %s: the renewal of epoch %d took %.2fs, past %.2fs: it does not count",
                             self.directory, n, self.clock() - started, self.ttl_s * FENCE)

    def release(self) -> bool:
        """Hand the lease over at a clean stop: stop leading first, then create ``released-<n>`` for the epoch
        held (followers take the next one at once). Only once nothing of this sidecar writes any more (the
        board's thread is stopped first). Whether a release was written."""
        with self._lock:
            n = self.epoch if self._fresh() else None
            self.epoch, self._renewed_at, self._seen = None, None, None
        if n is None:
            return False
        record = {"holder": self.holder, "released_at": time.time()}
        try:
            self.storage.create_new(join_path(self.directory, released_name(n)), json.dumps(record).encode())
        except (OSError, StorageError) as exc:  # the followers take over after ttl_s, as after a crash
            _log.warning("lease %s: cannot release epoch %d: %s", self.directory, n, exc)
            return False
        _log.warning("lease %s: %s released epoch %d", self.directory, self.holder, n)
        return True

    def _clean(self, epochs: list[int], n: int) -> None:
        for old in (e for e in epochs if e < n - KEEP_EPOCHS):
            for name in (beat_name(old), epoch_name(old), released_name(old)):
                try:
                    self.storage.remove(join_path(self.directory, name))  # within the root, writable
                except FileNotFoundError:
                    pass
                except (OSError, StorageError) as exc:  # left for the next tick
                    _log.debug("lease %s: cannot delete %s: %s", self.directory, name, exc)

    # ---- reading -------------------------------------------------------------------------------

    def _listing(self) -> LeaseListing:
        """One listing: what counts (less the epochs found at the bound), each ignored name reported once."""
        listing = list_lease(self.storage, self.directory)
        if self._exhausted:
            listing.epochs = [e for e in listing.epochs if e not in self._exhausted]
        for name, why in listing.ignored.items():
            self._report(name, why)
        return listing

    def _report(self, name: str, why: str) -> None:
        with self._lock:
            if name in self._reported or len(self._reported) >= MAX_REPORTED:
                return
            self._reported.add(name)
        _log.warning("lease %s: ignoring %s: %s", self.directory, name, why)

    def _read(self, name: str) -> bytes | None:
        """A lease file's bytes; None when it is absent, or too large or not a file (reported once: a forged
        beat then never changes, and its epoch expires)."""
        try:
            return read_record(self.storage, join_path(self.directory, name))
        except FileNotFoundError:
            return None
        except StoredFormatError as exc:
            self._report(name, str(exc))
            return None

    def _holder_of(self, n: int) -> str | None:
        try:
            return read_epoch_record(self.storage, join_path(self.directory, epoch_name(n))).holder
        except FileNotFoundError:
            return None
        except StoredFormatError as exc:  # being written (local create-only is not atomic), or forged
            _log.debug("lease %s: epoch %d's holder unknown: %s", self.directory, n, exc)
            return None


class LeaseBoard:
    """The leases of every job a sidecar catalogs, kept by one daemon thread ticking every ``ttl_s / 4``."""

    def __init__(self, storage: Storage, ttl_s: float, *, jobs: Callable[[], Iterable[str]],
                 read_only: Callable[[str], bool] = lambda _job: False, holder: str | None = None) -> None:
        self.storage = storage
        self.ttl_s = ttl_s
        self.holder = holder or default_holder()
        self._jobs = jobs
        self._read_only = read_only
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-lease", daemon=True)

    def directory(self, job: str) -> str:
        return lease_directory(self.storage, job, read_only=self._read_only(job))

    def lease(self, job: str) -> Lease:
        with self._lock:
            found = self._leases.get(job)
            if found is None:
                found = self._leases[job] = Lease(self.storage, self.directory(job), self.holder, self.ttl_s)
            return found

    def leads(self, job: str) -> bool:
        """Whether this sidecar writes ``job``'s records now (False until its lease was taken)."""
        with self._lock:
            found = self._leases.get(job)
        return found is not None and found.leads()

    def confirms(self, job: str) -> bool:
        """Whether this sidecar leads ``job`` and storage lists no newer epoch (``Lease.confirmed``)."""
        with self._lock:
            found = self._leases.get(job)
        return found is not None and found.confirmed()

    def views(self) -> dict[str, LeaseView]:
        with self._lock:
            leases = dict(self._leases)
        return {job: lease.view() for job, lease in sorted(leases.items())}

    def tick(self) -> None:
        """One pass over every job: renew, watch or take over."""
        names = set(self._jobs())
        with self._lock:
            for gone in set(self._leases) - names:
                del self._leases[gone]
        for job in sorted(names):
            try:
                self.lease(job).tick()
            except (OSError, StorageError) as exc:  # storage trouble: a leader fences itself by time
                _log.warning("lease of %s: %s", job, exc)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop ticking; then (``release``) hand over every lease held, so that a follower leads at its next
        tick rather than after ``ttl_s`` (``Lease.release``). Called last at shutdown: after the drain."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if release and not self._thread.is_alive():  # a tick still running could take a term again
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                lease.release()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # never let the thread die: a leader that stops ticking fences itself by time
                _log.exception("lease tick failed")
            self._stop.wait(self.ttl_s / 4)


__all__ = ["FENCE", "LEASE_DIR", "MAX_EPOCH", "HeldLease", "Lease", "LeaseBoard", "LeaseView", "beat_name",
           "default_holder", "epoch_name", "held_lease", "lease_directory", "released_name"]
