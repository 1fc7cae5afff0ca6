"""The ``multihost`` family: restart-to-first-step of a multi-controller job, from memory against from storage.

Two real JAX processes (jax.distributed on 127.0.0.1, 4 CPU devices each, gloo, one global mesh of 8) first
save one state (the profile's ``arrays`` float32 arrays of ``rows`` x ``cols``, sharded over the 8 devices) as
step 10 twice: to storage (a plain multi-process Orbax save) and to each host's shared memory (each host its
part). Then, in every repeat and side by side (alternating which goes first), the job is restarted twice as a
JobSet restarts it (new processes): once with each host's shared memory there (the agreement takes memory:
each host restores its own part), once with it gone (the agreement takes storage: every process reads its
shards with Orbax). Each restarted process times, from the moment it joined the job (``initialize_multihost``
returned and its backend knows the 8 global devices: ~0.2 s on a loaded 2-core machine, the same for both
tiers and for any start) to its first training step done (the resume agreement, the restore, one jitted
step over the state, compiled before: a restarted trainer finds it in JAX's persistent cache, loaded here
before the step runs so the two show apart): ``restart-to-first-step``.
The key is storage ÷ memory of the slower process, per repeat; before each restart the step on storage and
JAX's cache are evicted from the page cache (when the profile says so), never the hosts' shared memory.
The time from launching the processes (interpreter, imports, jax.distributed) is recorded beside it: the
same for both paths, it is not what the tier changes.

``run_multihost_persist`` (bench/multihost_persist.py, another family member) adds its key when that module
exists; a missing one is reported in the results' notes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results, alternate, evict_from_page_cache, free_gib, rmtree, stop_process

REPO = Path(__file__).resolve().parent.parent
KEY = "multihost_restart_speedup_memory_vs_storage"

_WORKER = r"""
import sys, time
launched, port, index, shm, root, mode, rows, cols, arrays = (
    float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]),
    int(sys.argv[8]), int(sys.argv[9]))
import json
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core.protocol import ResumeRequest
from trainer_client.runtime.saving._checkpointing import Checkpointer, target_shardings, training_metadata
from trainer_client.runtime.multihost._job_store import initialize_multihost
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.multihost._multihost import ResumeAgreement
jax.config.update("jax_compilation_cache_dir", root + "/../jax-cache")  # as a restarted trainer reuses its cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
initialize_multihost(f"127.0.0.1:{port}", 2, index, heartbeat_timeout_s=10, initialization_timeout_s=120)
mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))  # the backend's start: the global devices (gloo)
joined = time.time()  # the process is up and in the job, its devices known: what follows is what the tier changes
specs = {f"a{i}": P("data", None) for i in range(arrays)}
abstract = {k: jax.ShapeDtypeStruct((rows, cols), jnp.float32) for k in specs}
if mode == "save":
    def leaf(i):
        return jax.make_array_from_callback((rows, cols), NamedSharding(mesh, specs[f"a{i}"]), lambda idx: (
            np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)[idx] + i))
    state = {f"a{i}": leaf(i) for i in range(arrays)}
    meta = training_metadata(10, state, data_position=80, global_batch=8, mesh=mesh, slices=[0])
    checkpointer = Checkpointer(root + "/job")
    checkpointer.save_with_metadata(10, state, meta)
    checkpointer.wait()
    MemoryTier(shm, "job", max_snapshots=2, preallocate=False).save(10, state, meta, persist=False)
    print(json.dumps({"saved": True}), flush=True)
    sys.exit(0)
client = CkptdClient(ClientSettings(url=sys.argv[10], resume_deadline_s=2, timeout_s=1, report_events=False), root=root)
agreement = ResumeAgreement("job", None if shm == "-" else shm, client, process_index=index, process_count=2)
plan = agreement.plan(ResumeRequest(policy="pause", alive_devices=8, process_count=2))
planned = time.time()
state, restored = agreement.restore(plan, lambda p: target_shardings(abstract, mesh, specs, p.arrays))
jax.block_until_ready(state)
restored_at = time.time()
step = jax.jit(lambda s: (jax.tree_util.tree_map(lambda x: x * 0.5, s),
                          sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(s))))
compiled = step.lower(state).compile()  # what step(state) does first: trace, lower, JAX's cache (or compile)
compiled_at = time.time()
state, total = compiled(state)
jax.block_until_ready((state, total))
done = time.time()
print(json.dumps({"tier": restored.tier, "step": restored.step, "join_to_first_step": done - joined,
                  "launch_to_first_step": done - launched, "plan_s": planned - joined,
                  "restore_s": restored_at - planned, "first_step_s": done - restored_at,
                  "first_step_compile_s": compiled_at - restored_at, "first_step_run_s": done - compiled_at,
                  "agreement": {k: round(v, 4) for k, v in agreement.timings.items()}}), flush=True)
"""


def _job(base: Path, mode: str, shape: tuple[int, int, int], shms: list[str], timeout_s: float,
         url: str) -> list[dict[str, Any]]:
    """One incarnation of the 2-process job (``url``: the sidecar process 0 asks); each process's JSON line."""
    port = _free_port()
    rows, cols, arrays = shape
    env = _env()
    launched = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(launched), str(port), str(k), shms[k],
                               str(base / "root"), mode, str(rows), str(cols), str(arrays),
                               url], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(2)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} job process failed ({proc.returncode}): {stderr[-2000:]}")
            out.append(json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}


