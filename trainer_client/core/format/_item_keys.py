"""The raw documents of an Orbax item that the zarr index is built from: which keys end in zarr metadata,
their bytes, the item's ``_METADATA``, and whether the item is an OCDBT database.

A local item is read without tensorstore: an OCDBT database through this package's own index reader
(``trainer_client/core/format/_ocdbt_index.py``), plain zarr files straight from the directory. So the
sidecar, which plans steps written by plain Orbax too, never maps tensorstore for a local root. Items on
``gs://``, and databases the reader does not understand, are read through tensorstore, imported only then
(the jax-free install, ``pip install ckptd``, does not have it: a clear ``ArrayIndexError`` says so).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from trainer_client.core._errors import (
    ArrayIndexError,
    OcdbtFormatError,
    OcdbtRefusedError,
    RecordTooLargeError,
    StoredFormatError,
)
from trainer_client.core._storage import join_path, read_fd
from trainer_client.core.format._files import ITEM_METADATA, OCDBT_MANIFEST, OCDBT_PROCESS_PREFIX
from trainer_client.core.format._ocdbt_index import DEADLINE_S, OcdbtIndex

ZARR2_SUFFIX = "/.zarray"
ZARR3_SUFFIX = "/zarr.json"

# (uses OCDBT, [(key, zarr metadata bytes)], the item's _METADATA bytes or None)
Fetched = tuple[bool, list[tuple[str, bytes]], bytes | None]
MAX_DOCUMENT_BYTES = 64 << 20  # a zarr metadata document or an item's _METADATA: kilobytes, megabytes at most


def _read_document(path: Path) -> bytes | None:
    """A small metadata file, or None when there is none; never follows a link, never reads past
    ``MAX_DOCUMENT_BYTES`` (a document that is a link to /dev/zero or a huge file is refused by its size, before
    a byte is read: ``storage.read_fd``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ArrayIndexError(f"cannot read {path}: {exc}") from exc
    try:
        return read_fd(fd, MAX_DOCUMENT_BYTES, str(path))
    except RecordTooLargeError as exc:
        raise ArrayIndexError(f"{path} is larger than {MAX_DOCUMENT_BYTES} bytes: not a metadata document") from exc
    except StoredFormatError as exc:  # a FIFO, a directory
        raise ArrayIndexError(f"cannot read {path}: {exc}") from exc
    finally:
        os.close(fd)


def item_kvstore_spec(step_url: str | os.PathLike[str], item: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of ``<step_url>/<item>/`` (a ``file`` or ``gcs`` driver spec); ``item`` ``""``
    (``ROOT_ITEM``: a bare ``Checkpointer``'s step) is the step directory itself."""
    url = os.fspath(step_url)
    if item in (".", "..") or "/" in item.strip("/") or (item and not item.strip("/")):
        raise ArrayIndexError(f"invalid item name {item!r}")
    item = item.strip("/")
    if url.startswith("gs://"):
        bucket, _, prefix = url[len("gs://") :].partition("/")
        if not bucket:
            raise ArrayIndexError(f"no bucket in {url!r}")
        prefix = prefix.strip("/")
        path = "/".join(part for part in (prefix, item) if part) + "/"
        return {"driver": "gcs", "bucket": bucket, "path": path}
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        raise ArrayIndexError(f"unsupported URL {url!r}: expected a local path or gs://bucket/path")
    if not url:
        raise ArrayIndexError("empty step path")
    path = os.path.abspath(url)
    return {"driver": "file", "path": (join_path(path, item) if item else path).rstrip("/") + "/"}


def describe(spec: dict[str, Any]) -> str:
    if spec["driver"] == "gcs":
        return f"gs://{spec['bucket']}/{spec['path']}"
    return str(spec["path"])


def tensorstore() -> Any:
    """tensorstore, imported here rather than at the top: the sidecar maps it only when it reads the index
    of a step without ckptd's metadata, and the jax-free install (``pip install ckptd``) does not have it."""
    try:
        import tensorstore
    except ImportError as exc:
        raise ArrayIndexError("reading the zarr metadata of a step without ckptd's metadata needs tensorstore "
                              "(pip install 'ckptd[trainer]' or 'ckptd[server]')") from exc
    return tensorstore


class _Deadline:
    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def _fetch_with_tensorstore(spec: dict[str, Any], timeout: float | None) -> Fetched:
    """``fetch`` through tensorstore (any kvstore driver); tensorstore's errors escape."""
    ts = tensorstore()

    deadline = _Deadline(timeout)
    context = ts.Context()
    base = ts.KvStore.open(spec, context=context).result(timeout=deadline.left())
    manifest_f = base.read(OCDBT_MANIFEST)
    metadata_f = base.read(ITEM_METADATA)
    pending: list[Any] = [manifest_f, metadata_f]
    try:
        use_ocdbt = manifest_f.result(timeout=deadline.left()).state == "value"
        meta = metadata_f.result(timeout=deadline.left())
        item_metadata = meta.value if meta.state == "value" else None
        if use_ocdbt:
            store = ts.KvStore.open({"driver": "ocdbt", "base": spec}, context=context).result(timeout=deadline.left())
        else:
            store = base
        listing = store.list()
        pending.append(listing)
        all_keys = listing.result(timeout=deadline.left())
        keys: list[tuple[str, bytes]] = []
        for raw_key in all_keys:
            key = raw_key.decode("utf-8", errors="replace")
            if key.endswith((ZARR2_SUFFIX, ZARR3_SUFFIX)):
                keys.append((key, raw_key))
            elif not use_ocdbt and key.startswith(OCDBT_PROCESS_PREFIX) and key.endswith(OCDBT_MANIFEST):
                raise _unfinished(spec, key)
        if not keys and item_metadata is None:
            raise _no_item(spec, bool(all_keys))
        reads = [store.read(raw_key) for _, raw_key in keys]
        pending.extend(reads)
        values: list[tuple[str, bytes]] = []
        for (key, _), read in zip(keys, reads, strict=True):
            result = read.result(timeout=deadline.left())
            if result.state != "value":
                raise ArrayIndexError(f"{describe(spec)}: {key} was listed but cannot be read")
            values.append((key, result.value))
        pending.clear()
        return use_ocdbt, values, item_metadata
    finally:
        for future in pending:
            future.cancel()


def _no_item(spec: dict[str, Any], listed_anything: bool) -> ArrayIndexError:
    what = "nothing stored there" if not listed_anything else f"no {ITEM_METADATA} and no zarr arrays"
    return ArrayIndexError(f"no Orbax item at {describe(spec)} ({what})")


def _unfinished(spec: dict[str, Any], key: str) -> ArrayIndexError:
    return ArrayIndexError(f"{describe(spec)} holds per-process OCDBT stores ({key}) but no merged "
                           f"{OCDBT_MANIFEST}: the save did not finish")


def _fetch_local(spec: dict[str, Any], timeout: float | None = None) -> Fetched | None:
    """``fetch`` for a local item without tensorstore, its OCDBT index read within ``timeout`` seconds (and
    the reader's own deadline); None when its database is one the index reader does not understand
    (tensorstore reads it then). A database the reader refuses (``OcdbtRefusedError``: hostile, docs/operations.md,
    "What each limit defends") is an ``ArrayIndexError``."""
    root = Path(spec["path"])
    item_metadata = _read_document(root / ITEM_METADATA)
    if (root / OCDBT_MANIFEST).is_file():
        try:
            index = OcdbtIndex(root, deadline_s=DEADLINE_S if timeout is None else min(timeout, DEADLINE_S))
            keys = sorted(k for k in index.values if k.endswith((ZARR2_SUFFIX, ZARR3_SUFFIX)))
            values = [(key, index.read(key, MAX_DOCUMENT_BYTES)) for key in keys]
        except OcdbtRefusedError as exc:  # hostile or broken past any real database: tensorstore is not asked
            raise ArrayIndexError(f"{describe(spec)}: OCDBT index refused: {exc}") from exc
        except OcdbtFormatError:
            return None
        if not values and item_metadata is None:
            raise _no_item(spec, bool(index.values))
        return True, values, item_metadata
    listed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        listed.extend(name if rel == "." else f"{Path(rel).as_posix()}/{name}" for name in sorted(filenames))
    values = []
    for key in listed:
        if key.endswith((ZARR2_SUFFIX, ZARR3_SUFFIX)):
            document = _read_document(root / key)
            if document is None:
                raise ArrayIndexError(f"{describe(spec)}: {key} was listed but cannot be read")
            values.append((key, document))
        elif key.startswith(OCDBT_PROCESS_PREFIX) and key.endswith(OCDBT_MANIFEST):
            raise _unfinished(spec, key)
    if not values and item_metadata is None:
        raise _no_item(spec, bool(listed))
    return False, values, item_metadata


def fetch(spec: dict[str, Any], timeout: float | None) -> Fetched:
    """The item's zarr metadata documents and ``_METADATA`` (see ``Fetched``), within ``timeout`` seconds
    on ``gs://``. Raises ArrayIndexError for a missing or unfinished item; storage errors escape."""
    if spec["driver"] == "file":
        local = _fetch_local(spec, timeout)
        if local is not None:
            return local
    return _fetch_with_tensorstore(spec, timeout)


__all__ = ["ZARR2_SUFFIX", "ZARR3_SUFFIX", "Fetched", "describe", "fetch", "item_kvstore_spec", "tensorstore"]
