"""Restores: ckptd's storage restore against plain Orbax, the disk's cold-read limit and the memory tier,
side by side; and the host memory each restore holds.

Figures (the state and step come from ``bench.io``'s save repeats):

* ``restore_time_ratio_vs_orbax`` / ``reshard_restore_time_ratio_vs_orbax``: ``trainer_client.runtime
  .checkpointing.restore`` (which reads the chunks itself: ``trainer_client.runtime.restore._direct_restore``) against
  plain ``ocp.CheckpointManager.restore`` of the same step, onto the same 8-device mesh and onto 6 devices,
  the step's files evicted from the page cache before each (cold), order alternating; warm (files in the
  page cache) beside it.
* ``restore_throughput_ratio_vs_disk_limit``: bytes/s of that cold restore ÷ bytes/s of the disk's cold-read
  limit (``bench.disk_limit``: the best reader count of a sweep, timed again in every repeat beside the
  restore on the step's own data files).
* ``memory_tier_restore_speedup_vs_disk``: cold restore from storage ÷ ``restore_snapshot`` from shared
  memory, same state, same target (the warm-disk speedup beside it).
* ``restore_peak_host_rss_ratio_vs_state``: peak RSS above the baseline during one ckptd restore ÷ the
  state's bytes, each restore in a child process of its own (``bench.restore_rss``); plain Orbax and ckptd
  with a cap of a quarter of the state (``host_bytes``) beside it.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bench import disk_limit, restore_rss
from bench.common import Figure, Profile, Results, alternate, evict_from_page_cache, free_gib, timed
from trainer_client.runtime.memory._memory_tier import restore_snapshot
from trainer_client.runtime.saving._checkpointing import restore

PyTree = Any
SPEC = PartitionSpec("data", None)


def target(profile: Profile, mesh: Mesh) -> PyTree:
    """The io state's abstract tree (``ShapeDtypeStruct`` leaves) on ``mesh``."""
    sharding = NamedSharding(mesh, SPEC)
    shape = (profile.rows, profile.cols)
    return {"params": {f"layer{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
                       for i in range(profile.arrays)}}


