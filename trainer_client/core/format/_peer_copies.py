"""Where a host keeps the copies of other hosts' snapshot parts, and how a trainer asks its sidecar for its own part
back from a peer (docs/multihost.md, "Peer copies").

Both sides read these names: ckptd's data channel (``ckptd/peers``) writes the copies and answers the requests,
the trainer's resume agreement (``trainer_client/runtime/multihost/_multihost.py``) offers the copies its host holds and
asks for its part when its memory was wiped. Everything lives under the job's directory of the host's shared
memory, under the memory tier's rules (``_private_files``: owned by the one user, 0700/0600, no links):

```
<shm>/<job>/<step>/                       this host's own part (the memory tier's snapshot)
<shm>/<job>/.peer-<k>/<step>/             a copy of host k's part of <step> (data.bin, snapshot.json)
<shm>/<job>/.peer-fetch-<step>.json       the trainer asks: bring my part of <step> back from host <source>
<shm>/<job>/.peer-fetch-<step>.done.json  the sidecar answers: {"ok": true} (the part is now <shm>/<job>/<step>/)
<shm>/<job>/<step>/from_peer.json         in a part brought back from a peer: {"host": <the peer>}
```

A name starting with a dot is never a step: the memory tier and ckptd's keeper list digits only.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer_client.core._errors import UnsafePathError
from trainer_client.core.format._private_files import (
    check_private_dir,
    ensure_private_dir,
    is_real_dir,
    read_private,
    write_private,
)
from trainer_client.core.format._snapshot import SnapshotMeta, problems, read_meta
from trainer_client.core.format._snapshot_dirs import check_job_dir

COPY_PREFIX = ".peer-"
FETCH_PREFIX = ".peer-fetch-"
_COPY_DIR = re.compile(r"^\.peer-([0-9]{1,6})$")
_STEP = re.compile(r"^[0-9]{1,19}$")
_FETCH = re.compile(r"^\.peer-fetch-([0-9]{1,19})\.json$")
MAX_REQUEST_BYTES = 4096
FROM_PEER_FILE = "from_peer.json"


def brought_from(part: str | Path) -> int | None:
    """The host a part was brought back from (its ``from_peer.json``), or None for a part written here."""
    try:
        body = json.loads(read_private(Path(part) / FROM_PEER_FILE, max_bytes=MAX_REQUEST_BYTES))
        return int(body["host"])
    except (OSError, ValueError, KeyError, TypeError, UnsafePathError):
        return None


def copies_dir(shm_dir: str | Path, job: str, origin: int) -> Path:
    """Where this host keeps its copies of host ``origin``'s parts of ``job``."""
    return Path(shm_dir) / job / f"{COPY_PREFIX}{origin}"


def held_copies(shm_dir: str | None, job: str) -> list[tuple[int, Path, SnapshotMeta]]:
    """``(origin, path, meta)`` of every intact copy this host holds of another host's part of ``job``
    (``problems() == []``, the part of the host its directory names), newest step first. Shard checksums are
    checked when a copy is received and again when it is restored."""
    if shm_dir is None:
        return []
    try:
        base = check_job_dir(shm_dir, job)
    except UnsafePathError:
        return []
    if base is None:
        return []
    out = []
    for entry in base.iterdir():
        named = _COPY_DIR.match(entry.name)
        if named is None or not is_real_dir(entry):
            continue
        try:
            check_private_dir(entry)
        except (OSError, UnsafePathError):
            continue
        for step_dir in entry.iterdir():
            if not _STEP.match(step_dir.name) or not is_real_dir(step_dir) or problems(step_dir):
                continue
            try:
                meta = read_meta(step_dir)
            except (OSError, ValueError, ValidationError):
                continue
            if meta.process_index == int(named.group(1)) and meta.is_part:
                out.append((meta.process_index, step_dir, meta))
    return sorted(out, key=lambda c: -c[2].step)


def _request_path(shm_dir: str | Path, job: str, step: int) -> Path:
    return Path(shm_dir) / job / f"{FETCH_PREFIX}{step}.json"


def _answer_path(shm_dir: str | Path, job: str, step: int) -> Path:
    return Path(shm_dir) / job / f"{FETCH_PREFIX}{step}.done.json"


def request_fetch(shm_dir: str | Path, job: str, step: int, *, source: int, origin: int, count: int,
                  save_id: str | None) -> None:
    """The trainer of host ``origin`` asks its sidecar to bring its part of ``step`` back from host ``source``."""
    ensure_private_dir(Path(shm_dir) / job)
    _answer_path(shm_dir, job, step).unlink(missing_ok=True)
    write_private(_request_path(shm_dir, job, step), json.dumps(
        {"step": step, "source": source, "origin": origin, "count": count, "save_id": save_id}).encode())


def pending_fetches(shm_dir: str | Path, job: str) -> list[dict[str, Any]]:
    """The requests of ``job``'s trainer not answered yet (read by the sidecar: each a dict with ``step``,
    ``source``, ``origin``, ``count``, ``save_id``; a malformed one is answered as failed and dropped)."""
    base = Path(shm_dir) / job
    out = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    for entry in entries:
        named = _FETCH.match(entry.name)
        if named is None:
            continue
        step = int(named.group(1))
        try:
            body = json.loads(read_private(entry, max_bytes=MAX_REQUEST_BYTES))
            request = {"step": step, "source": int(body["source"]), "origin": int(body["origin"]),
                       "count": int(body["count"]),
                       "save_id": None if body.get("save_id") is None else str(body["save_id"])}
        except (OSError, ValueError, KeyError, TypeError, UnsafePathError) as exc:
            answer_fetch(shm_dir, job, step, ok=False, error=f"unreadable request: {exc}")
            continue
        out.append(request)
    return out


def answer_fetch(shm_dir: str | Path, job: str, step: int, *, ok: bool, error: str = "") -> None:
    """The sidecar's answer to the request for ``step`` (the request is removed)."""
    write_private(_answer_path(shm_dir, job, step), json.dumps({"ok": ok, "error": error[:2000]}).encode())
    _request_path(shm_dir, job, step).unlink(missing_ok=True)


def wait_fetch(shm_dir: str | Path, job: str, step: int, timeout_s: float) -> str | None:
    """Wait for the sidecar's answer: None when the part was brought back, else why not (its error, or no
    answer within ``timeout_s``: the request is withdrawn)."""
    deadline = time.monotonic() + timeout_s
    answer = _answer_path(shm_dir, job, step)
    while time.monotonic() < deadline:
        try:
            body = json.loads(read_private(answer, max_bytes=MAX_REQUEST_BYTES))
        except FileNotFoundError:
            time.sleep(0.02)
            continue
        except (OSError, ValueError, UnsafePathError) as exc:
            return f"unreadable answer: {exc}"
        answer.unlink(missing_ok=True)
        return None if body.get("ok") is True else str(body.get("error") or "failed")
    _request_path(shm_dir, job, step).unlink(missing_ok=True)
    return f"no answer from this host's ckptd within {timeout_s:.0f} s (is its peer channel on?)"


__all__ = ["COPY_PREFIX", "FETCH_PREFIX", "FROM_PEER_FILE", "answer_fetch", "brought_from", "copies_dir",
           "held_copies", "pending_fetches", "request_fetch", "wait_fetch"]
