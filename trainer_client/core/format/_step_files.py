"""The files of a step as one listing shows them: name, size and, on an object store, the CRC32C it keeps.

What a manifest is built from and checked against (``manifest.py``, ``validation.py``). On a local disk the
listing is one ``scandir`` per directory: fsspec's own listing stats every entry several times, which was a
tenth of ckptd's first sight of a step (docs/operations.md, "First sight"). No jax here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer_client.core._storage import Storage, mtime_of, storage_errors


@dataclass(frozen=True)
class Listed:
    """A file as a listing shows it: its size, and the object store's CRC32C where there is one."""

    size: int
    crc32c: str | None


def _walk_local(top: str) -> dict[str, Listed]:
    """``list_files`` on a local disk: one ``scandir`` per directory (fsspec's listing stats every entry
    several times), with fsspec's answer: a link is listed with its target's size and a link to a directory
    is listed as an entry, not walked into (so no link loop is followed); an unreadable directory is left
    out, a dangling link has size 0."""
    out: dict[str, Listed] = {}
    pending = [("", top)]
    while pending:
        rel_dir, path = pending.pop()
        try:
            with os.scandir(path) as children:
                found = list(children)
        except FileNotFoundError:
            if not rel_dir:
                return {}
            continue
        except OSError:
            continue
        for child in found:
            rel = rel_dir + child.name
            try:
                if child.is_dir(follow_symlinks=False):
                    pending.append((rel + "/", child.path))
                    continue
                size = child.stat().st_size
            except OSError:  # a dangling link
                size = 0
            out[rel] = Listed(size, None)
    return out


def list_files(storage: Storage, step_path: str) -> dict[str, Listed]:
    """Every file under ``step_path`` (relative posix path -> size and object CRC32C), one listing."""
    if not storage.is_remote:
        with storage_errors(f"cannot list {storage.url_of(step_path)}"):
            return _walk_local(step_path.rstrip("/") or "/")
    storage.invalidate(step_path)
    base = storage.fs._strip_protocol(step_path).rstrip("/") + "/"
    out = {}
    with storage_errors(f"cannot list {storage.url_of(step_path)}"):
        found = storage.fs.find(step_path, detail=True)
    for name, info in found.items():
        name = str(name)
        if info.get("type") != "directory" and name.startswith(base) and len(name) > len(base):
            crc = info.get("crc32c") if storage.is_remote else None
            out[name[len(base):]] = Listed(int(info.get("size") or 0), str(crc) if crc else None)
    return out


def newest_file_time(storage: Storage, step_path: str) -> float | None:
    """When any file under ``step_path`` last changed (None when nothing says). On a local disk the
    inode change time counts too: a copy that preserves modification times still shows when it landed."""
    times = []
    for info in storage.fs.find(step_path, detail=True).values():
        for value in (mtime_of(info), info.get("created") if not storage.is_remote else None):
            if isinstance(value, int | float):
                times.append(float(value))
    return max(times) if times else None


__all__ = ["Listed", "list_files", "newest_file_time"]
