"""Snapshot parts written without jax, and sidecar peer channels on 127.0.0.1, for the peer-copy tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from examples.demo import free_port, start_ckptd
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


class PeerSidecars:
    """``count`` real ``ckptd serve`` processes with their peer channels on, one storage root (a directory or a
    ``gs://`` prefix), each host's shared memory ``base/shm<k>``. Without ``static`` the sidecars learn each
    other's addresses only from the registry under ``<root>/<job>/.ckptd/peers/`` (no ``CKPTD_PEERS``)."""

    def __init__(self, base: Path, root: str, count: int, *, static: bool = False, bandwidth: int = 1 << 30,
                 env: dict[str, str] | None = None) -> None:
        self.base, self.root, self.count, self.static, self.bandwidth = base, root, count, static, bandwidth
        self.env = env or {}
        self.shm = [base / f"shm{k}" for k in range(count)]
        for shm in self.shm:
            shm.mkdir(mode=0o700)
        self.ports = [free_port() for _ in range(count)]
        self.peer_ports = [free_port() for _ in range(count)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count

    def start(self, k: int, *, peer_port: int | None = None) -> None:
        """Host ``k``'s sidecar (again, after a kill: on ``peer_port`` when given, as a replaced pod may be)."""
        if peer_port is not None:
            self.peer_ports[k] = peer_port
        env = {"CKPTD_PEER_PORT": str(self.peer_ports[k]), "CKPTD_PEER_SECRET": SECRET,
               "CKPTD_PEER_BANDWIDTH_BYTES_S": str(self.bandwidth), **self.env}
        if self.static:
            env["CKPTD_PEERS"] = ",".join(f"{i}=127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        self.procs[k] = start_ckptd(self.root, self.base / f"state{k}", self.shm[k], self.ports[k],
                                    self.base / f"ckptd-{k}.log", env)

    def kill(self, k: int) -> None:
        proc = self.procs[k]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        for k in range(self.count):
            self.kill(k)

    def log(self, k: int) -> str:
        return (self.base / f"ckptd-{k}.log").read_text(errors="replace")

    def copy(self, holder: int, job: str, origin: int, step: int) -> Path:
        """Where host ``holder`` keeps its copy of host ``origin``'s part of ``step``."""
        return self.shm[holder] / job / f".peer-{origin}" / str(step)

    def wipe(self, k: int) -> None:
        """Host ``k``'s shared memory emptied (a replaced node), its sidecar left running."""
        def gone_meanwhile(_fn: object, _path: str, exc: Any) -> None:  # the sidecar may remove a part first
            if not isinstance(exc[1], FileNotFoundError):
                raise exc[1]

        for child in self.shm[k].iterdir():
            shutil.rmtree(child, onerror=gone_meanwhile)


def flip_a_bit(part: Path) -> None:
    """One bit of the part's first shard flipped: the sizes still right, the checksum not."""
    with (part / SNAPSHOT_DATA_FILE).open("r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))


__all__ = ["ROWS", "SECRET", "PeerSidecars", "flip_a_bit", "write_part"]
