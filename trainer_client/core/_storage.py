"""Storage access for checkpoint roots: local directories and ``gs://`` buckets, through fsspec.

ckptd and the client's fallback scan read storage through this one small interface, so a rule written
once (the commit rule, step discovery) behaves the same on a laptop and on GCS. Only listing and reading
small metadata files happen here: array bytes are Orbax's and tensorstore's business.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec

from trainer_client.core._errors import StorageError, StoredFormatError, UnsafePathError
from trainer_client.core._gcs_pacing import pace
from trainer_client.core._object_reads import read_object, too_large
from trainer_client.core._said_once import SaidOnce
from trainer_client.core._storage_causes import failure_cause
from trainer_client.core.format._files import SIDE_DIR

_log = logging.getLogger(__name__)
_links_said = SaidOnce()  # links out of a listed directory already warned about

MAX_RECORD_BYTES = 64 << 20  # the most ``read_bytes`` reads of one file, unless its caller bounds it lower
_READ_CHUNK = 1 << 16


def read_fd(fd: int, max_bytes: int, name: str) -> bytes:
    """The bytes of the open file ``fd`` (``name`` in errors), read only when it is a regular file of at most
    ``max_bytes`` by its size, and never more than ``max_bytes + 1`` of them (it may grow while read): else
    ``RecordTooLargeError``, and ``StoredFormatError`` for what is not a regular file (a directory, a FIFO).
    A 1 GiB sparse file planted as a record costs nothing (docs/operations.md, "What each limit defends")."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise StoredFormatError(f"{name} is not a regular file")
    if info.st_size > max_bytes:
        raise too_large(name, info.st_size, max_bytes)
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(max(info.st_size + 1 - total, _READ_CHUNK), max_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise too_large(name, total, max_bytes)


def storage_failures() -> tuple[type[BaseException], ...]:
    """What file-system backends raise for storage trouble: ``OSError``, plus the exceptions of gcsfs and
    aiohttp that are not ``OSError`` (gcsfs raises its ``HttpError`` for a 5xx or 429 that outlived its
    retries). Looked up when needed: importing gcsfs here would fix its class choice before a test or a
    deployment has set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``."""
    found: list[type[BaseException]] = [OSError]
    gcsfs_retry = sys.modules.get("gcsfs.retry")
    if gcsfs_retry is not None:
        found += [gcsfs_retry.HttpError, gcsfs_retry.ChecksumError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        found.append(aiohttp.ClientError)
    return tuple(found)


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Raise a backend's storage failure as ``StorageError`` (``FileNotFoundError`` passes as it is)."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except Exception as exc:
        if isinstance(exc, storage_failures()):
            raise StorageError(f"{what}: {exc}") from exc
        raise


@dataclass(frozen=True)
class Entry:
    """One child of a directory."""

    name: str
    path: str
    is_dir: bool
    mtime: float | None
    size: int | None = None


def mtime_of(info: dict[str, Any]) -> float | None:
    """A listing entry's modification time, whatever the file system calls it (seconds since the epoch)."""
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


def join_path(path: str, *names: str) -> str:
    """``path`` (a local path, an fsspec path or a ``gs://`` URL) with ``names`` appended, one ``/`` between
    each: the one way paths are joined, for local roots and object stores alike. A name is one or more plain
    segments (``item/_METADATA``); one with an empty, ``.`` or ``..`` segment, or an absolute one, is refused
    with ``UnsafePathError``: a name read from a record or a listing never leads out of ``path``
    (docs/operations.md, "Security")."""
    for name in names:
        segments = name.removesuffix("/").split("/")
        if any(segment in ("", ".", "..") or "\0" in segment for segment in segments):
            raise UnsafePathError(f"{name[:200]!r} is no relative path of plain names: refused")
    parts = [path.rstrip("/"), *(name.removesuffix("/") for name in names)]
    return "/".join(parts) if parts[0] else "/" + "/".join(parts[1:])


class Storage:
    """A checkpoint root (``/abs/dir`` or ``gs://bucket/prefix``) and the file system that holds it."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.url = url.rstrip("/") if url not in ("/",) else url
        if fs is None:
            fs, path = fsspec.core.url_to_fs(self.url)
        else:
            path = fs._strip_protocol(self.url)
        self.fs: fsspec.AbstractFileSystem = fs
        pace(fs)  # GCS: 429/503 retried with full jitter, not gcsfs's near-lockstep schedule (core/_gcs_pacing.py)
        self.root: str = path if path.startswith("/") or self.is_remote else os.path.abspath(path)
        self._links_refused: dict[str, dict[str, str]] = {}  # directory -> {child name: where it leads}
        self._read_only: Callable[[str], bool] = lambda _job: False  # job -> ckptd writes nothing under it

    @property
    def is_remote(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return "file" not in protocols and "local" not in protocols

    def join(self, *parts: str) -> str:
        """A path under the root: ``join(job, step)``."""
        return join_path(self.root, *parts)

    def url_of(self, path: str) -> str:
        """The URL a user (or Orbax) would use for ``path``: ``gs://...`` or an absolute local path."""
        if not self.is_remote:
            return path
        return self.fs.unstrip_protocol(path)

    def invalidate(self, path: str | None = None) -> None:
        """Forget cached listings (gcsfs caches them) so the next listing sees storage as it is now:
        all of them, or those of ``path``, its parents and everything under it.

        gcsfs's own ``invalidate_cache(path)`` drops only ``path`` and its parents. A listing it kept of
        a step directory would hide a ``commit_success.txt`` written since (``exists`` answers "no" from
        the parent's cached listing) and keep the old size of a rewritten ``_CHECKPOINT_METADATA``.
        """
        if path is None:
            self.fs.invalidate_cache()
            return
        self.fs.invalidate_cache(path)
        cache = getattr(self.fs, "dircache", None)
        if cache is None:
            return
        prefix = str(self.fs._strip_protocol(path)).rstrip("/") + "/"
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(prefix)]:
            with contextlib.suppress(KeyError):  # another thread dropped it first
                del cache[key]

    # ---- links out of the root (local roots; docs/operations.md) ----------------------------------

    def inside(self, path: str, within: str | None = None) -> bool:
        """Whether ``path``, its links resolved, stays inside ``within`` (default: the root). Object stores
        have no links: always."""
        if self.is_remote:
            return True
        base = os.path.realpath(within if within is not None else self.root)
        real = os.path.realpath(path)
        return real == base or real.startswith(base.rstrip(os.sep) + os.sep)

    def require_inside(self, path: str) -> str:
        """``path``, when it stays inside the root once its links are resolved; else ``UnsafePathError``:
        nothing is written through a link that leads out of the root."""
        if not self.inside(path):
            raise UnsafePathError(f"{path} leads to {os.path.realpath(path)}, outside the checkpoint root "
                                  f"{self.root}: refused")
        return path

    # ---- the one check before every write (docs/operations.md, "Security") ----------------------------

    def guard_writes(self, read_only: Callable[[str], bool]) -> None:
        """From now on ``writable`` refuses every path under ``<root>/<job>/`` of a job ``read_only(job)`` names:
        such a job's records go to ``<root>/.ckptd/`` (docs/protocol.md, "Read-only adoption")."""
        self._read_only = read_only

    def write_refusal(self, path: str) -> str | None:
        """Why ckptd may not create, replace, move or delete ``path``; None when it may: ``path`` is spelled
        plainly (no empty, ``.`` or ``..`` segment) below the root, stays below it once its links are resolved
        (local roots: its real path under the root's), and is not under a read-only job (``guard_writes``)."""
        if self.is_remote:  # a URL (gs://bucket/...) or the file system's own path (bucket/...)
            path = str(self.fs._strip_protocol(path))
        base = self.root.rstrip("/")
        if not path.startswith(base + "/") or posixpath.normpath(path) != path.rstrip("/"):
            return f"{path[:300]} is not a plain path inside the checkpoint root {self.root}: refused"
        job = path[len(base) + 1:].split("/", 1)[0]
        if job != SIDE_DIR and self._read_only(job):
            return (f"{path}: job {job!r} is watched read-only, ckptd changes nothing under {base}/{job}/ "
                    f"(docs/protocol.md, Read-only adoption)")
        if not self.inside(path):
            return (f"{path} leads through a link to {os.path.realpath(path)}, outside the checkpoint root "
                    f"{self.root}: refused")
        return None

    def writable(self, path: str) -> str:
        """``path`` when ckptd may write it (``write_refusal``); else ``UnsafePathError``. Every writer of a
        root calls it: ``create_new``, ``write_json_file``, ``remove``, ``rename``, and whoever hands a path to
        the persist worker."""
        why = self.write_refusal(path)
        if why is not None:
            raise UnsafePathError(why)
        return path

    def remove(self, paths: str | list[str], *, recursive: bool = False, if_generation: int | None = None) -> bool:
        """Delete ``paths`` (files; with ``recursive`` directories and all below them), each ``writable``. With
        ``if_generation`` (one object on an object store): only while it holds that generation, a DELETE with
        ``ifGenerationMatch`` (docs/gcs.md, "Fencing on gs://"); False when it was rewritten (412) or is gone."""
        listed = [paths] if isinstance(paths, str) else list(paths)
        for path in listed:
            self.writable(path)
        if if_generation is not None:
            if not self.is_remote or len(listed) != 1 or recursive:
                raise ValueError("a generation precondition deletes one object of an object store")
            bucket, key, _ = self.fs.split_path(listed[0])
            with storage_errors(f"cannot delete {self.url_of(listed[0])}"):
                try:
                    self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(if_generation))
                except (FileExistsError, FileNotFoundError):  # gcsfs raises 412 as FileExistsError, 404 as the other
                    return False
            return True
        if listed:
            with storage_errors(f"cannot delete {self.url_of(listed[0])}" + (" ..." if len(listed) > 1 else "")):
                self.fs.rm(listed if len(listed) > 1 else listed[0], recursive=recursive)
        return True

    def rename(self, source: str, target: str) -> None:
        """Move ``source`` to ``target`` on a local root (both ``writable``): ``os.rename``, which refuses to
        replace a directory that is not empty (``OSError``)."""
        os.rename(self.writable(source), self.writable(target))

    def links_refused(self, path: str) -> dict[str, str]:
        """The children of ``path`` its last listing left out: links leading out of it (name -> target)."""
        return dict(self._links_refused.get(path.rstrip("/") or "/", {}))

    def _leaves(self, directory: str, child: str, info: dict[str, Any]) -> bool:
        """Whether the listed ``child`` of ``directory`` is a link leading out of it (logged once per process:
        ``trainer_client/core/_said_once.py``)."""
        if self.is_remote or not info.get("islink") or self.inside(child, directory):
            return False
        target = os.path.realpath(child)
        if _links_said.first(child, target):  # once per link and target in a process, not at every listing
            _log.warning("ignoring %s: a link to %s, outside %s", child, target, directory)
        self._links_refused.setdefault(directory.rstrip("/") or "/", {})[posixpath.basename(child)] = target
        return True

    def list_dir(self, path: str) -> list[Entry]:
        """Children of ``path``; an empty list when ``path`` does not exist. On a local root, a child that is a
        link leading out of ``path`` is left out (``links_refused``): no job, step or file is read through it."""
        try:
            infos = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        except storage_failures() as exc:
            raise StorageError(f"cannot list {self.url_of(path)}: {exc}") from exc
        entries = []
        self._links_refused.pop(path.rstrip("/") or "/", None)
        for info in infos:
            full = str(info["name"]).rstrip("/")
            name = posixpath.basename(full)
            if not name or full == path.rstrip("/") or self._leaves(path, full, info):
                continue
            size = info.get("size")
            entries.append(Entry(name, full, info.get("type") == "directory", mtime_of(info),
                                 int(size) if isinstance(size, int | float) else None))
        return sorted(entries, key=lambda e: e.name)

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except storage_failures() as exc:
            raise StorageError(f"cannot stat {self.url_of(path)}: {exc}") from exc

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory; False when nothing is there. Storage that cannot answer raises
        ``StorageError`` (fsspec's ``isdir`` answers False for it: a network down read as "not a directory")."""
        try:
            return bool(self.fs.info(path).get("type") == "directory")
        except (FileNotFoundError, NotADirectoryError):
            return False
        except storage_failures() as exc:
            raise StorageError(f"cannot stat {self.url_of(path)}: {failure_cause(exc)}") from exc

    def read_bytes(self, path: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
        """The file's bytes; ``FileNotFoundError`` when absent, or when on a local root it is reached through a
        link leading out of the root (such a file is not there, for ckptd). Only files ckptd reads whole pass
        here (records, Orbax's metadata), so the size is checked before a byte is read: past ``max_bytes``,
        ``RecordTooLargeError`` (a ``ValueError``: the record is unreadable), and at most ``max_bytes + 1``
        bytes are ever read (locally ``read_fd``; on an object store one ranged read of a small object, its size
        first past 64 KiB: ``core/_object_reads.py``). ``StoredFormatError`` for a directory or another file that
        is not a regular one (on an object store a prefix of the name with no object of it is absent)."""
        if not self.inside(path):
            raise FileNotFoundError(f"{path}: a link leading out of the checkpoint root, ignored")
        try:
            if not self.is_remote:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block the open
                try:
                    return read_fd(fd, max_bytes, path)
                finally:
                    os.close(fd)
            return read_object(self.fs, path, max_bytes, self.url_of(path))
        except (FileNotFoundError, StoredFormatError):
            raise
        except storage_failures() as exc:
            raise StorageError(f"cannot read {self.url_of(path)}: {exc}") from exc

    def create_new(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if nothing is there: True when this call created it, False when
        it existed (someone else won). The one coordination primitive among sidecars (docs/multihost.md):
        ``O_CREAT | O_EXCL`` then fsync of the file and its directory locally; on GCS a write with
        ``ifGenerationMatch=0`` (gcsfs's ``mode="create"``: HTTP 412 is raised as ``FileExistsError``)."""
        self.writable(path)
        if self.is_remote:
            with storage_errors(f"cannot create {self.url_of(path)}"):
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    return False
            self.invalidate(posixpath.dirname(path))
            return True
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return True

    def read_json(self, path: str) -> Any:
        """Parse a JSON file; ``FileNotFoundError`` when absent, ``ValueError`` when not JSON."""
        return json.loads(self.read_bytes(path).decode("utf-8"))

    def newest_mtime(self, path: str) -> float | None:
        """The newest modification time of ``path`` or its direct children (object stores have no
        directory times: there, of its direct child objects, else of any object under it)."""
        times = [e.mtime for e in self.list_dir(path) if e.mtime is not None]
        if not self.is_remote:
            with contextlib.suppress(OSError):
                times.append(os.stat(path).st_mtime)
        elif not times:
            # No direct child is an object (only "directories", e.g. an item being written): date the
            # step by the newest object under it, or it would never age into ``abandoned``.
            try:
                infos = self.fs.find(path, detail=True)
            except FileNotFoundError:
                infos = {}
            except storage_failures() as exc:
                raise StorageError(f"cannot list {self.url_of(path)}: {exc}") from exc
            times = [t for t in (mtime_of(info) for info in infos.values()) if t is not None]
        return max(times) if times else None


__all__ = ["MAX_RECORD_BYTES", "Entry", "Storage", "StorageError", "read_fd", "storage_errors", "storage_failures"]
