"""The host-memory snapshot format, shared by the trainer (writer) and ckptd (reader, persister): what one
snapshot records, whether it is intact, and its bytes read in place.

A snapshot is a directory in host shared memory (``<shm_dir>/<job>/<step>/``, where ``shm_dir`` is
``/dev/shm/...`` or any tmpfs both containers of a pod mount):

```
data.bin         every saved shard's bytes, one after the other, each at a 64-byte boundary (one replica of each)
snapshot.json    step, training metadata, the state's tree as data (``tree_paths``: key paths, and the leaves
                 that are not arrays as values), per array: shape, dtype, and each shard's index, offset and
                 XXH3-64 checksum; and the data iterator's state when the trainer has one (Grain's
                 ``get_state()`` as JSON data, with the process it belongs to), which ckptd persists as the
                 step's ``iter`` item in Grain's own format; in a multi-process job, the writing process's
                 index and the process count: the snapshot is then that host's part of the step only
persisted.json   written by ckptd once the step is committed on storage (path, time)
superseded.json  written by ckptd instead when it will not persist the snapshot: a newer one marked persist took
                 its place while a persist was still running (the newer step, time)
```

It is written under ``<step>.tmp-<pid>`` and renamed into place when complete, so a directory named by a
step is whole unless damaged afterwards; ``problems()`` checks that (sizes and shard coverage) before a
snapshot is ever used, and ``damaged_shards()`` checks every shard's bytes against its checksum. Nothing read
from a snapshot is unpickled or followed through a link, and the directories are private to the one user
trainer and ckptd run as (``private_files``; docs/operations.md, "Security"). Reading needs numpy only (no
jax): ckptd's persist worker hands the shards to Orbax straight from a memory map (``ShardReader``,
``shard_grid``), and a restore maps it instead of reading disk.

A job's snapshots together (which are finished, the newest whole one, persisted marks, eviction, leftovers of
writers that are gone) are ``trainer_client/core/format/_snapshot_dirs.py``.
"""

from __future__ import annotations

import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from trainer_client.core._dtypes import np_dtype
from trainer_client.core.format._files import (
    DEFAULT_ITEM,
    ITEM_NAME_PATTERN,
    SNAPSHOT_DATA_FILE,
    SNAPSHOT_META_FILE,
)
from trainer_client.core.format._private_files import check_private_dir, open_private, read_private
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import SAVE_ID_PATTERN, TrainingMetadata

SNAPSHOT_FORMAT = "ckptd-snapshot/2"
MAX_META_BYTES = 64 << 20  # snapshot.json: ~100 bytes per shard; a bigger one is not read
# Where each shard starts in data.bin: at a multiple of this (XLA's CPU buffers take a view of it as is).
SHARD_ALIGN = 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OfProcess(Protocol):
    process_index: int
    process_count: int


_P = TypeVar("_P", bound=_OfProcess)


def process_in_range(record: _P) -> _P:
    """The check of a record that names one process of a job (``process_index`` of ``process_count``): a
    model's after-validator."""
    if record.process_index >= record.process_count:
        raise ValueError(f"process {record.process_index} of {record.process_count}")
    return record


class ShardRecord(_Model):
    index: list[list[int]] = Field(description="[start, stop) per dimension of the global array")
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    xxh3: int = Field(ge=0, lt=2**64, description="XXH3-64 (seed 0) of the shard's bytes")
    # Written only in a part of a multi-process job (a single process's snapshot.json stays as older readers
    # parse it): the lowest jax ``replica_id`` among this process's devices holding the region. The part with
    # replica 0 writes the region when the step is persisted from parts, as plain Orbax decides who writes.
    replica_id: int | None = Field(default=None, ge=0, exclude_if=lambda v: v is None,
                                   description="the lowest jax replica_id of this region on this process")


class ArrayRecord(_Model):
    shape: list[int]
    dtype: str
    shards: list[ShardRecord]


