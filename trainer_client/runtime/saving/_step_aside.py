"""Before ``trainer_client.CheckpointManager`` saves a step, what holds that number and is not good is moved aside,
never replaced (docs/adopt.md, "A save over a bad step").

Orbax saves a step over whatever holds its number: a quarantined step (with ckptd's quarantine record, the
evidence of what went wrong) or a save cut short would be replaced with no word. ``clear_for_save`` looks at the
two names a save of step N takes (``N``, and ``N.orbax-checkpoint-tmp`` of Orbax's atomic rename):

- a good step is left alone (Orbax refuses to save over it: ``StepAlreadyExistsError``);
- a committed step that is not good (quarantined, corrupt) and an uncommitted one last written longer ago than
  the save timeout (abandoned) are moved to ``<N>.ckptd-aside-<UTC time>`` (``core.format._aside``), with the
  records a read-only ckptd keeps for them on the side prefix, and a WARNING says where;
- an uncommitted step written within the save timeout may still be being written by another writer (another
  process, a ckptd persisting it from host memory): the save is refused with Orbax's own
  ``StepAlreadyExistsError`` (what a loop already handles), saying why; nothing is moved.

Only a writer moves: process 0 (the others check and refuse alike, and Orbax's primary host, process 0, is the
only one that writes the step's directory), and never on a read-only manager. A local move is one
``os.rename``. gs:// has no rename: the step is copied, every object of the copy checked against the source's
(name and size), and only then the source deleted, its commit marker first (a deletion cut short leaves an
uncommitted remainder, never a committed step missing files); a failure raises before Orbax writes anything.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from trainer_client.core._storage import Entry, Storage, StorageError, join_path, mtime_of, storage_errors
from trainer_client.core._validation import read_quarantine
from trainer_client.core.format._aside import aside_name
from trainer_client.core.format._files import COMMIT_MARKER, TMP_DIR_SUFFIX
from trainer_client.core.format._records import side_dir
from trainer_client.core.format._steps import inspect_step
from trainer_client.core.protocol import StepState

_log = logging.getLogger(__name__)

_UNCOMMITTED = (StepState.WRITING, StepState.ABANDONED)


def newest_write(storage: Storage, path: str) -> float | None:
    """When anything under ``path`` was last written (the directory itself included on a local disk)."""
    if not storage.is_remote:
        times = []
        for folder, _, files in os.walk(path):
            for name in (folder, *(os.path.join(folder, f) for f in files)):
                try:
                    times.append(os.lstat(name).st_mtime)
                except OSError:
                    continue
        return max(times, default=None)
    with storage_errors(f"cannot list {storage.url_of(path)}"):
        infos = storage.fs.find(path, detail=True)
    found = [t for t in (mtime_of(info) for info in infos.values()) if t is not None]
    return max(found, default=None)


def clear_for_save(storage: Storage, job: str, step: int, *, good: Callable[[], Sequence[int]],
                   save_timeout_s: float, mover: bool, now: float | None = None) -> list[str]:
    """Move aside what holds ``step``'s names in ``job`` and is not good (``mover``: this process moves; the
    others only refuse alike); returns the moved-aside names (where ``mover`` is false: the names in the way,
    not moved). Raises ``StepAlreadyExistsError`` for an
    uncommitted step written less than ``save_timeout_s`` ago."""
    names = [str(step), f"{step}{TMP_DIR_SUFFIX}"]
    for name in names:
        storage.invalidate(storage.join(job, name))
    present = [name for name in names if storage.is_dir(storage.join(job, name))]
    if not present or (str(step) in present and step in good()):
        return []  # nothing there, or a good step: Orbax refuses to save over it
    now = time.time() if now is None else now
    in_the_way: list[tuple[str, str]] = []
    for name in present:
        path = storage.join(job, name)
        inspection = inspect_step(storage, Entry(name, path, True, None), save_timeout_s=save_timeout_s, now=now)
        if inspection is None:
            continue
        if inspection.state in _UNCOMMITTED:
            written = newest_write(storage, path)
            if written is None or now - written < save_timeout_s:
                age = "an unknown time" if written is None else f"{max(now - written, 0.0):.0f}s"
                raise StepAlreadyExistsError(
                    f"cannot save step {step}: {storage.url_of(path)} is an uncommitted step last written {age} ago, "
                    f"less than the save timeout ({save_timeout_s:g}s): another writer may still be writing it. "
                    "Wait, or, when you know no one writes it, move it away yourself or construct the manager with a "
                    "shorter save_timeout_s")
            in_the_way.append((name, "uncommitted"))
        elif read_quarantine(storage, path) is not None:
            in_the_way.append((name, "quarantined"))
        else:
            in_the_way.append((name, f"not good: {inspection.reason or inspection.state.value}"))
    if not mover:
        return [name for name, _ in in_the_way]
    moved = []
    for name, what in in_the_way:
        job_path = storage.join(job)
        storage.invalidate(job_path)
        target = aside_name(step, {e.name for e in storage.list_dir(job_path)}, now)
        move(storage, storage.join(job, name), storage.join(job, target))
        _log.warning("step %s (%s, %s) moved aside to %s before a new save of step %s: kept, never served, listed "
                     "by `ckptd show`", step, what, name, storage.url_of(storage.join(job, target)), step)
        moved.append(target)
    return moved


def move(storage: Storage, source: str, target: str) -> None:
    """``source`` (a step directory) to ``target`` (a name not taken), with its side-prefix records."""
    side_source = side_dir(source)
    side = storage.is_dir(side_source)
    if not storage.is_remote:
        with storage_errors(f"cannot move {source} aside"):
            storage.rename(source, target)
            if side:
                os.makedirs(os.path.dirname(side_dir(target)), exist_ok=True)
                storage.rename(side_source, side_dir(target))
        return
    _copy_then_delete(storage, source, target)
    if side:
        _copy_then_delete(storage, side_source, side_dir(target))
    storage.invalidate()
    # Orbax's own file system object (etils') lists from its own cache: it would take the step for still there
    # and delete it again before writing (FileNotFoundError)
    for fs in list(getattr(type(storage.fs), "_cache", {}).values()):
        fs.invalidate_cache(source)


def _objects(storage: Storage, path: str) -> dict[str, Any]:
    """Relative name -> size of every object under ``path``."""
    with storage_errors(f"cannot list {storage.url_of(path)}"):
        infos = storage.fs.find(path, detail=True)
    base = path.rstrip("/") + "/"
    return {name[len(base):]: info.get("size") for name, info in infos.items() if name.startswith(base)}


def _copy_then_delete(storage: Storage, source: str, target: str) -> None:
    """gs://: copy ``source`` to ``target`` object by object, check the copy, then delete ``source`` (its commit
    marker first)."""
    storage.writable(source)
    storage.writable(target)
    wanted = _objects(storage, source)
    with storage_errors(f"cannot copy {storage.url_of(source)} aside"):
        for rel in wanted:
            storage.fs.copy(join_path(source, rel), join_path(target, rel))
    storage.invalidate(target)
    copied = _objects(storage, target)
    if copied != wanted:
        missing = sorted(set(wanted.items()) - set(copied.items()))[:5]
        raise StorageError(f"moving {storage.url_of(source)} aside: the copy at {storage.url_of(target)} differs "
                           f"({missing}); the step is left where it was")
    if COMMIT_MARKER in wanted:
        storage.remove(join_path(source, COMMIT_MARKER))
    storage.remove(source, recursive=True)


__all__ = ["clear_for_save", "move", "newest_write"]
