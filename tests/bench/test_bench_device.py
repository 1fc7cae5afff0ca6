"""The device profile runs end to end at its toy size on CPU devices, so that CI keeps it working: bench/device.py
(the replica tier with the runner's defaults, paced, its memory kind measured and chosen, beside the same loop
without it; a restore of the held snapshot checked against the state it was taken from; the rates per host memory
kind), and the whole profile of bench.run (bench/device_profile.py: every key with its limit, each tier's restore
and first step, the recovery in the same PID against a relaunch, with no TCP or UDP socket anywhere), and the choice
of the profile and its platform.

The real figures come from a run on a chip (docs/benchmarks.md, "Device profile").
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import device_profile
from bench.device_profile import choose, device_size
from bench.report import DEVICE_BEGIN, DEVICE_END
from tests.support.helpers import REPO, clean_env
from tests.support.sockets import tcp_allowed


def test_the_device_profile_runs_at_its_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "device.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.device", "--size", "toy", "--schedule", "4,60,1", "--out", str(out)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["platform"] == "cpu" and result["state_bytes"] > 0 and result["step_s"] > 0
    (run,) = result["replica_runs"]
    choice = run["choice"]
    assert choice is not None, run  # the pacer measured both kinds and chose
    assert choice["replica_memory_kind"] in ("pinned_host", "unpinned_host") and choice["replica_period"] >= 1
    assert run["staged"] is True and run["snapshots"] >= 2  # one to each kind, then at the chosen period
    assert result["replica_overhead_ratio_whole"] > 0
    assert result["replica_restore_exact"] is True and result["replica_first_step_s"] > 0
    dispatched = sum(took for _, took in result["replica_trace"])  # the last may still be in flight when counted
    assert len(result["replica_trace"]) == 60 and dispatched >= run["snapshots"]
    assert {"pinned_host", "unpinned_host", "numpy"} <= set(result["memory_kinds"])


def test_measuring_the_rates_leaves_the_meshs_devices_alone() -> None:
    """``Array.devices()`` is the mesh's own cached set: emptied once (a ``.pop()``), every array on that mesh had
    no devices, and Orbax's save of the next state failed on the chip (``'NamedSharding' object has no attribute
    'addressable_memories'``)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from bench import device
    from bench.decoder import mesh_of

    mesh = mesh_of(jax.devices()[:1], 1)
    state = {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P()))}
    before = set(state["w"].devices())
    rates = device._rates(state)
    assert {"pinned_host", "unpinned_host", "numpy"} <= set(rates)
    assert state["w"].devices() == before and mesh_of(jax.devices()[:1], 1).devices.size == 1
    assert isinstance(state["w"].device, jax.Device)  # what Orbax's save asks of each shard


# ---- the device profile of bench.run (bench/device_profile.py) -------------------------------------------------

# (key, its limit): the contract of results-device.json (bench/device_profile.py's docstring)
DEVICE_KEYS = {
    "replica_overhead_ratio": "<= 1.02",
    "replica_end_to_end_speedup_vs_shm": ">= 2",
    "shm_restore_vs_numpy_h2d": ">= 0.5",
    "shm_save_stall_ratio_vs_device_get": "<= 1.5",
    "inprocess_recovery_speedup_vs_relaunch": ">= 5",
}
TIERS = ("replicas", "numpy", "shm", "direct", "plain_orbax")
PENDING = "(the first run of this profile on the chip is pending)"  # docs/benchmarks.md until a chip run replaces it

# Loaded by every Python process of the run (PYTHONPATH): a TCP or UDP socket bound, connected or sent to is
# refused, as on the lent chip's machine, and written to a log, so that one swallowed by a retry still fails the test.
# Not logged: urllib3's probe at import (``_has_ipv6`` binds ::1 and reads a refusal as "no IPv6").
NO_TCP = '''
import errno, os, socket, sys, traceback

def _guard(name):
    real = getattr(socket.socket, name)

    def refuse(self, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            if sys._getframe(1).f_code.co_name != "_has_ipv6":
                with open(os.environ["BENCH_TEST_TCP_LOG"], "a") as log:
                    log.write(f"pid {os.getpid()} {name}{args!r}\\n{''.join(traceback.format_stack(limit=12))}\\n")
            raise OSError(errno.EPERM, "no TCP or UDP socket here (the test's guard, as on the lent chip)")
        return real(self, *args, **kwargs)

    setattr(socket.socket, name, refuse)

for _name in ("bind", "connect", "connect_ex", "sendto"):
    _guard(_name)
'''


