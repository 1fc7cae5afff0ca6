"""Save, persist and restore: ckptd's data path against a memcpy, the raw disk and plain Orbax, side by side.

One state of ``profile.arrays`` float32 arrays (rows sharded over 8 fake CPU devices, mesh ``("data",)``)
is saved and restored by every path in turn. Every repeat measures a path *and its baseline* back to back
(the order changes from repeat to repeat), and every ratio is formed within one repeat, so the noise of a
shared 2-core machine hits both sides alike. Figures:

* ``save_stall_ratio_vs_memcpy``: time the training loop is blocked per save — ``Checkpointer.save``
  returning (async Orbax underneath) and ``MemoryTier.save`` (copy into shared memory, into the file its
  previous save allocated in the background; that allocation is ``io.memory_tier_spare_s``) — divided by a plain
  numpy copy (``np.copy``) of the same bytes; the worse of the two paths per repeat. Plain
  ``ocp.CheckpointManager.save``'s stall is reported beside it.
* ``persist_throughput_ratio_vs_raw_disk``: bytes/s of a complete persist — ``Checkpointer`` save until
  committed (compression off, manifest and fsync included), and ckptd's persist worker run as ckptd runs
  it (one long-lived ``--serve`` child, started before the repeats; a request per snapshot) from a memory
  snapshot — divided by numpy ``tofile`` + ``fsync`` of the same bytes into the same directory; the worse of
  the two per repeat. Beside it: the worker's first request (process start and the jax/Orbax import
  included), the one-shot CLI (``python -m ckptd.persist._persist_worker SNAPSHOT DIR``, a fresh process per
  snapshot), the worker called in-process, plain Orbax with its default zstd and with compression off.
* ``persist_throughput_ratio_vs_disk_limit``: the same persists against the disk's write limit
  (``bench.disk_limit``: the best of 1, 2, 4, 8 parallel writers of the same bytes with fsync, swept once,
  then timed at the winning count in every repeat); the worse of the two paths per repeat.
* Restores (``restore_time_ratio_vs_orbax``, ``restore_throughput_ratio_vs_disk_limit``, the memory tier,
  peak host memory): ``bench.io_restore``, on the last repeat's step and snapshot.
* Storage requests on GCS against plain Orbax: ``bench.gcs_requests``.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from bench import disk_limit, persist_phases
from bench.common import Figure, Profile, Results, alternate, filesystem_of, free_gib, rmtree, timed
from bench.gcs_requests import run_gcs_requests
from bench.io_restore import SPEC, run_restores
from bench.persist_phases import ServeWorker
from ckptd.config import DEFAULT_PERSIST_NICE
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, standard_handler, training_metadata

PyTree = Any
JOB = "bench-io"


def make_state(profile: Profile, mesh: Mesh) -> PyTree:
    """Random normal weights (trained weights barely compress; zeros would flatter zstd)."""
    rng = np.random.default_rng(0)
    sharding = NamedSharding(mesh, SPEC)
    params = {}
    for i in range(profile.arrays):
        host = rng.standard_normal((profile.rows, profile.cols), dtype=np.float32)
        host *= 0.02
        params[f"layer{i}"] = jax.device_put(host, sharding)
        del host
    state = {"params": params}
    jax.block_until_ready(state)
    return state


def _shard_views(state: PyTree) -> list[list[np.ndarray]]:
    """Per array, its shards' host bytes in row order (zero-copy views of the CPU device buffers)."""
    out = []
    for leaf in jax.tree_util.tree_leaves(state):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        out.append([np.asarray(s.data) for s in shards if s.replica_id == 0])
    return out


