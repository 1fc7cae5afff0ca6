"""Raw facts of a device's memory system under a donating training step, before any tier is involved.

Why it exists: the replica tier's design (docs/concepts.md, "Three tiers") rests on measured facts of the
accelerator: how fast an on-device copy of the state is, how fast each host memory kind takes a copy, whether a
copy to the host slows a step that donates its state (it does when the copy reads the donated buffers), and what
the device's memory statistics report. ``python -m bench.device_probe [SIZE]`` prints them as one JSON document
(and writes it to ``$OUT/probe.json`` when ``OUT`` is set); SIZE is a key of ``bench.decoder.SIZES``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from bench.decoder import SIZES, make_batch, make_state, make_step, mesh_of, tree_bytes

PyTree = Any


def _timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times), times


def _leaves(state: PyTree) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]


def main(argv: list[str]) -> int:
    size = SIZES[argv[0] if argv else "chip"]
    devices = jax.devices()
    mesh = mesh_of(devices, 1)
    out: dict[str, Any] = {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                           "devices": len(devices), "jax": jax.__version__, "size": argv[0] if argv else "chip"}
    out["memory_kinds"] = sorted(m.kind for m in devices[0].addressable_memories())
    state = make_state(size, mesh)
    step = make_step(size)
    nbytes = tree_bytes(state)
    out["state_bytes"] = nbytes
    batches = [make_batch(size, mesh, i) for i in range(4)]
    t0 = time.perf_counter()
    state, loss = step(state, batches[0])
    loss.block_until_ready()
    out["compile_and_first_step_s"] = time.perf_counter() - t0

    def run_steps(n: int, between: Callable[[int], None] | None = None) -> list[float]:
        nonlocal state
        times = []
        for i in range(n):
            t = time.perf_counter()
            state, loss = step(state, batches[i % 4])
            if between is not None:
                between(i)
            loss.block_until_ready()
            times.append(time.perf_counter() - t)
        return times

    run_steps(3)
    base = run_steps(10)
    out["step_s"] = statistics.median(base)
    out["memory_stats"] = devices[0].memory_stats()

    # on-device copies
    leaves = _leaves(state)
    shardings = [x.sharding for x in leaves]
    out["d2d_device_put_s"], _ = _timed(lambda: jax.device_put(leaves, shardings, may_alias=False))
    copy_fn = jax.jit(lambda xs: [x.copy() for x in xs])
    jax.block_until_ready(copy_fn(leaves))
    out["d2d_jit_copy_s"], _ = _timed(lambda: copy_fn(leaves))
    out["d2d_GBps"] = nbytes / out["d2d_device_put_s"] / 1e9
    # device -> host per memory kind, from a copy the step does not touch
    staged = jax.block_until_ready(jax.device_put(leaves, shardings, may_alias=False))
    rates: dict[str, Any] = {}
    for kind in ("pinned_host", "unpinned_host"):
        if kind not in out["memory_kinds"]:
            continue
        dispatch = []

        def to_kind(kind: str = kind, dispatch: list[float] = dispatch, staged: Any = staged) -> Any:
            t = time.perf_counter()
            r = jax.device_put(staged, [s.with_memory_kind(kind) for s in shardings], may_alias=False)
            dispatch.append(time.perf_counter() - t)
            return r

        med, _ = _timed(to_kind, 2)
        host = to_kind()
        jax.block_until_ready(host)
        back = [s for s in shardings]
        h2d, _ = _timed(lambda host=host, back=back: jax.device_put(host, back, may_alias=False), 2)
        rates[kind] = {"d2h_s": med, "d2h_GBps": nbytes / med / 1e9, "dispatch_s": statistics.median(dispatch),
                       "h2d_s": h2d, "h2d_GBps": nbytes / h2d / 1e9}
        del host
    t = time.perf_counter()
    arrays = [np.asarray(x) for x in staged]
    d2n = time.perf_counter() - t
    h2d_np, _ = _timed(lambda arrays=arrays: jax.device_put(arrays, shardings), 2)
    rates["numpy"] = {"d2h_s": d2n, "d2h_GBps": nbytes / d2n / 1e9, "h2d_s": h2d_np, "h2d_GBps": nbytes / h2d_np / 1e9}
    del arrays, staged
    out["rates"] = rates

    # the step with a snapshot's copy beside it: direct from the state (the step donates what the copy reads) or
    # from an on-device copy (the step donates nothing the copy reads); one copy in flight, busy ones skipped
    def arm(kind: str, staged_copy: bool, steps: int) -> dict[str, Any]:
        busy = threading.Event()
        dispatches: list[float] = []
        copies: list[float] = []

        def between(_: int) -> None:
            if busy.is_set():
                return
            t = time.perf_counter()
            src = _leaves(state)
            shard = [x.sharding for x in src]
            if staged_copy:
                src = jax.device_put(src, shard, may_alias=False)
                host = None
            else:
                host = jax.device_put(src, [s.with_memory_kind(kind) for s in shard], may_alias=False)
            dispatches.append(time.perf_counter() - t)
            busy.set()

            def finish(src: Any = src, host: Any = host, t: float = t) -> None:
                if host is None:
                    host = jax.device_put(src, [s.with_memory_kind(kind) for s in shard], may_alias=False)
                jax.block_until_ready(host)
                copies.append(time.perf_counter() - t)
                del src, host
                busy.clear()

            threading.Thread(target=finish, daemon=True).start()

        times = run_steps(steps, between)
        while busy.is_set():
            time.sleep(0.05)
        return {"step_s": statistics.median(times), "ratio": statistics.median(times) / out["step_s"],
                "mean_ratio": statistics.mean(times) / out["step_s"], "dispatch_s": dispatches, "copy_s": copies,
                "steps": times}

    arms: dict[str, Any] = {}
    for kind in ("unpinned_host", "pinned_host"):
        arms[f"staged_{kind}"] = arm(kind, True, 40)
        arms[f"direct_{kind}"] = arm(kind, False, 6)
    out["arms"] = arms
    out["step_s_after"] = statistics.median(run_steps(10))
    out["memory_stats_after"] = devices[0].memory_stats()
    # pathwaysutils' split by mesh axis on host memory kinds
    try:
        from pathwaysutils.experimental.split_by_mesh_axis import split_by_mesh_axis
        x = _leaves(state)[0]
        for kind in ("pinned_host", "unpinned_host"):
            h = jax.device_put(x, x.sharding.with_memory_kind(kind))
            parts = split_by_mesh_axis(h, "replica")
            out[f"split_{kind}"] = [str(p.sharding.memory_kind) for p in parts]
    except Exception as exc:  # recorded: the probe reports what fails
        out["split_error"] = f"{type(exc).__name__}: {exc}"
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe.json"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
