"""The files of a step persisted from host parts (docs/multihost.md, section 5), jax-free: read by ckptd (the
part writers' claims and records, the leader's commit) and by the client's storage-scan fallback, which must
never take a step committed from parts unless every part's record is there.

```
<job>/.ckptd/claims/<step>.json              {"save_id", "process_count", "created_at"}: create-only
<job>/.ckptd/staging/<step>.<save_id>/       a local root's step until the leader commits it (renamed)
<step>/ckptd_parts/process_<k>.json          host k's part record (PartInfo), create-only, once durable
```
"""

from __future__ import annotations

import json
import posixpath
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_client.core.errors import StorageError
from trainer_client.core.format.files import OCDBT_PROCESS_PREFIX
from trainer_client.core.format.manifest import file_entry
from trainer_client.core.format.tree_paths import TreeEntry
from trainer_client.core.protocol import TrainingMetadata
from trainer_client.core.storage import Storage, join_path

PARTS_DIR = "ckptd_parts"
CLAIMS_DIR = ".ckptd/claims"
STAGING_DIR = ".ckptd/staging"
ARRAY_METADATAS = "array_metadatas"
ITER_ITEM = "iter"
MAX_RECORD_BYTES = 64 << 20


class PartFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    size: int = Field(ge=0)
    crc32c: str


class PartInfo(BaseModel):
    """One host's part record: what it wrote (files with checksums, the regions it wrote) and, for the
    leader's commit, what the step's metadata is made of (the training metadata, the tree, write shapes)."""

    model_config = ConfigDict(extra="forbid")
    save_id: str = Field(pattern=r"^[0-9a-f]{1,32}-[0-9]{1,19}$")
    process_index: int = Field(ge=0)
    process_count: int = Field(ge=2)
    sidecar: str = ""
    item: str
    has_iter: bool
    training: TrainingMetadata
    tree: list[TreeEntry]
    files: list[PartFile]
    arrays: dict[str, list[list[list[int]]]] = Field(description="per array, the regions this part wrote")
    write_shapes: dict[str, list[int]]
    written_at: float


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    save_id: str = Field(pattern=r"^[0-9a-f]{1,32}-[0-9]{1,19}$")
    process_count: int = Field(ge=2)
    created_at: float


def claim_path(storage: Storage, job: str, step: int) -> str:
    return storage.join(job, CLAIMS_DIR, f"{step}.json")


def step_path_for(storage: Storage, job: str, step: int, save_id: str) -> str:
    """Where the parts of one save of ``step`` are written: staged on a local root, in place on ``gs://``."""
    if storage.is_remote:
        return storage.join(job, str(step))
    return storage.join(job, STAGING_DIR, f"{step}.{save_id}")


def record_path(step_path: str, process_index: int) -> str:
    return join_path(step_path, PARTS_DIR, f"process_{process_index}.json")


def read_claim(storage: Storage, job: str, step: int) -> Claim | None:
    try:
        return Claim.model_validate_json(storage.read_bytes(claim_path(storage, job, step)))
    except (FileNotFoundError, StorageError, ValidationError, ValueError):
        return None


def make_claim(storage: Storage, job: str, step: int, save_id: str, process_count: int) -> Claim | None:
    """Create the claim of ``step`` for ``save_id`` (create-only), or find it; the claim that stands."""
    payload = Claim(save_id=save_id, process_count=process_count, created_at=time.time())
    if storage.create_new(claim_path(storage, job, step), payload.model_dump_json().encode()):
        return payload
    return read_claim(storage, job, step)


def read_part(storage: Storage, step_path: str, process_index: int) -> PartInfo | None:
    """A part record, or None when it is missing or unreadable."""
    try:
        raw = storage.read_bytes(record_path(step_path, process_index))
        if len(raw) > MAX_RECORD_BYTES:
            return None
        return PartInfo.model_validate_json(raw)
    except (FileNotFoundError, StorageError, ValidationError, ValueError):
        return None


def parts_of(storage: Storage, step_path: str, count: int) -> list[PartInfo | None]:
    return [read_part(storage, step_path, k) for k in range(count)]


def part_files(storage: Storage, step_path: str, item: str, process_index: int, process_count: int) -> list[PartFile]:
    """Every file host ``process_index``'s part wrote under ``step_path``, with size and CRC32C."""
    rels: list[str] = []
    roots = [f"{item}/{OCDBT_PROCESS_PREFIX}{process_index}", f"{item}/{ARRAY_METADATAS}/process_{process_index}",
             f"{ITER_ITEM}/process_{process_index}-of-{process_count}.json"]
    if process_index == 0:
        roots.append(f"{item}/_strings.json")
    for rel in roots:
        path = join_path(step_path, rel)
        if storage.is_dir(path):
            rels.extend(posixpath.relpath(found, step_path.rstrip("/")) for found in storage.fs.find(path))
        elif storage.exists(path):
            rels.append(rel)
    out = []
    for rel in sorted(rels):
        entry = file_entry(storage, join_path(step_path, rel))
        out.append(PartFile(path=rel, size=entry.size, crc32c=entry.crc32c))
    return out


def part_problems(storage: Storage, step_path: str) -> list[str]:
    """Why a step is not whole as a step committed from parts: empty for a step that was not (no
    ``ckptd_parts``) or whose every part record is there, of one save and one process count."""
    listing = join_path(step_path, PARTS_DIR)
    try:
        if not storage.is_dir(listing):
            return []
    except StorageError as exc:
        return [f"{PARTS_DIR}: {exc}"]
    first = read_part(storage, step_path, 0)
    if first is None:
        return [f"{PARTS_DIR}/process_0.json is missing or unreadable"]
    out = []
    for k, part in enumerate(parts_of(storage, step_path, first.process_count)):
        if part is None:
            out.append(f"{PARTS_DIR}/process_{k}.json is missing or unreadable")
        elif (part.save_id, part.process_count, part.process_index) != (first.save_id, first.process_count, k):
            out.append(f"{PARTS_DIR}/process_{k}.json is of another save ({part.save_id})")
    return out


def record_bytes(info: PartInfo) -> bytes:
    return json.dumps(info.model_dump(mode="json"), sort_keys=True).encode()


__all__ = [
    "CLAIMS_DIR",
    "PARTS_DIR",
    "STAGING_DIR",
    "Claim",
    "PartFile",
    "PartInfo",
    "claim_path",
    "make_claim",
    "part_problems",
    "parts_of",
    "read_claim",
    "read_part",
    "record_bytes",
    "record_path",
    "step_path_for",
]
