"""The host-memory snapshot format, shared by the trainer (writer) and ckptd (reader, persister).

A snapshot is a directory in host shared memory (``/dev/shm/ckptd/<job>/<step>/``, or any tmpfs both
containers of a pod mount):

```
data.bin         every saved shard's bytes, one after the other, each at a 64-byte boundary (one replica of each)
treedef.pickle   the state's pytree structure (jax's PyTreeDef, pickled), for an exact restore
snapshot.json    step, training metadata, and per array: shape, dtype, and each shard's index and offset
persisted.json   written by ckptd once the step is committed on storage (path, time)
```

It is written under ``<step>.tmp-<pid>`` and renamed into place when complete, so a directory named by a
step is whole unless damaged afterwards; ``problems()`` checks that (sizes and shard coverage) before a
snapshot is ever used. Reading needs numpy only (no jax): ckptd's persist worker hands the shards to
Orbax straight from a memory map (``ShardReader``, ``shard_grid``), and a restore maps it instead of
reading disk.
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

from trainer_client.core.dtypes import np_dtype
from trainer_client.core.format.files import (
    SNAPSHOT_DATA_FILE,
    SNAPSHOT_META_FILE,
    SNAPSHOT_PERSISTED_FILE,
    SNAPSHOT_SPARE_PREFIX,
    SNAPSHOT_TREEDEF_FILE,
)
from trainer_client.core.protocol import TrainingMetadata

SNAPSHOT_FORMAT = "ckptd-snapshot/1"
# Where each shard starts in data.bin: at a multiple of this (XLA's CPU buffers take a view of it as is).
SHARD_ALIGN = 64
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
    return SnapshotMeta.model_validate_json(Path(path, SNAPSHOT_META_FILE).read_bytes())


def problems(path: str | os.PathLike[str]) -> list[str]:
    """Why a snapshot directory cannot be used (empty: it is whole)."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError) as exc:
        return [f"{SNAPSHOT_META_FILE} unreadable: {str(exc).splitlines()[0][:200]}"]
    out = []
    if path.name.isdigit() and int(path.name) != meta.step:
        out.append(f"snapshot is for step {meta.step}, not {path.name}")
    try:
        size = (path / SNAPSHOT_DATA_FILE).stat().st_size
    except OSError:
        return [*out, f"{SNAPSHOT_DATA_FILE} missing"]
    if size != meta.nbytes:
        out.append(f"{SNAPSHOT_DATA_FILE} has {size} bytes, snapshot says {meta.nbytes}")
    if not (path / SNAPSHOT_TREEDEF_FILE).is_file():
        out.append(f"{SNAPSHOT_TREEDEF_FILE} missing")
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




def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_UNFINISHED = re.compile(r"^[0-9]{1,19}\.tmp-([0-9]+)$")  # a snapshot its writer (that pid) had not finished


def drop_leftovers(base: str | os.PathLike[str], *, older_than_s: float | None = None) -> int:
    """Delete what writers that are gone left in a job's snapshot directory ``base``: their spare files and
    the snapshots they were still writing (``<step>.tmp-<pid>``). Gone means: the process no longer exists
    (judged in this PID namespace), or, with ``older_than_s``, the entry was not renewed for that long
    (ckptd's view: a sidecar need not see the trainer's PIDs; a live writer loses at most its spare's head
    start). Returns how many entries were deleted."""
    dropped = 0
    try:
        entries = list(Path(base).iterdir())
    except OSError:
        return 0
    now = time.time()
    for path in entries:
        unfinished = _UNFINISHED.match(path.name)
        if unfinished:
            pid = unfinished.group(1)
        elif path.name.startswith(SNAPSHOT_SPARE_PREFIX):
            pid = path.name[len(SNAPSHOT_SPARE_PREFIX):].removesuffix(".part")
        else:
            continue
        try:
            if older_than_s is not None:
                gone = now - path.stat().st_mtime > older_than_s
            else:
                gone = pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
            if not gone:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            dropped += 1
        except OSError:
            continue
    return dropped


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
    return Path(path, SNAPSHOT_PERSISTED_FILE).is_file()


def mark_persisted(path: str | os.PathLike[str], step_url: str) -> None:
    Path(path, SNAPSHOT_PERSISTED_FILE).write_text(json.dumps({"path": step_url, "persisted_at": time.time()}))


def evictable(path: Path) -> bool:
    """A snapshot may be dropped once nothing still needs it from memory alone."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError):
        return True
    return not meta.persist or is_persisted(path)


def evict(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def evict_oldest(held: list[Path], keep_at_most: int, *, never: Path | None = None) -> int:
    """Evict the oldest evictable snapshots of ``held`` (oldest first; they leave the list too) until at most
    ``keep_at_most`` remain or none may go; ``never`` is never evicted. Returns how many were evicted."""
    evicted = 0
    while len(held) > keep_at_most:
        victim = next((p for p in held if p != never and evictable(p)), None)
        if victim is None:
            break
        evict(victim)
        held.remove(victim)
        evicted += 1
    return evicted


def map_data(path: str | os.PathLike[str], meta: SnapshotMeta, *, private: bool = False) -> np.ndarray:
    """``data.bin`` of a snapshot as a memory map of bytes (no read, no copy): read-only, or with ``private``
    copy-on-write — writes through it (a training step that donates buffers aliasing it) land in private
    pages of this process, never in the snapshot, and the mapping outlives the snapshot's eviction."""
    if not meta.nbytes:
        return np.zeros(0, np.uint8)
    return np.memmap(Path(path) / SNAPSHOT_DATA_FILE, dtype=np.uint8, mode="c" if private else "r")


