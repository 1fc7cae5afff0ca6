"""ckptd's per-step manifest: every file of a step with its size and CRC32C, plus the arrays and training
metadata, so a step can be checked end to end — something neither Orbax nor PyTorch DCP records.

Written by trainer_client *inside* the step before Orbax commits it (Orbax's post-finalization callback
runs before the commit marker and the rename), so a committed step saved by trainer_client always has
one. Steps written by plain Orbax get one "at first sight" from ckptd (``writer: "adopted"``).

Two files of a step change after the manifest is written: Orbax rewrites ``_CHECKPOINT_METADATA`` with the
commit time, and writes ``commit_success.txt``. ckptd records their checksums in a small *seal* file when
it first verifies the step, so deep validation covers every byte of the step from then on.

Orbax ignores all three files (``ckptd_manifest.json``, ``ckptd_seal.json``, ``ckptd_quarantine.json``):
plain Orbax restores a step that has them. No jax here.
"""

from __future__ import annotations

import base64
import json
import posixpath
import time
from collections.abc import Callable
from typing import Literal

import google_crc32c
from pydantic import BaseModel, ConfigDict, Field

from trainer_client.layout import CHECKPOINT_METADATA, COMMIT_MARKER
from trainer_client.protocol import ArraySpec, TrainingMetadata
from trainer_client.storage import Storage

MANIFEST_FILE = "ckptd_manifest.json"
SEAL_FILE = "ckptd_seal.json"
QUARANTINE_FILE = "ckptd_quarantine.json"
MANIFEST_FORMAT = "ckptd-manifest/1"
# Files that are not (or not yet) final when the manifest is written, or are ckptd's own.
UNMANIFESTED = frozenset({CHECKPOINT_METADATA, COMMIT_MARKER, MANIFEST_FILE, SEAL_FILE, QUARANTINE_FILE})
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


class Seal(_Model):
    """Checksums of the files Orbax finished after the manifest was written."""

    sealed_at: float
    files: dict[str, FileEntry]


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
    with storage.fs.open(path, "rb") as f:
        size, crc = crc32c_of(lambda: f.read(_CHUNK))
    return FileEntry(size=size, crc32c=crc)


def list_files(storage: Storage, step_path: str) -> dict[str, int]:
    """Every file under ``step_path`` (relative posix path -> size)."""
    storage.invalidate(step_path)
    base = storage.fs._strip_protocol(step_path).rstrip("/") + "/"
    out = {}
    for name, info in storage.fs.find(step_path, detail=True).items():
        name = str(name)
        if info.get("type") != "directory" and name.startswith(base) and len(name) > len(base):
            out[name[len(base):]] = int(info.get("size") or 0)
    return out


def remote_crc32c(storage: Storage, path: str) -> str | None:
    """The CRC32C the object store keeps for ``path`` (GCS), or None on a local disk."""
    if not storage.is_remote:
        return None
    value = storage.fs.info(path).get("crc32c")
    return str(value) if value else None


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
    for rel in sorted(list_files(storage, step_path)):
        if posixpath.basename(rel) in UNMANIFESTED and "/" not in rel:
            continue
        full = f"{step_path.rstrip('/')}/{rel}"
        remote = remote_crc32c(storage, full)
        if remote is not None:
            files[rel] = FileEntry(size=int(storage.fs.info(full)["size"]), crc32c=remote)
        else:
            files[rel] = file_entry(storage, full)
    return Manifest(step=step, writer=writer, created_at=time.time(), files=files, arrays=arrays or {},
                    training=training)


def write_json_file(storage: Storage, path: str, payload: str) -> None:
    with storage.fs.open(path, "wb") as f:
        f.write(payload.encode("utf-8"))


def write_manifest(storage: Storage, step_path: str, manifest: Manifest) -> str:
    path = f"{step_path.rstrip('/')}/{MANIFEST_FILE}"
    write_json_file(storage, path, manifest.model_dump_json(indent=1))
    return path


def read_manifest(storage: Storage, step_path: str) -> Manifest | None:
    """The step's manifest; None when it has none. ``ValueError`` when it is unreadable."""
    try:
        raw = storage.read_bytes(f"{step_path.rstrip('/')}/{MANIFEST_FILE}")
    except FileNotFoundError:
        return None
    return Manifest.model_validate_json(raw)


def read_seal(storage: Storage, step_path: str) -> Seal | None:
    try:
        raw = storage.read_bytes(f"{step_path.rstrip('/')}/{SEAL_FILE}")
    except FileNotFoundError:
        return None
    return Seal.model_validate_json(raw)


def write_seal(storage: Storage, step_path: str) -> Seal:
    """Seal the files Orbax finished after the manifest (the commit marker and final step metadata)."""
    files = {name: file_entry(storage, f"{step_path.rstrip('/')}/{name}") for name in SEALED}
    seal = Seal(sealed_at=time.time(), files=files)
    write_json_file(storage, f"{step_path.rstrip('/')}/{SEAL_FILE}", seal.model_dump_json(indent=1))
    return seal


def quarantine_record(step_path: str, reason: str, problems: list[str]) -> str:
    return json.dumps(
        {"quarantined_at": time.time(), "reason": reason, "problems": problems[:100], "path": step_path}, indent=1
    )


__all__ = [
    "MANIFEST_FILE",
    "QUARANTINE_FILE",
    "SEALED",
    "SEAL_FILE",
    "UNMANIFESTED",
    "FileEntry",
    "Manifest",
    "Seal",
    "build_manifest",
    "crc32c_b64",
    "crc32c_of",
    "file_entry",
    "list_files",
    "quarantine_record",
    "read_manifest",
    "read_seal",
    "remote_crc32c",
    "write_json_file",
    "write_manifest",
    "write_seal",
]
