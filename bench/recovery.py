"""In-process recovery against a relaunch, on the demo model (examples/elastic_mlp.py), phase by phase.

A real ckptd (``python -m ckptd serve`` with the host-memory tier on) serves a root on 127.0.0.1. Every
run is a fresh child process (so no run inherits another's in-memory compile cache) on 8 fake CPU
devices in 4 slices, mesh ``(replica, data) = (4, 2)``, memory snapshots every 5 steps, JAX's
persistent compilation cache on (one directory shared by every run, warmed by a first run):

* ``inprocess``: the ElasticRunner trains, slice 2 goes down at step ``FAIL_AT`` (for good), the runner
  recovers in the same process onto ``(3, 2)``; the figure is the time from the raise of the slice-loss error
  to the first completed step on the new mesh (``Recovery.seconds``, which starts once the loss is confirmed,
  is recorded beside it). Its phases (``INPROCESS_PHASES``, from the runner's events): ``detect`` (the error
  classified, the slices' health checked), ``release`` (compile-ahead stopped, JAX's caches cleared, the failed
  attempt's arrays deleted), ``slices`` (pathwaysutils' wait: a health check of every slice), ``plan`` (ckptd's
  resume plan), ``restore`` and ``first_step``. Variants: background precompilation of the likely next meshes
  on (it is given time to finish before the failure; the attempt after it gets the executable compiled for its
  mesh, ``ctx.precompiled``, and runs its first step with it: no trace, recorded as ``handed_over``), off with
  the persistent cache warm, and off with an empty cache (the compile is on the critical path).
* ``relaunch``: what a user pays for a new process with slice 2 already down: the interpreter starts, imports
  jax and the trainer code, initialises JAX's devices, builds the runner, waits for the slices (their health
  check), asks ckptd, restores from the same tier (the memory snapshot the resume plan names), traces and
  compiles the step and runs it once on ``(3, 2)``; timed from just before the spawn to that first step, in the
  phases ``RELAUNCH_PHASES``. With the persistent cache warm (the relaunch at its best: the figure) and empty
  (a relaunch onto a mesh it never compiled for). Killing the old process and rescheduling are not counted.

``inprocess_recovery_speedup_vs_relaunch`` = relaunch (cache warm) / in-process (precompile on), per repeat.
"""

from __future__ import annotations

import contextlib
import json
import os
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

# (phase, from mark, to mark): the marks are the runner's events (wall times), and the bench's own
INPROCESS_PHASES = (
    ("detect", "raised", "failure_detected"),  # classified as a slice loss, confirmed by a health check
    ("release", "failure_detected", "waiting_for_slices"),  # compile-ahead stopped, caches cleared, arrays deleted
    ("slices", "waiting_for_slices", "slices_ready"),  # pathwaysutils' wait: every slice health-checked
    ("plan", "slices_ready", "plan_received"),  # ckptd's resume plan
    ("restore", "plan_received", "restored"),
    ("first_step", "restored", "first_step_done"),
)
RELAUNCH_PHASES = (
    ("interpreter", "spawned", "started"),  # the process and Python up, the bench module imported
    ("imports", "started", "imported"),  # jax, the trainer code, the demo model
    ("devices", "imported", "devices"),  # JAX's backend and devices initialised
    ("runner", "devices", "start"),  # ElasticRunner built (compilation cache, slices, tiers), client
    ("slices", "start", "slices_ready"),  # pathwaysutils' wait: every slice health-checked
    ("plan", "slices_ready", "plan_received"),
    ("restore", "plan_received", "restored"),
    ("first_step", "restored", "first_step_done"),  # the step traced, compiled (or loaded from the cache), run
)


def split_phases(marks: dict[str, float], spec: tuple[tuple[str, str, str], ...]) -> dict[str, float]:
    """Seconds per phase of ``spec`` from the wall times in ``marks``; the phases are consecutive, so they sum
    to the time from the first mark to the last. A mark missing (an event that did not come) is an error."""
    missing = [m for _, a, b in spec for m in (a, b) if m not in marks]
    if missing:
        raise ValueError(f"no mark {sorted(set(missing))} (have {sorted(marks)})")
    return {name: marks[b] - marks[a] for name, a, b in spec}


def event_marks(timeline: list[tuple[str, float]], after: float) -> dict[str, float]:
    """The first wall time of each event kind at or after ``after``."""
    marks: dict[str, float] = {}
    for kind, wall in timeline:
        if wall >= after:
            marks.setdefault(kind, wall)
    return marks


# ---- the children (run as ``python -m bench.recovery MODE ...``) --------------------------------------


class StopRun(Exception):
    """Raised from the event callback once the step a child waits for is done (a relaunch's first step)."""