def run_multihost(profile: Profile, results: Results, base: Path, shm: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    shape = profile.multihost_shape
    state_bytes = profile.multihost_state_bytes
    shms = [str(shm / f"multihost-host{k}") for k in range(2)]
    timeout_s = 120 + state_bytes / 2**20  # a second per MiB on top of the start: a stalled job, not a slow one
    print(f"  state {state_bytes / 2**20:.1f} MiB over 2 processes x 4 devices; {free_gib():.1f} GiB available",
          flush=True)
    from examples.demo import last_step_on_storage, start_ckptd

    port = _free_port()
    (base / "root" / "job").mkdir(parents=True, exist_ok=True)
    (base / "sidecar-shm").mkdir(exist_ok=True)
    # process 0's sidecar, as in a pod: its answer is the storage side of the agreement (step 10, once verified)
    sidecar = start_ckptd(base / "root", base / "ckptd-state", base / "sidecar-shm", port, base / "ckptd.log")
    try:
        _measure(profile, results, base, shms, shape, timeout_s, f"http://127.0.0.1:{port}", last_step_on_storage)
    finally:
        stop_process(sidecar, 120)
        for path in [*shms, str(base / "sidecar-shm")]:  # the hosts' parts: freed before the persist key makes its own
            rmtree(path)
    _persist_key(profile, results, base, shm)


def _measure(profile: Profile, results: Results, base: Path, shms: list[str], shape: tuple[int, int, int],
             timeout_s: float, url: str, verified: Any) -> None:
    state_bytes = profile.multihost_state_bytes
    _job(base, "save", shape, shms, timeout_s, url)
    deadline = time.monotonic() + 120
    while verified(base / "root", "job") != 10:
        if time.monotonic() > deadline:
            raise RuntimeError("ckptd did not verify step 10 within 120 s")
        time.sleep(0.2)
    memory: list[float] = []
    storage: list[float] = []
    launch: dict[str, list[float]] = {"memory": [], "storage": []}
    parts: dict[str, list[dict[str, Any]]] = {"memory": [], "storage": []}
    cold = [False]

    def restart(tier: str) -> None:
        # the step on storage and JAX's cache, both read by either restart (never the hosts' shared memory)
        cold[0] = evict_from_page_cache(base / "root", base / "jax-cache") if profile.cold_reads else False
        hosts = _job(base, "restore", shape, shms if tier == "memory" else ["-", "-"], timeout_s, url)
        if {h["tier"] for h in hosts} != {tier}:
            raise RuntimeError(f"the {tier} restart restored from {[h['tier'] for h in hosts]}")
        (memory if tier == "memory" else storage).append(max(h["join_to_first_step"] for h in hosts))
        launch[tier].append(max(h["launch_to_first_step"] for h in hosts))
        parts[tier].append({**{k: round(max(h[k] for h in hosts), 4) for k in ("plan_s", "restore_s", "first_step_s",
                                                                    "first_step_compile_s", "first_step_run_s")},
                            "agreement": [h["agreement"] for h in hosts]})

    restart("memory")  # not counted: compiles the first step into JAX's cache, as the job's first start did
    for tier in ("memory", "storage"):
        (memory if tier == "memory" else storage).clear()
        launch[tier].clear()
        parts[tier].clear()
    for i in range(max(1, profile.recovery_repeats)):
        alternate(i, lambda: restart("memory"), lambda: restart("storage"))
        results.progress()
    for tier, samples in (("memory", memory), ("storage", storage)):
        results.measure(f"multihost_restart_to_first_step_s_{tier}", samples, "s",
                        f"restart of a 2-process job to its first step, from {tier} (join to first step)")
        results.measure(f"multihost_restore_s_{tier}", [p["restore_s"] for p in parts[tier]], "s",
                        f"of which the restore alone, from {tier} (the slower process)")
        results.measure(f"multihost_launch_to_first_step_s_{tier}", launch[tier], "s",
                        "the same from launching the processes (interpreter, imports, jax.distributed)")
    results.figure(Figure(
        KEY, [s / m for s, m in zip(storage, memory, strict=True)], ">=", 3.0, "x",
        "restart-to-first-step of a 2-process job from storage / from every host's memory, side by side",
        details={"state_bytes": state_bytes, "memory_s": memory, "storage_s": storage, "phases": parts,
                 "cold_files_evicted": cold[0], "launch_to_first_step_s": launch}))


def _persist_key(profile: Profile, results: Results, base: Path, shm: Path) -> None:
    """The other key of the family, from bench/multihost_persist.py when it is there."""
    try:
        from bench.multihost_persist import run_multihost_persist  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        results.notes["multihost_persist"] = f"bench/multihost_persist.py not available: {exc}"
        print(f"  multihost_persist_throughput_ratio_vs_single: not measured ({exc})", flush=True)
        return
    run_multihost_persist(profile, results, base / "persist", shm)


__all__ = ["KEY", "run_multihost"]
