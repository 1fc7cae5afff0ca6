"""Small files written whole: a reader sees the old file or the new one, never half of either.

Generic storage: ckptd's records in a step (``trainer_client/core/format/_manifest.py``), its event files and
summaries (``ckptd/events/_events.py``) and its lease files (``ckptd/lease/_lease.py``) are all written
through ``write_json_file``, and only where ``Storage.writable`` lets a writer of the root write.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from trainer_client.core._storage import Storage, storage_errors


def write_json_file(storage: Storage, path: str, payload: str | bytes, *, durable: bool = True,
                    sync: Callable[[str], None] | None = None) -> None:
    """Write a small file whole: an object store replaces objects atomically; on a local disk the file
    is written beside and renamed over, so a crash never leaves half a manifest. Never where
    ``Storage.writable`` refuses (``UnsafePathError``): outside the root, through a link leading out of it,
    under a read-only job. ``durable=False`` skips the fsync, for a record whose loss in a power cut costs only
    work (it is checksummed, so a torn one is never believed). ``sync(tmp)``, on a
    local disk, replaces the fsync of the file written beside: it must make ``tmp`` durable before it returns
    (the seal fsyncs it together with the step's own files: one wait instead of two)."""
    storage.writable(path)
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    if storage.is_remote:
        with storage_errors(f"cannot write {storage.url_of(path)}"):
            storage.fs.pipe_file(path, data)  # on GCS one request (a simple upload), not a resumable one's two
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a record on the side prefix: its directory may be new
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        if durable and sync is None:
            f.flush()
            os.fsync(f.fileno())
    if sync is not None:
        try:
            sync(tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # not left beside the step's files
            raise
    os.replace(tmp, path)


__all__ = ["write_json_file"]