class DataIteratorRecord(_Model):
    """A data iterator's state at a step: what its ``get_state()`` returned, as JSON data (a Grain
    ``DatasetIterator``'s dict, or the JSON document a ``DataLoaderIterator`` returns as bytes), and the JAX
    process it is the state of (Grain keeps one file per process: ``process_<index>-of-<count>.json``)."""

    process_index: int = Field(ge=0)
    process_count: int = Field(ge=1)
    state: JsonValue

    _index_in_range = model_validator(mode="after")(process_in_range)


class SnapshotMeta(_Model):
    format: Literal["ckptd-snapshot/2"] = "ckptd-snapshot/2"
    step: int
    created_at: float
    persist: bool = Field(description="ckptd must persist this snapshot to storage")
    nbytes: int
    leaf_names: list[str] = Field(description="dotted leaf paths of the arrays, in pytree flatten order")
    tree: list[TreeEntry] = Field(description="every leaf's key path and kind, in flatten order (no pickle)")
    arrays: dict[str, ArrayRecord]
    training: TrainingMetadata
    data_iterator: DataIteratorRecord | None = Field(default=None, exclude_if=lambda v: v is None,
                                                     description="the data iterator's state, if the trainer has one")
    item: str = Field(default=DEFAULT_ITEM, exclude_if=lambda v: v == DEFAULT_ITEM, pattern=ITEM_NAME_PATTERN,
                      description="the Orbax item the trainer saves the state as (MaxText's: items)")
    # Written only by a process of a multi-process (multi-controller) job, so a single process's snapshot.json
    # stays what readers before these fields parse. Such a snapshot is one host's part of the step: it holds
    # that process's shards only, and whether the step is whole in memory is a job-level fact
    # (docs/multihost.md).
    process_index: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                               description="the JAX process (jax.process_index()) whose shards these are")
    process_count: int = Field(default=1, ge=1, exclude_if=lambda v: v == 1,
                               description="how many JAX processes the job had (jax.process_count())")
    save_id: str | None = Field(default=None, exclude_if=lambda v: v is None, pattern=SAVE_ID_PATTERN,
                                description="<job incarnation>-<step>: equal in every host's part of one save")

    _process_in_range = model_validator(mode="after")(process_in_range)

    @property
    def is_part(self) -> bool:
        """One host's part of a multi-process job's step: never whole on its own."""
        return self.process_count > 1


def read_meta(path: str | os.PathLike[str]) -> SnapshotMeta:
    """The snapshot's ``snapshot.json``: a private regular file (no link), at most ``MAX_META_BYTES``."""
    return SnapshotMeta.model_validate_json(read_private(Path(path, SNAPSHOT_META_FILE), max_bytes=MAX_META_BYTES))


def problems(path: str | os.PathLike[str]) -> list[str]:
    """Why a snapshot directory cannot be used (empty: it is whole, or for a part of a multi-process step
    (``SnapshotMeta.is_part``), intact: its own shards are all there)."""
    path = Path(path)
    try:
        check_private_dir(path)
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError) as exc:
        return [f"{SNAPSHOT_META_FILE} unreadable: {str(exc).splitlines()[0][:200]}"]
    out = []
    if path.name.isdigit() and int(path.name) != meta.step:
        out.append(f"snapshot is for step {meta.step}, not {path.name}")
    try:
        fd = open_private(path / SNAPSHOT_DATA_FILE)
        size = os.fstat(fd).st_size
        os.close(fd)
    except OSError as exc:
        return [*out, f"{SNAPSHOT_DATA_FILE} unusable: {exc}"]
    if size != meta.nbytes:
        out.append(f"{SNAPSHOT_DATA_FILE} has {size} bytes, snapshot says {meta.nbytes}")
    if set(meta.leaf_names) != set(meta.arrays) or len(meta.leaf_names) != len(meta.arrays):
        out.append("the leaf names and the arrays described differ")
    if sum(entry.kind == "array" for entry in meta.tree) != len(meta.leaf_names):
        out.append("the tree description and the arrays differ in number")
    for name, array in meta.arrays.items():
        itemsize = np_dtype(array.dtype).itemsize
        covered = 0
        for shard in array.shards:
            volume = math.prod(stop - start for start, stop in shard.index)
            covered += volume
            if shard.nbytes != volume * itemsize or shard.offset + shard.nbytes > meta.nbytes:
                out.append(f"{name}: a shard's extent does not match its bytes")
                break
        # a part holds its process's shards only: they fit in the array, the other hosts hold the rest
        total = math.prod(array.shape)
        if (covered > total) if meta.is_part else (covered != total):
            out.append(f"{name}: shards cover {covered} of {total} elements")
    return out


