"""``multihost_persist_throughput_ratio_vs_single``: two hosts' sidecars persisting one state from their parts
against one sidecar persisting the same state whole (docs/multihost.md, section 5).

One state (the profile's ``arrays`` float32 arrays of ``rows`` x ``cols``, sharded by rows over 8 devices) is
snapshotted once by a single process (``MemoryTier``, a child with 8 CPU devices). Its shards are then cut
into two host parts as a 2-process job's processes would hold them (process k: the rows of devices 4k..4k+3,
replica 0, one save id), without running a JAX job: the parts are the snapshot format's own records over the
same bytes. In every repeat, side by side (alternating which goes first), onto a fresh job directory:

* single: one persist worker (a warm ``ckptd.persist._persist_worker --serve`` child, as ckptd runs it)
  persists the whole snapshot: Orbax's save, ckptd's manifest, the commit;
* parts: two persist workers (one per host's sidecar) write their parts at the same time through
  ``PartSaves.persist_part`` (claim, part, part record), then the leader's ``commit_ready`` (merge,
  metadata, manifest, marker, rename).

The key is single ÷ parts wall time (the same bytes: a throughput ratio per byte). Workers are started and
warmed (jax imported) before timing, as a running ckptd's worker is. On this 2-core machine the two part
writers share the cores the single writer has alone.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import Figure, Profile, Results, alternate, rmtree
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import InProcessWorker, PersistSnapshot, PersistWorker, PersistWorkerClient
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_META_FILE
from trainer_client.core.format._private_files import ensure_private_dir, make_private_dir, write_private
from trainer_client.core.format._snapshot import ArrayRecord, read_meta

KEY = "multihost_persist_throughput_ratio_vs_single"
TARGET = 0.8
REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 3600.0

_SNAPSHOT = r"""
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trainer_client.runtime.saving._checkpointing import training_metadata
from trainer_client.runtime.memory._memory_tier import MemoryTier
shm, rows, cols, arrays = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
def leaf(i):
    return jax.make_array_from_callback((rows, cols), NamedSharding(mesh, P("data", None)), lambda idx: (
        np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)[idx] + i))
state = {f"a{i}": leaf(i) for i in range(arrays)}
meta = training_metadata(10, state, data_position=80, global_batch=8, mesh=mesh, slices=[0])
print(MemoryTier(shm, "job", max_snapshots=2, preallocate=False).save(10, state, meta, persist=True), flush=True)
"""


def _snapshot(profile: Profile, shm: Path) -> Path:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    rows, cols, arrays = profile.multihost_shape
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT, str(shm), str(rows), str(cols),
                          str(arrays)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"snapshotting the state failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def split_into_parts(whole: Path, shm: Path, parts: int = 2) -> list[Path]:
    """The whole snapshot's shards cut into ``parts`` hosts' parts by row blocks (process k: the k-th run of
    shards, as the processes of a job whose devices are numbered process by process hold them)."""
    meta = read_meta(whole)
    data = (whole / SNAPSHOT_DATA_FILE).read_bytes()
    out = []
    for k in range(parts):
        arrays: dict[str, ArrayRecord] = {}
        chunks: list[bytes] = []
        offset = 0
        for name in meta.leaf_names:
            record = meta.arrays[name]
            shards = sorted(record.shards, key=lambda s: s.index[0][0])
            per = len(shards) // parts
            mine = []
            for shard in shards[k * per:(k + 1) * per]:
                pad = -offset % 64
                chunks.append(bytes(pad))
                offset += pad
                chunks.append(data[shard.offset:shard.offset + shard.nbytes])
                mine.append(shard.model_copy(update={"offset": offset, "replica_id": 0}))
                offset += shard.nbytes
            arrays[name] = record.model_copy(update={"shards": mine})
        part_meta = meta.model_copy(update={"arrays": arrays, "nbytes": offset, "process_index": k,
                                            "process_count": parts, "save_id": f"00bec4-{meta.step}"})
        job = shm / f"part{k}" / "job"
        ensure_private_dir(job.parent)
        ensure_private_dir(job)
        target = job / str(meta.step)
        rmtree(target)
        make_private_dir(target)
        write_private(target / SNAPSHOT_DATA_FILE, b"".join(chunks))
        write_private(target / SNAPSHOT_META_FILE, part_meta.model_dump_json().encode())
        out.append(target)
    return out


class _Workers:
    """Warm persist workers (children, as ckptd runs them), or this process's own handling (toy profile)."""

    def __init__(self, count: int, child: bool) -> None:
        if child:
            self.workers: list[PersistWorker] = [PersistWorkerClient(nice=0, devices=8, timeout_s=_TIMEOUT_S)
                                                 for _ in range(count)]
        else:
            from ckptd.persist._persist_worker import handle
            self.workers = [InProcessWorker(handle)] * count

    def close(self) -> None:
        for worker in self.workers:
            worker.close(10.0)


