"""The ``peers`` family: restart-to-first-step of a 2-process job whose host 1 lost its memory, its part brought
back from host 0's sidecar against every host reading storage; and what the background copies cost training.

``multihost_restart_speedup_peer_vs_storage``: the job of bench/multihost.py (the same worker, state and
timing: join to first step, the slower process), with a ``ckptd serve`` per host, each with its peer channel
on (docs/multihost.md, "Peer copies"). After the save, each sidecar copies its host's part to the other. Each
repeat, side by side (alternating which goes first): host 1's shared memory is wiped and the job restarted
(the agreement takes memory: host 0 restores its own part, host 1 its part brought back from host 0's copy by
its sidecar: as soon as the sidecar sees the memory wiped, while the trainers start, or when the trainer
asks), and the job is restarted without a memory tier (every process reads its shards from
storage, as with both hosts wiped). The key is storage ÷ peer per repeat. Beside it, in the same run: a restart
with every host's memory kept (``multihost_restart_peer_over_memory``: what bringing a part back costs over
not having lost it) and the restore phase alone (``multihost_restore_speedup_peer_vs_storage``); the slower
process's phases (plan, restore, the first step's compile and run) are in the key's details.

``peer_copy_training_slowdown``: ms per step of a jitted loop in a trainer-like process (all of its devices
busy) while this host's sidecar copies a new part of the state's size to its peer every second, over the same
loop while the same parts are written with the peer channel off (the cost of the copies, not of the saves);
both in every repeat, alternating which goes first, the key on / off of the medians per repeat.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results, alternate, evict_from_page_cache, stop_process
from bench.multihost import REPO, _env, _free_port, _job

KEY = "multihost_restart_speedup_peer_vs_storage"
SECRET = "bench-peer-secret-0123456789abcdef"

_LOOP = r"""
import sys, time, json
import jax, jax.numpy as jnp
seconds = float(sys.argv[1])
x = jnp.ones((512, 512), jnp.float32)
step = jax.jit(lambda a: (a @ a) / 512.0)
x = step(x).block_until_ready()
times = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t = time.perf_counter()
    x = step(x).block_until_ready()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def _sidecars(base: Path, shms: list[str], peers: bool) -> list[subprocess.Popen[bytes]]:
    from examples.demo import start_ckptd

    ports = [_free_port() for _ in shms]
    peer_ports = [_free_port() for _ in shms]
    static = ",".join(f"{k}=127.0.0.1:{p}" for k, p in enumerate(peer_ports))
    out: list[subprocess.Popen[bytes]] = []
    try:
        for k, shm in enumerate(shms):
            extra = {"CKPTD_PEER_PORT": str(peer_ports[k]), "CKPTD_PEER_SECRET": SECRET, "CKPTD_PEERS": static,
                     "CKPTD_LEASE_TTL_S": "3"} if peers else {"CKPTD_LEASE_TTL_S": "3"}
            Path(shm).mkdir(mode=0o700, exist_ok=True)
            out.append(start_ckptd(base / "root", base / f"ckptd-state-{k}", Path(shm), ports[k],
                                   base / f"ckptd-{k}.log", extra))
            out[-1].url = f"http://127.0.0.1:{ports[k]}"  # type: ignore[attr-defined]
    except BaseException:  # the second failed to start, or the run was interrupted: the first stops too
        _stop(out)
        raise
    return out


