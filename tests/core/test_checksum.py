"""The manifest's CRC pass read several files at once in small reads (``checksum.py``) gives what one stream
read through fsspec gives, a changed byte still changes it, and ``sync_tree`` fsyncing files in parallel
still syncs every file before any directory and reports a failure. Synthetic files, no jax."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trainer_client.core._durability import Syncer, sync_tree, using_syncer
from trainer_client.core._storage import Storage
from trainer_client.core.format._checksum import READ_SIZE, file_crc32c, files_crc32c
from trainer_client.core.format._manifest import build_manifest, crc32c_of, file_entries, file_entry

SIZES = [0, 1, READ_SIZE - 1, READ_SIZE, READ_SIZE + 1, 3 * READ_SIZE + 17, 4096]


def _step(root: Path) -> Path:
    step = root / "job" / "7"
    (step / "d").mkdir(parents=True)
    for i, size in enumerate(SIZES):
        (step / ("d" if i % 2 else "") / f"f{i}").write_bytes(os.urandom(size))
    return step


def _sequential(storage: Storage, path: Path) -> tuple[int, str]:
    """The former way: one fsspec stream read in 8 MiB pieces."""
    with storage.fs.open(str(path), "rb") as f:
        return crc32c_of(lambda: f.read(8 << 20))


def test_parallel_crc_equals_the_sequential_one_and_a_changed_byte_changes_it(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    step = _step(tmp_path)
    files = sorted(str(p) for p in step.rglob("*") if p.is_file())
    expected = {p: _sequential(storage, Path(p)) for p in files}
    assert files_crc32c(files) == expected
    assert files_crc32c(files, workers=1) == expected
    manifest = build_manifest(storage, str(step), step=7, writer="adopted")
    assert list(manifest.files) == sorted(manifest.files)  # the order the manifest always had
    assert {str(step / rel): (e.size, e.crc32c) for rel, e in manifest.files.items()} == expected
    assert file_entry(storage, files[-1]).crc32c == expected[files[-1]][1]
    assert {p: (e.size, e.crc32c) for p, e in file_entries(storage, files).items()} == expected

    # One flipped byte in the middle of the biggest file (past the first read) is seen by both paths.
    big = max(files, key=os.path.getsize)
    data = bytearray(Path(big).read_bytes())
    data[len(data) // 2] ^= 0x01
    Path(big).write_bytes(bytes(data))
    assert files_crc32c(files)[big] != expected[big]
    assert file_crc32c(big) == _sequential(storage, Path(big))


def test_a_file_that_cannot_be_read_is_an_error_not_an_entry(tmp_path: Path) -> None:
    step = _step(tmp_path)
    with pytest.raises(FileNotFoundError):
        files_crc32c([str(step / "f0"), str(step / "missing")])
    with pytest.raises(IsADirectoryError):
        files_crc32c([str(step / "f0"), str(step / "d")])


class _Recorder(Syncer):
    def __init__(self, failing: str | None = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.threads: set[int] = set()
        self.failing = failing
        self._lock = threading.Lock()
        self._second = threading.Event()

    def fsync_file(self, path: str) -> None:
        with self._lock:
            self.events.append(("file", path))
            self.threads.add(threading.get_ident())
            first = len(self.events) == 1
            if len(self.events) == 2:
                self._second.set()
        if first:  # the others are handed out while this one is busy: it ends once another has begun
            self._second.wait(10)
        if path == self.failing:
            raise OSError(5, "EIO: simulated disk error", path)
        super().fsync_file(path)

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self.events.append(("dir", path))
        super().fsync_dir(path)


def test_sync_tree_syncs_every_file_in_parallel_before_any_directory(tmp_path: Path) -> None:
    step = _step(tmp_path)
    files = {str(p) for p in step.rglob("*") if p.is_file()}
    recorder = _Recorder()
    with using_syncer(recorder):
        assert sync_tree(str(step)) == len(files)
    kinds = [kind for kind, _ in recorder.events]
    assert {p for kind, p in recorder.events if kind == "file"} == files
    assert kinds == ["file"] * len(files) + ["dir", "dir"]  # every file before the directories
    assert [p for kind, p in recorder.events if kind == "dir"] == [str(step / "d"), str(step)]  # bottom-up
    assert len(recorder.threads) > 1  # several files at once

    failing = _Recorder(failing=str(step / "d" / "f1"))
    with using_syncer(failing), pytest.raises(OSError, match="EIO"):
        sync_tree(str(step))
    assert not [p for kind, p in failing.events if kind == "dir"]  # no directory synced after a failure
