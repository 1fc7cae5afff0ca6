"""The costs the autopilot harness (bench/autopilot.py) replays its traces with, read from what `make bench`
measured: one TPU v5e chip's step, replica snapshots and shared-memory tier (bench/device-runs/, the newest
``*-device.json`` from ``python -m bench.device`` and ``*-tier_restore.json`` from ``python -m bench.tier_restore``),
and this machine's persist and cold restore rates (bench/results.json), scaled to the chip's state.

Why it exists: the harness must compare strategies on costs that were measured, and say which measurement each cost
is; ``KEYS`` names them. What no run measured is an assumption and says so: the detection time (the advisor's
default), that the persist ckptd makes from a shared-memory snapshot costs the accelerator's loop nothing (it runs
in the sidecar's process, on the host's cores), and the shares of failures by the fastest tier that survives them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_client.core.planning import TierCosts

BENCH = Path(__file__).resolve().parent
DETECT_S = 60.0  # assumption: ckptd advise's default detection time (a collective or heartbeat timeout at scale)
# assumption: of every 10 failures, 7 leave a replica (one slice lost), 2 leave host memory but no replica (two slices,
# or the controller restarted), 1 leaves only storage (hosts lost)
SHARES = (0.7, 0.2, 0.1)

KEYS: dict[str, str] = {
    "step_s": "device.json step_s",
    "replicas.block_s": "device.json replica_runs[0].choice: replica_overhead x replica_period x step_s (the pacer's "
                        "measured loop cost of one snapshot)",
    "replicas.copy_s": "device.json replica_runs[0].choice.replica_copy_seconds",
    "replicas.restore_s": "device.json replica_restore_s",
    "first_step_s (replicas, memory)": "device.json replica_first_step_s (same process, program compiled)",
    "memory.block_s = memory.copy_s": "tier_restore.json shm_save_s (the shared-memory save the loop waits for)",
    "memory.restore_s": "tier_restore.json shm_restore_s",
    "storage.copy_s": "memory's save + state bytes / results.json io.persist_worker_child_gbps (ckptd's persist "
                      "from the snapshot)",
    "storage.restore_s": "state bytes / (results.json context.io_state.bytes / io.ckptd_restore_cold_s)",
    "storage.first_step_s": "results.json recovery.relaunch_s + device.json compile_and_first_step_s (a new "
                            "process, a new compile)",
    "orbax.block_s": "state bytes / device.json memory_kinds.numpy.d2h_GBps (the device-to-host copy an async "
                     "Orbax save waits for)",
    "orbax.copy_s": "orbax.block_s + state bytes / results.json io.checkpointer_persist_gbps",
    "storage.requests": "results.json gcs.requests.ckptd_persist",
}


def _newest(pattern: str) -> Path:
    found = sorted((BENCH / "device-runs").glob(pattern))
    if not found:
        raise FileNotFoundError(f"no bench/device-runs/{pattern}: run `make bench` on the device first")
    return found[-1]


def _median(results: dict[str, Any], key: str) -> float:
    return float(results["measurements"][key]["median"])


@dataclass(frozen=True)
class Profile:
    """The measured costs: the tiers of a ckptd run (replicas, shared memory, storage persisted from it) and the one
    tier of a run that saves with Orbax straight to storage (MaxText's way), with the files they came from."""

    step_s: float
    state_bytes: float
    tiers: tuple[TierCosts, ...]  # replicas, memory, storage (nested in memory)
    orbax: TierCosts  # storage alone: an async Orbax save
    persist_s: float  # the storage tier's copy beyond the memory save (what a slow storage day stretches)
    sources: tuple[str, ...]

    def describe(self) -> list[str]:
        out = [f"step {self.step_s:.3f} s, state {self.state_bytes / 1e9:.2f} GB; from {', '.join(self.sources)}"]
        for t in (*self.tiers, self.orbax):
            out.append(f"{t.name}: block {t.block_s:.3g} s, copy {t.copy_s:.3g} s, restore {t.restore_s:.3g} s, "
                       f"first step {t.first_step_s:.3g} s")
        return out


def load(results: Path | None = None, device: Path | None = None, tier_restore: Path | None = None) -> Profile:
    """The profile from the given files (default: bench/results.json and the newest device runs)."""
    results = results or BENCH / "results.json"
    device = device or _newest("*-device.json")
    tier_restore = tier_restore or _newest("*-tier_restore.json")
    r = json.loads(results.read_text())
    d = json.loads(device.read_text())
    t = json.loads(tier_restore.read_text())
    step, state = float(d["step_s"]), float(d["state_bytes"])
    choice = d["replica_runs"][0]["choice"]
    first = float(d["replica_first_step_s"])
    persist = state / (_median(r, "io.persist_worker_child_gbps") * 1e9)
    restore = state / (float(r["context"]["io_state"]["bytes"]) / _median(r, "io.ckptd_restore_cold_s"))
    relaunch = _median(r, "recovery.relaunch_s") + float(d["compile_and_first_step_s"])
    shm = float(t["shm_save_s"])
    requests = _median(r, "gcs.requests.ckptd_persist")
    replicas = TierCosts("replicas", block_s=float(choice["replica_overhead"]) * int(choice["replica_period"]) * step,
                         copy_s=float(choice["replica_copy_seconds"]), restore_s=float(d["replica_restore_s"]),
                         first_step_s=first, survives=SHARES[0], host_bytes=2 * state)
    memory = TierCosts("memory", block_s=shm, copy_s=shm, restore_s=float(t["shm_restore_s"]), first_step_s=first,
                       survives=SHARES[0] + SHARES[1], host_bytes=2 * state)
    storage = TierCosts("storage", block_s=0.0, copy_s=shm + persist, restore_s=restore, first_step_s=relaunch,
                        nested=True, write_bytes=state, requests=requests)
    d2h = state / (float(d["memory_kinds"]["numpy"]["d2h_GBps"]) * 1e9)
    orbax = TierCosts("storage", block_s=d2h, copy_s=d2h + state / (_median(r, "io.checkpointer_persist_gbps") * 1e9),
                      restore_s=restore, first_step_s=relaunch, write_bytes=state, requests=requests)
    names = tuple(str(p.relative_to(BENCH.parent)) for p in (results, device, tier_restore))
    return Profile(step, state, (replicas, memory, storage), orbax, persist, names)


__all__ = ["DETECT_S", "KEYS", "SHARES", "Profile", "load"]
