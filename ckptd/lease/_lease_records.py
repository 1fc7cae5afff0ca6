"""The leadership lease's files on storage, read as hostile input: names, bounds, records (docs/multihost.md, §7).

``ckptd/lease/_lease.py`` runs the lease; this module says what its files are called and which of them count.
Anyone who can write the root can plant files in a job's ``.ckptd/leader/`` directory, so every name and
record read there is checked before it is believed (docs/operations.md, "Several sidecars on one root"):

* an epoch counts only when its name is ``epoch-<n>.json`` with exactly 20 digits and ``n`` is at most
  ``MAX_EPOCH`` (10^12: a takeover a second would take 31,700 years to get there). Any other ``epoch-*`` or
  ``released-*`` name is ignored and reported once: a forged ``epoch-99999999999999999999.json`` once made
  the next takeover create a 21-digit name no listing finds, and the job never had a leader again;
* a record is read only up to ``MAX_LEASE_RECORD_BYTES`` (its size is checked before a byte is read);
* an epoch record (``EpochRecord``) has a holder of at most ``MAX_HOLDER_CHARS`` characters, a finite
  ``ttl_s`` in (0, ``MAX_LEASE_TTL_S``] and a finite ``created_at``; one that is not is treated as invalid:
  its holder is unknown to the sidecars (its beat still decides when it expires), and ``ckptd gc`` /
  ``ckptd validate`` ignore it with a one-line notice instead of a traceback or a refusal that never ends.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_client.core import Entry, Storage, StorageError, StoredFormatError, join_path
from trainer_client.core.format import LEASE_DIR, SIDE_DIR, side_job_dir

MAX_EPOCH = 10**12  # the highest epoch ckptd writes or believes (the names keep 20 digits)
MAX_LEASE_RECORD_BYTES = 4096  # an epoch, beat or release record is ~100 bytes
MAX_LEASE_TTL_S = 86400.0  # the longest lease time a record may state (CKPTD_LEASE_TTL_S has the same bound)
MAX_HOLDER_CHARS = 256
_EPOCH = re.compile(r"epoch-(\d{20})\.json")
_RELEASED = re.compile(r"released-(\d{20})\.json")
_NUMBERED = ("epoch-", "released-")  # the names a number is read from: the others are not looked at


def default_holder() -> str:
    """This process, as the lease names it: ``<host>/<pid>/<random>`` (unique per start)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def epoch_name(n: int) -> str:
    return f"epoch-{n:020d}.json"


def beat_name(n: int) -> str:
    return f"beat-{n:020d}.json"


def released_name(n: int) -> str:
    return f"released-{n:020d}.json"


def lease_directory(storage: Storage, job: str, *, read_only: bool = False) -> str:
    """Where ``job``'s lease lives: in the job (``<job>/.ckptd/leader``), on the side when it is read-only."""
    if read_only:
        return join_path(side_job_dir(storage, job), LEASE_DIR)
    return storage.join(job, SIDE_DIR, LEASE_DIR)


class EpochRecord(BaseModel):
    """``epoch-<n>.json``: who took the term, with which lease time, when (their own wall clock)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    holder: str = Field(min_length=1, max_length=MAX_HOLDER_CHARS, strict=True)
    ttl_s: float = Field(gt=0, le=MAX_LEASE_TTL_S, strict=True)
    created_at: float = Field(ge=0, strict=True)


def read_record(storage: Storage, path: str) -> bytes:
    """A lease file's bytes, at most ``MAX_LEASE_RECORD_BYTES`` (``RecordTooLargeError`` past them, unread)."""
    return storage.read_bytes(path, max_bytes=MAX_LEASE_RECORD_BYTES)


def parse_epoch_record(raw: bytes, path: str) -> EpochRecord:
    """The epoch record in ``raw``; ``StoredFormatError`` naming the first field that is wrong (one line)."""
    try:
        return EpochRecord.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the record"
        raise StoredFormatError(f"{path}: {where}: {first['msg']}") from None


def read_epoch_record(storage: Storage, path: str) -> EpochRecord:
    """``parse_epoch_record`` of the file at ``path``: ``FileNotFoundError``, ``StoredFormatError``."""
    return parse_epoch_record(read_record(storage, path), path)


