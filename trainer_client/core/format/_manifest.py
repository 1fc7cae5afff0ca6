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

Each array is recorded once: in ``training.arrays`` (the copy of what ``_CHECKPOINT_METADATA`` says), and in
the top-level ``arrays`` only when a manifest has no training metadata of its own or other arrays (older
manifests hold both copies; they are read as before). The checksum is the CRC32C of the manifest's compact
JSON without the field, as pydantic renders it; it is checked by rendering the parsed document with orjson
(the same bytes, ``json_docs.dumps``), and only when that disagrees by pydantic's own rendering, so reading a
manifest does not validate and re-serialize thousands of entries twice (docs/operations.md, "First sight").

Orbax ignores ckptd's files (``ckptd_manifest.json``, ``ckptd_verified.json``, ``ckptd_quarantine.json``):
plain Orbax restores a step that has them. No jax here.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Literal

import google_crc32c
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from trainer_client.core._identity import step_identity
from trainer_client.core._storage import Entry, Storage, join_path, storage_errors
from trainer_client.core._whole_files import write_json_file
from trainer_client.core.format._checksum import crc32c_b64, file_crc32c, files_crc32c
from trainer_client.core.format._files import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    VERIFIED_FILE,
)
from trainer_client.core.format._json_docs import dumps, dumps_sharing, loads_sharing, rendered_arrays, validated_arrays
from trainer_client.core.format._records import RecordPlace, read_record
from trainer_client.core.format._step_files import Listed, list_files, newest_file_time
from trainer_client.core.protocol import ArraySpec, StepIdentity, TrainingMetadata

MANIFEST_FORMAT = "ckptd-manifest/1"
# Files that are not (or not yet) final when the manifest is written, or are ckptd's own.
UNMANIFESTED = frozenset({CHECKPOINT_METADATA, COMMIT_MARKER, CKPTD_MANIFEST, QUARANTINE_FILE, VERIFIED_FILE})
SEALED = (CHECKPOINT_METADATA, COMMIT_MARKER)
_CHUNK = 8 << 20
MANIFEST_ARRAYS = ("training", "arrays")  # where a manifest holds the per-array part (``json_docs.loads_sharing``)
# What stands in for a layout rendered once (``_rendered_body``): one array under a name no manifest holds.
_STAND_IN_ARRAYS = {f"ckptd-stand-in-{secrets.token_hex(12)}": ArraySpec(partition_spec=[])}
_STAND_IN_RENDERED = TypeAdapter(dict[str, ArraySpec]).dump_json(_STAND_IN_ARRAYS)


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
    """Read ``path`` through and checksum it (on a local disk in small reads: ``checksum.py``)."""
    with storage_errors(f"cannot read {storage.url_of(path)}"):
        if not storage.is_remote:
            size, crc = file_crc32c(path)
        else:
            with storage.fs.open(path, "rb") as f:
                size, crc = crc32c_of(lambda: f.read(_CHUNK))
    return FileEntry(size=size, crc32c=crc)


def file_entries(storage: Storage, paths: list[str]) -> dict[str, FileEntry]:
    """``file_entry`` of each path: on a local disk several files at a time (``checksum.py``), on an object
    store one after another (prefer the CRC32C its listing gives, as ``build_manifest`` does)."""
    if storage.is_remote or not paths:
        return {path: file_entry(storage, path) for path in paths}
    with storage_errors(f"cannot read the files under {storage.url_of(os.path.commonpath(paths))}"):
        return {path: FileEntry(size=size, crc32c=crc) for path, (size, crc) in files_crc32c(paths).items()}


def build_manifest(storage: Storage, step_path: str, *, step: int, writer: Literal["trainer_client", "adopted"],
                   arrays: dict[str, ArraySpec] | None = None, training: TrainingMetadata | None = None,
                   known: Mapping[str, tuple[int, str]] | None = None) -> Manifest:
    """Checksum every file of the step (but the unmanifested ones): on GCS the object store's CRC32C; on a
    local disk the files are read back (``checksum.py``) but those in ``known`` at the listed size (path ->
    (size, CRC32C) read back as the writer closed them, ``core.written_crc``). ``arrays`` are kept apart
    from ``training.arrays`` only when they differ (each array is recorded once)."""
    files = {}
    unlisted = []  # no CRC32C in the listing: read back
    for rel, listed in sorted(list_files(storage, step_path).items()):
        if rel in UNMANIFESTED:
            continue
        if listed.crc32c is not None:
            files[rel] = FileEntry(size=listed.size, crc32c=listed.crc32c)
        elif known is not None and (entry := known.get(rel)) is not None and entry[0] == listed.size:
            files[rel] = FileEntry(size=entry[0], crc32c=entry[1])
        else:
            unlisted.append(rel)
    read = file_entries(storage, [join_path(step_path, rel) for rel in unlisted])
    files.update({rel: read[join_path(step_path, rel)] for rel in unlisted})
    files = dict(sorted(files.items()))
    if training is not None and arrays is not None and (arrays is training.arrays or arrays == training.arrays):
        arrays = None  # the training metadata holds them
    return Manifest(step=step, writer=writer, created_at=time.time(), files=files, arrays=arrays or {},
                    training=training, identity=step_identity(storage, step_path, training))


def write_manifest(storage: Storage, step_path: str, manifest: Manifest, *, read_only: bool = False,
                   sync: Callable[[str], None] | None = None) -> Manifest:
    """Write ``manifest`` with its own checksum filled in; returns what was written. ``read_only``: to the
    side prefix, not into the step (``records.py``); ``sync``: as for ``write_json_file``."""
    path = RecordPlace(step_path, read_only).write_path(CKPTD_MANIFEST)
    body = _rendered_body(manifest)  # rendered once: summed and written
    checksum = crc32c_b64(google_crc32c.value(body))
    write_json_file(storage, path, _with_checksum(body, checksum), sync=sync)
    return manifest.model_copy(update={"checksum": checksum})


