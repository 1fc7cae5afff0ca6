"""What a verdict belongs to: a step's identity, and the looks that tell when the content under a step's name is
no longer the content ckptd verified or quarantined (docs/operations.md, "A step saved again under its number").

A verdict is about content, not about a name: a step deleted and saved again under its number, or whose
directory is swapped for another, is another step to judge. Its identity is the (size, modification time) of the
top-level files every save writes anew — ``_CHECKPOINT_METADATA``, the commit marker, the manifest
(``FINGERPRINTED``: what a verified record keeps as ``fingerprints``). The catalog keeps each settled step's
identity in its row (``ckptd/catalog/_step_table.py``), and, on a local disk, the step directory's time as listed
when the identity was last seen to hold. Two looks, neither reading a step's metadata:

* before a step is named, the listing of its top level that shows its commit marker (``Catalog._still_good``) is
  compared with its identity (``same_content``); another identity sends the step through verification again,
  never through a check against the manifest of what it held before;
* a refresh that lists a job (``looked_again``) lists the top level of each settled step whose directory's time
  changed since, and, on an object store (no directory times), of each quarantined step at every full pass: a
  quarantined step saved again correctly is verified and offered, not left quarantined for good.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainer_client.core import Entry, Storage, StorageError
from trainer_client.core.format import StepInspection, fingerprints
from trainer_client.core.protocol import StepState


def directory_time_ns(storage: Storage, path: str) -> int | None:
    """A local directory's modification time (ns); None on an object store, which has none, or where it is gone."""
    if storage.is_remote:
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def identity_of(prints: Mapping[str, tuple[int, float]] | Iterable[Entry]) -> str:
    """The identity of a step's content: its fingerprints (or those of its listed top level), as one string."""
    found = fingerprints(list(prints)) if not isinstance(prints, Mapping) else prints
    return json.dumps(sorted([name, int(size), float(mtime)] for name, (size, mtime) in found.items()))


def same_content(identity: str | None, listed: Iterable[Entry]) -> bool:
    """Whether a step's top level as ``listed`` now is still the content whose identity is ``identity`` (unknown:
    taken as the same; the answers then validate the step in full, as before identities were kept)."""
    return identity is None or identity_of(listed) == identity


@dataclass(frozen=True)
class Judged:
    """A step as a scan found it, with the identity its verdict is about (None: no verdict, or not known) and its
    directory's time as listed when that identity held (None: not known, or an object store's)."""

    inspection: StepInspection
    identity: str | None = None
    listed_mtime: float | None = None


@dataclass(frozen=True)
class Settledness:
    """What a catalogued settled step's row says of its verdict: its state, identity and directory time."""

    state: str
    identity: str | None
    listed_mtime: float | None


def looked_again(storage: Storage, entries: Iterable[Entry], rows: Mapping[str, Settledness], *,
                 quick: bool) -> tuple[list[Entry], dict[str, float]]:
    """The settled steps among ``entries`` (a job's listing) whose content is no longer the one judged, and the
    directory times to keep for those looked at and found unchanged. A step is looked at (one listing of its top
    level) when its listed directory time is not the one kept; on an object store, where no time is listed, only a
    quarantined step, and not on a ``quick`` pass (a verified one is looked at before it is named). A step that
    cannot be listed now is left to the next pass."""
    changed: list[Entry] = []
    kept: dict[str, float] = {}
    for entry in entries:
        row = rows.get(entry.name)
        if row is None:
            continue
        if entry.mtime is not None:
            if row.listed_mtime == entry.mtime:
                continue
        elif quick or row.state != StepState.QUARANTINED.value:
            continue
        storage.invalidate(entry.path)
        try:
            listed = storage.list_dir(entry.path)
        except StorageError:
            continue
        if row.identity is not None and same_content(row.identity, listed):
            if entry.mtime is not None:
                kept[entry.name] = entry.mtime
        else:
            changed.append(entry)
    return changed, kept


__all__ = ["Judged", "Settledness", "directory_time_ns", "identity_of", "looked_again", "same_content"]