def map_data(path: str | os.PathLike[str], meta: SnapshotMeta, *, private: bool = False,
             populate: bool = False) -> np.ndarray:
    """``data.bin`` of a snapshot as a memory map of bytes (no read, no copy): read-only, or with ``private``
    copy-on-write — writes through it (a training step that donates buffers aliasing it) land in private
    pages of this process, never in the snapshot, and the mapping outlives the snapshot's eviction.

    With ``populate`` (read-only only) the whole file is mapped at once (``MAP_POPULATE``) instead of page by
    page as it is touched: in the gVisor sandbox of the lent TPU machine, touching a fresh map page by page ran
    at ~1.4 GB/s on 13 threads, a populated map was there at once (bench/tier_restore.py). The map is
    unmapped when the last array viewing it is gone."""
    if not meta.nbytes:
        return np.zeros(0, np.uint8)
    fd = open_private(Path(path) / SNAPSHOT_DATA_FILE)
    if populate:
        if private:
            os.close(fd)
            raise ValueError("a populated map of a snapshot is read-only")
        try:
            size = os.fstat(fd).st_size
            if size < meta.nbytes:  # mapping past the end would fault when read
                raise OSError(f"{SNAPSHOT_DATA_FILE} has {size} bytes, its record says {meta.nbytes}")
            mapped = mmap.mmap(fd, meta.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the map keeps its own reference to the file
        return np.frombuffer(mapped, dtype=np.uint8)
    with os.fdopen(fd, "rb") as f:  # the map keeps its own reference to the file
        return np.memmap(f, dtype=np.uint8, mode="c" if private else "r", shape=(meta.nbytes,))


_CHECK_THREADS = 4  # xxhash releases the GIL: shards are checked in parallel (~9 GiB/s a thread here)


def damaged_shards(data: np.ndarray, meta: SnapshotMeta) -> list[str]:
    """The shards of a snapshot whose bytes in ``data`` (``map_data``) do not match their checksum (empty:
    every byte is as the trainer wrote it)."""
    shards = [(name, k, shard) for name in meta.leaf_names for k, shard in enumerate(meta.arrays[name].shards)]

    def damaged(item: tuple[str, int, ShardRecord]) -> str | None:
        name, k, shard = item
        digest = xxhash.xxh3_64_intdigest(data[shard.offset: shard.offset + shard.nbytes].data)
        return None if digest == shard.xxh3 else f"{name} shard {k}: XXH3 {digest:016x}, recorded {shard.xxh3:016x}"

    if len(shards) <= 1:
        return [bad for bad in map(damaged, shards) if bad]
    with ThreadPoolExecutor(min(_CHECK_THREADS, len(shards)), thread_name_prefix="snapshot-check") as pool:
        return [bad for bad in pool.map(damaged, shards) if bad]


__all__ = [
    "SHARD_ALIGN",
    "SNAPSHOT_FORMAT",
    "ArrayRecord",
    "DataIteratorRecord",
    "ShardRecord",
    "SnapshotMeta",
    "damaged_shards",
    "map_data",
    "problems",
    "process_in_range",
    "read_meta",
]
