"""CRC32C of the files of a step on a local disk, read back as they are on storage, several files at once.

The manifest records each file's CRC32C as read back from storage (``manifest.py``), so the persist path
reads every byte Orbax just wrote. That read was a third of a persist (docs/benchmarks.md, "What holds the
persist gap"): it went through fsspec in 8 MiB ``read``s, and each 8 MiB ``bytes`` object is a fresh
``mmap`` from the allocator, page-faulted in 4 KiB pages and unmapped again. ``google_crc32c`` takes only
``bytes`` (not a ``memoryview``, ``bytearray`` or ``mmap``), and holds the GIL while it sums, so the
cheap way is small reads whose buffers the allocator reuses (1 MiB: 3x faster here), several files at once
on a thread pool so one file's ``read`` (which releases the GIL) overlaps another's sum. No jax here.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import google_crc32c

READ_SIZE = 1 << 20  # below glibc's mmap threshold once raised: the allocator hands the same memory back
WORKERS = 4


def crc32c_b64(value: int) -> str:
    """base64 of the big-endian CRC32C, as GCS reports it."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def file_crc32c(path: str, read_size: int = READ_SIZE) -> tuple[int, str]:
    """Size and CRC32C (base64) of the bytes of the file at ``path`` as read now (``OSError`` if unreadable)."""
    crc = 0
    size = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while data := os.read(fd, read_size):
            crc = google_crc32c.extend(crc, data)
            size += len(data)
    except OSError as exc:
        if exc.filename is None:  # a read error names no file: say which
            raise type(exc)(exc.errno, exc.strerror, path) from exc
        raise
    finally:
        os.close(fd)
    return size, crc32c_b64(crc)


def files_crc32c(paths: Iterable[str], workers: int = WORKERS) -> dict[str, tuple[int, str]]:
    """``file_crc32c`` of each path, ``workers`` files at a time; the first ``OSError`` is raised."""
    todo = list(paths)
    if len(todo) <= 1 or workers <= 1:
        return {path: file_crc32c(path) for path in todo}
    # Largest first, so the big files do not all start last.
    todo.sort(key=_size_or_zero, reverse=True)
    with ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="ckptd-crc32c") as pool:
        return dict(zip(todo, pool.map(file_crc32c, todo), strict=True))


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


__all__ = ["READ_SIZE", "WORKERS", "crc32c_b64", "file_crc32c", "files_crc32c"]
