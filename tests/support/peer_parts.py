"""Snapshot parts written without jax, and sidecar peer channels on 127.0.0.1, for the peer-copy tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from tests.support.orbax_steps import training_metadata
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_META_FILE
from trainer_client.core.format._private_files import ensure_private_dir, make_private_dir, open_private, write_private
from trainer_client.core.format._snapshot import ArrayRecord, ShardRecord, SnapshotMeta
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import TrainingMetadata

SECRET = "peer-secret-for-tests-0123456789"
ROWS = 8  # rows of the one array, split between the hosts


def write_part(shm: Path, job: str, step: int, *, index: int, count: int = 2, cols: int = 1024,
               save_id: str | None = None, seed: int = 0, random: bool = True) -> Path:
    """Host ``index``'s part of ``step``: its rows of one f32[ROWS, cols] array (``<shm>/<job>/<step>/``), random
    or (``random=False``, cheap to make in bulk) one value per step and host."""
    ensure_private_dir(shm)
    ensure_private_dir(shm / job)
    rows = ROWS // count
    data = (np.random.default_rng(seed * 1000 + step * 10 + index).standard_normal((rows, cols)).astype(np.float32)
            if random else np.full((rows, cols), step * 10 + index, np.float32))
    raw = data.tobytes()
    shard = ShardRecord(index=[[index * rows, (index + 1) * rows], [0, cols]], offset=0, nbytes=len(raw),
                        xxh3=xxhash.xxh3_64_intdigest(raw), replica_id=0)
    training = TrainingMetadata.model_validate(training_metadata(step)["ckptd"])
    meta = SnapshotMeta(step=step, created_at=1.0, persist=False, nbytes=len(raw), leaf_names=["w"],
                        tree=[TreeEntry(path=[("dict", "w")])],
                        arrays={"w": ArrayRecord(shape=[ROWS, cols], dtype="float32", shards=[shard])},
                        training=training, process_index=index, process_count=count,
                        save_id=save_id or f"ab-{step}")
    tmp = make_private_dir(shm / job / f"{step}.tmp-{os.getpid()}")
    fd = open_private(tmp / SNAPSHOT_DATA_FILE, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    write_private(tmp / SNAPSHOT_META_FILE, meta.model_dump_json().encode())
    os.rename(tmp, shm / job / str(step))
    return shm / job / str(step)


__all__ = ["ROWS", "SECRET", "write_part"]
