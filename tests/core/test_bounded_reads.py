"""Every file ckptd reads whole is size-checked before a byte is read (``Storage.read_bytes``, ``read_fd``;
docs/operations.md, "What each limit defends"): a 1 GiB sparse claim once cost 1,075 MiB of RSS, a 768 MiB
lease beat 1.6 GiB in each sidecar. The peak memory is measured in a fresh process (``/proc/self/status``,
its peak reset first), locally and on the GCS emulator; a FIFO planted as a record does not block the read,
a directory is not a record, and a record at the bound still reads."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.gcs_emulator import GcsEmulator  # the gcs_emulator fixture: tests/conftest.py, one per session
from tests.support.peak_rss import peak_growth
from trainer_client.core._errors import RecordTooLargeError, StoredFormatError
from trainer_client.core._storage import MAX_RECORD_BYTES, Storage
from trainer_client.core.format._private_files import ensure_private_dir, read_private, write_private

GIB = 1 << 30
GROWTH_LIMIT_MIB = 24  # what the reads may add to the process's peak RSS (before: the file's whole size)

_IMPORTS = """
from trainer_client.core.format._item_keys import fetch, item_kvstore_spec
from trainer_client.core.format._parts import read_claim
from trainer_client.core.format._private_files import read_private
from trainer_client.core._storage import Storage
"""
_SETUP = """
storage = Storage(args["root"])
for path in args["warm_up"]:  # a first request sets up a client (on GCS tens of MiB): not what is measured
    storage.read_bytes(path)
"""
_READS = """
for kind, arg in args["reads"]:  # each as ckptd reads it
    try:
        if kind == "claim":
            outcomes.append("none" if read_claim(storage, arg[0], arg[1]) is None else "claim")
        elif kind == "item":
            outcomes.append(len(fetch(item_kvstore_spec(arg, "default"), 10.0)[1]))
        elif kind == "private":
            outcomes.append(len(read_private(arg, max_bytes=64 << 20)))
        else:
            outcomes.append(len(storage.read_bytes(arg)))
    except Exception as exc:
        outcomes.append(type(exc).__name__)
"""


def _measure(root: str, reads: list[tuple[str, Any]], warm_up: tuple[str, ...] = ()) -> dict[str, Any]:
    return peak_growth(_IMPORTS, _READS, {"root": root, "reads": reads, "warm_up": warm_up}, setup=_SETUP)


def _sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)  # a hole: no disk used, but whole reads of it fill memory
    return path


def test_a_sparse_gibibyte_record_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    claim = _sparse(tmp_path / "job" / ".ckptd" / "claims" / "7.json", GIB)
    manifest = _sparse(tmp_path / "job" / "7" / "ckptd_manifest.json", GIB)
    _sparse(tmp_path / "job" / "7" / "default" / "_METADATA", GIB)  # Orbax's, read without tensorstore
    private = tmp_path / "shm"
    ensure_private_dir(private)
    write_private(private / "snapshot.json", b"{}")
    os.truncate(private / "snapshot.json", GIB)
    result = _measure(str(tmp_path), [("claim", ["job", 7]), ("bytes", str(manifest)),
                                      ("private", str(private / "snapshot.json")), ("item", str(manifest.parent))])
    assert result["outcomes"] == ["none", "RecordTooLargeError", "RecordTooLargeError", "ArrayIndexError"]
    assert result["grew_mib"] < GROWTH_LIMIT_MIB, result
    assert claim.stat().st_size == GIB  # reported and skipped, never deleted


def test_a_sparse_item_metadata_is_refused_by_the_trainers_direct_restore(tmp_path: Path) -> None:
    _sparse(tmp_path / "default" / "_METADATA", GIB)
    result = peak_growth("from trainer_client.runtime.restore._direct_restore import restore_direct",
                         "try:\n    restore_direct(args['item'], {}, str)\nexcept Exception as exc:\n"
                         "    outcomes.append(f'{type(exc).__name__}: {exc}')", {"item": str(tmp_path / "default")})
    assert result["outcomes"][0].startswith("DirectRestoreUnsupported") and "more than" in result["outcomes"][0]
    assert result["grew_mib"] < GROWTH_LIMIT_MIB, result


def test_a_record_at_the_bound_reads_and_one_byte_more_does_not(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    (tmp_path / "r.json").write_bytes(b"x" * 100)
    assert storage.read_bytes(str(tmp_path / "r.json"), max_bytes=100) == b"x" * 100
    with pytest.raises(RecordTooLargeError, match="101 bytes, more than the 100"):
        (tmp_path / "r.json").write_bytes(b"x" * 101)
        storage.read_bytes(str(tmp_path / "r.json"), max_bytes=100)
    assert storage.read_bytes(str(tmp_path / "r.json")) == b"x" * 101  # the default bound: MAX_RECORD_BYTES
    (tmp_path / "empty.json").write_bytes(b"")
    assert storage.read_bytes(str(tmp_path / "empty.json")) == b""
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(str(tmp_path / "absent.json"))


def test_a_fifo_or_a_directory_planted_as_a_record_is_not_a_record(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    os.mkfifo(tmp_path / "fifo.json")  # nobody writes it: an open that waits for a writer never returns
    (tmp_path / "dir.json").mkdir()
    started = time.monotonic()
    for name in ("fifo.json", "dir.json"):
        with pytest.raises(StoredFormatError, match="is not a regular file"):
            storage.read_bytes(str(tmp_path / name))
    assert time.monotonic() - started < 5


def test_a_private_file_past_its_bound_is_refused_by_its_size(tmp_path: Path) -> None:
    ensure_private_dir(tmp_path / "shm")
    write_private(tmp_path / "shm" / "snapshot.json", b"{}" * 10)
    assert read_private(tmp_path / "shm" / "snapshot.json", max_bytes=20) == b"{}" * 10
    with pytest.raises(RecordTooLargeError):
        read_private(tmp_path / "shm" / "snapshot.json", max_bytes=19)


def test_an_oversized_object_is_refused_by_its_size_on_gcs(gcs_emulator: GcsEmulator) -> None:
    root = gcs_emulator.gs(f"bounded-{uuid.uuid4().hex[:8]}")
    storage = Storage(root)
    big = storage.join("job", "7", "ckptd_manifest.json")
    storage.fs.pipe_file(big, b"\0" * (MAX_RECORD_BYTES + (16 << 20)))  # 80 MiB: the emulator keeps it in memory
    small = storage.join("job", "7", "_CHECKPOINT_METADATA")
    storage.fs.pipe_file(small, b"{}" * 50)
    empty = storage.join("job", "7", "empty.json")
    storage.fs.pipe_file(empty, b"")
    try:
        result = _measure(root, [("bytes", big), ("bytes", small), ("bytes", empty)], warm_up=(small,))
        assert result["outcomes"] == ["RecordTooLargeError", 100, 0]
        assert result["grew_mib"] < GROWTH_LIMIT_MIB, result
        assert storage.read_bytes(small, max_bytes=100) == b"{}" * 50
        with pytest.raises(RecordTooLargeError):
            storage.read_bytes(small, max_bytes=99)
        with pytest.raises(FileNotFoundError):
            storage.read_bytes(storage.join("job", "7", "absent.json"))
    finally:
        storage.fs.rm(storage.join("job"), recursive=True)
