"""Storage access for checkpoint roots: local directories and ``gs://`` buckets, through fsspec.

ckptd and the client's fallback scan read storage through this one small interface, so a rule written
once (the commit rule, step discovery) behaves the same on a laptop and on GCS. Only listing and reading
small metadata files happen here: array bytes are Orbax's and tensorstore's business.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec


class StorageError(OSError):
    """Storage could not be listed or read (after the file system's own retries)."""


@dataclass(frozen=True)
class Entry:
    """One child of a directory."""

    name: str
    path: str
    is_dir: bool
    mtime: float | None


def _mtime_of(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "updated", "LastModified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


class Storage:
    """A checkpoint root (``/abs/dir`` or ``gs://bucket/prefix``) and the file system that holds it."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        if fs is None:
            fs, path = fsspec.core.url_to_fs(self.url)
        else:
            path = fs._strip_protocol(self.url)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = path if path.startswith("/") or self.is_remote else os.path.abspath(path)

    @property
    def is_remote(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return "file" not in protocols and "local" not in protocols

    def join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """The URL a user (or Orbax) would use for ``path``: ``gs://...`` or an absolute local path."""
        if not self.is_remote:
            return path
        return self.fs.unstrip_protocol(path)

    def invalidate(self, path: str | None = None) -> None:
        """Forget cached listings (gcsfs caches them) so the next listing sees storage as it is now."""
        self.fs.invalidate_cache(path)

    def list_dir(self, path: str) -> list[Entry]:
        """Children of ``path``; an empty list when ``path`` does not exist."""
        try:
            infos = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {self.url_of(path)}: {exc}") from exc
        entries = []
        for info in infos:
            full = str(info["name"]).rstrip("/")
            name = posixpath.basename(full)
            if not name or full == path.rstrip("/"):
                continue
            entries.append(Entry(name, full, info.get("type") == "directory", _mtime_of(info)))
        return sorted(entries, key=lambda e: e.name)

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except OSError as exc:
            raise StorageError(f"cannot stat {self.url_of(path)}: {exc}") from exc

    def is_dir(self, path: str) -> bool:
        try:
            return bool(self.fs.isdir(path))
        except OSError as exc:
            raise StorageError(f"cannot stat {self.url_of(path)}: {exc}") from exc

    def read_bytes(self, path: str) -> bytes:
        try:
            with self.fs.open(path, "rb") as f:
                return bytes(f.read())
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read {self.url_of(path)}: {exc}") from exc

    def read_json(self, path: str) -> Any:
        """Parse a JSON file; ``FileNotFoundError`` when absent, ``ValueError`` when not JSON."""
        return json.loads(self.read_bytes(path).decode("utf-8"))

    def newest_mtime(self, path: str) -> float | None:
        """The newest modification time of ``path`` or its direct children (object stores have no
        directory times)."""
        times = [e.mtime for e in self.list_dir(path) if e.mtime is not None]
        if not self.is_remote:
            try:
                times.append(os.stat(path).st_mtime)
            except OSError:
                pass
        return max(times) if times else None


__all__ = ["Entry", "Storage", "StorageError"]
