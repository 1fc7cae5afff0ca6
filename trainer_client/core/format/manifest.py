"""ckptd's per-step manifest: every file of a step with its size and CRC32C, plus the arrays and training
metadata, so a step can be checked end to end — something neither Orbax nor PyTorch DCP records.

Written by trainer_client *inside* the step before Orbax commits it (Orbax's post-finalization callback
runs before the commit marker and the rename), so a committed step saved by trainer_client always has
one. Steps written by plain Orbax get one "at first sight" from ckptd (``writer: "adopted"``).

Two files of a step change after the manifest is written: Orbax rewrites ``_CHECKPOINT_METADATA`` with the
commit time, and writes ``commit_success.txt``. ckptd *seals* the manifest when it first verifies the step:
it adds their checksums, so deep validation covers every byte of the step from then on. The manifest
carries a checksum of itself, so a flipped byte in it is caught too.

Once a step is verified ckptd writes a small *verified record* beside the manifest (``ckptd_verified.json``:
when, the manifest's checksum, and the training metadata without its per-array part). It is to a good
verdict what the quarantine record is to a bad one: any ckptd that starts later catalogues the step from
that one small file instead of re-reading and re-validating megabytes of metadata per step. A quarantine
record wins over it; the step named in an answer is still checked against storage first.

Orbax ignores ckptd's files (``ckptd_manifest.json``, ``ckptd_verified.json``, ``ckptd_quarantine.json``):
plain Orbax restores a step that has them. No jax here.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import google_crc32c
from pydantic import BaseModel, ConfigDict, Field

from trainer_client.core.format.files import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    VERIFIED_FILE,
)
from trainer_client.core.format.records import RecordPlace, read_record
from trainer_client.core.identity import step_identity
from trainer_client.core.protocol import ArraySpec, StepIdentity, TrainingMetadata
from trainer_client.core.storage import Entry, Storage, join_path, mtime_of, storage_errors

MANIFEST_FORMAT = "ckptd-manifest/1"
# Files that are not (or not yet) final when the manifest is written, or are ckptd's own.
UNMANIFESTED = frozenset({CHECKPOINT_METADATA, COMMIT_MARKER, CKPTD_MANIFEST, QUARANTINE_FILE, VERIFIED_FILE})
SEALED = (CHECKPOINT_METADATA, COMMIT_MARKER)
_CHUNK = 8 << 20


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileEntry(_Model):
    size: int = Field(ge=0)
    crc32c: str = Field(description="base64 of the big-endian CRC32C, as GCS reports it")


class Manifest(_Model):
    format: Literal["ckptd-manifest/1"] = "ckptd-manifest/1"
    step: int
    writer: Literal["trainer_client", "adopted"]
    created_at: float
    files: dict[str, FileEntry]
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    training: TrainingMetadata | None = None
    sealed: dict[str, FileEntry] | None = Field(
        default=None, description="files Orbax finished after the manifest, checksummed at verification"
    )
    sealed_at: float | None = None
    identity: StepIdentity | None = Field(
        default=None, exclude_if=lambda v: v is None,  # absent from older manifests: their checksums still hold
        description="job, run, process count and mesh of the save (docs/protocol.md, Identity)",
    )
    checksum: str = Field(default="", description="CRC32C of this manifest without this field")

    def expected_files(self) -> dict[str, FileEntry]:
        return {**self.files, **(self.sealed or {})}

    def computed_checksum(self) -> str:
        body = self.model_dump_json(exclude={"checksum"}).encode("utf-8")
        return base64.b64encode(google_crc32c.value(body).to_bytes(4, "big")).decode("ascii")


def crc32c_b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_of(read_chunks: Callable[[], bytes], chunk: int = _CHUNK) -> tuple[int, str]:
    """Size and CRC32C (base64) of a stream given as a ``read(n)``-like callable."""
    checksum = google_crc32c.Checksum()
    size = 0
    while True:
        data = read_chunks()
        if not data:
            break
        checksum.update(data)
        size += len(data)
    return size, base64.b64encode(checksum.digest()).decode("ascii")


def file_entry(storage: Storage, path: str) -> FileEntry:
    """Read ``path`` through and checksum it."""
    with storage_errors(f"cannot read {storage.url_of(path)}"), storage.fs.open(path, "rb") as f:
        size, crc = crc32c_of(lambda: f.read(_CHUNK))
    return FileEntry(size=size, crc32c=crc)


@dataclass(frozen=True)
class Listed:
    """A file as a listing shows it: its size, and the object store's CRC32C where there is one."""

    size: int
    crc32c: str | None