def _child(argv: list[str]) -> int:
    started = time.time()
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
    from trainer_client.runtime.compilation._options import CompilationOptions
    from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner, Event
    from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
    from trainer_client.runtime.memory._options import MemoryTierOptions
    from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

    imported = time.time()
    devices = jax.device_count()  # the backend's initialisation
    devices_up = time.time()
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
    out: dict[str, Any] = {"mode": args.mode, "precompile": precompile, "started_wall": started,
                           "imported_wall": imported, "devices_wall": devices_up, "devices": devices}
    slices: Any
    if args.mode == "inprocess":

        class TimedSlices(SimulatedSlices):
            """Records when the slice-loss error is raised: where the recovery's time starts."""

            raised_wall: float | None = None

            def at_step_boundary(self, step: int, active: Any) -> None:
                try:
                    super().at_step_boundary(step, active)
                except jax.errors.JaxRuntimeError:
                    if self.raised_wall is None:
                        self.raised_wall = time.time()
                    raise

        timed = TimedSlices(num_slices=4, faults=[SliceFault(2, FAIL_AT, None)])
        slices = timed
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
        raised = timed.raised_wall if timed.raised_wall is not None else result.events[0].wall_time
        marks = event_marks([(e.kind, e.wall_time) for e in result.events], raised)
        marks["raised"] = raised
        phases = split_phases(marks, INPROCESS_PHASES)
        out.update(seconds=marks["first_step_done"] - raised, recovery_seconds=rec.seconds, phases=phases,
                   restored_step=rec.restored_step, lost_steps=rec.lost_steps,
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
                raise StopRun

        runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=f"{args.root}/{args.job}",
                               on_event=on_event)
        with contextlib.suppress(StopRun):
            runner.run(make_train_fn(10**9, TrainLog(), use_precompile=False))
        first = next(e for e in events if e.kind == "first_step_done")
        restored = next((e for e in events if e.kind == "restored"), None)
        marks = event_marks([(e.kind, e.wall_time) for e in events], 0.0)
        marks.update(started=started, imported=imported, devices=devices_up)
        out.update(marks=marks, first_step_wall=first.wall_time, restored_from=restored.detail if restored else None,
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


def spawn_child(module: str, mode: str, args: list[str], env: dict[str, str], timeout_s: float = 600) -> dict[str, Any]:
    """``python -m MODULE MODE ARGS`` in ``env`` (bench/recovery.py's children, bench/device_recovery.py's): what it
    printed after ``RESULT_PREFIX``; a relaunch's ``seconds`` (spawn -> first step), ``import_s`` and ``phases``
    (``RELAUNCH_PHASES``) from its marks and the spawn's wall time."""
    spawned = time.time()
    done = subprocess.run([sys.executable, "-m", module, mode, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False, cwd=Path(__file__).resolve().parent.parent)
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if line is None:
        raise RuntimeError(f"{module} {mode} failed (rc {done.returncode}): {done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
    out["spawned_wall"] = spawned
    if mode == "relaunch":
        out["seconds"] = out["first_step_wall"] - spawned
        out["import_s"] = out["imported_wall"] - spawned  # the interpreter's start and the imports
        out["phases"] = split_phases({**out.pop("marks"), "spawned": spawned}, RELAUNCH_PHASES)
    return out


def _spawn(mode: str, *, job: str, root: Path, shm: Path, url: str, cache: Path, precompile: bool) -> dict[str, Any]:
    return spawn_child("bench.recovery", mode, ["--job", job, "--root", str(root), "--shm", str(shm), "--url", url,
                                                "--cache", str(cache), "--precompile", str(int(precompile))], _env())


def phases_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1000:.0f}" for k, v in phases.items()) + " ms"


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    import statistics

    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]} if runs else {}


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


