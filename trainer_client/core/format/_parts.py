"""The files of a step persisted from host parts (docs/multihost.md, section 5), jax-free: read by ckptd (the
part writers' claims and records, the leader's commit) and by the client's storage-scan fallback, which must
never take a step committed from parts unless every part's record is there.

```
<job>/.ckptd/claims/<step>.json              {"save_id", "process_count", "created_at"}: create-only
<job>/.ckptd/claims/<step>.takeover-<save>   that save's fate: committed or retired (format/_fates.py)
<job>/.ckptd/staging/<step>.<save_id>/       a local root's step until the leader commits it (renamed)
<step>/ckptd_parts/process_<k>.json          host k's part record (PartInfo), create-only, once durable
```

Whoever can write the root can plant these, so every field is bounded (process counts, times, sizes) and every
name patterned (the item, each file's path): a record past a bound is reported once and skipped, never acted
on, never deleted; the records of a save are listed before any is read (docs/operations.md, "Security").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer_client.core._durability import sync_paths
from trainer_client.core._errors import StorageError, UnsafePathError
from trainer_client.core._said_once import SaidOnce
from trainer_client.core._storage import Storage, join_path
from trainer_client.core._whole_files import write_json_file
from trainer_client.core.format._fates import fate_path, fate_record
from trainer_client.core.format._files import (
    CLAIMS_DIR,
    COMMIT_MARKER,
    ITEM_NAME_PATTERN,
    PARTS_DIR,
    STAGING_DIR,
)
from trainer_client.core.format._snapshot import process_in_range
from trainer_client.core.format._step_files import Listed
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import TrainingMetadata

_log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 << 20
# Bounds of what a claim or a part record may say (docs/operations.md, "What each limit defends"); a record
# past one is forged or damaged: reported once, skipped, never acted on and never deleted.
MAX_PROCESSES = 65536  # processes of one save
MAX_AHEAD_S = 86400.0  # how far past this host's clock a record's time may be (clocks differ; not by a day)
MAX_FILE_BYTES = 1 << 50  # one file of a part
MAX_PART_FILES = 1 << 20  # files of one part
SAVE_ID_PATTERN = r"^[0-9a-f]{1,32}-[0-9]{1,19}$"
_CLAIM_NAME = re.compile(r"^([0-9]{1,19})\.json$")
_RECORD_NAME = re.compile(r"^process_(0|[1-9][0-9]{0,4})\.json$")
_STAGED_NAME = re.compile(r"^([0-9]{1,19})\.([0-9a-f]{1,32}-[0-9]{1,19})$")


def _not_ahead(when: float) -> float:
    if when > time.time() + MAX_AHEAD_S:
        raise ValueError(f"{when:.6g} is more than {MAX_AHEAD_S:.0f}s ahead of this host's clock")
    return when


def _relative(path: str) -> str:
    try:
        join_path("", path)  # refuses an empty, "." or ".." segment, or an absolute path
    except UnsafePathError as exc:
        raise ValueError(str(exc)) from None
    return path


Timestamp = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_not_ahead)]
RelativePath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[A-Za-z0-9_./-]+$"),
                         AfterValidator(_relative)]


class PartFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: RelativePath
    size: int = Field(ge=0, le=MAX_FILE_BYTES)
    crc32c: str = Field(pattern=r"^[A-Za-z0-9+/]{6}==$", description="base64 of the big-endian CRC32C")


class PartInfo(BaseModel):
    """One host's part record: what it wrote (files with checksums, the regions it wrote) and, for the
    leader's commit, what the step's metadata is made of (the training metadata, the tree, write shapes)."""

    model_config = ConfigDict(extra="forbid")
    save_id: str = Field(pattern=SAVE_ID_PATTERN)
    process_index: int = Field(ge=0, lt=MAX_PROCESSES)
    process_count: int = Field(ge=2, le=MAX_PROCESSES)
    sidecar: str = Field(default="", max_length=256)
    item: str = Field(pattern=ITEM_NAME_PATTERN)
    has_iter: bool
    training: TrainingMetadata
    tree: list[TreeEntry]
    files: list[PartFile] = Field(max_length=MAX_PART_FILES)
    arrays: dict[str, list[list[list[int]]]] = Field(description="per array, the regions this part wrote")
    write_shapes: dict[str, list[Annotated[int, Field(ge=0)]]]
    written_at: Timestamp

    _index_in_range = model_validator(mode="after")(process_in_range)


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    save_id: str = Field(pattern=SAVE_ID_PATTERN)
    process_count: int = Field(ge=2, le=MAX_PROCESSES)
    created_at: Timestamp


_reported = SaidOnce()  # record path -> why it was refused, as last logged (bounded)


def report_refused(path: str, why: str) -> None:
    """Log once per path and reason that a claim, a part record or a save was refused (forged or damaged)."""
    if not _reported.first(path, why):
        return
    _log.warning("ignoring %s, forged or damaged: %s (docs/multihost.md, section 5)", path, why)


def _read_record(storage: Storage, path: str, model: type[Claim] | type[PartInfo]) -> Claim | PartInfo | None:
    """The record at ``path`` as ``model``; None when it is missing, unreadable or out of bounds (reported)."""
    try:
        return model.model_validate_json(storage.read_bytes(path, max_bytes=MAX_RECORD_BYTES))
    except (FileNotFoundError, StorageError, UnsafePathError):
        return None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        report_refused(path, f"{exc.error_count()} invalid field(s), first {where or 'the record'}: {first['msg']}")
    except ValueError as exc:
        report_refused(path, str(exc).splitlines()[0][:200])
    return None


def claim_path(storage: Storage, job: str, step: int) -> str:
    return storage.join(job, CLAIMS_DIR, f"{step}.json")


def step_path_for(storage: Storage, job: str, step: int, save_id: str) -> str:
    """Where the parts of one save of ``step`` are written: staged on a local root, in place on ``gs://``."""
    if storage.is_remote:
        return storage.join(job, str(step))
    return storage.join(job, STAGING_DIR, f"{step}.{save_id}")


