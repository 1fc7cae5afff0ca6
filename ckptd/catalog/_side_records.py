"""Records on the side prefix that are about an earlier save of a step (docs/operations.md, "A step saved again
under its number").

In a job watched read-only ckptd keeps a step's records (manifest, verified and quarantine records) under
``<root>/.ckptd/<job>/<step>/`` (``trainer_client/core/format/_records.py``), where a new save of the step does not
reach: the tool that owns the job deletes the step and saves it again, and the records stay. Honoured, they would
judge the new save by what the old one held: a good save quarantined because its files are not those of the old
manifest, or kept quarantined by the old verdict, at every start.

Every save writes its own ``_CHECKPOINT_METADATA`` (Orbax records the save's times in it), so its CRC32C tells two
saves apart whatever the files' modification times say (a copy that keeps them, a ``touch``): the sealed manifest
keeps it, and so does each quarantine record ckptd writes (``metadata_crc32c``). Side records whose CRC32C is not
that of the step's file now are moved aside, kept, to ``<root>/.ckptd/<job>/<step>.ckptd-aside-<UTC time>``
(never deleted), and the step is judged afresh. Records that keep no CRC32C (a quarantine record of an older ckptd,
a manifest never sealed) are honoured as before.
"""

from __future__ import annotations

import logging
import posixpath

from trainer_client.core import Storage, StorageError, join_path, parse_quarantine, storage_errors
from trainer_client.core.format import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    QUARANTINE_FILE,
    aside_name,
    file_entry,
    parse_manifest,
    parse_step_name,
    side_dir,
)

_log = logging.getLogger(__name__)

METADATA_CRC = "metadata_crc32c"  # the quarantine record's key: the CRC32C of the step's _CHECKPOINT_METADATA


def metadata_crc(storage: Storage, step_path: str) -> str | None:
    """The CRC32C of the step's ``_CHECKPOINT_METADATA`` now (None: it cannot be read)."""
    try:
        return file_entry(storage, join_path(step_path, CHECKPOINT_METADATA)).crc32c
    except (StorageError, OSError, ValueError):
        return None


def _recorded_crc(storage: Storage, side: str) -> str | None:
    """The CRC32C of ``_CHECKPOINT_METADATA`` the step's side records were made for: the quarantine record's when
    there is one (None when it keeps none), else the sealed manifest's; None when nothing says."""
    names = {entry.name for entry in storage.list_dir(side)}
    if QUARANTINE_FILE in names:
        crc = parse_quarantine(storage.read_bytes(join_path(side, QUARANTINE_FILE))).get(METADATA_CRC)
        return crc if isinstance(crc, str) else None
    if CKPTD_MANIFEST not in names:
        return None
    try:
        sealed = (parse_manifest(storage.read_bytes(join_path(side, CKPTD_MANIFEST))).sealed or {})
    except ValueError:
        return None
    entry = sealed.get(CHECKPOINT_METADATA)
    return entry.crc32c if entry is not None else None


def of_an_earlier_save(storage: Storage, step_path: str) -> bool:
    """Whether the step's records on the side prefix were made for an earlier save under its name."""
    recorded = _recorded_crc(storage, side_dir(step_path))
    if recorded is None:
        return False
    now = metadata_crc(storage, step_path)
    return now is not None and now != recorded


def move_side_records_aside(storage: Storage, step_path: str) -> str:
    """Move the step's side records to ``<step>.ckptd-aside-<UTC time>`` beside them (on an object store: copied,
    then the originals deleted); the new place."""
    side = side_dir(step_path).rstrip("/")
    job_side, name = posixpath.split(side)
    parsed = parse_step_name(name)
    step = parsed.step if parsed is not None else 0
    storage.invalidate(job_side)
    target = join_path(job_side, aside_name(step, {e.name for e in storage.list_dir(job_side)}))
    with storage_errors(f"cannot move the records of {storage.url_of(side)} aside"):
        if not storage.is_remote:
            storage.rename(side, target)
        else:
            storage.writable(target)
            for path in storage.fs.find(side):
                storage.fs.copy(path, join_path(target, str(path)[len(side) + 1:]))
            storage.remove(side, recursive=True)
    _log.warning("the records of %s were made for an earlier save of step %s (its _CHECKPOINT_METADATA differs): "
                 "moved aside to %s, kept; the step is judged afresh", storage.url_of(step_path), step,
                 storage.url_of(target))
    return target


__all__ = ["METADATA_CRC", "metadata_crc", "move_side_records_aside", "of_an_earlier_save"]