def run_recovery(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:

    root, state, cache, shm = workdir / "root", workdir / "state", workdir / "jax-cache", shm_dir / "recovery"
    for d in (root, state, cache, shm):
        d.mkdir(parents=True, exist_ok=True)
    from bench.sidecar import start_ckptd  # not at the top: the children import this module (their start is timed)

    proc, url = start_ckptd(root, state, shm, _env(), workdir / "ckptd.log")
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
        arms = ("inprocess_precompile", "inprocess_no_precompile_warm_cache", "inprocess_no_precompile_cold_cache",
                "relaunch", "relaunch_cold_cache")
        s: dict[str, list[float]] = {k: [] for k in (*arms, "relaunch_import", "inprocess_recovery_seconds")}
        phases: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
        last: dict[str, dict[str, Any]] = {}

        def record(arm: str, out: dict[str, Any]) -> None:
            last[arm] = out
            s[arm].append(out["seconds"])
            phases[arm].append(out["phases"])

        for r in range(profile.recovery_repeats):
            job = f"rec{r}"

            def pre(job: str = job) -> None:
                out = spawn("inprocess", job)
                record("inprocess_precompile", out)
                s["inprocess_recovery_seconds"].append(out["recovery_seconds"])
                out = spawn("relaunch", job)  # the same tier, the same job
                record("relaunch", out)
                s["relaunch_import"].append(out["import_s"])

            def nopre_warm(r: int = r) -> None:
                record("inprocess_no_precompile_warm_cache", spawn("inprocess", f"nopre{r}", precompile=False))

            def nopre_cold(r: int = r) -> None:
                empty = workdir / f"empty-cache-{r}"
                record("inprocess_no_precompile_cold_cache",
                       spawn("inprocess", f"cold{r}", precompile=False, cache_dir=empty))
                rmtree(empty)

            def relaunch_cold(r: int = r) -> None:  # from the step nopre_warm left in the memory tier
                empty = workdir / f"empty-relaunch-cache-{r}"
                record("relaunch_cold_cache", spawn("relaunch", f"nopre{r}", cache_dir=empty))
                rmtree(empty)

            order: list[Callable[[], None]] = [pre, nopre_warm, nopre_cold]
            if r % 2:
                order.reverse()
            for fn in order:
                fn()
            relaunch_cold()
            print(f"  repeat {r + 1}/{profile.recovery_repeats}: in-process {s['inprocess_precompile'][-1]:.3f}s "
                  f"(no precompile: warm cache {s['inprocess_no_precompile_warm_cache'][-1]:.3f}s, empty cache "
                  f"{s['inprocess_no_precompile_cold_cache'][-1]:.3f}s); relaunch {s['relaunch'][-1]:.3f}s "
                  f"(empty cache {s['relaunch_cold_cache'][-1]:.3f}s); ratio "
                  f"{s['relaunch'][-1] / s['inprocess_precompile'][-1]:.2f}x", flush=True)
            print(f"    in-process phases: {phases_line(phases['inprocess_precompile'][-1])}", flush=True)
            print(f"    relaunch phases:   {phases_line(phases['relaunch'][-1])}", flush=True)
        medians = {k: median_phases(v) for k, v in phases.items()}
        print("  phases, median of the repeats (ms):", flush=True)
        for arm in arms:
            print(f"    {arm}: {phases_line(medians[arm])}", flush=True)
        for k, v in s.items():
            results.measure(f"recovery.{k}_s", v, "s")
        speedup = [a / b for a, b in zip(s["relaunch"], s["inprocess_precompile"], strict=True)]
        nopre = [a / b for a, b in zip(s["relaunch"], s["inprocess_no_precompile_warm_cache"], strict=True)]
        cold = [a / b for a, b in zip(s["relaunch_cold_cache"], s["inprocess_precompile"], strict=True)]
        results.measure("recovery.speedup_no_precompile_warm_cache", nopre, "x")
        results.measure("recovery.speedup_vs_relaunch_cold_cache", cold, "x")
        results.context["recovery"] = {"fail_at_step": FAIL_AT, "memory_period": MEMORY_PERIOD,
                                       "child_runs": runs, "phases_median_s": medians, "last": last}
        m = results.measurements
        results.figure(Figure(
            "inprocess_recovery_speedup_vs_relaunch", speedup, ">=", 5.0, "x",
            "relaunch (spawn -> interpreter -> imports -> devices -> runner -> slices -> plan -> restore -> first "
            "step, persistent cache warm) / in-process (slice-loss error raised -> first step on the new mesh), "
            "precompilation on, per repeat",
            {"inprocess_precompile_s_median": m["recovery.inprocess_precompile_s"]["median"],
             "inprocess_no_precompile_warm_cache_s_median":
                 m["recovery.inprocess_no_precompile_warm_cache_s"]["median"],
             "inprocess_no_precompile_cold_cache_s_median":
                 m["recovery.inprocess_no_precompile_cold_cache_s"]["median"],
             "relaunch_s_median": m["recovery.relaunch_s"]["median"],
             "relaunch_cold_cache_s_median": m["recovery.relaunch_cold_cache_s"]["median"],
             "speedup_without_precompile_median": m["recovery.speedup_no_precompile_warm_cache"]["median"],
             "speedup_vs_relaunch_cold_cache_median": m["recovery.speedup_vs_relaunch_cold_cache"]["median"],
             "inprocess_phases_median_s": medians["inprocess_precompile"],
             "relaunch_phases_median_s": medians["relaunch"],
             "restored_from": {k: v.get("restored_from") for k, v in last.items()}},
        ))
    finally:
        stop_process(proc, 15)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