def list_files(storage: Storage, step_path: str) -> dict[str, Listed]:
    """Every file under ``step_path`` (relative posix path -> size and object CRC32C), one listing."""
    storage.invalidate(step_path)
    base = storage.fs._strip_protocol(step_path).rstrip("/") + "/"
    out = {}
    with storage_errors(f"cannot list {storage.url_of(step_path)}"):
        found = storage.fs.find(step_path, detail=True)
    for name, info in found.items():
        name = str(name)
        if info.get("type") != "directory" and name.startswith(base) and len(name) > len(base):
            crc = info.get("crc32c") if storage.is_remote else None
            out[name[len(base):]] = Listed(int(info.get("size") or 0), str(crc) if crc else None)
    return out


def newest_file_time(storage: Storage, step_path: str) -> float | None:
    """When any file under ``step_path`` last changed (None when nothing says). On a local disk the
    inode change time counts too: a copy that preserves modification times still shows when it landed."""
    times = []
    for info in storage.fs.find(step_path, detail=True).values():
        for value in (mtime_of(info), info.get("created") if not storage.is_remote else None):
            if isinstance(value, int | float):
                times.append(float(value))
    return max(times) if times else None


def build_manifest(
    storage: Storage,
    step_path: str,
    *,
    step: int,
    writer: Literal["trainer_client", "adopted"],
    arrays: dict[str, ArraySpec] | None = None,
    training: TrainingMetadata | None = None,
) -> Manifest:
    """Checksum every file of the step (but the unmanifested ones). On GCS the object store's own
    CRC32C is used, so nothing is downloaded."""
    files = {}
    for rel, listed in sorted(list_files(storage, step_path).items()):
        if rel in UNMANIFESTED:
            continue
        if listed.crc32c is not None:
            files[rel] = FileEntry(size=listed.size, crc32c=listed.crc32c)
        else:
            files[rel] = file_entry(storage, join_path(step_path, rel))
    return Manifest(step=step, writer=writer, created_at=time.time(), files=files, arrays=arrays or {},
                    training=training, identity=step_identity(storage, step_path, training))


