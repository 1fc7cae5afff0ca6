"""The host parts of one multi-host step, written without jax: what each of N processes' trainers leaves in its
host's shared memory for its sidecar to persist (docs/multihost.md, sections 4 and 5), at a small size, so a
thousand hosts' parts take a second to make.

The state is a real layout of a data-parallel job over N processes (one device each, mesh ``data`` = N):
``params.w`` and ``opt.mu``, f32[N * rows, cols] sharded by rows (process k holds rows k*rows..(k+1)*rows,
replica 0), and ``params.b``, f32[cols] replicated on every process (replica 0 on process 0, so process 0's part
writes it, as Orbax's primary host would). Every part has one save id; the values are a function of the
process and the array, so a restored step can be checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_META_FILE
from trainer_client.core.format._private_files import ensure_private_dir, make_private_dir, open_private, write_private
from trainer_client.core.format._snapshot import ArrayRecord, ShardRecord, SnapshotMeta
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import TrainingMetadata

SHARDED = ("params.w", "opt.mu")  # f32[N * rows, cols], by rows over the processes
REPLICATED = "params.b"  # f32[cols] on every process
LEAVES = ("opt.mu", "params.b", "params.w")  # in pytree flatten order (sorted keys)


def expected(name: str, k: int, rows: int, cols: int) -> np.ndarray:
    """The values of ``name`` that process ``k`` holds (its rows, or the whole replicated array)."""
    if name == REPLICATED:
        return np.linspace(0.0, 1.0, cols, dtype=np.float32)
    base = (SHARDED.index(name) + 1) * 1_000_000 + k * rows * cols
    return np.arange(base, base + rows * cols, dtype=np.float32).reshape(rows, cols)


def training(step: int, hosts: int, rows: int, cols: int) -> TrainingMetadata:
    arrays = {name: {"shape": [hosts * rows, cols], "dtype": "float32", "partition_spec": ["data", None]}
              for name in SHARDED}
    arrays[REPLICATED] = {"shape": [cols], "dtype": "float32", "partition_spec": [None]}
    return TrainingMetadata.model_validate({
        "step": step, "data_position": step * hosts, "global_batch": hosts, "wall_time": 1_700_000_000.0 + step,
        "mesh": {"axis_names": ["data"], "shape": [hosts]}, "slices": [0], "arrays": arrays,
        "run_id": "gcs-hosts", "process_count": hosts})


def write_host_part(shm: Path, job: str, step: int, k: int, hosts: int, *, rows: int = 4, cols: int = 256,
                    save_id: str | None = None) -> Path:
    """Process ``k``'s part of ``step`` at ``<shm>/<job>/<step>/`` (a snapshot directory, as the memory tier
    makes it)."""
    ensure_private_dir(shm)
    ensure_private_dir(shm / job)
    chunks: list[bytes] = []
    arrays: dict[str, ArrayRecord] = {}
    offset = 0
    for name in LEAVES:
        raw = expected(name, k, rows, cols).tobytes()
        pad = -offset % 64
        chunks.append(bytes(pad))
        offset += pad
        if name == REPLICATED:
            index, shape, replica = [[0, cols]], [cols], k
        else:
            index, shape, replica = [[k * rows, (k + 1) * rows], [0, cols]], [hosts * rows, cols], 0
        shard = ShardRecord(index=index, offset=offset, nbytes=len(raw), xxh3=xxhash.xxh3_64_intdigest(raw),
                            replica_id=replica)
        arrays[name] = ArrayRecord(shape=shape, dtype="float32", shards=[shard])
        chunks.append(raw)
        offset += len(raw)
    tree = [TreeEntry(path=[("dict", part) for part in name.split(".")]) for name in LEAVES]
    meta = SnapshotMeta(step=step, created_at=1.0, persist=True, nbytes=offset, leaf_names=list(LEAVES), tree=tree,
                        arrays=arrays, training=training(step, hosts, rows, cols), process_index=k,
                        process_count=hosts, save_id=save_id or f"ab-{step}")
    tmp = make_private_dir(shm / job / f"{step}.tmp-{os.getpid()}")
    fd = open_private(tmp / SNAPSHOT_DATA_FILE, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(chunks))
    write_private(tmp / SNAPSHOT_META_FILE, meta.model_dump_json().encode())
    os.rename(tmp, shm / job / str(step))
    return shm / job / str(step)


def write_host_parts(base: Path, job: str, step: int, hosts: int, *, rows: int = 4, cols: int = 256) -> list[Path]:
    """Every process's part, each in its own host's shared memory (``<base>/host<k>``)."""
    return [write_host_part(base / f"host{k}", job, step, k, hosts, rows=rows, cols=cols) for k in range(hosts)]


__all__ = ["LEAVES", "REPLICATED", "SHARDED", "expected", "training", "write_host_part", "write_host_parts"]
