"""CRC32C of a step's data files as the writer closes them, so the manifest's pass need not read them again.

A local persist wrote the state, then read every byte back for the manifest's CRC32C (``checksum.py``):
a fifth to a third of a persist (docs/benchmarks.md, ``persist_throughput_ratio_vs_disk_limit``). Orbax's
array bytes are in OCDBT data files (``<item>/ocdbt.process_<n>/d/<random name>``), which tensorstore
writes once, under their final names, and never changes after closing them. ``ClosedFileSums`` watches a
save's directory tree with inotify and checksums each data file when its writer closes it
(``IN_CLOSE_WRITE``), while the rest of the state is still being written. The read is the same as the
manifest pass's (``file_crc32c``: the bytes on storage, read back), only earlier.

What a sum is trusted for: the file it was read from (device and inode: the step's directories are renamed
at the commit, the files are not), unchanged since (size, modification and change time in ns, taken before
the read and equal after it and when asked). Anything else — a file closed before its directory was
watched, rewritten since, or not a data file (metadata files are rewritten and renamed over) — is left to
the manifest's own pass. Linux only (inotify through libc); elsewhere nothing is watched. No jax here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from trainer_client.core.format._checksum import file_crc32c
from trainer_client.core.format._files import OCDBT_DATA_DIR as DATA_DIR

IN_CLOSE_WRITE = 0x00000008
IN_CREATE = 0x00000100
IN_ISDIR = 0x40000000
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_MASK = IN_CLOSE_WRITE | IN_CREATE
_EVENT = struct.Struct("iIII")
WORKERS = 2  # files summed at once while the write goes on (the write needs the other core)

Signature = tuple[int, int, int]  # size, mtime_ns, ctime_ns


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:  # by its soname: ``ctypes.util.find_library`` runs ldconfig (~0.3 s)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.inotify_init1  # noqa: B018 (present on Linux only)
    except (OSError, AttributeError):
        return None
    return libc


def _signature(st: os.stat_result) -> Signature:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ClosedFileSums:
    """Watch ``root`` (an existing directory) and everything created under it; sum each OCDBT data file
    when it is closed after writing. ``entries(step_dir)`` then gives the sums still true, by path."""

    def __init__(self, root: str, workers: int = WORKERS, *, existing_dirs: bool = True) -> None:
        """``existing_dirs=False``: watch ``root`` and only the directories created under it from now on (a
        job's directory holds every step: watching each one's tree on every save would cost a watch and a
        descriptor per directory)."""
        self.root = root
        self._lock = threading.Lock()
        self._sums: dict[tuple[int, int], Future[tuple[Signature, int, str] | None]] = {}
        self._dirs: dict[int, tuple[str, int]] = {}  # watch -> (path when watched, an open descriptor of it)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-crc-early")
        self._libc = _libc()
        self._fd = -1
        self._thread: threading.Thread | None = None
        if self._libc is None:
            return
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            return
        self._fd = fd
        if existing_dirs:
            self._watch_tree(root)
        else:
            self._watch(root)
        self._thread = threading.Thread(target=self._run, name="ckptd-crc-watch", daemon=True)
        self._thread.start()

    @property
    def watching(self) -> bool:
        return self._thread is not None

    def _watch(self, path: str) -> None:
        assert self._libc is not None
        try:  # held open: a file is opened through it, wherever the directory has been renamed to since
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _MASK)
        if wd < 0 or wd in self._dirs:
            os.close(dir_fd)
            return
        self._dirs[wd] = (path, dir_fd)

    def _watch_tree(self, path: str) -> None:
        """Watch ``path`` and the directories already under it (files already there are not summed here:
        whether their writer has closed them is not known)."""
        self._watch(path)
        try:
            with os.scandir(path) as it:
                subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for sub in subdirs:
            self._watch_tree(sub)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()  # once asked to stop: what is queued still counts, then out
            ready, _, _ = select.select([self._fd], [], [], 0 if stopping else 0.05)
            if ready and not self._read_events():
                return
            if stopping and not ready:
                return

    def _read_events(self) -> bool:
        """Handle the events queued now; False when the descriptor is unusable."""
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return True
        except OSError:
            return False
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            watched = self._dirs.get(wd)
            if watched is None or mask & IN_Q_OVERFLOW:
                continue
            parent, dir_fd = watched
            if mask & IN_ISDIR:
                if mask & IN_CREATE:
                    self._watch_tree(os.path.join(parent, os.fsdecode(name)))
            elif mask & IN_CLOSE_WRITE and os.path.basename(parent) == DATA_DIR:
                self._submit(name, dir_fd)
        return True

    def _submit(self, name: bytes, dir_fd: int) -> None:
        try:  # through its directory's descriptor: Orbax renames the item's directory when the write ends
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            if key not in self._sums:
                self._sums[key] = self._pool.submit(self._sum, fd, _signature(st))
                return
        os.close(fd)

    @staticmethod
    def _sum(fd: int, before: Signature) -> tuple[Signature, int, str] | None:
        try:
            size, crc = file_crc32c(f"/proc/self/fd/{fd}")  # the file opened, wherever it is now
            after = _signature(os.fstat(fd))
        except OSError:
            return None
        finally:
            os.close(fd)
        return (before, size, crc) if after == before and size == before[0] else None

    def close(self) -> None:
        """Stop watching, once the events queued so far are handled (sums already started finish;
        ``entries`` still answers)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for _path, dir_fd in self._dirs.values():
            os.close(dir_fd)
        self._dirs.clear()

    def entries(self, step_dir: str) -> dict[str, tuple[int, str]]:
        """Stop watching; for every file under ``step_dir`` summed since and unchanged since, its path
        (relative, ``/``-separated) -> (size, CRC32C base64). Waits for the sums in progress."""
        self.close()
        out: dict[str, tuple[int, str]] = {}
        with self._lock:
            sums = dict(self._sums)
        if not sums:
            return out
        for current, _dirs, files in os.walk(step_dir):
            if os.path.basename(current) != DATA_DIR:
                continue
            for name in files:
                path = os.path.join(current, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                future = sums.get((st.st_dev, st.st_ino))
                done = future.result() if future is not None else None
                if done is not None and done[0] == _signature(st):
                    out[os.path.relpath(path, step_dir).replace(os.sep, "/")] = (done[1], done[2])
        return out

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=True)


__all__ = ["ClosedFileSums"]