def _rendered_body(manifest: Manifest) -> bytes:
    """``manifest.model_dump_json(exclude={"checksum"})``, its training metadata's arrays rendered once per
    layout (``json_docs.rendered_arrays``; the rest with a stand-in there, the stand-in's bytes replaced)."""
    training = manifest.training
    arrays = rendered_arrays(training.arrays) if training is not None and training.arrays else None
    if training is None or arrays is None:
        return manifest.model_dump_json(exclude={"checksum"}).encode("utf-8")
    stand_in = training.model_copy(update={"arrays": _STAND_IN_ARRAYS})
    body = manifest.model_copy(update={"training": stand_in}).model_dump_json(exclude={"checksum"}).encode("utf-8")
    if body.count(_STAND_IN_RENDERED) != 1:
        return manifest.model_dump_json(exclude={"checksum"}).encode("utf-8")
    return body.replace(_STAND_IN_RENDERED, arrays)


def _with_checksum(body: bytes, checksum: str) -> bytes:
    """The compact JSON of the manifest from that of the manifest without its checksum (the last field)."""
    if not body.endswith(b"}") or len(body) < 3:
        raise ValueError("not a rendered manifest")
    return body[:-1] + b',"checksum":' + dumps(checksum) + b"}"


def _present(doc: dict[str, object], key: str) -> bool:
    return key in doc and doc[key] != {}


def _checksum_holds(raw: bytes, doc: dict[str, object], stored: str) -> bool:
    """Whether the manifest's own checksum ``stored`` (taken out of ``doc``, the parsed ``raw``) matches its
    content rendered compactly: checked on ``raw`` itself when it is that rendering with the checksum last
    (what ``write_manifest`` writes: every byte of it is then covered), else on orjson's rendering of
    ``doc``. False sends the caller to pydantic's rendering."""
    end = b',"checksum":' + dumps(stored) + b"}"
    if raw.endswith(end) and crc32c_b64(google_crc32c.value(raw[:-len(end)] + b"}")) == stored:
        return True
    try:
        body = dumps_sharing(doc, MANIFEST_ARRAYS)
    except (TypeError, ValueError):
        return False
    return crc32c_b64(google_crc32c.value(body)) == stored


def parse_manifest(raw: bytes) -> Manifest:
    """A manifest from its bytes, parsed once; ``ValueError`` (pydantic's ``ValidationError`` is one) when it
    does not parse, is not a valid manifest or its own checksum does not match."""
    doc = loads_sharing(raw, MANIFEST_ARRAYS)
    stored = doc.pop("checksum", None) if isinstance(doc, dict) else None
    if isinstance(stored, str) and _checksum_holds(raw, doc, stored):
        # The content is what its writer summed: validate it, each array's entry once per distinct layout.
        training = doc.get("training")
        light = {**doc, "checksum": stored, "arrays": {}}
        if isinstance(training, dict):
            light["training"] = {**training, "arrays": {}}
        manifest = Manifest.model_validate(light)
        update: dict[str, object] = {}
        if _present(doc, "arrays"):
            update["arrays"] = validated_arrays(doc["arrays"])
        if manifest.training is not None and isinstance(training, dict) and _present(training, "arrays"):
            update["training"] = manifest.training.model_copy(
                update={"arrays": validated_arrays(training["arrays"])})
        return manifest.model_copy(update=update) if update else manifest
    # Not the orjson rendering: pydantic's own (how every manifest is summed), or a mismatch.
    manifest = Manifest.model_validate_json(raw)
    if manifest.checksum != manifest.model_copy(update={"checksum": ""}).computed_checksum():
        raise ValueError("manifest checksum does not match its content")
    return manifest


def read_manifest(storage: Storage, step_path: str) -> Manifest | None:
    """The step's manifest (the side prefix's when there is one: ``records.py``); None when it has none.
    ``ValueError`` when it is unreadable or its own checksum does not match."""
    found = read_record(storage, step_path, CKPTD_MANIFEST)
    if found is None:
        return None
    return parse_manifest(found[1])


def seal_manifest(storage: Storage, step_path: str, manifest: Manifest, *, read_only: bool = False,
                  listed: dict[str, Listed] | None = None, sync: Callable[[str], None] | None = None) -> Manifest:
    """Add the files Orbax finished after the manifest (final step metadata, commit marker). ``listed``: the
    step's files as just listed (``list_files``); on an object store their CRC32C is taken from there, as
    ``build_manifest`` takes it, instead of downloading them again. ``sync``: as for ``write_json_file``."""
    files = {}
    for name in SEALED:
        seen = (listed or {}).get(name)
        files[name] = (FileEntry(size=seen.size, crc32c=seen.crc32c) if seen is not None and seen.crc32c
                       else file_entry(storage, join_path(step_path, name)))
    return write_manifest(storage, step_path, manifest.model_copy(update={"sealed": files, "sealed_at": time.time()}),
                          read_only=read_only, sync=sync)


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
    # not fsynced: losing it in a power cut costs a re-verification; a torn one fails its checksum
    write_json_file(storage, RecordPlace(step_path, read_only).write_path(VERIFIED_FILE),
                    record.model_dump_json(indent=1), durable=False)
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
    "file_entries",
    "file_entry",
    "fingerprints",
    "list_files",
    "newest_file_time",
    "parse_manifest",
    "quarantine_record",
    "read_manifest",
    "read_verified_record",
    "seal_manifest",
    "training_summary",
    "write_manifest",
    "write_verified_record",
]
