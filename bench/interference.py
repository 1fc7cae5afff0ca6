"""Interference: how much a save running in the background slows the training steps beside it.

The training loop is a jitted matmul step (``tanh(x @ w)`` on float32 [N, N], one device), timed step by
step. Each repeat times a window of steps alone, then the same loop while a save of the io state persists
in the background, for each of three savers, the order rotating from repeat to repeat:

* ``checkpointer``: trainer_client's ``Checkpointer.save`` (async Orbax in this process, compression off,
  ckptd's manifest and fsync) until committed;
* ``orbax_zstd``: plain ``ocp.CheckpointManager.save`` with Orbax's defaults (zstd) until finished;
* ``persist_worker``: the memory tier's way: the state is snapshotted into shared memory, then ckptd's
  persist worker (``python -m ckptd.persist._persist_worker --serve``, a child process, as ckptd runs it) writes it
  to storage while the loop runs.

The slowdown is the median step time during the background save divided by the median step time alone,
both from the same repeat. The loop runs in the benchmark's own process, so the in-process savers also
compete for its interpreter; the persist worker only for the machine's cores and disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from bench.common import Profile, Results, rmtree
from bench.io import ServeWorker, make_state, orbax_manager
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata

JOB = "bench-interference"
ALONE_STEPS = 40
MATMUL_N = {"full": 1024, "quick": 1024, "toy": 64}


def _step_fn(n: int) -> Callable[[], None]:
    x = jnp.asarray(np.random.default_rng(1).standard_normal((n, n), dtype=np.float32))
    w = jnp.asarray(np.random.default_rng(2).standard_normal((n, n), dtype=np.float32) / np.sqrt(n))
    step = jax.jit(lambda a, b: jnp.tanh(a @ b))
    step(x, w).block_until_ready()

    def run() -> None:
        step(x, w).block_until_ready()

    return run


def _time_steps(step: Callable[[], None], until: Callable[[], bool], at_least: int = 3) -> list[float]:
    """Step times until ``until()`` holds (and at least ``at_least`` steps)."""
    times: list[float] = []
    while len(times) < at_least or not until():
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _in_background(work: Callable[[], object]) -> Callable[[], bool]:
    """Start ``work`` in a thread; the returned callable says whether it finished (re-raising its error)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as exc:  # reported to the timing loop's caller
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, name="bench-background-save", daemon=True).start()

    def finished() -> bool:
        if done.is_set() and failure:
            raise failure[0]
        return done.is_set()

    return finished


def run_interference(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:
    devices = jax.devices()
    mesh8 = Mesh(np.array(devices[:8]), ("data",))
    state = make_state(profile, mesh8)
    step = _step_fn(MATMUL_N[profile.name])
    # no spare file: the persist worker's interference alone (the spare's allocation is io.memory_tier_spare_s)
    tier = MemoryTier(str(shm_dir), JOB, max_snapshots=2, reserve_bytes=0, preallocate=False)
    worker = ServeWorker() if profile.persist_child else None
    slowdowns: dict[str, list[float]] = {"checkpointer": [], "orbax_zstd": [], "persist_worker": []}
    seconds: dict[str, list[float]] = {name: [] for name in slowdowns}
    alone_ms: list[float] = []

    def checkpointer(d: Path, n: int) -> Callable[[], bool]:
        ck = Checkpointer(str(d))
        ck.save(n, state, data_position=n * 64, global_batch=64, mesh=mesh8, slices=list(range(8)))

        def wait() -> None:
            ck.wait()
            ck.close()

        return _in_background(wait)

    def orbax_zstd(d: Path, n: int) -> Callable[[], bool]:
        mgr = orbax_manager(d, compression=None)
        mgr.save(n, args=ocp.args.StandardSave(state))

        def wait() -> None:
            mgr.wait_until_finished()
            mgr.close()

        return _in_background(wait)

    def persist_worker(d: Path, n: int) -> Callable[[], bool]:
        meta = training_metadata(n, state, data_position=n * 64, global_batch=64, mesh=mesh8, slices=list(range(8)))
        rmtree(tier.dir)  # the earlier repeats' snapshots (nobody marks them persisted here, as ckptd would)
        snapshot = tier.save(n, state, meta, persist=True)
        if worker is None:  # toy profile: the worker in this process (no second jax import)
            from ckptd.persist._persist_worker import persist

            return _in_background(lambda: persist(snapshot, str(d)))
        return _in_background(lambda: worker.persist(snapshot, d))

    savers: dict[str, Callable[[Path, int], Callable[[], bool]]] = {
        "checkpointer": checkpointer, "orbax_zstd": orbax_zstd, "persist_worker": persist_worker}
    names = list(savers)
    try:
        for i in range(profile.interference_repeats or profile.repeats):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                alone = _time_steps(step, lambda: True, ALONE_STEPS)
                d = workdir / f"{name}-{i}"
                started = time.perf_counter()
                finished = savers[name](d, i + 1)
                during = _time_steps(step, finished)
                seconds[name].append(time.perf_counter() - started)
                base = float(np.median(alone))
                alone_ms.append(base * 1000)
                slowdowns[name].append(float(np.median(during)) / base)
                rmtree(d)
    finally:
        if worker is not None:
            worker.close()
    results.measure("interference.step_alone_ms", alone_ms, "ms",
                    f"median step time of tanh(x @ w), [{MATMUL_N[profile.name]}]^2 float32, with nothing beside it")
    for name in names:
        results.measure(f"interference.slowdown.{name}", slowdowns[name], "x",
                        f"median step time while {name} saves in the background / alone, same repeat")
        results.measure(f"interference.save_window_s.{name}", seconds[name], "s",
                        f"how long {name}'s background save ran beside the loop")
    results.context["interference"] = {"matmul_n": MATMUL_N[profile.name], "alone_steps": ALONE_STEPS,
                                       "state_bytes": profile.state_bytes}


__all__ = ["run_interference"]