def record_path(step_path: str, process_index: int) -> str:
    return join_path(step_path, PARTS_DIR, f"process_{process_index}.json")


def read_claim(storage: Storage, job: str, step: int) -> Claim | None:
    """The claim of ``step``, or None when it is missing or unreadable (a forged one is reported)."""
    claim = _read_record(storage, claim_path(storage, job, step), Claim)
    return claim if isinstance(claim, Claim) else None


def claimed_steps(storage: Storage, job: str) -> list[int]:
    """The steps of ``job`` with a claim (``<step>.json``: 1 to 19 digits), by one listing; oldest first."""
    try:
        entries = storage.list_dir(storage.join(job, CLAIMS_DIR))
    except (FileNotFoundError, StorageError):
        return []
    return sorted(int(m.group(1)) for e in entries if not e.is_dir and (m := _CLAIM_NAME.match(e.name)))


def make_claim(storage: Storage, job: str, step: int, save_id: str, process_count: int) -> Claim | None:
    """Create the claim of ``step`` for ``save_id`` (create-only), or find it; the claim that stands."""
    payload = Claim(save_id=save_id, process_count=process_count, created_at=time.time())
    if storage.create_new(claim_path(storage, job, step), payload.model_dump_json().encode()):
        return payload
    return read_claim(storage, job, step)


def incarnation_of(save_id: str) -> str:
    """The job incarnation that made a save: its id's prefix (``<incarnation>-<step>``, docs/multihost.md, 4)."""
    return save_id.rsplit("-", 1)[0]