@dataclass
class LeaseListing:
    """One listing of a lease directory: the epochs and releases that count, every entry by name (files and
    directories: no takeover tries to create one of these names) and the names ignored, with why."""

    epochs: list[int] = field(default_factory=list)  # sorted
    released: set[int] = field(default_factory=set)
    entries: dict[str, Entry] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)

    def file(self, name: str) -> Entry | None:
        entry = self.entries.get(name)
        return entry if entry is not None and not entry.is_dir else None

    def successor(self, top: int | None) -> int | None:
        """The epoch a takeover after ``top`` creates: the next number whose name is free (a directory or an
        ignored file may hold one), or None when that would pass ``MAX_EPOCH``."""
        n = 0 if top is None else top + 1
        while epoch_name(n) in self.entries:
            n += 1
        return n if n <= MAX_EPOCH else None


def _number(name: str, pattern: re.Pattern[str]) -> int | None:
    found = pattern.fullmatch(name)
    if found is None:
        return None
    n = int(found.group(1))
    return n if n <= MAX_EPOCH else None


def list_lease(storage: Storage, directory: str) -> LeaseListing:
    """The lease directory as one listing finds it; an absent directory lists empty. ``StorageError`` as
    ``Storage.list_dir`` raises it."""
    listing = LeaseListing()
    for entry in storage.list_dir(directory):
        listing.entries[entry.name] = entry
        if not entry.name.startswith(_NUMBERED):
            continue
        pattern = _EPOCH if entry.name.startswith("epoch-") else _RELEASED
        n = None if entry.is_dir else _number(entry.name, pattern)
        if n is None:
            listing.ignored[entry.name] = ("a directory" if entry.is_dir else
                                           f"not a lease name (20 digits, at most {MAX_EPOCH})")
        elif pattern is _EPOCH:
            listing.epochs.append(n)
        else:
            listing.released.add(n)
    listing.epochs.sort()
    return listing


@dataclass(frozen=True)
class HeldLease:
    """A job's lease as one look at storage finds it held: by ``holder``, in ``epoch``, beaten ``age_s`` ago."""

    holder: str
    epoch: int
    age_s: float
    ttl_s: float


def held_lease(storage: Storage, directory: str, now: float | None = None) -> HeldLease | None:
    """The lease in ``directory`` when one look finds it held (for tools that run once, e.g. ``ckptd gc``): the
    newest epoch, not released, whose beat (or epoch file) was written less than its ``ttl_s`` ago by the
    storage's modification time against this machine's wall clock (a sidecar watching keeps its own clock
    instead: ``Lease.tick``). None when there is no lease, it was released, or it expired.
    ``StoredFormatError`` (one line) when the newest epoch's record is invalid or its beat is dated further in
    the future than its lease time: such a lease cannot be judged, and it never expires by these rules."""
    try:
        listing = list_lease(storage, directory)
        if not listing.epochs or listing.epochs[-1] in listing.released:
            return None
        top = listing.epochs[-1]
        record = read_epoch_record(storage, join_path(directory, epoch_name(top)))
    except (FileNotFoundError, StorageError):
        return None
    beat = listing.file(beat_name(top)) or listing.file(epoch_name(top))
    if beat is None or beat.mtime is None:
        return None
    age_s = (time.time() if now is None else now) - beat.mtime
    if age_s < -record.ttl_s:
        raise StoredFormatError(f"{storage.url_of(beat.path)}: written {-age_s:.0f}s in the future by this "
                                f"machine's clock, past the lease time of {record.ttl_s:g}s")
    if age_s >= record.ttl_s:
        return None
    return HeldLease(record.holder, top, max(age_s, 0.0), record.ttl_s)


__all__ = ["LEASE_DIR", "MAX_EPOCH", "MAX_HOLDER_CHARS", "MAX_LEASE_RECORD_BYTES", "MAX_LEASE_TTL_S", "EpochRecord",
           "HeldLease", "LeaseListing", "beat_name", "default_holder", "epoch_name", "held_lease", "lease_directory",
           "list_lease", "parse_epoch_record", "read_epoch_record", "read_record", "released_name"]
