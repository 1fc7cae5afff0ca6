"""The replica snapshot tier against no snapshots and against the shared-memory tier, side by side in one run.

8 fake CPU devices in 4 slices of 2, mesh ``(replica, data) = (4, 2)``; the train state is an MLP's weights
with two Adam moments, each array replicated along ``replica`` and split along ``data`` (data parallel
across slices, sharded within one), the step a jitted forward, backward and Adam update that donates the
state. ``ReplicaTier`` and ``MemoryTier`` are used directly, as the elastic runner uses them:

* ``replica_snapshot_step_overhead_ratio``: mean step time with a replica snapshot dispatched after every
  step (``ReplicaTier.snapshot``, prepared with ``ReplicaTier.prepare``; a busy tier skips) / without, the
  same state, step and batch; each repeat runs both, in alternating order. The state's size against the
  step's compute is recorded beside it (bytes copied per snapshot, FLOPs and seconds per step).
* ``replica_recovery_speedup_vs_memory_tier``: slice 2 lost; the time from the failure to the first step
  done on the shrunk mesh ``(3, 2)``, restored from the surviving replicas (``ReplicaTier.restore``) / the
  same, restored from a shared-memory snapshot of the same state (``MemoryTier.save`` before the failure,
  ``restore_snapshot`` after it: checksums, memory map, reshard). The step on the new mesh is compiled
  before the failure for both (as the runner's precompiler does), so the figure is the restore and one step.

On CPU every "device" and its "pinned host" memory are the same RAM, and the snapshot's copy competes with
the step for the same cores; on TPU hosts the copy is a DMA beside the step. docs/benchmarks.md,
"Replica snapshots".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.common import Figure, Profile, Results, alternate, rmtree
from trainer_client.runtime.memory._memory_tier import MemoryTier, restore_snapshot
from trainer_client.runtime.replicas._replica_tier import ReplicaTier, required_bytes
from trainer_client.runtime.saving._checkpointing import training_metadata

PyTree = Any
AXES = ("replica", "data")
SLICES, LOST_SLICE = 4, 2
# per profile: the overhead's MLP (width, layers, global batch: divisible by 4 and by 3 replicas), timed steps
# per arm, repeats; the recovery's MLP (width, layers, batch): a larger state and a small step, the restore's part
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "full": (512, 2, 4608, 12, 5),
    "quick": (512, 2, 4608, 8, 3),
    "toy": (64, 2, 48, 3, 1),
}
RECOVERY_SIZES: dict[str, tuple[int, int, int]] = {"full": (2048, 4, 48), "quick": (2048, 2, 48), "toy": (64, 2, 48)}


def _mesh(devices: list[jax.Device], replicas: int) -> Mesh:
    return Mesh(np.array(devices).reshape(replicas, 2), AXES)


def _state_shardings(mesh: Mesh, layers: int) -> PyTree:
    w = NamedSharding(mesh, P(None, "data"))
    return {k: [w] * layers for k in ("params", "m", "v")}


def make_state(mesh: Mesh, width: int, layers: int, seed: int = 0) -> PyTree:
    def init() -> PyTree:
        keys = jax.random.split(jax.random.key(seed), layers)
        params = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width) for k in keys]
        return {"params": params, "m": [jnp.zeros_like(p) for p in params], "v": [jnp.zeros_like(p) for p in params]}

    return jax.jit(init, out_shardings=_state_shardings(mesh, layers))()


def make_step(mesh: Mesh, layers: int) -> Any:
    """The jitted train step on ``mesh``: (state, x, y) -> (state, loss), the state donated."""

    def loss_fn(params: list[jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    def step(state: PyTree, x: jax.Array, y: jax.Array) -> tuple[PyTree, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        m = [0.9 * a + 0.1 * g for a, g in zip(state["m"], grads, strict=True)]
        v = [0.999 * a + 0.001 * g * g for a, g in zip(state["v"], grads, strict=True)]
        params = [p - 1e-3 * a / (jnp.sqrt(b) + 1e-8) for p, a, b in zip(state["params"], m, v, strict=True)]
        return {"params": params, "m": m, "v": v}, loss

    return jax.jit(step, donate_argnums=0,
                   out_shardings=(_state_shardings(mesh, layers), NamedSharding(mesh, P())))


def make_batch(mesh: Mesh, width: int, batch: int) -> tuple[jax.Array, jax.Array]:
    rows = NamedSharding(mesh, P("replica", None))
    x = jax.device_put(np.random.default_rng(1).standard_normal((batch, width), np.float32), rows)
    y = jax.device_put(np.random.default_rng(2).standard_normal((batch, width), np.float32), rows)
    return x, y


def _slice_map(devices: list[jax.Device]) -> dict[int, list[jax.Device]]:
    return {k: devices[2 * k:2 * k + 2] for k in range(SLICES)}


def _abstract(state: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def _steps(step: Any, state: PyTree, batch: tuple[jax.Array, jax.Array], n: int,
           tier: ReplicaTier | None, first: int) -> tuple[PyTree, float]:
    """``n`` steps, each waited for (a loop that reads its loss), then with ``tier`` a snapshot of its state
    at the step boundary, as the runner takes it. Returns the state and the mean seconds per step."""
    started = time.perf_counter()
    for i in range(n):
        state, loss = step(state, *batch)
        float(loss)
        if tier is not None:
            tier.snapshot(first + i, state, data_position=first + i)
    seconds = (time.perf_counter() - started) / n
    if tier is not None:
        tier.wait()
    return state, seconds


def _overhead(profile: Profile, results: Results, devices: list[jax.Device]) -> None:
    width, layers, batch, steps, repeats = SIZES[profile.name]
    mesh = _mesh(devices, SLICES)
    step, data = make_step(mesh, layers), make_batch(mesh, width, batch)
    state = make_state(mesh, width, layers)
    state, _ = _steps(step, state, data, 2, None, 0)  # compiled and warm
    tier = ReplicaTier(replica_axis="replica", slice_to_devices=_slice_map(devices))
    prepare_started = time.perf_counter()
    tier.prepare(state)
    prepare_s = time.perf_counter() - prepare_started
    plain: list[float] = []
    snap: list[float] = []
    done = [2]

    def without() -> None:
        nonlocal state
        state, s = _steps(step, state, data, steps, None, done[0])
        done[0] += steps
        plain.append(s)

    def with_snapshots() -> None:
        nonlocal state
        state, s = _steps(step, state, data, steps, tier, done[0])
        done[0] += steps
        snap.append(s)

    try:
        for r in range(repeats):
            alternate(r, without, with_snapshots)
            print(f"  repeat {r + 1}/{repeats}: {plain[-1] * 1e3:.1f} ms/step without, {snap[-1] * 1e3:.1f} with a "
                  f"snapshot every step", flush=True)
        stats = tier.stats()
    finally:
        tier.close()
    params = layers * width * width
    flops = 6 * batch * params  # forward and backward of the matmuls (the update and tanh are noise)
    one = required_bytes(state, in_flight=False)
    results.measure("replicas.step_s_without", plain, "s")
    results.measure("replicas.step_s_with_snapshots", snap, "s")
    results.context["replicas_state"] = {
        "mesh": "(replica=4, data=2), 4 slices of 2 devices", "arrays": 3 * layers, "width": width,
        "state_bytes": 3 * params * 4, "host_bytes_per_snapshot": one, "step_flops": flops,
        "global_batch": batch, "host_bytes_per_step_flop": round(one / flops, 6),
        "prepare_s": round(prepare_s, 4), "snapshots": stats.snapshots, "skips": stats.skips,
        "failures": stats.failures, "last_dispatch_s": stats.last_dispatch_s}
    print(f"  state {3 * params * 4 / 2**20:.1f} MiB ({one / 2**20:.1f} MiB of host memory per snapshot: every "
          f"replica), step {flops / 1e9:.1f} GFLOP: {one / flops:.2e} bytes copied per FLOP; snapshots "
          f"{stats.snapshots}, skipped {stats.skips}", flush=True)
    results.figure(Figure(
        "replica_snapshot_step_overhead_ratio", [a / b for a, b in zip(snap, plain, strict=True)], "<=", 1.10, "x",
        "mean step time with a replica snapshot (pinned host copy of the state) dispatched after every step / "
        "without, same state, step and batch (8 CPU devices)",
        {"step_s_without_median": results.measurements["replicas.step_s_without"]["median"],
         "step_s_with_median": results.measurements["replicas.step_s_with_snapshots"]["median"],
         "host_bytes_per_snapshot": one, "step_gflop": round(flops / 1e9, 2), "skips": stats.skips,
         "snapshots": stats.snapshots}))


def _recovery(profile: Profile, results: Results, devices: list[jax.Device], shm_dir: Path) -> None:
    width, layers, batch = RECOVERY_SIZES[profile.name]
    repeats = SIZES[profile.name][4]
    mesh = _mesh(devices, SLICES)
    alive = [d for k, ds in _slice_map(devices).items() if k != LOST_SLICE for d in ds]
    shrunk = _mesh(alive, SLICES - 1)
    step_before, step_after = make_step(mesh, layers), make_step(shrunk, layers)
    data_after = make_batch(shrunk, width, batch)
    step_after(make_state(shrunk, width, layers, seed=9), *data_after)[1].block_until_ready()  # compiled
    state, _ = _steps(step_before, make_state(mesh, width, layers), make_batch(mesh, width, batch), 3, None, 0)
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=NamedSharding(shrunk, a.sharding.spec)),
                                    state)
    memory = MemoryTier(str(shm_dir / "replicas"), "bench", max_snapshots=2)
    memory.prepare(_abstract(state))
    path = memory.save(3, state, training_metadata(3, state, data_position=3 * batch, global_batch=batch, mesh=mesh,
                                                   slices=list(range(SLICES))), persist=False)
    shardings = jax.tree_util.tree_map(lambda t: t.sharding, target)
    # the reference: a copy on the new mesh (device_put would alias the shards that stay on their devices, and
    # the step donates them)
    copied = jax.device_put(jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t))(state), shardings)
    want = _first_step(step_after, copied, data_after)
    from_replicas: list[float] = []
    from_memory: list[float] = []
    restore_only: dict[str, list[float]] = {"replicas": [], "memory": []}

    def replicas() -> None:
        tier = ReplicaTier(replica_axis="replica", slice_to_devices=_slice_map(devices))
        try:
            tier.prepare(state)
            assert tier.snapshot(3, state, data_position=3 * batch) and tier.wait(120)
            started = time.perf_counter()  # the failure: slice 2 is gone
            restored = tier.restore(shrunk, lost_slices={LOST_SLICE}).state
            restore_only["replicas"].append(time.perf_counter() - started)
            loss = _first_step(step_after, restored, data_after)
            from_replicas.append(time.perf_counter() - started)
        finally:
            tier.close()
        assert loss == want, (loss, want)  # the same state came back

    def shared_memory() -> None:
        started = time.perf_counter()
        restored = restore_snapshot(path, target)
        restore_only["memory"].append(time.perf_counter() - started)
        loss = _first_step(step_after, restored, data_after)
        from_memory.append(time.perf_counter() - started)
        assert loss == want, (loss, want)

    try:
        for r in range(repeats):
            alternate(r, replicas, shared_memory)
            print(f"  repeat {r + 1}/{repeats}: failure -> first step {from_replicas[-1]:.3f}s from replicas, "
                  f"{from_memory[-1]:.3f}s from shared memory (restores {restore_only['replicas'][-1]:.3f}s, "
                  f"{restore_only['memory'][-1]:.3f}s)", flush=True)
    finally:
        memory.close()
        rmtree(path.parent)
    results.measure("replicas.recovery_s_from_replicas", from_replicas, "s")
    results.measure("replicas.recovery_s_from_memory_tier", from_memory, "s")
    results.measure("replicas.restore_s_from_replicas", restore_only["replicas"], "s")
    results.measure("replicas.restore_s_from_memory_tier", restore_only["memory"], "s")
    results.figure(Figure(
        "replica_recovery_speedup_vs_memory_tier", [b / a for a, b in zip(from_replicas, from_memory, strict=True)],
        ">=", 2.0, "x",
        "slice 2 of 4 lost: failure -> first step done on (3, 2) restored from the shared-memory tier / from the "
        "surviving replicas, same state, the step compiled ahead for both (8 CPU devices)",
        {"from_replicas_s_median": results.measurements["replicas.recovery_s_from_replicas"]["median"],
         "from_memory_tier_s_median": results.measurements["replicas.recovery_s_from_memory_tier"]["median"],
         "restore_only_speedup_median": round(float(np.median(
             [b / a for a, b in zip(restore_only["replicas"], restore_only["memory"], strict=True)])), 3)}))


def _first_step(step: Any, state: PyTree, data: tuple[jax.Array, jax.Array]) -> float:
    """One step (``state`` donated), waited for; its loss."""
    _, loss = step(state, *data)
    return float(loss)


def run_replicas(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:
    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(f"the replica benchmarks need 8 devices, found {len(devices)}")
    workdir.mkdir(parents=True, exist_ok=True)
    _overhead(profile, results, devices[:8])
    _recovery(profile, results, devices[:8], shm_dir)


__all__ = ["make_batch", "make_state", "make_step", "run_replicas"]