def take_over_claim(storage: Storage, job: str, step: int, stale: Claim, save_id: str, process_count: int) -> bool:
    """Replace the claim ``stale`` of ``step`` (a dead incarnation's, as the caller judged) by one for
    ``save_id``; True when this call replaced it. One taker per stale save among any number of processes and
    sidecars: creating ``<step>.takeover-<stale save>`` (create-only) decides, and retires the stale save for good
    (``format/_fates.py``: no leader commits it from then on). The winner replaces the claim only if it still
    reads ``stale``. On a local root by a rename over it (atomic: a reader sees the old claim or the new one).
    On ``gs://``, where a save's parts are written in place, it first deletes what the dead save left in
    ``<job>/<step>/`` (nothing there is committed: the caller checked, and the fate keeps any commit out), then
    writes the new claim: the new save's hosts write only once the claim names their save, so nothing of theirs
    is deleted and nothing of the dead save mixes with theirs. A taker that dies between the two leaves the
    stale claim to the save timeout (docs/multihost.md, section 5)."""
    claims = storage.join(job, CLAIMS_DIR)
    claim = Claim(save_id=save_id, process_count=process_count, created_at=time.time())
    if not storage.create_new(fate_path(storage, job, step, stale.save_id), fate_record("retire", save_id)):
        return False  # another process took it over (or tried and died), or a leader decided its fate first
    if read_claim(storage, job, step) != stale:
        return False  # cleaned as abandoned, or replaced, since the caller read it
    path = claim_path(storage, job, step)
    if storage.is_remote:
        where = step_path_for(storage, job, step, stale.save_id)
        storage.invalidate(where)
        if storage.exists(join_path(where, COMMIT_MARKER)):
            return False  # committed meanwhile by another writer (a direct Orbax save): nothing to take over
        if storage.exists(where):
            storage.remove(where, recursive=True)
        write_json_file(storage, path, claim.model_dump_json())
        storage.invalidate(storage.join(job))
        return True
    tmp = storage.writable(f"{path}.{save_id}.tmp")
    with open(tmp, "wb") as out:
        out.write(claim.model_dump_json().encode())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, storage.writable(path))
    sync_paths(claims)
    storage.invalidate(claims)
    return True


def staged_saves(storage: Storage, job: str) -> list[tuple[int, str]]:
    """The staged saves of ``job`` on a local root, ``(step, save id)`` by their names (``<step>.<save id>``),
    by one listing; anything else there is no staged save (and on ``gs://`` nothing is staged)."""
    if storage.is_remote:
        return []
    try:
        entries = storage.list_dir(storage.join(job, STAGING_DIR))
    except (FileNotFoundError, StorageError):
        return []
    return sorted((int(m.group(1)), m.group(2)) for e in entries if e.is_dir and (m := _STAGED_NAME.match(e.name)))


def read_part(storage: Storage, step_path: str, process_index: int) -> PartInfo | None:
    """A part record, or None when it is missing or unreadable (a forged one is reported)."""
    part = _read_record(storage, record_path(step_path, process_index), PartInfo)
    return part if isinstance(part, PartInfo) else None


def parts_of(storage: Storage, step_path: str, count: int) -> list[PartInfo | None]:
    return [read_part(storage, step_path, k) for k in range(count)]


class SaveParts:
    """What storage holds of the parts of one save: the records that are there, in process order; the processes
    whose record is absent; those whose record is there but unreadable, forged or of another save. ``stopped``:
    the process whose record was not read because the time a caller allowed was spent (``save_parts``'
    ``spent``; the records read before it are in the lists), None when every record asked for was read."""

    def __init__(self, found: list[PartInfo], absent: list[int], bad: list[int], stopped: int | None = None) -> None:
        self.found, self.absent, self.bad, self.stopped = found, absent, bad, stopped

    @property
    def whole(self) -> bool:
        """Every record asked for was read, and each is there and good."""
        return not self.absent and not self.bad and self.stopped is None


def listed_parts(storage: Storage, step_path: str) -> set[int]:
    """The processes whose record ``<step>/ckptd_parts/`` lists, by one listing (nothing read)."""
    try:
        entries = storage.list_dir(join_path(step_path, PARTS_DIR))
    except (FileNotFoundError, StorageError):
        return set()
    return {int(m.group(1)) for e in entries if not e.is_dir and (m := _RECORD_NAME.match(e.name))}