def orbax_manager(directory: Path, *, compression: bool | None) -> ocp.CheckpointManager:
    """Plain Orbax, as a user would make it; ``compression=None`` keeps Orbax's default handler (zstd)."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=None, create=True)
    if compression is None:
        return ocp.CheckpointManager(str(directory), options=options)
    return ocp.CheckpointManager(str(directory), options=options, item_handlers=standard_handler(compression))


def _save_repeat(i: int, profile: Profile, state: PyTree, views: list[list[np.ndarray]], mesh8: Mesh,
                 tier: MemoryTier, workdir: Path, worker: ServeWorker | None, writers: int,
                 phases: dict[str, dict[str, float]]) -> tuple[dict[str, float], Path, Path]:
    """One repeat of every save and persist measurement; (timings, its snapshot, its Checkpointer step).
    ``phases`` gets the worker's persist phases, child and in-process (``bench.persist_phases``)."""
    step = 100 * (i + 1)
    print(f"  repeat {i + 1}/{profile.repeats} ({free_gib():.1f} GiB available)", flush=True)
    rep: dict[str, float] = {}
    snapshot: list[Path] = []
    kept: list[Path] = []

    def meta(step: int) -> Any:
        return training_metadata(step, state, data_position=step * 64, global_batch=64, mesh=mesh8,
                                 slices=list(range(8)))

    # -- the stall: memcpy vs the memory tier's copy, alternating --------------------------------
    def memcpy() -> None:
        with timed() as t:
            copies = [np.copy(v) for arr in views for v in arr]
        rep["memcpy"] = t.seconds
        with timed() as t:
            for dst, src in zip(copies, (v for arr in views for v in arr), strict=True):
                np.copyto(dst, src)
        rep["memcpy_prefaulted"] = t.seconds
        del copies

    def tier_save() -> None:
        with timed() as t:
            path = tier.save(step, state, meta(step), persist=True)
        rep["memory_tier_blocked"] = t.seconds
        snapshot.append(path)
        # the next snapshot's file, allocated in the background after the save returned (not blocking the
        # loop); waited for here so that it overlaps nothing timed
        tier.wait_spare()
        rep["memory_tier_spare"] = tier.last_spare_s if tier.last_spare_s is not None else float("nan")

    alternate(i, memcpy, tier_save)

    # -- complete persists against the raw disk, a new order each repeat ----------------------------
    def raw_disk() -> None:
        d = workdir / f"raw-{i}"
        d.mkdir()
        os.sync()
        with timed() as t:
            for j, arr in enumerate(views):
                with open(d / f"array{j}.bin", "wb") as f:
                    for v in arr:
                        v.tofile(f)
                    f.flush()
                    os.fsync(f.fileno())
        rep["raw_disk"] = t.seconds
        rmtree(d)

    def checkpointer() -> None:
        d = workdir / f"ckpt-{i}"
        ck = Checkpointer(str(d))  # compression off: ckptd's default
        os.sync()
        with timed() as total:
            with timed() as t:
                ck.save(step, state, data_position=step * 64, global_batch=64, mesh=mesh8, slices=list(range(8)))
            ck.wait()
        ck.close()
        rep["checkpointer_blocked"] = t.seconds
        rep["checkpointer_persist"] = total.seconds
        kept.append(d / str(step))

    def orbax(compression: bool | None, name: str) -> Callable[[], None]:
        def run() -> None:
            d = workdir / f"{name}-{i}"
            mgr = orbax_manager(d, compression=compression)
            os.sync()
            with timed() as total:
                with timed() as t:
                    mgr.save(step, args=ocp.args.StandardSave(state))
                mgr.wait_until_finished()
            mgr.close()
            rep[f"{name}_persist"] = total.seconds
            if compression is None:
                rep["orbax_zstd_blocked"] = t.seconds
            else:
                rep["orbax_blocked"] = t.seconds
            rmtree(d)

        return run

    def worker_child() -> None:
        if worker is None:  # toy: the in-process figure stands in (no second jax import)
            return
        d = workdir / f"worker-{i}"
        os.sync()
        before = resource.getrusage(resource.RUSAGE_SELF)
        with timed() as t:
            worker.persist(snapshot[0], d)
        after = resource.getrusage(resource.RUSAGE_SELF)
        rep["persist_worker_child"] = t.seconds
        # what this process spent meanwhile (it only waits for the answer): CPU taken from the niced child
        phases["child"] = {**worker.last_phases, "parent_cpu": (after.ru_utime + after.ru_stime)
                           - (before.ru_utime + before.ru_stime)}
        rmtree(d)

    def worker_oneshot() -> None:
        if worker is None:
            return
        d = workdir / f"worker-oneshot-{i}"
        os.sync()
        with timed() as t:
            done = subprocess.run([sys.executable, "-m", "ckptd.persist._persist_worker", str(snapshot[0]), str(d)],
                                  capture_output=True, text=True, check=False, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"persist worker failed: {done.stderr[-2000:]}")
        rep["persist_worker_oneshot"] = t.seconds
        rmtree(d)

    def worker_inprocess() -> None:
        from ckptd.persist._persist_worker import persist

        d = workdir / f"worker-inproc-{i}"
        persist_phases.install()
        os.sync()
        with timed() as t:
            started = persist_phases.begin()
            persist(snapshot[0], str(d))
            phases["inprocess"] = persist_phases.end(started)
        rep["persist_worker_inprocess"] = t.seconds
        rmtree(d)

    def write_limit() -> None:
        rep["disk_write_limit"] = disk_limit.write_limit([v for arr in views for v in arr], workdir / f"limit-{i}",
                                                         writers)

    order: list[Callable[[], None]] = [raw_disk, write_limit, checkpointer, worker_child, orbax(None, "orbax_zstd"),
                                       orbax(False, "orbax_nocompression"), worker_inprocess]
    if profile.oneshot_repeats is None or i < profile.oneshot_repeats:
        order.append(worker_oneshot)
    # A different order each repeat, not a rotation: a rotation keeps who follows whom, and a persist
    # run right after the Checkpointer's save measured slower (docs/benchmarks.md, "phase by phase").
    for run in random.Random(i).sample(order, len(order)):
        run()
        gc.collect()

    if worker is None:
        rep["persist_worker_child"] = rep["persist_worker_oneshot"] = rep["persist_worker_inprocess"]
    return rep, snapshot[0], kept[0]


