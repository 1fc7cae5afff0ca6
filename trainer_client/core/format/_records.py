"""Where ckptd's own records of a step live: inside the step, or under the root's ``.ckptd/`` prefix.

ckptd keeps three small files per step (``files.py``): the manifest, the verified record and the quarantine
record. Normally they sit inside the step directory, beside Orbax's files. A job (or a whole root) watched
*read-only* is one whose step directories ckptd must not write into — a bucket it may not write, or
checkpoints another system owns (MaxText's, a colleague's): there ckptd writes them to the *side prefix*
instead, ``<root>/.ckptd/<job>/<step directory>/``, and writes nothing under ``<root>/<job>/``
(docs/protocol.md, "Read-only adoption").

Reading does not depend on the mode, so every reader agrees whatever the writer's mode was (the server in
either mode, ``ckptd`` commands, the client's storage fallback): a manifest or verified record is taken from
the side prefix when one is there (only a read-only ckptd puts one there, and it is that ckptd's latest
word on the step: adopted or sealed), else from the step; a quarantine record counts wherever it is.
A read-only job's elastic events go to ``<root>/.ckptd/.events/<job>/`` instead of ``<root>/<job>/.ckptd/events/``
(``.events`` is no job name, so they never mix with step records). Orbax never looks under ``.ckptd`` (not a
step name) and no job can be named ``.ckptd``. No jax here.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import (
    SIDE_DIR,  # <root>/.ckptd/<job>/<step directory>/: the side prefix
    SIDE_EVENTS_DIR,
)


def side_dir(step_path: str) -> str:
    """``<root>/.ckptd/<job>/<step directory>`` for the step at ``<root>/<job>/<step directory>``."""
    step_path = step_path.rstrip("/")
    job_path, name = posixpath.split(step_path)
    root, job = posixpath.split(job_path)
    return join_path(root, SIDE_DIR, job, name)


def side_job_dir(storage: Storage, job: str) -> str:
    """``<root>/.ckptd/<job>``: where a read-only job's step records are."""
    return storage.join(SIDE_DIR, job)


@dataclass(frozen=True)
class RecordPlace:
    """Where ckptd writes the records of one step: in the step (normal) or on the side (read-only)."""

    step_path: str
    read_only: bool = False

    def write_path(self, name: str) -> str:
        return join_path(side_dir(self.step_path) if self.read_only else self.step_path, name)


def record_paths(step_path: str, name: str) -> tuple[str, str]:
    """Where a reader looks for the record ``name`` of a step, in order: the side prefix, then the step."""
    return join_path(side_dir(step_path), name), join_path(step_path, name)


def read_record(storage: Storage, step_path: str, name: str) -> tuple[str, bytes] | None:
    """(path, bytes) of the step's record ``name``: the side copy when there is one, else the step's own;
    None when neither exists."""
    for path in record_paths(step_path, name):
        try:
            return path, storage.read_bytes(path)
        except FileNotFoundError:
            continue
    return None


def record_location(storage: Storage, step_path: str, name: str) -> str | None:
    """The path ``read_record`` would read ``name`` from, or None."""
    for path in record_paths(step_path, name):
        if storage.exists(path):
            return path
    return None


def side_records(storage: Storage, job: str) -> dict[str, set[str]]:
    """Step directory name -> the record files under ``<root>/.ckptd/<job>/<name>/``, one listing for the
    job (empty when the job has no side records: the usual case)."""
    base = side_job_dir(storage, job)
    out: dict[str, set[str]] = {}
    try:
        found = storage.fs.find(base, detail=False)
    except (FileNotFoundError, OSError):
        return out
    prefix = storage.fs._strip_protocol(base).rstrip("/") + "/"
    for path in found:
        rel = str(path)[len(prefix):] if str(path).startswith(prefix) else ""
        name, _, file = rel.partition("/")
        if name and file and "/" not in file:
            out.setdefault(name, set()).add(file)
    return out


__all__ = ["SIDE_DIR", "SIDE_EVENTS_DIR", "RecordPlace", "read_record", "record_location", "record_paths", "side_dir",
           "side_job_dir", "side_records"]