def write_json_file(storage: Storage, path: str, payload: str) -> None:
    """Write a small file whole: an object store replaces objects atomically; on a local disk the file
    is written beside and renamed over, so a crash never leaves half a manifest. Never through a link that
    leads out of the root (``UnsafePathError``)."""
    storage.require_inside(path)
    data = payload.encode("utf-8")
    if storage.is_remote:
        with storage_errors(f"cannot write {storage.url_of(path)}"), storage.fs.open(path, "wb") as f:
            f.write(data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a record on the side prefix: its directory may be new
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(storage: Storage, step_path: str, manifest: Manifest, *, read_only: bool = False) -> Manifest:
    """Write ``manifest`` with its own checksum filled in; returns what was written. ``read_only``: to the
    side prefix, not into the step (``records.py``)."""
    path = RecordPlace(step_path, read_only).write_path(CKPTD_MANIFEST)
    written = manifest.model_copy(update={"checksum": ""})
    written = written.model_copy(update={"checksum": written.computed_checksum()})
    write_json_file(storage, path, written.model_dump_json(indent=1))
    return written


def read_manifest(storage: Storage, step_path: str) -> Manifest | None:
    """The step's manifest (the side prefix's when there is one: ``records.py``); None when it has none.
    ``ValueError`` when it is unreadable or its own checksum does not match."""
    found = read_record(storage, step_path, CKPTD_MANIFEST)
    if found is None:
        return None
    raw = found[1]
    manifest = Manifest.model_validate_json(raw)
    if manifest.checksum != manifest.model_copy(update={"checksum": ""}).computed_checksum():
        raise ValueError("manifest checksum does not match its content")
    return manifest


def seal_manifest(storage: Storage, step_path: str, manifest: Manifest, *, read_only: bool = False) -> Manifest:
    """Add the files Orbax finished after the manifest (final step metadata, commit marker)."""
    files = {name: file_entry(storage, join_path(step_path, name)) for name in SEALED}
    return write_manifest(storage, step_path, manifest.model_copy(update={"sealed": files, "sealed_at": time.time()}),
                          read_only=read_only)


# The step's own top-level files a verified record fingerprints: rewriting any of them (a new save under
# the same name, a broken copy, an unsealed manifest) sends the step through full verification again.
FINGERPRINTED = (CHECKPOINT_METADATA, COMMIT_MARKER, CKPTD_MANIFEST)


class VerifiedRecord(_Model):
    """A good verdict, on storage: the step passed quick validation against the manifest with this checksum,
    when its top-level files had these (size, modification time) fingerprints."""

    format: Literal["ckptd-verified/1"] = "ckptd-verified/1"
    step: int
    verified_at: float
    manifest_checksum: str
    writer: Literal["trainer_client", "adopted"]
    committed_at: float | None = None
    training: TrainingMetadata | None = Field(default=None, description="without its per-array part")
    fingerprints: dict[str, tuple[int, float]] = Field(default_factory=dict)
    checksum: str = Field(default="", description="CRC32C of this record without this field")

    def computed_checksum(self) -> str:
        return crc32c_b64(google_crc32c.value(self.model_dump_json(exclude={"checksum"}).encode("utf-8")))


def training_summary(training: TrainingMetadata | None) -> TrainingMetadata | None:
    """``training`` without ``arrays`` (thousands of entries for a large model): what catalogues keep."""
    return training.model_copy(update={"arrays": {}}) if training is not None and training.arrays else training


def fingerprints(entries: list[Entry]) -> dict[str, tuple[int, float]]:
    """(size, modification time) of the ``FINGERPRINTED`` files among a step directory's listed children."""
    return {e.name: (int(e.size or 0), float(e.mtime or 0.0)) for e in entries
            if e.name in FINGERPRINTED and not e.is_dir}


def _fresh_fingerprints(storage: Storage, step_path: str) -> dict[str, tuple[int, float]]:
    storage.invalidate(step_path)  # a cached listing would predate the seal
    return fingerprints(storage.list_dir(step_path))


def write_verified_record(
    storage: Storage, step_path: str, manifest: Manifest, committed_at: float | None, *, read_only: bool = False
) -> VerifiedRecord:
    record = VerifiedRecord(step=manifest.step, verified_at=time.time(), manifest_checksum=manifest.checksum,
                            writer=manifest.writer, committed_at=committed_at,
                            training=training_summary(manifest.training),
                            fingerprints=_fresh_fingerprints(storage, step_path))
    record = record.model_copy(update={"checksum": record.computed_checksum()})
    write_json_file(storage, RecordPlace(step_path, read_only).write_path(VERIFIED_FILE),
                    record.model_dump_json(indent=1))
    return record


def read_verified_record(storage: Storage, step_path: str) -> VerifiedRecord | None:
    """The step's verified record; None when it has none, it does not parse or its checksum does not match
    (then the step is verified again the full way, and the record rewritten)."""
    found = read_record(storage, step_path, VERIFIED_FILE)
    if found is None:
        return None
    try:
        record = VerifiedRecord.model_validate_json(found[1])
    except ValueError:
        return None
    return record if record.checksum == record.computed_checksum() else None


def quarantine_record(step_path: str, reason: str, problems: list[str]) -> str:
    return json.dumps(
        {"quarantined_at": time.time(), "reason": reason, "problems": problems[:100], "path": step_path}, indent=1
    )


__all__ = [
    "FINGERPRINTED",
    "SEALED",
    "UNMANIFESTED",
    "FileEntry",
    "Listed",
    "Manifest",
    "VerifiedRecord",
    "build_manifest",
    "crc32c_b64",
    "crc32c_of",
    "file_entry",
    "fingerprints",
    "list_files",
    "newest_file_time",
    "quarantine_record",
    "read_manifest",
    "read_verified_record",
    "seal_manifest",
    "training_summary",
    "write_json_file",
    "write_manifest",
    "write_verified_record",
]