def _first_request(worker: ServeWorker, state: PyTree, mesh8: Mesh, tier: MemoryTier, workdir: Path) -> float:
    """Seconds of the worker's first request (started just before: its process start and jax/Orbax import
    are in it, as in ckptd's first persist), on a snapshot of its own, before anything else is timed."""
    meta = training_metadata(1, state, data_position=64, global_batch=64, mesh=mesh8, slices=list(range(8)))
    path = tier.save(1, state, meta, persist=True)
    tier.wait_spare()  # the first timed save finds its file allocated, as every save after a first one does
    os.sync()
    with timed() as t:
        worker.persist(path, workdir / "worker-first")
    rmtree(workdir / "worker-first")
    rmtree(path)
    return t.seconds


def run_io(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:
    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(f"needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), got {len(devices)}")
    mesh8 = Mesh(np.array(devices[:8]), ("data",))
    mesh6 = Mesh(np.array(devices[:6]), ("data",))
    workdir.mkdir(parents=True, exist_ok=True)
    nbytes = profile.state_bytes
    gib = nbytes / 2**30
    results.context["io_state"] = {
        "arrays": profile.arrays, "shape": [profile.rows, profile.cols], "dtype": "float32", "bytes": nbytes,
        "gib": round(gib, 3), "mesh": "('data',) = 8 fake CPU devices", "reshard_mesh": "('data',) = 6",
        "storage_dir": str(workdir), "storage_fs": filesystem_of(workdir), "shm_dir": str(shm_dir),
        "shm_fs": filesystem_of(shm_dir),
    }
    print(f"io: state {profile.arrays} x {profile.rows}x{profile.cols} float32 = {gib:.2f} GiB on 8 devices; "
          f"storage {workdir} ({filesystem_of(workdir)}); {free_gib():.1f} GiB available", flush=True)
    with timed() as t:
        state = make_state(profile, mesh8)
    print(f"  state made in {t.seconds:.1f}s", flush=True)
    views = _shard_views(state)
    assert sum(v.nbytes for arr in views for v in arr) == nbytes
    tier = MemoryTier(str(shm_dir), JOB, max_snapshots=profile.repeats + 2, reserve_bytes=0)

    s: dict[str, list[float]] = {k: [] for k in (
        "memcpy", "memcpy_prefaulted", "checkpointer_blocked", "memory_tier_blocked", "memory_tier_spare",
        "orbax_blocked",
        "raw_disk", "disk_write_limit", "checkpointer_persist", "persist_worker_child", "persist_worker_inprocess",
        "persist_worker_oneshot", "orbax_zstd_persist", "orbax_nocompression_persist", "orbax_zstd_blocked")}
    ratio: dict[str, list[float]] = {k: [] for k in (
        "stall_checkpointer", "stall_memory_tier", "stall_orbax", "persist_checkpointer", "persist_worker_child",
        "persist_worker_inprocess", "persist_worker_oneshot", "persist_orbax_zstd", "persist_orbax_nocompression",
        "limit_checkpointer", "limit_worker_child", "limit_orbax_nocompression")}
    keep_step_dir: Path | None = None
    keep_snapshot: Path | None = None

    nice = int(os.environ.get("BENCH_PERSIST_NICE", DEFAULT_PERSIST_NICE))
    worker = ServeWorker(os.environ.get("BENCH_PERSIST_PHASES", "1") != "0", nice) if profile.persist_child else None
    phase_series: dict[str, list[float]] = {}
    try:
        if worker is not None:
            first = _first_request(worker, state, mesh8, tier, workdir)
            results.measure("io.persist_worker_first_request_s", [first], "s",
                            "the --serve worker's first request: process start, jax/Orbax import, one persist")
            print(f"  persist worker's first request (start and import included): {first:.2f}s", flush=True)
        writers, sweep = disk_limit.write_sweep([v for arr in views for v in arr], workdir)
        results.context["disk_write_sweep_gbps"] = {str(n): round(nbytes / t / 1e9, 3) for n, t in sweep.items()}
        print("  write sweep (fsync included): " + ", ".join(
            f"{n} writers {nbytes / t / 1e9:.2f} GB/s" for n, t in sweep.items()), flush=True)
        for i in range(profile.repeats):
            phases: dict[str, dict[str, float]] = {}
            rep, snap, step_dir = _save_repeat(i, profile, state, views, mesh8, tier, workdir, worker, writers, phases)
            for k, v in rep.items():
                s[k].append(v)
            for path, spans in phases.items():
                for phase, seconds in spans.items():
                    phase_series.setdefault(f"{path}.{phase}", []).append(seconds)
            ratio["stall_checkpointer"].append(rep["checkpointer_blocked"] / rep["memcpy"])
            ratio["stall_memory_tier"].append(rep["memory_tier_blocked"] / rep["memcpy"])
            ratio["stall_orbax"].append(rep["orbax_blocked"] / rep["memcpy"])
            raw_tput = nbytes / rep["raw_disk"]
            for name, key in (("persist_checkpointer", "checkpointer_persist"),
                              ("persist_worker_child", "persist_worker_child"),
                              ("persist_worker_inprocess", "persist_worker_inprocess"),
                              ("persist_worker_oneshot", "persist_worker_oneshot"),
                              ("persist_orbax_zstd", "orbax_zstd_persist"),
                              ("persist_orbax_nocompression", "orbax_nocompression_persist")):
                if key in rep:  # the one-shot CLI: not in every repeat of the quick profile
                    ratio[name].append((nbytes / rep[key]) / raw_tput)
            for name, key in (("limit_checkpointer", "checkpointer_persist"),
                              ("limit_worker_child", "persist_worker_child"),
                              ("limit_orbax_nocompression", "orbax_nocompression_persist")):
                ratio[name].append(rep["disk_write_limit"] / rep[key])
            if i == profile.repeats - 1:
                keep_snapshot, keep_step_dir = snap, step_dir
            else:
                rmtree(snap)
                rmtree(step_dir.parent)
            print(f"    memcpy {rep['memcpy']:.3f}s; blocked: checkpointer {rep['checkpointer_blocked']:.3f}s, "
                  f"memory tier {rep['memory_tier_blocked']:.3f}s (spare {rep['memory_tier_spare']:.3f}s in the "
                  f"background), orbax {rep['orbax_blocked']:.3f}s; persist: "
                  f"raw disk {nbytes / rep['raw_disk'] / 1e9:.2f} GB/s, checkpointer "
                  f"{nbytes / rep['checkpointer_persist'] / 1e9:.2f}, "
                  f"worker {nbytes / rep['persist_worker_child'] / 1e9:.2f} (in-process "
                  f"{nbytes / rep['persist_worker_inprocess'] / 1e9:.2f}, one-shot CLI "
                  f"{nbytes / rep.get('persist_worker_oneshot', float('nan')) / 1e9:.2f}), orbax zstd "
                  f"{nbytes / rep['orbax_zstd_persist'] / 1e9:.2f}, orbax no compression "
                  f"{nbytes / rep['orbax_nocompression_persist'] / 1e9:.2f} GB/s", flush=True)
    finally:
        if worker is not None:
            worker.close()

    for k, series in s.items():
        results.measure(f"io.{k}_s", series, "s")
    for k in ("raw_disk", "disk_write_limit", "checkpointer_persist", "persist_worker_child",
              "persist_worker_inprocess", "persist_worker_oneshot", "orbax_zstd_persist",
              "orbax_nocompression_persist"):
        results.measure(f"io.{k}_gbps", [nbytes / x / 1e9 for x in s[k]], "GB/s")
    for k, series in ratio.items():
        results.measure(f"io.ratio.{k}", series, "ratio")
    for k, series in sorted(phase_series.items()):  # bench.persist_phases: where the worker's persist goes
        counted = k.endswith(("page_faults", "_switches")) or ".vm_" in k
        results.measure(f"io.persist_phase.{k}", series, "count" if counted else "s")

    med = {k: results.measurements[f"io.ratio.{k}"]["median"] for k in ratio}
    results.figure(Figure(
        "save_stall_ratio_vs_memcpy",
        [max(a, b) for a, b in zip(ratio["stall_checkpointer"], ratio["stall_memory_tier"], strict=True)],
        "<=", 1.5, "ratio",
        "training blocked per save / np.copy of the same bytes; worse of Checkpointer.save and MemoryTier.save",
        {"checkpointer_median": med["stall_checkpointer"], "memory_tier_median": med["stall_memory_tier"],
         "orbax_async_save_median": med["stall_orbax"],
         "memory_tier_spare_background_s_median": results.measurements["io.memory_tier_spare_s"]["median"],
         "state_gib": round(gib, 3)},
    ))
    results.figure(Figure(
        "persist_throughput_ratio_vs_raw_disk",
        [min(a, b) for a, b in zip(ratio["persist_checkpointer"], ratio["persist_worker_child"], strict=True)],
        ">=", 0.9, "ratio",
        "bytes/s of a complete persist / numpy tofile+fsync of the same bytes (same run, same directory); "
        "worse of Checkpointer (save until committed) and the persist worker (ckptd's long-lived --serve child, "
        "from a snapshot)",
        {"checkpointer_median": med["persist_checkpointer"], "persist_worker_child_median": med["persist_worker_child"],
         "persist_worker_inprocess_median": med["persist_worker_inprocess"],
         "persist_worker_oneshot_median": med["persist_worker_oneshot"],
         "persist_worker_first_request_s": (results.measurements.get("io.persist_worker_first_request_s") or {}).get(
             "median"),
         "orbax_default_zstd_median": med["persist_orbax_zstd"],
         "orbax_compression_off_median": med["persist_orbax_nocompression"],
         "raw_disk_gbps_median": results.measurements["io.raw_disk_gbps"]["median"], "state_gib": round(gib, 3)},
    ))

    results.figure(Figure(
        "persist_throughput_ratio_vs_disk_limit",
        [min(a, b) for a, b in zip(ratio["limit_checkpointer"], ratio["limit_worker_child"], strict=True)],
        ">=", 0.8, "ratio",
        "bytes/s of a complete persist / the disk's write limit (the best of 1, 2, 4, 8 parallel writers of the same "
        "bytes, each file fsynced), same repeat; worse of Checkpointer and the persist worker (--serve child)",
        {"checkpointer_median": med["limit_checkpointer"], "persist_worker_child_median": med["limit_worker_child"],
         "orbax_compression_off_median": med["limit_orbax_nocompression"], "writers": writers,
         "write_sweep_gbps": results.context["disk_write_sweep_gbps"],
         "disk_write_limit_gbps_median": results.measurements["io.disk_write_limit_gbps"]["median"]},
    ))

    # -- restores ----------------------------------------------------------------------------------
    del views, state
    gc.collect()
    assert keep_step_dir is not None and keep_snapshot is not None
    run_restores(profile, results, keep_step_dir, keep_snapshot, mesh8, mesh6)
    rmtree(keep_step_dir.parent)
    rmtree(keep_snapshot)
    run_gcs_requests(profile, results)
