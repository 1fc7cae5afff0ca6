"""The host-memory tier on the trainer side, its save path: snapshot the state into shared memory.

``MemoryTier.save`` copies each array's addressable shards (one replica of each) into a snapshot
directory in host shared memory (format: ``trainer_client.core.format._snapshot``), with the leaves that are
not arrays (numbers, strings) and the data iterator's state recorded as data; the training loop is
blocked only for that device-to-host copy. The snapshot belongs to ckptd from then on: it persists the
snapshots marked ``persist`` to storage in Orbax's layout in the background — also when this process is
killed right after ``save`` returns — and evicts old ones. Memory is bounded: at most ``max_snapshots``
per job, and a snapshot that does not fit in the free shared memory is refused with a clear error
(``MemoryTierFull``) instead of failing halfway.

The restore path, ``restore_snapshot`` (the arrays for a new mesh from a snapshot's bytes, each shard checked as
it is read), is ``trainer_client/runtime/memory/_memory_restore.py``; it is named here too, as docs/protocol.md names
it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash

from trainer_client.checkpoint_io._state_tree import describe_paths, is_value, leaf_name, with_values
from trainer_client.core.format._files import (
    DEFAULT_ITEM,
    SNAPSHOT_DATA_FILE,
    SNAPSHOT_META_FILE,
    SNAPSHOT_SPARE_PREFIX,
)
from trainer_client.core.format._private_files import (
    ensure_private_dir,
    make_private_dir,
    open_private,
    write_private,
)
from trainer_client.core.format._snapshot import SHARD_ALIGN, ArrayRecord, DataIteratorRecord, ShardRecord, SnapshotMeta
from trainer_client.core.format._snapshot_dirs import complete_snapshots, drop_leftovers, evict_oldest, job_dir
from trainer_client.core.format._snapshot_shards import index_bounds
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import TrainingMetadata
from trainer_client.errors import MemoryTierFull
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_spare import leaf_bytes, make_spare, snapshot_bytes
from trainer_client.runtime.multihost._job_store import job_incarnation

_log = logging.getLogger(__name__)
PyTree = Any


class MemoryTier:
    """Snapshots of one job's state in host shared memory.

    With ``preallocate`` (the default, and when ``max_snapshots`` is 2 or more), after each save a
    background thread allocates the next snapshot's file ahead of time (``.spare-<pid>`` in the job's
    directory), evicting the oldest evictable snapshot first if that is what the next save would have done:
    the memory held never exceeds ``max_snapshots`` snapshots, and the next save writes into pages that
    exist instead of making the kernel allocate and zero 4 KiB pages of shared memory while the training
    loop waits (measured: ~0.45 s instead of ~1.1 s for 2 GiB; docs/benchmarks.md). ``prepare(state)``, called
    before the first save, makes the first save's spare at once, in the background; the spares of the first two
    saves are also touched (their pages faulted in: ``trainer_client.runtime.memory._memory_spare``), so that on a host
    that has just started the first snapshots cost what later ones do.

    In a multi-process job each process snapshots its own shards into its host's shared memory and the
    snapshot records ``process_index`` of ``process_count`` (``jax.process_index()``/``jax.process_count()``
    unless given): one host's part of the step, which its host's ckptd persists as that process's part of a
    plain multi-process Orbax step (committed once every host's part is durable) but never takes for whole
    on its own, and its ``save_id`` (``<job incarnation>-<step>``, the same in every host's part of one save).
    Such a part holds every region its process's devices hold, once, with the lowest jax ``replica_id`` its
    devices have for it (the part with replica 0 writes the region to storage, as Orbax decides), so each
    process restores onto the same global mesh from its own part alone (docs/multihost.md).
    """

    def __init__(self, shm_dir: str, job: str, *, max_snapshots: int = 2, reserve_bytes: int = 64 << 20,
                 preallocate: bool = True, process_index: int | None = None,
                 process_count: int | None = None, incarnation: str | None = None) -> None:
        if max_snapshots < 1:
            raise ValueError("max_snapshots must be at least 1")
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process {self.process_index} of {self.process_count}")
        # a part's save id is <this incarnation of the JAX job>-<step>: the same in every host's part of one save
        self.incarnation = incarnation if incarnation is not None or self.process_count == 1 else job_incarnation()
        self.dir = job_dir(shm_dir, job)
        self.max_snapshots = max_snapshots
        self.reserve_bytes = reserve_bytes
        self.preallocate = preallocate and max_snapshots > 1
        self.last_blocked_s: float | None = None
        self.file_bytes = 0  # the last snapshot's file (its spare's size too): 0 before the first save
        self.last_spare_s: float | None = None  # how long the background allocation of the last spare took
        self._spare = self.dir / f"{SNAPSHOT_SPARE_PREFIX}{os.getpid()}"
        self._spare_thread: threading.Thread | None = None
        self._touch_left = 2  # the spares of the first two saves are touched, not only allocated
        self._touch_gate = threading.Event()  # closed while a restore runs: the touching waits (``hold_spare``)
        self._touch_gate.set()
        self._tree: tuple[Any, list[TreeEntry]] | None = None  # the last state's structure and its key paths
        ensure_private_dir(shm_dir)  # UnsafePathError: someone else could write (or owns) the directory
        ensure_private_dir(self.dir)
        drop_leftovers(self.dir)

    @property
    def held_bytes(self) -> int:
        """Host memory the tier holds at its peak, as the last save sized it: ``max_snapshots`` snapshot files, the
        spare file made ahead for the next save among them (it is made only where one fewer is held)."""
        return self.max_snapshots * self.file_bytes

    def _make_room(self, nbytes: int) -> None:
        """Evict down to fewer than ``max_snapshots``; check that ``nbytes`` more fit."""
        held = complete_snapshots(self.dir.parent, self.dir.name)
        evict_oldest(held, self.max_snapshots - 1)
        if len(held) >= self.max_snapshots:
            raise MemoryTierFull(
                f"{len(held)} snapshots of {self.dir.name!r} are held in {self.dir} and none may be dropped "
                f"yet (all wait to be persisted by ckptd); max_snapshots={self.max_snapshots}. Is ckptd running?"
                + (" A host's part of a multi-process job's step is persisted by its own ckptd and evictable only once "
                   "every host's part is committed (docs/multihost.md, section 5)." if self.process_count > 1 else "")
            )
        free = shutil.disk_usage(self.dir).free
        if nbytes and nbytes + self.reserve_bytes > free:
            raise MemoryTierFull(
                f"a snapshot of {nbytes / 2**20:.1f} MiB does not fit in {self.dir}: {free / 2**20:.1f} MiB free "
                f"(keeping {self.reserve_bytes / 2**20:.0f} MiB in reserve). Lower max_snapshots or give the "
                "shared-memory volume more room."
            )

    def save(self, step: int, state: PyTree, training: TrainingMetadata, *, persist: bool,
             data_iterator: DataIteratorRecord | None = None, item: str = DEFAULT_ITEM) -> Path:
        """Copy ``state`` into a new snapshot of ``step`` (with ``data_iterator``, the data iterator's state at
        it; ``item``: the Orbax item ckptd persists the state as); returns its directory."""
        started = time.perf_counter()
        self.wait_spare()  # normally long done: it started right after the previous save
        ensure_private_dir(self.dir)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        if self._tree is None or self._tree[0] != treedef:  # key paths once per structure, not per save
            self._tree = (treedef, describe_paths(state))
        tree = with_values(self._tree[1], [leaf for _, leaf in leaves])  # the values of this save
        plan: list[tuple[str, jax.Array, list[Any]]] = []
        nbytes = 0
        for path, leaf in leaves:
            if is_value(leaf):  # recorded in the tree as data
                continue
            plan.append((leaf_name(path), leaf, self._own_shards(leaf)))
            nbytes += leaf_bytes(leaf)
        spare = self._spare_bytes()
        reuse = spare >= nbytes
        if spare and not reuse:
            self._spare.unlink(missing_ok=True)  # the state grew: its pages go back before the room is counted
        self._make_room(0 if reuse else nbytes)
        tmp = self.dir / f"{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        make_private_dir(tmp)
        try:
            if reuse:
                try:
                    os.replace(self._spare, tmp / SNAPSHOT_DATA_FILE)
                except FileNotFoundError:  # ckptd dropped it meanwhile as stale: a new file (ENOSPC is caught)
                    reuse = False
            arrays, offset = self._write(tmp, plan, reuse=reuse, replicas=self.process_count > 1)
        except OSError as exc:  # e.g. ENOSPC: the room checked above was taken meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
            raise MemoryTierFull(f"writing the snapshot of step {step} into {self.dir} failed: {exc}") from exc
        except BaseException:  # e.g. DATA_LOSS mid-copy (a slice lost): no half snapshot holds shared memory
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        meta = SnapshotMeta(step=step, created_at=time.time(), persist=persist, nbytes=offset,
                            leaf_names=[name for name, _, _ in plan], tree=tree, arrays=arrays, training=training,
                            data_iterator=data_iterator, item=item, process_index=self.process_index,
                            process_count=self.process_count,
                            save_id=f"{self.incarnation}-{step}" if self.incarnation is not None else None)
        write_private(tmp / SNAPSHOT_META_FILE, meta.model_dump_json().encode())
        final = self.dir / str(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.last_blocked_s = time.perf_counter() - started
        self.file_bytes = max(nbytes, offset)
        if self.preallocate:  # sized as this save's bound, which the same state's next save asks for
            self._start_spare(nbytes, final)
        return final

    def prepare(self, state: PyTree) -> None:
        """Make the first save's spare file for ``state`` (arrays or ``ShapeDtypeStruct``s with shardings)
        now, in the background: allocated and touched, so that the first save writes into pages that exist.
        Nothing without ``preallocate``; a spare that is already big enough is kept. Never waits: a spare still
        being made (the last save's, its pages being touched: ~10 s for 5 GB on the lent chip's sandbox,
        docs/benchmarks.md) goes on beside the restore and the first step, and the next save judges its size."""
        if not self.preallocate or self.making_spare():
            return
        self._join_spare()  # a finished thread: joined at once (a held gate stays held)
        nbytes = snapshot_bytes(state)
        if nbytes and self._spare_bytes() < nbytes:
            self._start_spare(nbytes, None)

    def _start_spare(self, nbytes: int, newest: Path | None) -> None:
        touched = self._touch_left > 0
        self._touch_left -= touched
        self._spare_thread = threading.Thread(target=self._prepare_spare, args=(nbytes, newest, touched),
                                              name="ckptd-memory-tier-spare", daemon=True)
        self._spare_thread.start()

    def _own_shards(self, leaf: jax.Array) -> list[Any]:
        """The shards this snapshot holds: one replica of each; in a multi-process job, every region this
        process's devices hold, once (a replicated array's too, whichever process holds replica 0)."""
        if self.process_count == 1:
            return [s for s in leaf.addressable_shards if s.replica_id == 0]
        regions: dict[Any, Any] = {}
        for s in leaf.addressable_shards:  # the replica with the lowest id: 0 where this process writes the region
            key = index_bounds(s.index, leaf.shape)
            if key not in regions or s.replica_id < regions[key].replica_id:
                regions[key] = s
        return list(regions.values())

    def _spare_bytes(self) -> int:
        try:
            return self._spare.stat().st_size
        except FileNotFoundError:  # never made, or dropped by ckptd as stale
            return 0

    def hold_spare(self) -> None:
        """Pause the touching of a spare file's pages (at the next chunk: 256 MiB at most), for a restore and the
        first step after it, which come first; ``release_spare``, or any wait for the spare, lets it go on."""
        self._touch_gate.clear()

    def release_spare(self) -> None:
        self._touch_gate.set()

    def making_spare(self) -> bool:
        """Whether the background allocation of the next snapshot's file is still running."""
        return self._spare_thread is not None and self._spare_thread.is_alive()

    def wait_spare(self) -> None:
        """Wait until the background allocation of the next snapshot's file (if any) is done."""
        self._touch_gate.set()  # a held spare is waited for only once it may go on
        self._join_spare()

    def _join_spare(self) -> None:
        if self._spare_thread is not None:
            self._spare_thread.join()
            self._spare_thread = None

    def _prepare_spare(self, nbytes: int, newest: Path | None, touched: bool) -> None:
        started = time.perf_counter()
        try:
            held = complete_snapshots(self.dir.parent, self.dir.name)
            if newest is not None:  # after a save: what the next save would evict, now (prepare evicts nothing:
                evict_oldest(held, self.max_snapshots - 1, never=newest)  # a resume may be reading them)
            if len(held) >= self.max_snapshots:
                return  # every older snapshot still waits for ckptd: no room for a spare
            self._spare.unlink(missing_ok=True)  # one too small for this state (prepare)
            if nbytes + self.reserve_bytes > shutil.disk_usage(self.dir).free:
                return
            make_spare(self._spare, nbytes, touched=touched, gate=self._touch_gate)
            self.last_spare_s = time.perf_counter() - started
        except OSError as exc:
            _log.info("no spare snapshot file prepared in %s: %s", self.dir, exc)

    def close(self) -> None:
        """Give the spare file's memory back (snapshots stay: they belong to ckptd)."""
        self.wait_spare()
        self._spare.unlink(missing_ok=True)

    @staticmethod
    def _write(tmp: Path, plan: list[tuple[str, jax.Array, list[Any]]], *,
               reuse: bool, replicas: bool = False) -> tuple[dict[str, ArrayRecord], int]:
        """One copy per shard, device to the shared-memory file (no pre-zeroing: that is a second pass), into
        the spare's allocated pages with ``reuse``. Each shard starts at a multiple of ``SHARD_ALIGN``, so the
        persist worker's jax takes a view of it as is (``replicas``: each shard's jax ``replica_id`` recorded, a
        multi-process part's). Each shard's XXH3-64 checksum is computed from the host copy by
        a helper thread while the next shard is copied and written (zlib releases the GIL)."""
        arrays: dict[str, ArrayRecord] = {}
        offset = 0
        fd = open_private(tmp / SNAPSHOT_DATA_FILE, os.O_RDWR if reuse else os.O_WRONLY | os.O_CREAT)
        with os.fdopen(fd, "r+b" if reuse else "wb") as f, ThreadPoolExecutor(
                _CHECKSUM_THREADS, thread_name_prefix="snapshot-checksum") as sums:
            pending: list[tuple[str, list[int], str,
                                list[tuple[list[list[int]], int, int, Future[int], int | None]]]] = []
            for name, leaf, shards in plan:
                records = []
                for shard in shards:
                    pad = -offset % SHARD_ALIGN
                    f.write(bytes(pad))
                    offset += pad
                    host = np.ascontiguousarray(np.asarray(shard.data)).reshape(-1).view(np.uint8)
                    digest = sums.submit(xxhash.xxh3_64_intdigest, host.data)
                    f.write(host.data)
                    index = [list(b) for b in index_bounds(shard.index, leaf.shape)]
                    records.append((index, offset, host.nbytes, digest, shard.replica_id if replicas else None))
                    offset += host.nbytes
                pending.append((name, list(leaf.shape), str(leaf.dtype), records))
            f.truncate(offset)
            for name, shape, dtype, records in pending:
                arrays[name] = ArrayRecord(shape=shape, dtype=dtype, shards=[
                    ShardRecord(index=index, offset=at, nbytes=size, xxh3=digest.result(), replica_id=replica)
                    for index, at, size, digest, replica in records])
        return arrays, offset


_CHECKSUM_THREADS = 2


__all__ = ["MemoryTier", "MemoryTierFull", "restore_snapshot"]
