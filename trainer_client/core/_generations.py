"""Acting on GCS objects only as they were when the action was decided (docs/gcs.md, "Fencing on gs://").

On a local root the job's flock keeps a commit and a deletion of one job apart (``ckptd/catalog/_job_lock.py``); on
``gs://`` no lock spans processes, and a deletion decided from an earlier look (retention's, a cleanup's) could
take what another writer put there since: a step saved again in place, a save a newer leader committed. GCS gives
every write of an object a new *generation*, and takes ``ifGenerationMatch=<g>`` on a write or a DELETE: the request
acts only while the object still holds generation ``g`` (else HTTP 412, nothing done). So a deletion here is three
steps:

1. ``listed_generations``: one listing of the prefix, each object with its generation, taken when deciding;
2. ``delete_as_listed``: the prefix listed again right before acting; anything added, rewritten or gone since
   refuses the whole deletion (nothing deleted);
3. each object then deleted with ``ifGenerationMatch`` of its listed generation (``Storage.remove`` with
   ``if_generation``), ``first`` (the commit marker) before the rest, so a step stops being committed before any
   of its files goes; a 412 or a 404 stops there.

The second step is what the tests can show: fake-gcs-server ignores ``ifGenerationMatch`` (and ``generation``) on a
DELETE (measured: an object deleted with a stale generation), so on the emulator only the re-listing fences; on
GCS the precondition closes the window left between the re-listing and each DELETE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from trainer_client.core._errors import StorageError
from trainer_client.core._storage import Storage, mtime_of, storage_failures


class ListedObject(NamedTuple):
    generation: int
    written_at: float | None  # the object's update time as storage reports it (Unix seconds)


ListedGenerations = dict[str, ListedObject]  # gcsfs path of each object under a prefix -> as listed


@dataclass(frozen=True)
class Deletion:
    """What ``delete_as_listed`` did: every listed object deleted (``refused`` None), or why it stopped, and how
    many objects went before it did (0 when the re-listing refused)."""

    deleted: int
    refused: str | None = None


def listed_generations(storage: Storage, prefix: str) -> ListedGenerations:
    """Every object under ``prefix`` with its generation, asked of storage now (gcsfs's cached listings dropped);
    {} when there is none. Object stores only: a local root has no generations."""
    if not storage.is_remote:
        raise ValueError(f"{storage.url} is a local root: its files have no generations")
    storage.invalidate(prefix)
    try:
        found = storage.fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    except storage_failures() as exc:
        raise StorageError(f"cannot list {storage.url_of(prefix)}: {exc}") from exc
    return {str(name): ListedObject(int(info["generation"]), mtime_of(info)) for name, info in found.items()
            if info.get("type") != "directory" and info.get("generation") is not None}


def changes_since(listed: ListedGenerations, now: ListedGenerations) -> list[str]:
    """The objects added, rewritten or gone between two listings of one prefix, sorted (at most 5 named)."""
    changed = sorted(name for name in listed.keys() | now.keys()
                     if (listed[name].generation if name in listed else None)
                     != (now[name].generation if name in now else None))
    return changed[:5] + ([f"... {len(changed) - 5} more"] if len(changed) > 5 else [])


def delete_as_listed(storage: Storage, prefix: str, listed: ListedGenerations, *, first: str | None = None) -> Deletion:
    """Delete the objects of ``listed`` (a ``listed_generations`` of ``prefix``), only if the prefix still holds
    exactly them: listed again now, then each deleted with its generation as precondition, ``first`` (a path
    among them, e.g. the commit marker) before the others. Nothing more is deleted once one is refused."""
    changed = changes_since(listed, listed_generations(storage, prefix))
    if changed:
        return Deletion(0, f"{storage.url_of(prefix)} changed since it was listed for deletion: {', '.join(changed)}")
    order = sorted(listed, key=lambda name: (name != first, name))
    deleted = 0
    try:
        for name in order:
            if not storage.remove(name, if_generation=listed[name].generation):
                return Deletion(deleted, f"{storage.url_of(name)} is no longer generation {listed[name].generation} "
                                         "(rewritten "
                                         "or deleted by another writer since it was listed)")
            deleted += 1
    finally:
        storage.invalidate(prefix)
    return Deletion(deleted)


__all__ = ["Deletion", "ListedGenerations", "ListedObject", "changes_since", "delete_as_listed", "listed_generations"]
