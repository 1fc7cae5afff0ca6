"""The device profile of ``make bench``: what the tiers cost and how fast they restore on a real accelerator, on
one chip (or a toy size on CPU devices), and recovery in the same PID against a relaunch there.

Why it exists: every other family runs on 8 fake CPU devices, where "device" and "host" memory are the same RAM;
a tier's cost is a fact of the hardware (docs/benchmarks.md, "Device profile"). This composes the measurements of
bench/device.py, bench/tier_restore.py and bench/recovery.py into one run that writes
``bench-output/results-device.json`` (keys with their limits, as every profile's) and its table.

Which profile (``choose``, before anything loads jax): ``--profile device``; else ``BENCH_DEVICE=<platform>``
(``tpu``; ``cpu`` for the toy on CPU devices; ``auto``: what jax finds); else found from the platform: the device
profile when ``JAX_PLATFORMS`` names an accelerator, or, with ``JAX_PLATFORMS`` unset, when an accelerator plugin
is installed (libtpu, a ``jax_plugins`` module) and jax's default backend, asked in a process of its own, is not
``cpu``. Every child runs on that platform (``JAX_PLATFORMS`` set to it). The size (bench/decoder.py's) is
``--size``, else ``BENCH_DEVICE_SIZE``, else ``chip`` on an accelerator and ``toy`` on CPU.

This process never loads jax (on a chip the process that does holds the device). Families, each in children:

* ``device`` (bench/device_tiers.py): the replica tier with the runner's defaults against the same loop without
  it (``replica_overhead_ratio`` <= 1.02; the chosen period, memory kind and copy beside it); device <-> host rates
  per memory kind; each tier's restore and the first step after it: replicas, numpy -> device, the shm tier, the
  direct Orbax reader, Orbax's own reader (``shm_restore_vs_numpy_h2d`` >= 0.5; ``replica_end_to_end_speedup_vs_shm``
  >= 2: the shm tier's restore and first step over the replicas'); the shm tier's save stall against
  ``jax.device_get`` of the same state (``shm_save_stall_ratio_vs_device_get`` <= 1.5).
* ``device_recovery`` (bench/device_recovery.py): ckptd on a unix socket (``ckptd serve --uds``: no TCP socket
  anywhere in the profile), the decoder trained by the ElasticRunner on one slice of every device, policy
  ``pause``; the slice lost inside JAX at step ``FAIL_AT`` and back after ``DOWN_S``; the in-process recovery
  timed from the slice's return (the raise plus the down time) to the first step, against a new process that
  restores the same memory snapshot with the compilation cache warm (``inprocess_recovery_speedup_vs_relaunch``
  >= 5; the figure with the down time included beside it).

Rates, per-tier restore and first-step seconds and the chosen period are measurements (facts of the machine,
no limit), under ``measurements``; the judged figures carry them in ``details``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results, filesystem_of, rmtree, stop_process
from bench.recovery import median_phases, phases_line, spawn_child
from bench.sidecar import start_ckptd

FAIL_AT, MEMORY_PERIOD, DOWN_S = 7, 5, 2.0  # the recovery: a snapshot at step 5, the loss at 7, back 2 s later
ROOT = Path(__file__).resolve().parent.parent

# ---- which profile, on which platform ------------------------------------------------------------------


def accelerator_plugin() -> bool:
    """Whether jax could find an accelerator here at all: libtpu or a jax plugin is installed."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    try:
        import jax_plugins  # the namespace package of jax's plugins

        if any(pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    except ImportError:
        pass
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


def probe_platform(environ: Mapping[str, str]) -> str:
    """jax's default backend in a process of its own (``JAX_PLATFORMS`` unset there), which lets it go on exit."""
    env = {k: v for k, v in environ.items() if k != "JAX_PLATFORMS"}
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
    except subprocess.TimeoutExpired:
        return "cpu"
    lines = done.stdout.split()
    return lines[-1] if done.returncode == 0 and lines else "cpu"


def choose(requested: str | None, environ: Mapping[str, str],
           probe: Callable[[], str] | None = None) -> tuple[str | None, str | None]:
    """(profile, platform): the profile ``--profile`` names, ``"device"``, or None (``BENCH_QUICK`` decides
    between quick and full); the platform is the device profile's jax platform, None for the CPU profiles."""
    ask = probe or (lambda: probe_platform(environ))
    device_env = environ.get("BENCH_DEVICE", "")
    named = environ.get("JAX_PLATFORMS", "").split(",")[0]
    if requested not in (None, "device"):
        return requested, None
    if device_env not in ("", "0"):
        return "device", ask() if device_env == "auto" else device_env
    if requested == "device":
        return "device", named or ask()
    if named and named != "cpu":
        return "device", named
    if not named and accelerator_plugin() and (found := ask()) != "cpu":
        return "device", found
    return None, None


def device_size(platform: str, requested: str | None, environ: Mapping[str, str]) -> str:
    """bench/decoder.py's size for the device profile: ``--size``, ``BENCH_DEVICE_SIZE``, or by the platform."""
    return requested or environ.get("BENCH_DEVICE_SIZE") or ("toy" if platform == "cpu" else "chip")


# ---- the families --------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This run's environment (its token and platform) for the children, without the caller's ckptd settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_LOG_LEVEL"] = "warning"
    return env


def _pairs(a: list[float], b: list[float], fn: Callable[[float, float], float]) -> list[float]:
    return [fn(x, y) for x, y in zip(a, b, strict=False) if y > 0]


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def run_device(profile: Profile, results: Results, workdir: Path, shm: Path) -> None:
    assert profile.decoder is not None and profile.replica_schedule is not None
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "tiers.json"
    cmd = [sys.executable, "-m", "bench.device_tiers", "--size", profile.decoder, "--schedule",
           ",".join(str(x) for x in profile.replica_schedule), "--repeats", str(profile.repeats), "--shm",
           str(shm / "tiers"), "--cache", str(workdir / "jax-cache"), "--out", str(out)]
    done = subprocess.run(cmd, env=child_env(), cwd=ROOT, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.device_tiers exited {done.returncode} (its output above)")
    doc = json.loads(out.read_text())
    d, stall, tiers = doc["device"], doc["stall"], doc["tiers"]
    results.context["device"] = {
        **{k: doc[k] for k in ("platform", "device_kind", "devices", "jax", "size", "parameters", "seconds")},
        **{k: d.get(k) for k in ("state_bytes", "state_leaves", "compile_and_first_step_s", "step_s",
                                 "replica_steady_steps", "replica_runs", "replica_restore_exact", "memory_stats")},
        "replica_schedule": list(profile.replica_schedule), "shm_fs": filesystem_of(shm)}
    results.measure("device.step_s", [d["step_s"]], "s", "median step without the replica tier (bench.device)")
    for kind, rates in d["memory_kinds"].items():
        for way, what in (("d2h", "device -> host"), ("h2d", "host -> device")):
            results.measure(f"device.rate.{kind}.{way}_GBps", [rates[f"{way}_GBps"]], "GB/s",
                            f"{what}, {kind}, the decoder's state (bench.device)")
    choices = [r["choice"] for r in d["replica_runs"] if r["choice"]]
    results.measure("device.replica_period", [c["replica_period"] for c in choices], "steps",
                    "the period the pacer chose, each arm with the tier")
    results.measure("device.replica_copy_s", [c["replica_copy_seconds"] for c in choices], "s",
                    "a snapshot's copy to the chosen host memory, as the pacer measured it")
    runs = {"replicas": (d.get("replica_restore_runs", {}).get("replica_restore_s", []),
                         d.get("replica_restore_runs", {}).get("replica_first_step_s", []))}
    for tier, arm, key in (("numpy", "numpy", "numpy_to_device_s"), ("shm", "shm", "shm_restore_s"),
                           ("direct", "direct", "direct_restore_s"), ("plain_orbax", "plain", "plain_orbax_restore_s")):
        runs[tier] = (tiers["runs"].get(key, []), tiers["runs"].get(f"{arm}_first_step_s", []))
    for tier, (restore_s, first_s) in runs.items():
        results.measure(f"device.restore.{tier}_s", restore_s, "s", f"{tier}: the restore, until ready")
        results.measure(f"device.first_step.{tier}_s", first_s, "s", f"{tier}: the first step after it")
    results.measure("device.shm_save_s", stall["shm_save_s"], "s", "MemoryTier.save, the loop blocked")
    results.measure("device.device_get_s", stall["device_get_s"], "s", "jax.device_get of the same state")
    choice = choices[-1] if choices else {}
    results.figure(Figure(
        "replica_overhead_ratio", [d["replica_overhead_ratio"]] if d.get("replica_overhead_ratio") else [],
        "<=", 1.02, "ratio",
        "mean step with the replica tier (RunnerReplicas, the runner's defaults) / without, over the steps after "
        "the pacer chose (bench/device.py, arms alternating)",
        {"whole_ratio": d.get("replica_overhead_ratio_whole"), "step_s": d.get("step_s"),
         "period": choice.get("replica_period"), "memory_kind": choice.get("replica_memory_kind"),
         "copy_s": choice.get("replica_copy_seconds"), "expected_lost_steps": choice.get("replica_expected_lost_steps"),
         "steady_steps": d.get("replica_steady_steps"),
         "reason": next((r["reason"] for r in reversed(d["replica_runs"]) if r.get("reason")), None)}))
    restore_s = {k: _med(v[0]) for k, v in runs.items()}
    first_s = {k: _med(v[1]) for k, v in runs.items()}
    results.figure(Figure(
        "shm_restore_vs_numpy_h2d", _pairs(runs["numpy"][0], runs["shm"][0], lambda a, b: a / b), ">=", 0.5, "ratio",
        "numpy -> device / the shm tier's restore (map, every shard's checksum, transfer), same state, per repeat",
        {"numpy_to_device_s": restore_s["numpy"], "shm_restore_s": restore_s["shm"],
         "direct_ratio": tiers.get("direct_ratio"), "plain_orbax_ratio": tiers.get("plain_orbax_ratio"),
         "numpy_to_device_GBps": tiers.get("numpy_to_device_GBps")}))
    replica_e2e = [a + b for a, b in zip(*runs["replicas"], strict=False)]
    shm_e2e = [a + b for a, b in zip(*runs["shm"], strict=False)]
    results.figure(Figure(
        "replica_end_to_end_speedup_vs_shm", _pairs(shm_e2e, replica_e2e, lambda a, b: a / b), ">=", 2.0, "x",
        "(the shm tier's restore + the first step) / (the replicas' restore + the first step), same process",
        {"restore_s": restore_s, "first_step_s": first_s}))
    results.figure(Figure(
        "shm_save_stall_ratio_vs_device_get", _pairs(stall["shm_save_s"], stall["device_get_s"], lambda a, b: a / b),
        "<=", 1.5, "ratio", "the loop blocked by MemoryTier.save / jax.device_get of the same state, per repeat",
        {"shm_save_s": _med(stall["shm_save_s"]), "device_get_s": _med(stall["device_get_s"])}))


def _socket_dir(workdir: Path) -> Path:
    """Where ckptd's socket goes: the family's directory, or a new one under /tmp where that path is too long
    for a unix socket (108 bytes)."""
    if len(str(workdir / "ckptd.sock")) < 100:
        return workdir
    return Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/tmp" if Path("/tmp").is_dir() else None))


def run_device_recovery(profile: Profile, results: Results, workdir: Path, shm_dir: Path) -> None:
    assert profile.decoder is not None
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    root, state, cache, shm = workdir / "root", workdir / "state", workdir / "jax-cache", shm_dir / "recovery"
    for d in (root, state, cache, shm):
        d.mkdir(parents=True, exist_ok=True)
    env = child_env()
    sockets = _socket_dir(workdir)
    proc, url = start_ckptd(root, state, shm, env, workdir / "ckptd.log", uds=sockets / "ckptd.sock")
    try:
        print(f"device recovery: decoder {profile.decoder}, one slice, policy pause, lost inside JAX at step "
              f"{FAIL_AT} for {DOWN_S:g} s; ckptd {url}", flush=True)
        s: dict[str, list[float]] = {k: [] for k in ("inprocess", "inprocess_with_down_time", "relaunch",
                                                     "relaunch_import")}
        phases: dict[str, list[dict[str, float]]] = {"inprocess": [], "after_return": [], "relaunch": []}
        last: dict[str, Any] = {}
        for r in range(profile.recovery_repeats):
            args = ["--job", f"rec{r}", "--root", str(root), "--shm", str(shm), "--url", url, "--cache", str(cache),
                    "--size", profile.decoder, "--fail-at", str(FAIL_AT), "--down-s", str(DOWN_S),
                    "--memory-period", str(MEMORY_PERIOD)]
            inproc = spawn_child("bench.device_recovery", "inprocess", args, env)
            relaunch = spawn_child("bench.device_recovery", "relaunch", args, env)
            if relaunch.get("restored_step") != inproc.get("restored_step"):
                raise RuntimeError(f"the relaunch restored step {relaunch.get('restored_step')}, the in-process "
                                   f"recovery {inproc.get('restored_step')}: not the same state")
            last = {"inprocess": inproc, "relaunch": relaunch}
            s["inprocess"].append(inproc["seconds"])
            s["inprocess_with_down_time"].append(inproc["seconds_total"])
            s["relaunch"].append(relaunch["seconds"])
            s["relaunch_import"].append(relaunch["import_s"])
            phases["inprocess"].append(inproc["phases"])
            phases["after_return"].append(inproc["after_return"])
            phases["relaunch"].append(relaunch["phases"])
            print(f"  repeat {r + 1}/{profile.recovery_repeats}: in-process {inproc['seconds']:.3f}s from the "
                  f"slice's return ({inproc['seconds_total']:.3f}s with its {DOWN_S:g} s down), restored step "
                  f"{inproc['restored_step']} from {inproc['restored_from']}; relaunch {relaunch['seconds']:.3f}s "
                  f"({relaunch['restored_from']})", flush=True)
            print(f"    in-process phases: {phases_line(inproc['phases'])}", flush=True)
            print(f"    relaunch phases:   {phases_line(relaunch['phases'])}", flush=True)
            print(f"    compiles after the restore: in-process {_compiles_after_restore(inproc)}, relaunch "
                  f"{_compiles_after_restore(relaunch)}; leaves whose key changed in-process: "
                  f"{inproc.get('state_changed') or 'none'}", flush=True)
            for label, child in (("in-process", inproc), ("relaunch", relaunch)):
                for samples, thread, stack in child.get("first_step_stacks", [])[:5]:
                    print(f"    {label} restore -> first step, {samples} samples in {thread}: {stack}", flush=True)
        for k, v in s.items():
            results.measure(f"device_recovery.{k}_s", v, "s")
        medians = {k: median_phases(v) for k, v in phases.items()}
        results.context["device_recovery"] = {"model": f"bench/decoder.py at size {profile.decoder}",
                                              "fail_at_step": FAIL_AT, "memory_period": MEMORY_PERIOD,
                                              "down_s": DOWN_S, "ckptd": "unix socket", "phases_median_s": medians,
                                              "last": last}
        results.figure(Figure(
            "inprocess_recovery_speedup_vs_relaunch", _pairs(s["relaunch"], s["inprocess"], lambda a, b: a / b),
            ">=", 5.0, "x",
            "relaunch (spawn -> imports -> devices -> runner -> plan -> restore of the memory snapshot -> first step, "
            "compilation cache warm) / in-process (the slice's return -> first step after the restore: the raise "
            "plus the down time excluded), one slice, policy pause, per repeat",
            {"inprocess_s_median": _med(s["inprocess"]),
             "inprocess_with_down_time_s_median": _med(s["inprocess_with_down_time"]), "down_s": DOWN_S,
             "relaunch_s_median": _med(s["relaunch"]), "relaunch_import_s_median": _med(s["relaunch_import"]),
             "inprocess_after_return_median_s": medians["after_return"],
             "relaunch_phases_median_s": medians["relaunch"],
             "restored_from": {k: v.get("restored_from") for k, v in last.items()}}))
    finally:
        stop_process(proc, 15)
        if sockets != workdir:
            rmtree(sockets)


def _compiles_after_restore(child: dict[str, Any]) -> str:
    """A recovery child's JAX compile events after its ``restored`` event: did the first step load its executable
    from the persistent cache or compile it again (bench/device_recovery.py, ``watch_compiles``)."""
    restored = [wall for kind, wall in child.get("timeline", []) if kind == "restored"]
    if not restored:
        return "no restore"
    after = [f"{what}{'' if seconds is None else f' {seconds:.2f}s'}"
             for wall, what, seconds in child.get("compiles", []) if wall >= restored[-1]]
    return ", ".join(after) or "none"


__all__ = ["accelerator_plugin", "choose", "device_size", "probe_platform", "run_device",
           "run_device_recovery"]
