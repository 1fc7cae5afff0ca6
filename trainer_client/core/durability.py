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
from contextlib import contextmanager


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


def sync_tree(root: str) -> int:
    """fsync every file under ``root``, then every directory bottom-up (``root`` included).

    Returns how many files were synced.
    """
    s = syncer()
    count = 0
    dirs = []
    for current, _subdirs, files in os.walk(root):
        dirs.append(current)
        for name in files:
            try:
                s.fsync_file(os.path.join(current, name))
            except FileNotFoundError:  # another writer's temporary file, renamed since the listing
                continue
            count += 1
    for directory in reversed(dirs):
        s.fsync_dir(directory)
    return count


def sync_paths(*paths: str) -> None:
    """fsync the given files and directories, in order (missing ones are skipped)."""
    s = syncer()
    for path in paths:
        if os.path.isdir(path):
            s.fsync_dir(path)
        elif os.path.exists(path):
            s.fsync_file(path)


__all__ = ["Syncer", "sync_paths", "sync_tree", "syncer", "using_syncer"]