def _stop(sidecars: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every sidecar at once, then wait for each (SIGKILL past two minutes)."""
    for proc in sidecars:
        if proc.poll() is None:
            proc.terminate()
    for proc in sidecars:
        stop_process(proc, 120)


def run_peers(profile: Profile, results: Results, base: Path, shm: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    (base / "root" / "job").mkdir(parents=True, exist_ok=True)
    shape = profile.multihost_shape
    state_bytes = profile.multihost_state_bytes
    shms = [str(shm / f"peers-host{k}") for k in range(2)]
    timeout_s = 120 + state_bytes / 2**20
    sidecars = _sidecars(base, shms, peers=True)
    try:
        _restart_key(profile, results, base, shms, shape, timeout_s, sidecars[0].url)  # type: ignore[attr-defined]
    finally:
        _stop(sidecars)
        for path in shms:  # each host's part and its peer's copy: freed before the copy-cost runs
            shutil.rmtree(path, ignore_errors=True)
    _copy_cost(profile, results, base, shm, state_bytes)


def _restart_key(profile: Profile, results: Results, base: Path, shms: list[str], shape: tuple[int, int, int],
                 timeout_s: float, url: str) -> None:
    from examples.demo import last_step_on_storage
    from examples.multihost_demo import wait_for as _wait

    _job(base, "save", shape, shms, timeout_s, url)
    _wait(lambda: last_step_on_storage(base / "root", "job") == 10, 120, "step 10 verified on storage")
    _wait(lambda: all((Path(shms[k]) / "job" / f".peer-{1 - k}" / "10").is_dir() for k in range(2)), 120,
          "each host's part copied to the other")
    peer: list[float] = []
    storage: list[float] = []
    memory: list[float] = []
    phases: dict[str, list[Any]] = {"peer": [], "storage": [], "memory": []}

    def restart(tier: str) -> None:
        if tier == "peer":
            # host 1 replaced: its part and the copies it kept are gone (once: its sidecar then starts bringing
            # its part back, as on a node whose sidecar saw the wipe)
            shutil.rmtree(Path(shms[1]) / "job", ignore_errors=True)
        if profile.cold_reads:
            evict_from_page_cache(base / "root", base / "jax-cache")
        hosts = _job(base, "restore", shape, ["-", "-"] if tier == "storage" else shms, timeout_s, url)
        want = "storage" if tier == "storage" else "memory"
        if {h["tier"] for h in hosts} != {want}:
            raise RuntimeError(f"the {tier} restart restored from {[h['tier'] for h in hosts]}")
        if tier == "peer" and not (Path(shms[1]) / "job" / "10" / "from_peer.json").is_file():
            raise RuntimeError("host 1 did not bring its part back from its peer")
        {"peer": peer, "storage": storage, "memory": memory}[tier].append(max(h["join_to_first_step"] for h in hosts))
        phases[tier].append({**{k: round(max(h[k] for h in hosts), 4) for k in (  # the slower process's
            "plan_s", "restore_s", "first_step_compile_s", "first_step_run_s")},
            "agreement": [h["agreement"] for h in hosts]})

    restart("peer")  # not counted: compiles the first step into JAX's cache, as the job's first start did
    peer.clear()
    phases["peer"].clear()
    for i in range(max(1, profile.recovery_repeats)):
        alternate(i, lambda: restart("peer"), lambda: restart("storage"))
        restart("memory")  # nothing wiped: what the peer path is worth against a host that kept its memory
        results.progress()
    results.measure("multihost_restart_to_first_step_s_peer", peer, "s",
                    "restart of a 2-process job to its first step, host 1's part from host 0's copy "
                    "(join to first step)")
    asked = [p["agreement"][1]["peer_fetch_s"] for p in phases["peer"] if "peer_fetch_s" in p["agreement"][1]]
    results.context["peer_restarts_refilled_before_the_trainer_asked"] = len(phases["peer"]) - len(asked)
    if asked:
        results.measure("multihost_peer_fetch_s", asked, "s",
                        "host 1's trainer waiting for its sidecar to bring its part back from host 0 (when asked)")
    results.measure("multihost_restart_peer_over_memory", [p / m for p, m in zip(peer, memory, strict=True)], "x",
                    "restart to first step with host 1's part from host 0's copy / with every host's memory kept "
                    "(same run)")
    restore = {t: [p["restore_s"] for p in phases[t]] for t in ("peer", "storage")}
    results.measure("multihost_restore_speedup_peer_vs_storage",
                    [s / p for s, p in zip(restore["storage"], restore["peer"], strict=True)], "x",
                    "the restore alone (agreement decided to arrays on the devices): storage / peer")
    results.figure(Figure(
        KEY, [s / p for s, p in zip(storage, peer, strict=True)], ">=", 3.0, "x",
        "restart-to-first-step of a 2-process job, one host's memory lost: from storage / its part from a peer",
        details={"state_bytes": profile.multihost_state_bytes, "peer_s": peer, "storage_s": storage,
                 "memory_s": memory, "phases": phases}))


def _copy_cost(profile: Profile, results: Results, base: Path, shm: Path, state_bytes: int) -> None:
    """ms per step of a jitted loop while parts of the state's size are written every second, with the peer
    channel copying each to the other host, against the channel off; each repeat runs both, alternating which
    goes first, and the figure is on / off of the medians per repeat."""
    seconds = 12.0 if profile.name == "full" else 6.0
    cols = max(1024, state_bytes // 2 // (8 // 2) // 4)  # host 0's part: half the state
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    medians: dict[str, list[float]] = {"off": [], "on": []}
    counts = {"copies_sent_on": 0, "copies_sent_off": 0, "parts_written_on": 0, "parts_written_off": 0}

    def run(label: str, repeat: int) -> None:
        times = _loop_beside_copies(base / f"cost-{label}-{repeat}", shm, f"{label}-{repeat}", label == "on", cols,
                                    seconds, counts, label)
        per_step[label] += times
        medians[label].append(sorted(times)[len(times) // 2])

    for i in range(max(1, profile.recovery_repeats)):
        alternate(i, functools.partial(run, "on", i), functools.partial(run, "off", i))
        results.progress()
    for name, count in counts.items():
        results.context[f"peer_copy_cost_{name}"] = count
    results.measure("peer_copy_step_ms_off", [t * 1000 for t in per_step["off"]], "ms",
                    "a jitted step while parts are written every second, the peer channel off")
    results.measure("peer_copy_step_ms_on", [t * 1000 for t in per_step["on"]], "ms",
                    "the same with each part copied to the peer in the background")
    results.figure(Figure(
        "peer_copy_training_slowdown", [on / off for on, off in zip(medians["on"], medians["off"], strict=True)],
        "<=", 1.1, "x", "median step time while the sidecar copies parts to its peer / with the peer channel off",
        details={"part_bytes": cols * 4 * 4, "seconds": seconds, "medians_ms": {
            k: [round(v * 1000, 4) for v in m] for k, m in medians.items()}}))


def _loop_beside_copies(work: Path, shm: Path, tag: str, peers: bool, cols: int, seconds: float,
                        counts: dict[str, int], label: str) -> list[float]:
    """One run of the loop (its step times) while host 0's parts are written every second, copied to host 1
    when ``peers``."""
    from tests.support.peer_parts import write_part

    shms = [str(shm / f"peers-cost-{tag}-{k}") for k in range(2)]
    (work / "root" / "job").mkdir(parents=True, exist_ok=True)
    sidecars = _sidecars(work, shms, peers=peers)
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        step = 0
        write_part(Path(shms[1]), "job", 0, index=1, cols=1024)  # host 1's sidecar learns its index
        while not stop.is_set():
            step += 1
            write_part(Path(shms[0]), "job", step, index=0, cols=cols, random=False)
            shutil.rmtree(Path(shms[0]) / "job" / str(step - 2), ignore_errors=True)
            writes[0] += 1
            stop.wait(1.0)

    thread = threading.Thread(target=writer, daemon=True)
    try:
        thread.start()
        time.sleep(2.0)
        loop = subprocess.run([sys.executable, "-c", _LOOP, str(seconds)], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300, check=True)
        times: list[float] = json.loads(loop.stdout.strip().splitlines()[-1])
    finally:
        stop.set()
        thread.join()
        _stop(sidecars)
        for path in shms:
            shutil.rmtree(path, ignore_errors=True)
        counts[f"copies_sent_{label}"] += (work / "ckptd-0.log").read_text(errors="replace").count(") held by host 1")
        counts[f"parts_written_{label}"] += writes[0]
    return times


__all__ = ["KEY", "run_peers"]
