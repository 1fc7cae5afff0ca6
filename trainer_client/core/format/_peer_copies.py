"""Where a host keeps the copies of other hosts' snapshot parts, and where a part brought back from a peer says so
(docs/multihost.md, "Peer copies").

Both sides read these names: ckptd's data channel (``ckptd/peers``) writes the copies and brings a part back, the
trainer's resume agreement (``trainer_client/runtime/multihost/_multihost.py``) offers the copies its host holds
and reports where a part came from. Everything lives under the job's directory of the host's shared memory,
under the memory tier's rules (``_private_files``: owned by the one user, 0700/0600, no links):

```
<shm>/<job>/<step>/                       this host's own part (the memory tier's snapshot)
<shm>/<job>/.peer-<k>/<step>/             a copy of host k's part of <step> (data.bin, snapshot.json)
<shm>/<job>/<step>/from_peer.json         in a part brought back from a peer: {"host": <the peer>}
```

A name starting with a dot is never a step: the memory tier and ckptd's keeper list digits only. The trainer
asks for its part back over ckptd's API (``POST /v1/jobs/{job}/peer-fetch``), never through these files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import ValidationError

from trainer_client.core._errors import UnsafePathError
from trainer_client.core.format._private_files import check_private_dir, is_real_dir, read_private
from trainer_client.core.format._snapshot import SnapshotMeta, problems, read_meta
from trainer_client.core.format._snapshot_dirs import check_job_dir
from trainer_client.core.protocol import MAX_HOSTS

COPY_PREFIX = ".peer-"
_COPY_DIR = re.compile(r"^\.peer-([0-9]{1,6})$")
_STEP = re.compile(r"^[0-9]{1,19}$")
MAX_RECORD_BYTES = 4096  # a from_peer.json
FROM_PEER_FILE = "from_peer.json"


def brought_from(part: str | Path) -> int | None:
    """The host a part was brought back from (its ``from_peer.json``), or None for a part written here."""
    try:
        body = json.loads(read_private(Path(part) / FROM_PEER_FILE, max_bytes=MAX_RECORD_BYTES))
        host = body["host"]
    except (OSError, ValueError, KeyError, TypeError, UnsafePathError):
        return None
    # a host index as written (an integer); not int() of whatever is there: int(1e400) is an OverflowError
    return host if isinstance(host, int) and not isinstance(host, bool) and 0 <= host < MAX_HOSTS else None


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


__all__ = ["COPY_PREFIX", "FROM_PEER_FILE", "brought_from", "copies_dir", "held_copies"]
