"""In-process recovery against a relaunch, on the demo model (examples/elastic_mlp.py).

A real ckptd (``python -m ckptd serve`` with the host-memory tier on) serves a root on 127.0.0.1. Every
run is a fresh child process (so no run inherits another's in-memory compile cache) on 8 fake CPU
devices in 4 slices, mesh ``(replica, data) = (4, 2)``, memory snapshots every 5 steps, JAX's
persistent compilation cache on (one directory shared by every run, warmed by a first run):

* ``inprocess``: the ElasticRunner trains, slice 2 goes down at step ``FAIL_AT`` (for good), the runner
  recovers in the same process onto ``(3, 2)``; the figure is its ``Recovery.seconds`` (exception caught ->
  first completed step on the new mesh). Variants: background precompilation of the likely next meshes on
  (it is given time to finish before the failure; the attempt after it gets the executable compiled for its
  mesh, ``ctx.precompiled``, and runs its first step with it: no trace, recorded as ``handed_over``), off with
  the persistent cache warm, and off with an empty cache (the compile is on the critical path).
* ``relaunch``: a new process with slice 2 already down imports jax and the trainer code, initialises,
  asks ckptd, compiles (persistent cache warm) and restores from the same tier (the memory snapshot the
  resume plan names), and runs one step on ``(3, 2)``; timed from just before the spawn to that first step.
  Killing the old process and rescheduling are not counted, so this is the relaunch at its best.

``inprocess_recovery_speedup_vs_relaunch`` = relaunch / in-process (precompile on), per repeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results, rmtree, stop_process

FAIL_AT = 12
MEMORY_PERIOD = 5
RESULT_PREFIX = "BENCH_RESULT "


# ---- the children (run as ``python -m bench.recovery MODE ...``) --------------------------------------


class _Stop(Exception):
    """Raised from the event callback once a relaunch has completed its first step."""


def _child(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["inprocess", "relaunch"])
    parser.add_argument("--job", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--shm", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--precompile", type=int, default=1)
    args = parser.parse_args(argv)

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from examples.elastic_mlp import TrainLog, make_train_fn
    from trainer_client.client._ckptd_client import CkptdClient
    from trainer_client.config import ClientSettings
    from trainer_client.runtime._elastic import ElasticConfig, ElasticRunner, Event
    from trainer_client.runtime._elastic_config import (
        CompilationOptions,
        ElasticOptions,
        HealthOptions,
        MemoryTierOptions,
    )
    from trainer_client.runtime._slices import SimulatedSlices, SliceFault

    imported = time.time()
    precompile = bool(args.precompile)
    config = ElasticConfig(
        job=args.job, mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48, checkpoint_period=0,
        elastic=ElasticOptions(policy="resize", elastic_timeout_s=60, elastic_max_retries=2),
        health=HealthOptions(scale_up_check_interval_s=3600),
        memory_tier=MemoryTierOptions(shm_dir=args.shm, memory_period=MEMORY_PERIOD, max_snapshots=4),
        compilation=CompilationOptions(compilation_cache_dir=args.cache, precompile=precompile),
    )
    client = CkptdClient(ClientSettings(url=args.url, shm_dir=args.shm, report_events=False), root=args.root)
    events: list[Event] = []
    out: dict[str, Any] = {"mode": args.mode, "precompile": precompile, "imported_wall": imported,
                           "devices": jax.device_count()}
    slices: Any
    if args.mode == "inprocess":
        slices = SimulatedSlices(num_slices=4, faults=[SliceFault(2, FAIL_AT, None)])
        runner: ElasticRunner | None = None

        def hook(step: int) -> None:
            if step == FAIL_AT - 1 and runner is not None and precompile:
                runner.precompiler.wait(120)  # a failure hours in finds the next meshes compiled

        runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=f"{args.root}/{args.job}",
                               on_event=events.append)
        inner = make_train_fn(FAIL_AT + 3, TrainLog(), step_hook=hook, use_precompile=precompile)
        handed: list[bool] = []

        def train(ctx: Any) -> Any:
            handed.append(ctx.precompiled is not None)
            return inner(ctx)

        result = runner.run(train)
        rec = result.recoveries[0]
        restored = next((e for e in result.events if e.kind == "restored" and e.t > rec.detected_t), None)
        out.update(seconds=rec.seconds, restored_step=rec.restored_step, lost_steps=rec.lost_steps,
                   mesh_before=rec.mesh_before, mesh_after=rec.mesh_after,
                   restored_from=restored.detail if restored else None,
                   precompiled=[[shape, round(s, 3)] for shape, s in runner.precompiler.compiled],
                   handed_over=handed[1:],
                   timeline=[[e.kind, round(e.t - rec.detected_t, 4)] for e in result.events
                             if e.t >= rec.detected_t])
    else:
        down = SimulatedSlices(num_slices=4)
        down.take_down(2, None)
        slices = down

        def on_event(event: Event) -> None:
            events.append(event)
            if event.kind == "first_step_done":
                raise _Stop

        runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=f"{args.root}/{args.job}",
                               on_event=on_event)
        with contextlib.suppress(_Stop):
            runner.run(make_train_fn(10**9, TrainLog(), use_precompile=False))
        first = next(e for e in events if e.kind == "first_step_done")
        restored = next((e for e in events if e.kind == "restored"), None)
        out.update(first_step_wall=first.wall_time, restored_from=restored.detail if restored else None,
                   restored_step=restored.step if restored else None,
                   timeline=[[e.kind, round(e.wall_time, 4)] for e in events])
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    os._exit(0)  # no teardown: the figure is taken, and background threads need not be joined


# ---- the parent -----------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["CKPTD_LOG_LEVEL"] = "warning"
    return env


def _spawn(mode: str, *, job: str, root: Path, shm: Path, url: str, cache: Path, precompile: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.recovery", mode, "--job", job, "--root", str(root), "--shm", str(shm),
           "--url", url, "--cache", str(cache), "--precompile", str(int(precompile))]
    spawned = time.time()
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if line is None:
        raise RuntimeError(f"recovery child {mode} failed (rc {done.returncode}): {done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
    out["spawned_wall"] = spawned
    if mode == "relaunch":
        out["seconds"] = out["first_step_wall"] - spawned
        out["import_s"] = out["imported_wall"] - spawned
    return out


def _wait_committed(root: Path, job: str, step: int, timeout: float = 120.0) -> bool:
    """ckptd persists the final snapshot in the background: wait so it does not run beside a measurement."""
    deadline = time.monotonic() + timeout
    marker = root / job / str(step) / "commit_success.txt"
    while time.monotonic() < deadline:
        if marker.exists():
            time.sleep(0.5)  # ckptd verifies it next
            return True
        time.sleep(0.1)
    return False


def _start_ckptd(root: Path, state: Path, shm: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--host", "127.0.0.1", "--port", str(port),
         "--state-dir", str(state), "--shm-dir", str(shm)], env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ckptd exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("ckptd did not become ready in 60 s")


def run_recovery(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:

    root, state, cache, shm = workdir / "root", workdir / "state", workdir / "jax-cache", shm_dir / "recovery"
    for d in (root, state, cache, shm):
        d.mkdir(parents=True, exist_ok=True)
    proc, url = _start_ckptd(root, state, shm)
    runs = 0

    def spawn(mode: str, job: str, precompile: bool = True, cache_dir: Path = cache) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        (root / job).mkdir(exist_ok=True)
        out = _spawn(mode, job=job, root=root, shm=shm, url=url, cache=cache_dir, precompile=precompile)
        if mode == "inprocess":
            _wait_committed(root, job, FAIL_AT + 3)
        return out

    try:
        print(f"recovery: demo MLP, 8 devices in 4 slices, slice 2 lost at step {FAIL_AT}; ckptd {url}", flush=True)
        warm = spawn("inprocess", "warmup")  # fills the persistent compilation cache
        spawn("relaunch", "warmup")
        print(f"  warm-up run: in-process recovery {warm['seconds']:.3f}s", flush=True)
        s: dict[str, list[float]] = {"inprocess_precompile": [], "inprocess_no_precompile_warm_cache": [],
                                     "inprocess_no_precompile_cold_cache": [], "relaunch": [],
                                     "relaunch_import": []}
        last: dict[str, dict[str, Any]] = {}
        for r in range(profile.recovery_repeats):
            job = f"rec{r}"

            def pre(job: str = job) -> None:
                last["inprocess_precompile"] = spawn("inprocess", job)
                s["inprocess_precompile"].append(last["inprocess_precompile"]["seconds"])
                last["relaunch"] = spawn("relaunch", job)  # the same tier, the same job
                s["relaunch"].append(last["relaunch"]["seconds"])
                s["relaunch_import"].append(last["relaunch"]["import_s"])

            def nopre_warm(r: int = r) -> None:
                out = spawn("inprocess", f"nopre{r}", precompile=False)
                s["inprocess_no_precompile_warm_cache"].append(out["seconds"])
                last["inprocess_no_precompile_warm_cache"] = out

            def nopre_cold(r: int = r) -> None:
                empty = workdir / f"empty-cache-{r}"
                out = spawn("inprocess", f"cold{r}", precompile=False, cache_dir=empty)
                s["inprocess_no_precompile_cold_cache"].append(out["seconds"])
                last["inprocess_no_precompile_cold_cache"] = out
                rmtree(empty)

            order: list[Callable[[], None]] = [pre, nopre_warm, nopre_cold]
            if r % 2:
                order.reverse()
            for fn in order:
                fn()
            print(f"  repeat {r + 1}/{profile.recovery_repeats}: in-process {s['inprocess_precompile'][-1]:.3f}s "
                  f"(no precompile: warm cache {s['inprocess_no_precompile_warm_cache'][-1]:.3f}s, empty cache "
                  f"{s['inprocess_no_precompile_cold_cache'][-1]:.3f}s); relaunch {s['relaunch'][-1]:.3f}s "
                  f"(imports {s['relaunch_import'][-1]:.3f}s)", flush=True)
        for k, v in s.items():
            results.measure(f"recovery.{k}_s", v, "s")
        speedup = [a / b for a, b in zip(s["relaunch"], s["inprocess_precompile"], strict=True)]
        nopre = [a / b for a, b in zip(s["relaunch"], s["inprocess_no_precompile_warm_cache"], strict=True)]
        results.measure("recovery.speedup_no_precompile_warm_cache", nopre, "x")
        results.context["recovery"] = {"fail_at_step": FAIL_AT, "memory_period": MEMORY_PERIOD,
                                       "child_runs": runs, "last": last}
        results.figure(Figure(
            "inprocess_recovery_speedup_vs_relaunch", speedup, ">=", 5.0, "x",
            "relaunch (spawn -> import -> init -> compile (persistent cache warm) -> restore -> first step) / "
            "in-process Recovery.seconds (exception -> first step on the new mesh), precompilation on",
            {"inprocess_precompile_s_median": results.measurements["recovery.inprocess_precompile_s"]["median"],
             "inprocess_no_precompile_warm_cache_s_median":
                 results.measurements["recovery.inprocess_no_precompile_warm_cache_s"]["median"],
             "inprocess_no_precompile_cold_cache_s_median":
                 results.measurements["recovery.inprocess_no_precompile_cold_cache_s"]["median"],
             "relaunch_s_median": results.measurements["recovery.relaunch_s"]["median"],
             "speedup_without_precompile_median": results.measurements[
                 "recovery.speedup_no_precompile_warm_cache"]["median"],
             "restored_from": {k: v.get("restored_from") for k, v in last.items()}},
        ))
    finally:
        stop_process(proc, 15)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
