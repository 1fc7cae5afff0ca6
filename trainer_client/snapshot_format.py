"""The host-memory snapshot format, shared by the trainer (writer) and ckptd (reader, persister).

A snapshot is a directory in host shared memory (``/dev/shm/ckptd/<job>/<step>/``, or any tmpfs both
containers of a pod mount):

```
data.bin         every saved shard's bytes, one after the other (one replica of each shard)
treedef.pickle   the state's pytree structure (jax's PyTreeDef, pickled), for an exact restore
snapshot.json    step, training metadata, and per array: shape, dtype, and each shard's index and offset
persisted.json   written by ckptd once the step is committed on storage (path, time)
```

It is written under ``<step>.tmp-<pid>`` and renamed into place when complete, so a directory named by a
step is whole unless damaged afterwards; ``problems()`` checks that (sizes and shard coverage) before a
snapshot is ever used. Reading needs numpy only (no jax): ckptd assembles global arrays from it to
persist the step, and a restore maps it instead of reading disk.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_client.protocol import TrainingMetadata

SNAPSHOT_FORMAT = "ckptd-snapshot/1"
DATA_FILE = "data.bin"
META_FILE = "snapshot.json"
TREEDEF_FILE = "treedef.pickle"
PERSISTED_FILE = "persisted.json"
_STEP_DIR = re.compile(r"^[0-9]{1,19}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardRecord(_Model):
    index: list[list[int]] = Field(description="[start, stop) per dimension of the global array")
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class ArrayRecord(_Model):
    shape: list[int]
    dtype: str
    shards: list[ShardRecord]


class SnapshotMeta(_Model):
    format: Literal["ckptd-snapshot/1"] = "ckptd-snapshot/1"
    step: int
    created_at: float
    persist: bool = Field(description="ckptd must persist this snapshot to storage")
    nbytes: int
    leaf_names: list[str] = Field(description="dotted leaf paths, in pytree flatten order")
    arrays: dict[str, ArrayRecord]
    training: TrainingMetadata


def job_dir(shm_dir: str | os.PathLike[str], job: str) -> Path:
    return Path(shm_dir) / job


def read_meta(path: str | os.PathLike[str]) -> SnapshotMeta:
    return SnapshotMeta.model_validate_json(Path(path, META_FILE).read_bytes())


def problems(path: str | os.PathLike[str]) -> list[str]:
    """Why a snapshot directory cannot be used (empty: it is whole)."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError) as exc:
        return [f"{META_FILE} unreadable: {str(exc).splitlines()[0][:200]}"]
    out = []
    if path.name.isdigit() and int(path.name) != meta.step:
        out.append(f"snapshot is for step {meta.step}, not {path.name}")
    try:
        size = (path / DATA_FILE).stat().st_size
    except OSError:
        return [*out, f"{DATA_FILE} missing"]
    if size != meta.nbytes:
        out.append(f"{DATA_FILE} has {size} bytes, snapshot says {meta.nbytes}")
    if not (path / TREEDEF_FILE).is_file():
        out.append(f"{TREEDEF_FILE} missing")
    for name, array in meta.arrays.items():
        itemsize = np_dtype(array.dtype).itemsize
        covered = 0
        for shard in array.shards:
            volume = math.prod(stop - start for start, stop in shard.index)
            covered += volume
            if shard.nbytes != volume * itemsize or shard.offset + shard.nbytes > meta.nbytes:
                out.append(f"{name}: a shard's extent does not match its bytes")
                break
        if covered != math.prod(array.shape):
            out.append(f"{name}: shards cover {covered} of {math.prod(array.shape)} elements")
    return out


def complete_snapshots(shm_dir: str | os.PathLike[str], job: str) -> list[Path]:
    """Snapshot directories of a job named by a step (finished writing), oldest step first."""
    base = job_dir(shm_dir, job)
    if not base.is_dir():
        return []
    dirs = [p for p in base.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(p.name))


def newest_whole(
    shm_dir: str | os.PathLike[str] | None, job: str, *, at_most: int | None = None
) -> tuple[Path, SnapshotMeta] | None:
    """The newest snapshot of ``job`` that is whole (and not beyond ``at_most``), with its metadata."""
    if shm_dir is None:
        return None
    for path in reversed(complete_snapshots(shm_dir, job)):
        if at_most is not None and int(path.name) > at_most:
            continue
        if not problems(path):
            return path, read_meta(path)
    return None


def is_persisted(path: str | os.PathLike[str]) -> bool:
    return Path(path, PERSISTED_FILE).is_file()


def mark_persisted(path: str | os.PathLike[str], step_url: str) -> None:
    Path(path, PERSISTED_FILE).write_text(json.dumps({"path": step_url, "persisted_at": time.time()}))


def evictable(path: Path) -> bool:
    """A snapshot may be dropped once nothing still needs it from memory alone."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError):
        return True
    return not meta.persist or is_persisted(path)


def evict(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def global_arrays(path: str | os.PathLike[str]) -> list[np.ndarray]:
    """Every array of the snapshot as a whole numpy array, in leaf order, assembled from its shards
    through a memory map of ``data.bin`` (one copy, no disk)."""
    path = Path(path)
    meta = read_meta(path)
    data = np.memmap(path / DATA_FILE, dtype=np.uint8, mode="r") if meta.nbytes else np.zeros(0, np.uint8)
    out = []
    for name in meta.leaf_names:
        array = meta.arrays[name]
        dtype = np_dtype(array.dtype)
        whole = np.empty(array.shape, dtype=dtype)
        for shard in array.shards:
            window = tuple(slice(start, stop) for start, stop in shard.index)
            chunk = data[shard.offset : shard.offset + shard.nbytes].view(dtype)
            whole[window] = chunk.reshape([stop - start for start, stop in shard.index])
        out.append(whole)
    return out


def np_dtype(name: str) -> np.dtype[np.generic]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


__all__ = [
    "DATA_FILE",
    "META_FILE",
    "PERSISTED_FILE",
    "SNAPSHOT_FORMAT",
    "TREEDEF_FILE",
    "ArrayRecord",
    "ShardRecord",
    "SnapshotMeta",
    "complete_snapshots",
    "evict",
    "evictable",
    "global_arrays",
    "is_persisted",
    "job_dir",
    "mark_persisted",
    "newest_whole",
    "np_dtype",
    "problems",
    "read_meta",
]
