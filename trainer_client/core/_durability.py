"""fsync, so a committed step survives a power loss and not just a process crash.

tensorstore fsyncs its data files, but Orbax writes ``_METADATA``, ``_CHECKPOINT_METADATA``,
``commit_success.txt`` and ``array_metadatas`` without fsync and does not fsync the directory after its
final rename (measured with strace). The writer therefore syncs every file of a step, and the step's
directories, before Orbax commits it; ckptd syncs the commit marker, the final metadata and the directory
entries (the renamed step in its job directory) before it reports the step good.

Local disks only: an object store's write is durable when it returns. The ``Syncer`` is swappable so
tests can record the order of operations.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

SYNC_WORKERS = 8  # files fsynced at once by ``sync_tree``


class Syncer:
    """Calls ``fsync(2)`` on files and directories."""

    def fsync_file(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_lock = threading.Lock()
_syncer: Syncer = Syncer()


def syncer() -> Syncer:
    return _syncer


@contextmanager
def using_syncer(replacement: Syncer) -> Iterator[Syncer]:
    """Route every fsync of this module through ``replacement`` (tests record with it)."""
    global _syncer
    with _lock:
        previous, _syncer = _syncer, replacement
    try:
        yield replacement
    finally:
        with _lock:
            _syncer = previous


def sync_tree(root: str, workers: int = SYNC_WORKERS) -> int:
    """fsync every file under ``root`` (``workers`` at a time: ``fsync`` releases the GIL, and the disk takes
    several flushes at once), then, once every file is synced, every directory bottom-up (``root`` included).

    Returns how many files were synced.
    """
    s = syncer()
    dirs: list[str] = []
    paths: list[str] = []
    for current, _subdirs, files in os.walk(root):
        dirs.append(current)
        paths.extend(os.path.join(current, name) for name in files)

    def synced(path: str) -> bool:
        try:
            s.fsync_file(path)
        except FileNotFoundError:  # another writer's temporary file, renamed since the listing
            return False
        return True

    if len(paths) <= 1 or workers <= 1:
        done = [synced(path) for path in paths]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(paths)), thread_name_prefix="ckptd-fsync") as pool:
            done = list(pool.map(synced, paths))  # a failure is raised once every fsync has ended
    for directory in reversed(dirs):
        s.fsync_dir(directory)
    return done.count(True)


def sync_paths(*paths: str) -> None:
    """fsync the given files and directories, in order (missing ones are skipped)."""
    s = syncer()
    for path in paths:
        if os.path.isdir(path):
            s.fsync_dir(path)
        elif os.path.exists(path):
            s.fsync_file(path)


__all__ = ["SYNC_WORKERS", "Syncer", "sync_paths", "sync_tree", "syncer", "using_syncer"]