def run_multihost_persist(profile: Profile, results: Results, base: Path, shm: Path) -> None:
    """Measure the key (``base``: work directory for the storage root; ``shm``: shared-memory directory)."""
    rmtree(base)
    base.mkdir(parents=True, exist_ok=True)
    shm_dir = shm / "multihost_persist"
    ensure_private_dir(shm_dir)
    try:
        _measure(profile, results, base, shm_dir)
    finally:  # the whole snapshot and its two parts: twice the state in shared memory, freed here
        rmtree(shm_dir)
        rmtree(base)


def _measure(profile: Profile, results: Results, base: Path, shm_dir: Path) -> None:
    whole = _snapshot(profile, shm_dir / "single")
    parts = split_into_parts(whole, shm_dir)
    storage = Storage(str(base / "root"))
    (base / "root").mkdir(exist_ok=True)
    workers = _Workers(3, profile.persist_child)
    single_s: list[float] = []
    parts_s: list[float] = []
    try:
        for k in range(3):  # warm: each child imports jax and makes its devices before the first timing
            workers.workers[k].exchange(PersistSnapshot(snapshot="/nonexistent", job_url=str(base / "warm")))

        def single(i: int) -> None:
            started = time.perf_counter()
            workers.workers[0].persist(str(whole), storage.url_of(storage.join(f"single{i}")))
            single_s.append(time.perf_counter() - started)

        def from_parts(i: int) -> None:
            job = f"parts{i}"
            sidecars = [PartSaves(storage, workers.workers[1 + k]) for k in range(2)]
            errors: list[str] = []

            def write(k: int) -> None:
                try:
                    outcome = sidecars[k].persist_part(job, str(parts[k]), read_meta(parts[k]))
                    if outcome != "written":
                        errors.append(f"part {k}: {outcome}")
                except Exception as exc:  # reported below
                    errors.append(f"part {k}: {type(exc).__name__}: {exc}")

            started = time.perf_counter()
            threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors or sidecars[0].commit_ready(job) != [10]:
                raise RuntimeError(f"persist from parts failed: {errors or 'not committed'}")
            parts_s.append(time.perf_counter() - started)

        for i in range(profile.repeats):
            alternate(i, functools.partial(single, i), functools.partial(from_parts, i))
            results.progress()
    finally:
        workers.close()
    results.measure("multihost_persist_single_s", single_s, "s", "one sidecar persists the whole state")
    results.measure("multihost_persist_parts_s", parts_s, "s",
                    "two sidecars persist their parts at once, then the leader commits")
    ratios = [s / p for s, p in zip(single_s, parts_s, strict=True)]
    results.figure(Figure(KEY, ratios, ">=", TARGET, "x",
                          "two hosts' sidecars persisting one state from their parts (and the leader's commit) "
                          "vs one sidecar persisting it whole: the single's time over the parts' (same bytes)",
                          {"state_bytes": profile.multihost_state_bytes, "single_s": single_s, "parts_s": parts_s}))
    print(json.dumps({"single_s": single_s, "parts_s": parts_s}), flush=True)


__all__ = ["KEY", "run_multihost_persist", "split_into_parts"]
