"""What a local attacker who can write the checkpoint root or the shared-memory directory plants: claims and
part records of multi-host saves (docs/multihost.md, section 5) written as raw JSON, so any field can be out
of bounds, and a whole memory snapshot written by hand (numpy and xxhash only, no jax). Also a snapshot of a
directory tree's bytes, names, modes and times, to show that nothing under it changed."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tests.support.orbax_steps import training_metadata
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_META_FILE
from trainer_client.core.format._private_files import ensure_private_dir, write_private


def forge_claim(root: Path, job: str, step: int, **fields: Any) -> Path:
    """``<root>/<job>/.ckptd/claims/<step>.json`` holding a claim (save ``ab-<step>`` of 2 processes, made
    now) with ``fields`` put over it as they are: nothing checked."""
    record = {"save_id": f"ab-{step}", "process_count": 2, "created_at": time.time(), **fields}
    path = root / job / ".ckptd" / "claims" / f"{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def forge_part(root: Path, job: str, step: int, k: int, **fields: Any) -> Path:
    """Host ``k``'s part record of the claim ``forge_claim`` makes, staged where a local root stages it
    (``process_<k>.json``), with ``fields`` put over it (``item`` and ``files`` are what a forger aims at the
    root with)."""
    save_id = fields.get("save_id", f"ab-{step}")
    record = {"save_id": save_id, "process_index": k, "process_count": 2, "sidecar": "forger/1",
              "item": "default", "has_iter": False, "training": training_metadata(step)["ckptd"], "tree": [],
              "files": [], "arrays": {}, "write_shapes": {}, "written_at": time.time(), **fields}
    path = root / job / ".ckptd" / "staging" / f"{step}.{save_id}" / "ckptd_parts" / f"process_{k}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def write_snapshot(shm: Path, job: str, step: int, *, persist: bool = True) -> Path:
    """A whole, valid memory snapshot of one float32 array ``w`` (shape (4, 8), one shard) at
    ``<shm>/<job>/<step>``, private as the trainer's memory tier makes it; what ckptd's keeper persists."""
    data = (np.arange(32, dtype=np.float32) + step).tobytes()
    arrays = {"params.w": {"shape": [4, 8], "dtype": "float32", "shards": [
        {"index": [[0, 4], [0, 8]], "offset": 0, "nbytes": len(data), "xxh3": xxhash.xxh3_64_intdigest(data)}]}}
    training = training_metadata(step, arrays={"params.w": {"shape": [4, 8], "dtype": "float32",
                                                            "partition_spec": [None, "data"]}})["ckptd"]
    meta = {"format": "ckptd-snapshot/2", "step": step, "created_at": time.time(), "persist": persist,
            "nbytes": len(data), "leaf_names": ["params.w"], "tree": [{"path": [["dict", "params"], ["dict", "w"]]}],
            "arrays": arrays, "training": training}
    ensure_private_dir(shm)
    path = ensure_private_dir(ensure_private_dir(shm / job) / str(step))
    write_private(path / SNAPSHOT_DATA_FILE, data)
    write_private(path / SNAPSHOT_META_FILE, json.dumps(meta).encode())
    return path


def tree_state(path: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``path`` (``path`` itself included): its mode, size, modification time in ns and, for
    a file, the SHA-256 of its bytes; keyed by the path relative to ``path``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [".", *dirnames, *filenames] if dirpath == str(path) else [*dirnames, *filenames]:
            full = Path(dirpath) / name
            info = full.lstat()
            digest = hashlib.sha256(full.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else ""
            out[str(full.relative_to(path))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
    return out


__all__ = ["forge_claim", "forge_part", "tree_state", "write_snapshot"]