def save_parts(storage: Storage, step_path: str, save_id: str, count: int, *, first_gap: bool = False,
               start: int = 0, spent: Callable[[], bool] | None = None, readers: int = 1) -> SaveParts:
    """The part records of save ``save_id`` (``count`` processes) under ``step_path``, from process ``start``
    on (those below it were found good before: neither read nor in ``found``). The records are listed first,
    so a record that is not there costs no read (a claim of 65,536 processes with no part: one listing).
    ``first_gap``: stop at the first record absent or bad (all a commit needs to know). ``readers``: records
    read at once, in order (on GCS a read is a round trip of 20-30 ms: 1,024 records one after another would
    take 20-30 s; docs/gcs.md, "Many hosts on one bucket"). ``spent()`` is asked before each batch of reads but
    the first (each call gets somewhere); once it says so, the reading stops there (``stopped``: the records
    below it were read)."""
    listed = listed_parts(storage, step_path)
    out = SaveParts([], [], [])
    wanted = range(start, min(count, MAX_PROCESSES))
    pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="part-records") if readers > 1 else None
    try:
        i, reads = 0, 0
        while i < len(wanted):
            batch: list[int] = []  # the next listed records, up to the first absent one
            while i + len(batch) < len(wanted) and len(batch) < readers and wanted[i + len(batch)] in listed:
                batch.append(wanted[i + len(batch)])
            if not batch:
                out.absent.append(wanted[i])
                i += 1
            else:
                if spent is not None and reads and spent():
                    out.stopped = batch[0]
                    break
                reads += len(batch)
                read = functools.partial(read_part, storage, step_path)
                got = list(pool.map(read, batch)) if pool is not None and len(batch) > 1 else [read(batch[0])]
                for k, part in zip(batch, got, strict=True):
                    i += 1
                    if part is None or (part.save_id, part.process_index, part.process_count) != (save_id, k, count):
                        out.bad.append(k)
                        if first_gap:
                            break
                    else:
                        out.found.append(part)
            if first_gap and not out.whole:
                break
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return out


def spans(indexes: list[int], most: int = 8) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``: at most ``most`` spans, then how many more (a log line stays short)."""
    runs: list[list[int]] = []
    for k in indexes:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" and {len(runs) - most} more" if len(runs) > most else "")


def part_problems(storage: Storage, step_path: str) -> list[str]:
    """Why a step is not whole as a step committed from parts: empty for a step that was not (no
    ``ckptd_parts``) or whose every part record is there, of one save and one process count."""
    listing = join_path(step_path, PARTS_DIR)
    try:
        if not storage.is_dir(listing):
            return []
    except StorageError as exc:
        return [f"{PARTS_DIR}: {exc}"]
    first = read_part(storage, step_path, 0)
    if first is None:
        return [f"{PARTS_DIR}/process_0.json is missing or unreadable"]
    held = save_parts(storage, step_path, first.save_id, first.process_count)
    out = []
    if held.absent:
        out.append(f"{PARTS_DIR}: the records of processes {spans(held.absent)} of {first.process_count} are missing")
    if held.bad:
        out.append(f"{PARTS_DIR}: the records of processes {spans(held.bad)} are unreadable or of another save")
    return out


def changed_files(parts: list[PartInfo], on_storage: dict[str, Listed]) -> list[str]:
    """The files the ``parts`` recorded whose listing (``gs://``: with the object's CRC32C) shows other bytes: a
    file written over in place since its part's record (docs/multihost.md, section 5, "Fenced writers")."""
    return sorted(f.path for part in parts for f in part.files if (listed := on_storage.get(f.path)) is not None
                  and listed.crc32c is not None and (listed.size, listed.crc32c) != (f.size, f.crc32c))


def record_bytes(info: PartInfo) -> bytes:
    return json.dumps(info.model_dump(mode="json"), sort_keys=True).encode()


__all__ = [
    "CLAIMS_DIR",
    "MAX_PROCESSES",
    "PARTS_DIR",
    "STAGING_DIR",
    "Claim",
    "PartFile",
    "PartInfo",
    "SaveParts",
    "changed_files",
    "claim_path",
    "claimed_steps",
    "incarnation_of",
    "listed_parts",
    "make_claim",
    "part_problems",
    "parts_of",
    "read_claim",
    "read_part",
    "record_bytes",
    "record_path",
    "report_refused",
    "save_parts",
    "spans",
    "staged_saves",
    "step_path_for",
    "take_over_claim",
]