def test_the_device_profile_runs_at_its_toy_size_without_tcp(tmp_path: Path) -> None:
    """``python -m bench.run --profile device --size toy``: every key with its limit, each tier's restore and first
    step, the rates per memory kind, the recovery in the same PID against a relaunch from the same memory snapshot,
    its table in the report; and no process of the run (ckptd and its clients included) touches TCP or UDP."""
    site, log = tmp_path / "site", tmp_path / "tcp.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TCP)
    env = clean_env(BENCH_TEST_TCP_LOG=str(log))
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    tried = subprocess.run([sys.executable, "-c", "import socket; socket.socket().bind(('127.0.0.1', 0))"], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert tried.returncode != 0  # the guard is in place, or the machine has no TCP at all (the lent chip's)
    assert not tcp_allowed() or ("the test's guard" in tried.stderr and log.exists())
    log.unlink(missing_ok=True)  # none where the machine refused the socket itself
    out, docs = tmp_path / "results-device.json", tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--profile", "device", "--size", "toy", "--out", str(out), "--docs",
         str(docs), "--workdir", str(tmp_path), "--shm", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not log.exists(), log.read_text()[:4000]
    payload = json.loads(out.read_text())
    assert payload["profile"]["name"] == "device" and payload["profile"]["decoder"] == "toy"
    assert payload["errors"] == {}
    assert {k: f["target"] for k, f in payload["keys"].items()} == DEVICE_KEYS
    for key, fig in payload["keys"].items():
        assert fig["n"] >= 1 and len(fig["samples"]) == fig["n"], key
        assert 0 < fig["min"] <= fig["median"] <= fig["max"] < float("inf"), key
        assert isinstance(fig["pass"], bool), key
        assert f"* {key} = " in proc.stdout, key  # printed as measured
    m = payload["measurements"]
    for tier in TIERS:
        assert m[f"device.restore.{tier}_s"]["median"] > 0 and m[f"device.first_step.{tier}_s"]["median"] > 0, tier
    for kind in ("pinned_host", "unpinned_host", "numpy"):
        assert m[f"device.rate.{kind}.d2h_GBps"]["median"] > 0 and m[f"device.rate.{kind}.h2d_GBps"]["median"] > 0
    assert m["device.replica_period"]["median"] >= 1  # the pacer chose
    device = payload["context"]["device"]
    assert device["platform"] == "cpu" and device["state_bytes"] > 0 and device["replica_restore_exact"] is True
    recovery = payload["keys"]["inprocess_recovery_speedup_vs_relaunch"]["details"]
    assert recovery["inprocess_s_median"] < recovery["inprocess_with_down_time_s_median"]
    assert recovery["inprocess_with_down_time_s_median"] >= recovery["down_s"] > 0
    restored = recovery["restored_from"]  # both sides from the same job's snapshot in shared memory
    assert restored["inprocess"].startswith("memory") and restored["relaunch"].startswith("from memory"), restored
    report = docs.read_text()  # docs/benchmarks.md with this run's table between its device markers, the rest as is
    assert all(f"`{key}`" in report for key in DEVICE_KEYS) and PENDING not in report
    published = (REPO / "docs" / "benchmarks.md").read_text()
    for text in (report, published):
        assert text.count(DEVICE_BEGIN) == 1 and text.count(DEVICE_END) == 1
    outside = [(t.split(DEVICE_BEGIN)[0], t.split(DEVICE_END)[1]) for t in (report, published)]
    assert outside[0] == outside[1]


def test_which_profile_and_platform_a_run_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BENCH_DEVICE`` or ``--profile device`` choose the device profile; else an accelerator named by
    ``JAX_PLATFORMS``, or found by jax where it is unset and a plugin is installed; the CPU profiles otherwise."""
    asked: list[str] = []

    def probe(found: str) -> Callable[[], str]:
        def ask() -> str:
            asked.append(found)
            return found

        return ask

    assert choose("full", {"BENCH_DEVICE": "tpu"}) == ("full", None)
    assert choose(None, {"BENCH_DEVICE": "tpu", "JAX_PLATFORMS": "cpu"}) == ("device", "tpu")  # make's cpu
    assert choose(None, {"BENCH_DEVICE": "auto"}, probe("tpu")) == ("device", "tpu")
    assert choose("device", {"JAX_PLATFORMS": "cpu"}) == ("device", "cpu")
    assert choose("device", {}, probe("cpu")) == ("device", "cpu")
    assert choose(None, {"JAX_PLATFORMS": "tpu,cpu"}) == ("device", "tpu")
    assert choose(None, {"JAX_PLATFORMS": "cpu", "BENCH_DEVICE": "0"}) == (None, None)
    asked.clear()
    monkeypatch.setattr(device_profile, "accelerator_plugin", lambda: False)
    assert choose(None, {}, probe("tpu")) == (None, None) and asked == []  # no plugin: jax is not asked
    monkeypatch.setattr(device_profile, "accelerator_plugin", lambda: True)
    assert choose(None, {}, probe("tpu")) == ("device", "tpu")
    assert choose(None, {}, probe("cpu")) == (None, None)
    assert device_size("cpu", None, {}) == "toy" and device_size("tpu", None, {}) == "chip"
    assert device_size("tpu", None, {"BENCH_DEVICE_SIZE": "chip-small"}) == "chip-small"
    assert device_size("tpu", "toy", {"BENCH_DEVICE_SIZE": "chip-small"}) == "toy"