class ShardReader:
    """Regions of one array of a snapshot, read from the memory map of its ``data.bin``.

    Called with a tuple of slices (what ``jax.make_array_from_callback`` passes). A region that is exactly a
    saved shard is that shard: a copy of it, or with ``copy=False`` a read-only view of the map (no copy at
    all; the caller must not let it be written to, nor outlive the snapshot). Any other region is assembled
    from the shards that overlap it, into a new array.
    """

    def __init__(self, data: np.ndarray, record: ArrayRecord, *, copy: bool = True) -> None:
        self.shape = tuple(record.shape)
        self.dtype = np_dtype(record.dtype)
        self.copy = copy
        self.shards: list[tuple[tuple[tuple[int, int], ...], np.ndarray]] = []
        for shard in record.shards:
            extent = [stop - start for start, stop in shard.index]
            view = data[shard.offset : shard.offset + shard.nbytes].view(self.dtype).reshape(extent)
            self.shards.append((tuple((start, stop) for start, stop in shard.index), view))
        self.exact = dict(self.shards)

    def __call__(self, index: tuple[slice, ...] | None) -> np.ndarray:
        bounds = self.bounds(index)
        hit = self.exact.get(bounds)
        if hit is None:
            return self.assemble(bounds)
        return np.array(hit) if self.copy else hit

    def bounds(self, index: tuple[slice, ...] | None) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dimension of the region ``index`` names."""
        return index_bounds(index, self.shape)

    def assemble(self, bounds: tuple[tuple[int, int], ...]) -> np.ndarray:
        """A new array of the region ``bounds``, copied from the saved shards that overlap it. It starts at
        a multiple of ``SHARD_ALIGN`` bytes, so XLA's CPU client can take it as a buffer without copying it
        again. (numpy's copies release the GIL: regions can be assembled by several threads at once.)"""
        region = aligned_empty([stop - start for start, stop in bounds], self.dtype)
        for shard_bounds, view in self.shards:
            lo = [max(a[0], b[0]) for a, b in zip(bounds, shard_bounds, strict=True)]
            hi = [min(a[1], b[1]) for a, b in zip(bounds, shard_bounds, strict=True)]
            if any(low >= high for low, high in zip(lo, hi, strict=True)):
                continue
            dst = tuple(slice(low - b[0], high - b[0]) for low, high, b in zip(lo, hi, bounds, strict=True))
            src = tuple(slice(low - b[0], high - b[0]) for low, high, b in zip(lo, hi, shard_bounds, strict=True))
            region[dst] = view[src]
        return region


def index_bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per dimension of the region of an array of ``shape`` that ``index`` (what
    ``jax.make_array_from_callback`` passes) names."""
    index = index or ()
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape, strict=False)
    ) + tuple((0, dim) for dim in shape[len(index) :])


def aligned_empty(shape: list[int], dtype: np.dtype[np.generic]) -> np.ndarray:
    """An uninitialised array whose data starts at a multiple of ``SHARD_ALIGN`` bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + SHARD_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % SHARD_ALIGN
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def shard_grid(record: ArrayRecord) -> list[int] | None:
    """How many shards the saved shards cut each dimension into, when they tile the array as a grid (as a
    ``NamedSharding``'s shards do); None when they do not."""
    grid = []
    for dim, size in enumerate(record.shape):
        cuts = sorted({(shard.index[dim][0], shard.index[dim][1]) for shard in record.shards})
        edges = [start for start, _ in cuts] + [cuts[-1][1]] if cuts else []
        if not cuts or edges[0] != 0 or edges[-1] != size or any(
            stop != nxt for (_, stop), nxt in zip(cuts, edges[1:], strict=False)
        ):
            return None
        grid.append(len(cuts))
    cells = {tuple((start, stop) for start, stop in shard.index) for shard in record.shards}
    return grid if math.prod(grid) == len(record.shards) == len(cells) else None


__all__ = [
    "SHARD_ALIGN",
    "SNAPSHOT_FORMAT",
    "ArrayRecord",
    "ShardReader",
    "ShardRecord",
    "SnapshotMeta",
    "aligned_empty",
    "complete_snapshots",
    "drop_leftovers",
    "evict",
    "evict_oldest",
    "evictable",
    "index_bounds",
    "is_persisted",
    "job_dir",
    "map_data",
    "mark_persisted",
    "newest_whole",
    "problems",
    "read_meta",
    "shard_grid",
]
