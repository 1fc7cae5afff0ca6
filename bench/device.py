"""The device profile: what the replica tier costs a real training step, and how fast it restores, on whatever
device jax has (one TPU chip; a toy size on CPU devices keeps the code working in the suite).

Why it exists: a tier's cost is a fact of the hardware (docs/benchmarks.md, "Device profile"). On a chip the
device-to-host link is far slower than the device's memory, and a training step donates its state: a tier is
judged there, with a donating step, against the same loop without it, side by side in one run.

``python -m bench.device [--size chip|chip-small|toy] [--out FILE]`` trains ``bench.decoder``'s model and prints
one JSON document:

* ``replica_overhead_ratio``: mean step time with the project's ``RunnerReplicas`` (its defaults: paced, the
  host memory kind measured and chosen) / without, over the steps after the pacer chose (target: <= 1.02),
  each repeat running both arms in alternating order; ``replica_overhead_ratio_whole`` over every step, the
  measuring snapshots included; the chosen period, memory kind, copy time and rate, expected steps lost per
  failure, snapshots held and skipped;
* ``replica_restore_s`` and ``replica_first_step_s``: the held snapshot restored onto the mesh
  (``ReplicaTier.restore``, checked against the state it was taken from) and the first step after it (medians of
  ``--restores`` runs, each under ``replica_restore_runs``);
* ``memory_kinds``: device -> host and host -> device rates per host memory kind, and numpy, measured on the
  state itself.

Runs in one process; no sockets. On the lent chip: ``JAX_PLATFORMS`` unset (docs/benchmarks.md says how).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from bench.decoder import SIZES, make_batch, make_state, make_step, mesh_of, tree_bytes
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas

PyTree = Any
# per size: (steps without the tier per arm, steps with it per arm, repeats)
SCHEDULE = {"chip": (40, 200, 2), "chip-small": (40, 160, 2), "toy": (8, 40, 1)}


def _leaves(state: PyTree) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]


def _rates(state: PyTree) -> dict[str, Any]:
    """Device -> host and back, per host memory kind, on the state's own arrays (median of 2)."""
    leaves = _leaves(state)
    shardings = [x.sharding for x in leaves]
    nbytes = tree_bytes(state)
    # next(iter(...)), never .pop(): devices() is the mesh's own cached set, which every array on it shares
    kinds = {m.kind for m in next(iter(leaves[0].devices())).addressable_memories()}
    out: dict[str, Any] = {}

    def timed(fn: Any) -> float:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for kind in ("pinned_host", "unpinned_host"):
        if kind not in kinds:
            continue
        d2h = timed(lambda kind=kind: jax.device_put(leaves, [s.with_memory_kind(kind) for s in shardings],
                                                     may_alias=False))
        host = jax.block_until_ready(jax.device_put(leaves, [s.with_memory_kind(kind) for s in shardings],
                                                    may_alias=False))
        h2d = timed(lambda host=host: jax.device_put(host, shardings, may_alias=False))
        out[kind] = {"d2h_GBps": round(nbytes / d2h / 1e9, 3), "h2d_GBps": round(nbytes / h2d / 1e9, 3)}
        del host
    t = time.perf_counter()
    arrays = [np.asarray(x) for x in leaves]
    d2n = time.perf_counter() - t
    h2d = timed(lambda: jax.device_put(arrays, shardings))
    out["numpy"] = {"d2h_GBps": round(nbytes / d2n / 1e9, 3), "h2d_GBps": round(nbytes / h2d / 1e9, 3)}
    return out


