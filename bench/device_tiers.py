"""``python -m bench.device_tiers``: the device profile's measurements of the tiers, in one process on whatever
device jax has, on bench/decoder.py's model; one JSON document to ``--out``.

Why it exists: the device profile (bench/device_profile.py, ``python -m bench.run --profile device``) composes what
separate scripts measured into one run on one state. Its parent never loads jax (on a chip a process that does
holds the device, and the recovery's processes need it next), so the measurements run here, as a child:

* ``device``: bench/device.py's ``run`` at ``--size`` with ``--schedule``: the replica tier's step overhead with
  the runner's defaults and the period it chose, the held snapshot restored ``--repeats`` times with a step after
  each, the device <-> host rates per memory kind;
* ``stall``: the loop blocked by ``MemoryTier.save`` (the shared-memory tier, as the runner configures it: the next
  snapshot's file allocated in the background, not timed) against ``jax.device_get`` of the same state (the pure
  device -> host copy), each right after a training step, ``--repeats`` times in alternating order;
* ``tiers``: bench/tier_restore.py's ``measure_restores`` on the decoder's state: numpy -> device, the shm tier,
  the direct Orbax reader and Orbax's own reader, ``--repeats`` times, a training step timed after each restore.

The Orbax step is written beside the snapshot, under ``--shm`` (so both read from memory, as bench/tier_restore.py
does). JAX's persistent compilation cache is in ``--cache``. No sockets.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax

from bench import device
from bench.common import alternate
from bench.decoder import SIZES, DecoderSize, make_batch, make_state, make_step, mesh_of
from bench.tier_restore import ARMS, measure_restores, summarize
from trainer_client.runtime.compilation._precompile import enable_persistent_cache
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import training_metadata

PyTree = Any


def _delete(tree: PyTree) -> None:
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def save_stall(size: DecoderSize, state: PyTree, shm: Path, repeats: int) -> tuple[PyTree, dict[str, list[float]]]:
    """Seconds the loop is blocked by ``MemoryTier.save`` and by ``jax.device_get`` of the same state, each right
    after a step (fresh arrays: nothing of them on the host yet). Returns the state after the steps, and the runs."""
    mesh = jax.tree_util.tree_leaves(state)[0].sharding.mesh  # a NamedSharding's
    step_fn = make_step(size)
    batch = make_batch(size, mesh, 0)
    meta = training_metadata(1, state, data_position=0, global_batch=size.batch, mesh=mesh, slices=[0])
    tier = MemoryTier(str(shm), "stall", max_snapshots=2)  # a spare file to write into, as the runner's tier
    tier.prepare(state)
    box = [state]
    runs: dict[str, list[float]] = {"shm_save_s": [], "device_get_s": []}

    def step() -> None:
        box[0], loss = step_fn(box[0], batch)
        jax.block_until_ready((box[0], loss))
        tier.wait_spare()  # the next file's allocation runs beside training: not in either figure

    def save(i: int) -> None:
        step()
        started = time.perf_counter()
        tier.save(i + 1, box[0], meta, persist=False)
        runs["shm_save_s"].append(time.perf_counter() - started)

    def copy() -> None:
        step()
        started = time.perf_counter()
        host = jax.device_get(box[0])
        runs["device_get_s"].append(time.perf_counter() - started)
        del host

    try:
        for i in range(repeats):
            alternate(i, copy, functools.partial(save, i))
    finally:
        tier.close()
        shutil.rmtree(shm, ignore_errors=True)
    return box[0], runs


def measure(size_name: str, schedule: tuple[int, int, int], repeats: int, shm: Path, threads: int) -> dict[str, Any]:
    """The document: ``device`` (bench/device.py's), ``stall`` (``save_stall``'s runs) and ``tiers``
    (``summarize`` of ``measure_restores``, with ``<arm>_first_step_s``)."""
    t0 = time.perf_counter()
    print(f"device tiers: bench.device at size {size_name}, schedule {schedule}, {repeats} restore(s)", flush=True)
    doc: dict[str, Any] = {"device": device.run(size_name, schedule, restores=repeats)}
    doc["device"].pop("replica_trace", None)  # every step's seconds: bench.device's own output keeps it
    doc["device_s"] = round(time.perf_counter() - t0, 1)
    size = SIZES[size_name]
    mesh = mesh_of(jax.devices(), 1)
    step_fn = make_step(size)
    batch = make_batch(size, mesh, 0)
    state = make_state(size, mesh)
    started = time.perf_counter()
    state, loss = step_fn(state, batch)
    jax.block_until_ready((state, loss))
    doc["tiers_first_step_s"] = round(time.perf_counter() - started, 3)  # compiled, or loaded from the cache
    print(f"device tiers: save stall against jax.device_get, {repeats} repeat(s)", flush=True)
    state, doc["stall"] = save_stall(size, state, shm / "stall", repeats)

    def first_step(arm: str, restored: PyTree) -> float:
        started = time.perf_counter()
        after, loss = step_fn(restored, batch)  # donates the restored state
        jax.block_until_ready((after, loss))
        seconds = time.perf_counter() - started
        _delete(after)
        return seconds

    print(f"device tiers: restores ({', '.join(ARMS)}), {repeats} repeat(s), a step after each", flush=True)
    (shm / "restore").mkdir(parents=True)
    (shm / "orbax").mkdir()
    measured = measure_restores(state, shm / "restore", shm / "orbax", repeats=repeats, threads=threads, arms=ARMS,
                                diagnostics=False, after=first_step)
    doc["tiers"] = summarize(measured)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", required=True, choices=sorted(SIZES))
    parser.add_argument("--schedule", required=True, help="OFF,ON,REPEATS: bench/device.py's replica arms")
    parser.add_argument("--repeats", type=int, default=2, help="of the restores and of the save stall")
    parser.add_argument("--shm", type=Path, required=True, help="a directory of this run's in shared memory")
    parser.add_argument("--cache", required=True, help="JAX's persistent compilation cache")
    parser.add_argument("--threads", type=int, default=None, help="the shm restore's checking threads (one a core)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    off, on, arms = (int(x) for x in args.schedule.split(","))
    enable_persistent_cache(args.cache)
    devices = jax.devices()
    doc = {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
           "jax": jax.__version__, "size": args.size, "parameters": SIZES[args.size].parameters,
           **measure(args.size, (off, on, arms), args.repeats, args.shm, args.threads or os.cpu_count() or 1)}
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"device tiers: done in {doc['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
