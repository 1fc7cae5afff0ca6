"""``python -m bench.tier_restore``: the shared-memory tier's restore and the direct Orbax reader against the
host-to-device rate measured in the same run, on whatever devices jax has (one TPU chip, or CPU devices).

A state of ``--leaves`` float32 arrays (``--gb`` GB together, a few large and many small, like a decoder's
parameters and Adam moments), each split along its first axis over every device, is saved once into the
memory tier (``MemoryTier.save``) and once as an Orbax step (``Checkpointer``, under ``--workdir``, default a
tmpfs beside the snapshot so both read from memory). Then, ``--repeats`` times in alternating order:

* ``numpy_to_device_s``: ``jax.device_put`` of the same arrays from ordinary numpy memory (already touched) to
  the same shardings, until ready: the host-to-device rate every restore is judged against;
* ``shm_restore_s``: ``restore_snapshot`` onto the same shardings, until ready (map, every shard's checksum,
  transfer); ``shm_ratio`` = its rate / the numpy-to-device rate (the target on accelerators: >= 0.5);
* ``direct_restore_s``: ``checkpointing.restore`` of the Orbax step (the direct reader), until ready;
* the shm restore's parts alone: ``checksum_s`` (every shard's XXH3 from a populated map, one thread per
  core), ``checksum_lazy_map_s`` (the same from a map faulted in page by page, as before this pipeline),
  ``transfer_from_map_s`` (``device_put`` of views of the map after its checks).

Prints one JSON line (medians, with every repeat's figures under ``runs``) and writes it to ``--out`` if given.
``measure_restores`` is the measurement itself, on any state: the device profile (bench/device_tiers.py) runs it
on the decoder's train state, with Orbax's own reader as a fourth arm and a training step after each restore.
Runs in one process on one chip with ``JAX_PLATFORMS`` unset (no sockets, no ckptd), or on CPU devices:
``JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.tier_restore --gb 0.25``.
The device's memory holds the state at most twice at a time (measured, then deleted).

Measured on the lent TPU v5e chip (gVisor, 13 cores; ``--gb 5.2 --repeats 3``, medians, ranges in brackets):
numpy -> device 1.92 s [1.10-1.99] (one ``device_put`` of the 25 arrays), shm restore 2.14 s [1.64-2.42]
(was 7.0 s), ratio 0.90; direct reader 1.66 s [0.74-1.90] (was 4.5 s); checks from a populated map 0.11 s
[0.09-0.29], from a map faulted page by page 3.47 s [3.12-3.52]; transfer of the checked map's views alone
1.71 s [1.51-1.75]. A probe there (not in this script): one 1.35 GB array put as one transfer 6.4 GB/s
(repeated; its first transfer from that buffer 3.0 GB/s), as 8-16 row blocks 11-13 GB/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_client.core.format._snapshot import map_data, read_meta
from trainer_client.core.format._snapshot_shards import index_bounds
from trainer_client.runtime.memory._memory_tier import MemoryTier, restore_snapshot
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, training_metadata

PyTree = Any
# relative sizes of the leaves: a decoder's stacked layer weights (large) and norms/biases/embeddings (small)
_WEIGHTS = (8, 8, 4, 4, 2, 1, 1, 0.5, 0.25, 0.1)


def _state_specs(total_bytes: int, leaves: int, devices: int) -> list[tuple[int, int]]:
    """(rows, cols) of each float32 leaf: ``total_bytes`` together, rows a multiple of ``devices``."""
    weights = [_WEIGHTS[k % len(_WEIGHTS)] for k in range(leaves)]
    cols = 1024
    out = []
    for w in weights:
        rows = max(devices, int(total_bytes * w / sum(weights) / 4 / cols) // devices * devices)
        out.append((rows, cols))
    return out


def _make_state(specs: list[tuple[int, int]], mesh: Mesh) -> dict[str, jax.Array]:
    sharding = NamedSharding(mesh, P("data"))
    state = {}
    for k, shape in enumerate(specs):
        make = jax.jit(lambda key, shape=shape: jax.random.normal(key, shape, np.float32), out_shardings=sharding)
        state[f"leaf{k:02d}"] = make(jax.random.key(k))
    return jax.block_until_ready(state)


def _timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - started, out


def _drop(tree: Any) -> None:
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def _checksums(path: Path, threads: int, *, populate: bool) -> float:
    """Seconds to check every shard of the snapshot from a new map (populated at once, or page by page)."""
    meta = read_meta(path)
    started = time.perf_counter()
    data = map_data(path, meta, populate=populate)
    shards = [s for name in meta.leaf_names for s in meta.arrays[name].shards]
    with ThreadPoolExecutor(threads) as pool:
        ok = list(pool.map(lambda s: xxhash.xxh3_64_intdigest(data[s.offset: s.offset + s.nbytes].data) == s.xxh3,
                           shards))
    assert all(ok), "the snapshot does not match its checksums"
    return time.perf_counter() - started


def _transfer_from_map(path: Path, target: dict[str, Any]) -> float:
    """Seconds to put views of a populated, already checked map of the snapshot on the devices."""
    meta = read_meta(path)
    data = map_data(path, meta, populate=True)
    views: dict[str, dict[tuple[tuple[int, int], ...], np.ndarray]] = {}
    for name in target:
        views[name] = {tuple((a, b) for a, b in s.index): data[s.offset: s.offset + s.nbytes].view(
            np.float32).reshape([b - a for a, b in s.index]) for s in meta.arrays[name].shards}
    for name in views:  # touched, as a check would have
        for v in views[name].values():
            xxhash.xxh3_64_intdigest(v.data)

    def region(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        return views[name][index_bounds(index, shape)]

    started = time.perf_counter()
    out = [jax.make_array_from_callback(want.shape, want.sharding, functools.partial(region, name, want.shape))
           for name, want in target.items()]
    jax.block_until_ready(out)
    seconds = time.perf_counter() - started
    _drop(out)
    return seconds


ARMS = ("numpy", "shm", "direct", "plain")


def measure_restores(state: PyTree, shm_dir: Path, work: Path, *, repeats: int, threads: int,
                     arms: tuple[str, ...] = ARMS[:3], diagnostics: bool = True,
                     after: Callable[[str, PyTree], float] | None = None) -> dict[str, Any]:
    """Save ``state`` once into a memory tier under ``shm_dir`` and (for ``direct`` and ``plain``) once as an Orbax
    step under ``work``, keep a host copy, delete ``state`` from the devices, then restore it ``repeats`` times by
    each of ``arms`` in alternating order, each restore checked against the host copy in the first repeat:
    ``numpy`` (``jax.device_put`` of the host copy), ``shm`` (``restore_snapshot``), ``direct`` (``restore``: the
    direct Orbax reader), ``plain`` (``restore(direct=False)``: Orbax's own ``PyTreeCheckpointer``).

    ``after(arm, restored)``: called with each restore's arrays, which it owns (deletes or donates); returns
    seconds recorded as ``<arm>_first_step_s`` (the device profile runs a training step from them). Without it the
    arrays are deleted. ``diagnostics``: the shm restore's parts alone per repeat (``checksum_s``,
    ``checksum_lazy_map_s``, ``transfer_from_map_s``; a flat dict of arrays only). Returns ``runs`` (seconds per
    measurement, every repeat), ``state_bytes``, ``leaves`` and ``shm_save_s``."""
    leaves = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    nbytes = sum(int(a.nbytes) for a in leaves)
    mesh = leaves[0].sharding.mesh  # type: ignore[attr-defined]  # a NamedSharding's
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    runs: dict[str, list[float]] = {}
    meta = training_metadata(1, state, data_position=0, global_batch=1, mesh=mesh, slices=[0])
    tier = MemoryTier(str(shm_dir), "bench", max_snapshots=1, preallocate=False)
    started = time.perf_counter()
    snapshot = tier.save(1, state, meta, persist=False)
    save_s = time.perf_counter() - started
    step_dir = None
    if {"direct", "plain"} & set(arms):
        ck = Checkpointer(str(work / "bench"))
        ck.save(1, state, data_position=0, global_batch=1, mesh=mesh, slices=[0])
        ck.wait()
        ck.close()
        step_dir = str(work / "bench" / "1")
    host = jax.tree_util.tree_map(np.asarray, state)  # ordinary memory, touched
    _drop(state)
    del state, leaves
    shardings = jax.tree_util.tree_map(lambda t: t.sharding, target)
    restores: dict[str, Callable[[], PyTree]] = {
        "numpy": lambda: jax.device_put(host, shardings),
        "shm": lambda: restore_snapshot(snapshot, target, threads=threads),
        "direct": lambda: restore(str(step_dir), target),
        "plain": lambda: restore(str(step_dir), target, direct=False),
    }
    names = {"numpy": "numpy_to_device_s", "shm": "shm_restore_s", "direct": "direct_restore_s",
             "plain": "plain_orbax_restore_s"}
    for repeat in range(repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            seconds, out = _timed(restores[arm])
            runs.setdefault(names[arm], []).append(seconds)
            if repeat == 0:
                for want, got in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(out), strict=True):
                    if not np.array_equal(np.asarray(got), want):
                        raise AssertionError(f"{arm}: the restored state differs from the state saved")
            if after is not None:
                runs.setdefault(f"{arm}_first_step_s", []).append(after(arm, out))
            else:
                _drop(out)
            del out
        if diagnostics:
            runs.setdefault("checksum_s", []).append(_checksums(snapshot, threads, populate=True))
            runs.setdefault("checksum_lazy_map_s", []).append(_checksums(snapshot, threads, populate=False))
            runs.setdefault("transfer_from_map_s", []).append(_transfer_from_map(snapshot, target))
    return {"runs": runs, "state_bytes": nbytes, "leaves": len(jax.tree_util.tree_leaves(target)),
            "shm_save_s": save_s}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Medians of ``measure_restores``' runs, the rates, and each reader's rate against numpy -> device's."""
    runs, nbytes = measured["runs"], measured["state_bytes"]
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    out: dict[str, Any] = {"state_bytes": nbytes, "leaves": measured["leaves"],
                           "shm_save_s": round(measured["shm_save_s"], 4), **{k: round(v, 4) for k, v in med.items()},
                           "numpy_to_device_GBps": round(nbytes / med["numpy_to_device_s"] / 1e9, 3)}
    readers = (("shm", "shm_restore_s"), ("direct", "direct_restore_s"), ("plain_orbax", "plain_orbax_restore_s"))
    for name, key in readers:
        if key in med:
            out[f"{name}_restore_GBps"] = round(nbytes / med[key] / 1e9, 3)
            out[f"{name}_ratio"] = round(med["numpy_to_device_s"] / med[key], 3)
    out["shm_ratio_target"] = 0.5
    out["runs"] = {k: [round(x, 6) for x in v] for k, v in runs.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=float(os.environ.get("TIER_RESTORE_GB", "0.25")),
                        help="state size in GB (TIER_RESTORE_GB; 5.2 on a TPU v5e chip)")
    parser.add_argument("--leaves", type=int, default=int(os.environ.get("TIER_RESTORE_LEAVES", "25")))
    parser.add_argument("--repeats", type=int, default=int(os.environ.get("TIER_RESTORE_REPEATS", "3")))
    parser.add_argument("--threads", type=int, default=None, help="checking threads (default: one per core)")
    parser.add_argument("--shm", default=os.environ.get("TIER_RESTORE_SHM", "/dev/shm"))
    parser.add_argument("--workdir", default=None, help="where the Orbax step goes (default: under --shm)")
    parser.add_argument("--no-direct", action="store_true", help="skip the Orbax step and the direct reader")
    parser.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    specs = _state_specs(int(args.gb * 1e9), args.leaves, len(devices))
    shm_base = Path(tempfile.mkdtemp(prefix="ckptd-tier-restore-", dir=args.shm if Path(args.shm).is_dir() else None))
    work = Path(tempfile.mkdtemp(prefix="ckptd-tier-restore-", dir=args.workdir or shm_base))
    try:
        measured = measure_restores(_make_state(specs, mesh), shm_base, work, repeats=args.repeats, threads=threads,
                                    arms=("numpy", "shm") if args.no_direct else ("numpy", "shm", "direct"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_base, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "tier_restore", "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "devices": len(devices), "threads": threads, "cores": os.cpu_count(), "repeats": args.repeats,
        **summarize(measured)}
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