def run(size_name: str, schedule: tuple[int, int, int] | None = None, restores: int = 1) -> dict[str, Any]:
    """The document below (the module's docstring) for ``size_name``; ``restores``: how many times the held
    snapshot is restored and a step run from it (``replica_restore_s`` and ``replica_first_step_s``: medians;
    every run under ``replica_restore_runs``)."""
    size = SIZES[size_name]
    off_steps, on_steps, repeats = schedule or SCHEDULE.get(size_name, SCHEDULE["toy"])
    devices = jax.devices()
    mesh = mesh_of(devices, 1)
    step_fn = make_step(size)
    batches = [make_batch(size, mesh, i) for i in range(4)]
    state = make_state(size, mesh)
    out: dict[str, Any] = {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                           "devices": len(devices), "jax": jax.__version__, "size": size_name,
                           "parameters": size.parameters, "state_bytes": tree_bytes(state),
                           "state_leaves": len(_leaves(state))}
    t = time.perf_counter()
    state, loss = step_fn(state, batches[0])
    loss.block_until_ready()
    out["compile_and_first_step_s"] = round(time.perf_counter() - t, 3)

    def steps(n: int, replicas: RunnerReplicas | None, first: int) -> list[tuple[float, bool]]:
        """``n`` steps, each blocked on its loss (as a loop that logs it); with ``replicas``, the runner's
        boundary, due and snapshot calls at each. Returns (seconds, paced yet) per step."""
        nonlocal state
        times = []
        for i in range(first, first + n):
            t = time.perf_counter()
            took = False
            if replicas is not None:
                replicas.boundary(i)
                if replicas.due(i):
                    took = replicas.snapshot(i, state, i, None)
            state, loss = step_fn(state, batches[i % 4])
            loss.block_until_ready()
            times.append((time.perf_counter() - t, replicas is not None and replicas.choice is not None))
            trace.append((round(times[-1][0], 4), took))
        return times

    trace: list[tuple[float, bool]] = []  # the last arm with the tier: each step's seconds, a snapshot taken
    steps(3, None, 1)
    off: list[float] = []
    on_steady: list[float] = []
    on_whole: list[float] = []
    runs: list[dict[str, Any]] = []
    replicas: RunnerReplicas | None = None
    step = 10
    for r in range(repeats):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for arm in order:
            if arm == "off":
                off.extend(s for s, _ in steps(off_steps, None, step))
                step += off_steps
                continue
            if replicas is not None:
                replicas.close()
            replicas = RunnerReplicas(ReplicaOptions(), {0: devices})
            replicas.prepare(state)
            trace.clear()
            timed = steps(on_steps, replicas, step)
            on_trace = list(trace)
            step += on_steps
            on_whole.extend(s for s, _ in timed)
            on_steady.extend(s for s, paced in timed if paced)
            stats = replicas.stats()
            runs.append({"choice": replicas.choice.fields() if replicas.choice else None,
                         "reason": replicas.choice.reason if replicas.choice else None,
                         "snapshots": stats.snapshots if stats else 0, "skips": stats.skips if stats else 0,
                         "staged": stats.staged if stats else None,
                         "staging_reason": replicas.tier.staging_reason if replicas.tier else None})
    base = statistics.mean(off)
    out["step_s"] = round(statistics.median(off), 4)
    out["replica_overhead_ratio"] = round(statistics.mean(on_steady) / base, 4) if on_steady else None
    out["replica_overhead_ratio_whole"] = round(statistics.mean(on_whole) / base, 4)
    out["replica_steady_steps"] = len(on_steady)
    out["replica_runs"] = runs
    out["replica_trace"] = on_trace  # each step of the last arm with the tier: seconds, a snapshot dispatched
    assert replicas is not None and replicas.tier is not None
    replicas.tier.wait()
    held = replicas.tier.held()
    if held is not None:
        want = [np.asarray(x) for x in _leaves(replicas.tier.restore(mesh).state)]  # warm, and the reference
        restore_runs: dict[str, list[float]] = {"replica_restore_s": [], "replica_first_step_s": []}
        for k in range(restores):  # the held snapshot restored again each time, then a step from it
            t = time.perf_counter()
            restored = replicas.tier.restore(mesh)
            jax.block_until_ready(restored.state)
            restore_runs["replica_restore_s"].append(round(time.perf_counter() - t, 3))
            if k == 0:
                got = [np.asarray(x) for x in _leaves(restored.state)]
                out["replica_restore_exact"] = all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
                del want, got
            state = restored.state
            t = time.perf_counter()
            state, loss = step_fn(state, batches[0])
            loss.block_until_ready()
            restore_runs["replica_first_step_s"].append(round(time.perf_counter() - t, 3))
        out.update({k: statistics.median(v) for k, v in restore_runs.items()})
        out["replica_restore_runs"] = restore_runs
        out["replica_restore_GBps"] = round(held and out["state_bytes"] / out["replica_restore_s"] / 1e9, 3)
    replicas.close()
    out["memory_kinds"] = _rates(state)
    out["memory_stats"] = devices[0].memory_stats()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="chip" if jax.devices()[0].platform != "cpu" else "toy",
                        choices=sorted(SIZES))
    parser.add_argument("--out", default=None, help="also write the JSON document here")
    parser.add_argument("--schedule", default=None,
                        help="OFF,ON,REPEATS: steps without the tier and with it per arm, and repeats")
    parser.add_argument("--restores", type=int, default=1, help="restores of the held snapshot (each then a step)")
    args = parser.parse_args(argv)
    schedule = tuple(int(x) for x in args.schedule.split(",")) if args.schedule else None
    if schedule is not None and len(schedule) != 3:
        parser.error("--schedule takes three numbers: OFF,ON,REPEATS")
    result = run(args.size, schedule, args.restores)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
