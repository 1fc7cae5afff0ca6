"""The fate of one multi-host save, decided once by a create-only record (docs/multihost.md, section 5, "Fenced
writers"): committed, or retired (cleaned as abandoned, or taken over by a restarted incarnation's save).

A leader paused (SIGSTOP, a stalled host, a partition) inside a cleanup, while a newer leader took the job over
and committed, must not delete what that one committed; a commit must not seal a save a cleanup or a takeover is
deleting. On a local root the job's flock already excludes them (``ckptd/catalog/_job_lock.py``); on ``gs://``
no lock spans processes and no write of one object can be made conditional on another (the lease's epoch
object): a generation precondition guards only the object written. So the decision itself is one object, made
with the one precondition every sidecar already relies on, create-only (``Storage.create_new``:
``ifGenerationMatch=0`` on GCS, ``O_EXCL`` locally):

```
<job>/.ckptd/claims/<step>.takeover-<save>   {"fate": "commit" | "retire", "by", "at"}: create-only
```

Whoever creates it first decides; the other side reads it and stands down: a commit never writes the marker of
a retired save, a cleanup or a takeover never deletes a save whose commit was decided. The name is the one a
takeover has always created (``take_over_claim``), so a taker of the previous release, whose record holds the
new save's claim, decides ``retire`` too, and two releases side by side still exclude each other. A record that
is neither (damaged, forged) counts as ``retire`` for a commit and as undecided-by-us for a cleanup: the save
is neither committed nor deleted (kept for inspection).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Literal

from trainer_client.core._errors import StorageError, UnsafePathError
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import CLAIMS_DIR

Fate = Literal["commit", "retire"]
MAX_FATE_BYTES = 4096  # a fate record is ~100 bytes


def fate_path(storage: Storage, job: str, step: int, save_id: str) -> str:
    return join_path(storage.join(job, CLAIMS_DIR), f"{step}.takeover-{save_id}")


@dataclass(frozen=True)
class FateRecord:
    """A decided fate, who decided it (a leader's holder, or the save that took over) and when (their clock)."""

    fate: Fate
    by: str
    at: float


def read_fate_record(storage: Storage, job: str, step: int, save_id: str) -> FateRecord | Literal["unreadable"] | None:
    """The fate record of ``save_id``: None when none was made. A takeover's record of the previous release (the
    new save's claim) is ``retire`` by that save at its claim's time; a record that cannot be read as either (or
    whose ``by`` or ``at`` is not a string and a finite number) is ``unreadable``."""
    try:
        raw = storage.read_bytes(fate_path(storage, job, step, save_id), max_bytes=MAX_FATE_BYTES)
    except FileNotFoundError:
        return None
    except (StorageError, UnsafePathError, ValueError):
        return "unreadable"
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:
        return "unreadable"
    if not isinstance(record, dict):
        return "unreadable"
    fate: Fate = "commit" if record.get("fate") == "commit" else "retire"
    by, at = record.get("by"), record.get("at")
    if record.get("fate") not in ("commit", "retire"):
        if "fate" in record or not isinstance(record.get("save_id"), str) or record["save_id"] == save_id:
            return "unreadable"
        by, at = record["save_id"], record.get("created_at")  # the previous release's takeover: its new claim
    if not isinstance(by, str) or isinstance(at, bool) or not isinstance(at, int | float):
        return "unreadable"
    try:
        when = float(at)
    except OverflowError:  # an integer no float holds (JSON allows any number of digits)
        return "unreadable"
    return FateRecord(fate, by, when) if math.isfinite(when) else "unreadable"


def read_fate(storage: Storage, job: str, step: int, save_id: str) -> Fate | Literal["unreadable"] | None:
    """The fate decided for ``save_id``: None when none was (no record). A takeover's record of the previous
    release (the new save's claim) is ``retire``; a record that cannot be read as either is ``unreadable``."""
    record = read_fate_record(storage, job, step, save_id)
    return record.fate if isinstance(record, FateRecord) else record


def fate_record(fate: Fate, by: str) -> bytes:
    """A fate record's bytes: the fate, who decided it (a leader's holder, or the save that took over), when."""
    return json.dumps({"fate": fate, "by": by[:256], "at": time.time()}).encode()


def decide_fate(storage: Storage, job: str, step: int, save_id: str, fate: Fate, by: str, *,
                redo_after_s: float = 0.0) -> bool:
    """Decide ``fate`` for ``save_id`` unless it was decided otherwise: True when this call decided it, or it had
    been decided the same way before, by ``by`` or longer than ``redo_after_s`` ago (a leader that died half-way
    through a commit or a cleanup is redone by the next; a cleanup of a save a taker retired and left, dead, goes
    on); False when the other way, by another party more recently (it may be paused half-way, and would write or
    delete in place after the redo: wait), or the record is unreadable: stand down. A takeover is decided by the
    creation alone (``take_over_claim``: one taker)."""
    if storage.create_new(fate_path(storage, job, step, save_id), fate_record(fate, by)):
        return True
    storage.invalidate(storage.join(job, CLAIMS_DIR))
    record = read_fate_record(storage, job, step, save_id)
    return isinstance(record, FateRecord) and record.fate == fate and (
        record.by == by[:256] or time.time() - record.at >= redo_after_s)


__all__ = ["Fate", "FateRecord", "decide_fate", "fate_path", "fate_record", "read_fate", "read_fate_record"]