def run_restores(profile: Profile, results: Results, step_dir: Path, snapshot: Path, mesh8: Mesh, mesh6: Mesh) -> None:
    job_dir, step = step_dir.parent, int(step_dir.name)
    cold = profile.cold_reads and evict_from_page_cache(job_dir)
    results.notes["cold"] = (
        "cold = the step's files written back and evicted from the page cache (`posix_fadvise(DONTNEED)` on "
        "each) before every cold restore, so they are read from disk; shared-memory snapshots are tmpfs pages "
        "and stay in RAM, untouched (bench/common.py, evict_from_page_cache: why not drop_caches)"
        if cold else "page cache NOT evicted (toy profile, or no posix_fadvise): 'cold' restores read warm files")
    results.context["restore_cold_files_evicted"] = cold
    t8, t6 = target(profile, mesh8), target(profile, mesh6)
    s: dict[str, list[float]] = {k: [] for k in (
        "ckptd_restore_cold", "orbax_restore_cold", "ckptd_reshard_cold", "orbax_reshard_cold", "memory_tier_restore",
        "ckptd_restore_warm", "orbax_restore_warm",
        "ckptd_restore_cold_touched", "memory_tier_restore_touched", "memory_tier_reshard")}
    # A restore may hand back arrays that alias its source (restore_snapshot maps shared memory zero-copy when
    # the layout matches): "touched" adds one jitted pass over every byte (a sum per array) to both sides.
    checksum = jax.jit(lambda tree: [jnp.sum(x) for x in jax.tree_util.tree_leaves(tree)])

    def timed_restore(name: str, fn: Callable[[], PyTree], *, drop: bool = True, touch: bool = False) -> None:
        if drop and cold:
            evict_from_page_cache(job_dir)
        with timed() as t:
            out = fn()
            jax.block_until_ready(checksum(out) if touch else out)
        s[name].append(t.seconds)
        del out
        gc.collect()

    def ckptd(want: PyTree) -> Callable[[], PyTree]:
        return lambda: restore(str(step_dir), want)

    def orbax(want: PyTree) -> Callable[[], PyTree]:
        def run() -> PyTree:
            mgr = ocp.CheckpointManager(str(job_dir))
            try:
                return mgr.restore(step, args=ocp.args.StandardRestore(want))
            finally:
                mgr.close()

        return run

    # warm-up: the first restore in a process pays one-off imports and setup, not part of either side
    jax.block_until_ready(checksum(restore(str(step_dir), t8)))  # also compiles the checksum
    gc.collect()
    files = disk_limit.data_files(step_dir)
    file_bytes = sum(f.stat().st_size for f in files)
    readers, sweep = disk_limit.read_sweep(files, cold=cold)
    results.context["disk_read_sweep_gbps"] = {str(n): round(file_bytes / t / 1e9, 3) for n, t in sweep.items()}
    print(f"  cold-read sweep over the step's {len(files)} data files ({file_bytes / 2**30:.2f} GiB): "
          + ", ".join(f"{n} readers {file_bytes / t / 1e9:.2f} GB/s" for n, t in sweep.items()), flush=True)
    s["disk_read_limit"] = []

    def read_limit() -> None:
        s["disk_read_limit"].append(disk_limit.read_limit(files, readers, cold=cold))

    rss: dict[str, list[float]] = {"ckptd": [], "orbax": [], "ckptd_capped": []}
    cap = max(1, profile.state_bytes // 4)

    def child(name: str, mode: str, limit: int | None = None) -> Callable[[], None]:
        def run() -> None:
            got = restore_rss.measure(step_dir, mode, arrays=profile.arrays, rows=profile.rows, cols=profile.cols,
                                      cap=limit)
            rss[name].append(got["peak_above_bytes"] / profile.state_bytes)

        return run

    cold_runs = [lambda: timed_restore("ckptd_restore_cold", ckptd(t8)),
                 lambda: timed_restore("orbax_restore_cold", orbax(t8)), read_limit]
    rss_runs = [child("ckptd", "ckptd"), child("orbax", "orbax")]
    capped = child("ckptd_capped", "ckptd", cap)  # beside the key: once (a child costs a jax import, ~3-8 s)
    for i in range(profile.repeats):
        print(f"  restore repeat {i + 1}/{profile.repeats} ({free_gib():.1f} GiB available)", flush=True)
        for run in _rotated(cold_runs, i) + _rotated(rss_runs, i):
            run()
        if i == 0 and profile.rss_capped:
            capped()
        # right after a read of the same files (an in-process recovery finds the step it just wrote in the cache)
        alternate(i, lambda: timed_restore("ckptd_restore_warm", ckptd(t8), drop=False),
                  lambda: timed_restore("orbax_restore_warm", orbax(t8), drop=False))
        alternate(i, lambda: timed_restore("ckptd_reshard_cold", ckptd(t6)),
                  lambda: timed_restore("orbax_reshard_cold", orbax(t6)))
        timed_restore("memory_tier_restore", lambda: restore_snapshot(snapshot, t8), drop=False)
        alternate(i, lambda: timed_restore("ckptd_restore_cold_touched", ckptd(t8), touch=True),
                  lambda: timed_restore("memory_tier_restore_touched", lambda: restore_snapshot(snapshot, t8),
                                        drop=False, touch=True))
        timed_restore("memory_tier_reshard", lambda: restore_snapshot(snapshot, t6), drop=False)
        print(f"    same mesh: ckptd {s['ckptd_restore_cold'][-1]:.3f}s, orbax {s['orbax_restore_cold'][-1]:.3f}s; "
              f"8->6: ckptd {s['ckptd_reshard_cold'][-1]:.3f}s, orbax {s['orbax_reshard_cold'][-1]:.3f}s; "
              f"memory tier {s['memory_tier_restore'][-1]:.3f}s (8->6 {s['memory_tier_reshard'][-1]:.3f}s), warm disk "
              f"{s['ckptd_restore_warm'][-1]:.3f}s (orbax {s['orbax_restore_warm'][-1]:.3f}s); "
              f"with a pass over every byte: memory tier "
              f"{s['memory_tier_restore_touched'][-1]:.3f}s, cold disk {s['ckptd_restore_cold_touched'][-1]:.3f}s; "
              f"disk read limit {file_bytes / s['disk_read_limit'][-1] / 1e9:.2f} GB/s ({readers} readers); peak RSS "
              f"/ state: ckptd {rss['ckptd'][-1]:.2f} (capped at 1/4: "
              f"{(rss['ckptd_capped'] or [math.nan])[-1]:.2f}), orbax {rss['orbax'][-1]:.2f}", flush=True)
    for k, v in s.items():
        results.measure(f"io.{k}_s", v, "s")
    same = [a / b for a, b in zip(s["ckptd_restore_cold"], s["orbax_restore_cold"], strict=True)]
    reshard = [a / b for a, b in zip(s["ckptd_reshard_cold"], s["orbax_reshard_cold"], strict=True)]
    speedup = [a / b for a, b in zip(s["ckptd_restore_cold"], s["memory_tier_restore"], strict=True)]
    warm = [a / b for a, b in zip(s["ckptd_restore_warm"], s["memory_tier_restore"], strict=True)]
    results.measure("io.ratio.memory_tier_speedup_vs_warm_disk", warm, "x")
    touched = [a / b for a, b in zip(s["ckptd_restore_cold_touched"], s["memory_tier_restore_touched"], strict=True)]
    results.measure("io.ratio.memory_tier_speedup_touched", touched, "x",
                    "cold disk restore + a sum over every array / memory tier restore + the same sum")
    resharded = [a / b for a, b in zip(s["ckptd_reshard_cold"], s["memory_tier_reshard"], strict=True)]
    results.measure("io.ratio.memory_tier_speedup_reshard_8_to_6", resharded, "x")
    warm_vs_orbax = [a / b for a, b in zip(s["ckptd_restore_warm"], s["orbax_restore_warm"], strict=True)]
    results.measure("io.ratio.restore_warm_vs_orbax", warm_vs_orbax, "ratio",
                    "as restore_time_ratio_vs_orbax, with the step's files in the page cache")
    results.figure(Figure("restore_time_ratio_vs_orbax", same, "<=", 1.0, "ratio",
                          "ckptd restore (trainer_client.runtime.saving._checkpointing.restore: chunks read directly, "
                          "trainer_client.runtime.restore._direct_restore) / plain Orbax "
                          "CheckpointManager.restore, same step, same 8-device mesh, cold cache, alternating order",
                          {"cold_files_evicted": cold, "warm_cache_ratio_median": results.measurements[
                              "io.ratio.restore_warm_vs_orbax"]["median"]}))
    results.figure(Figure("reshard_restore_time_ratio_vs_orbax", reshard, "<=", 1.0, "ratio",
                          "as above, restored onto 6 devices (saved on 8)", {"cold_files_evicted": cold}))
    results.figure(Figure("memory_tier_restore_speedup_vs_disk", speedup, ">=", 5.0, "x",
                          "restore of the step from storage (cold) / restore_snapshot from shared memory, same "
                          "state onto the same 8-device target",
                          {"warm_disk_speedup_median": results.measurements[
                              "io.ratio.memory_tier_speedup_vs_warm_disk"]["median"],
                           "touched_speedup_median": results.measurements[
                               "io.ratio.memory_tier_speedup_touched"]["median"],
                           "reshard_8_to_6_speedup_median": results.measurements[
                               "io.ratio.memory_tier_speedup_reshard_8_to_6"]["median"],
                           "cold_files_evicted": cold}))

    vs_limit = {name: [(profile.state_bytes / t) / (file_bytes / lim) for t, lim in zip(
        s[f"{name}_restore_cold"], s["disk_read_limit"], strict=True)] for name in ("ckptd", "orbax")}
    results.measure("io.disk_read_limit_gbps", [file_bytes / t / 1e9 for t in s["disk_read_limit"]], "GB/s",
                    f"cold read of the step's data files by {readers} parallel readers (the best of the sweep)")
    results.measure("io.ratio.orbax_restore_vs_disk_limit", vs_limit["orbax"], "ratio")
    results.figure(Figure(
        "restore_throughput_ratio_vs_disk_limit", vs_limit["ckptd"], ">=", 0.8, "ratio",
        "bytes/s of ckptd's cold restore (same 8-device mesh) / bytes/s of the disk's cold-read limit (the best of "
        "1, 2, 4, 8, 16 parallel readers of the step's data files, evicted from the page cache), same repeat",
        {"disk_read_limit_gbps_median": results.measurements["io.disk_read_limit_gbps"]["median"],
         "readers": readers, "read_sweep_gbps": results.context["disk_read_sweep_gbps"],
         "orbax_median": results.measurements["io.ratio.orbax_restore_vs_disk_limit"]["median"],
         "cold_files_evicted": cold}))
    for name, series in rss.items():
        results.measure(f"io.restore_peak_rss_ratio.{name}", series, "ratio")
    results.figure(Figure(
        "restore_peak_host_rss_ratio_vs_state", rss["ckptd"], "<=", 1.2, "ratio",
        "peak RSS above the baseline during one ckptd restore / the state's bytes (a child process per restore; on "
        "these CPU devices the restored arrays are host memory: a restore with no copy scores ~1.0)",
        {"orbax_median": results.measurements["io.restore_peak_rss_ratio.orbax"]["median"],
         "ckptd_capped_at_a_quarter_median": results.measurements["io.restore_peak_rss_ratio.ckptd_capped"]["median"],
         "cap_bytes": cap}))


def _rotated(runs: list[Callable[[], None]], i: int) -> list[Callable[[], None]]:
    shift = i % len(runs)
    return runs[shift:] + runs[:shift]
