"""The service: resume latency (one client, sequential), a burst of 64 resumes at once, catalog rebuild.

A job of ``profile.steps`` committed steps is fabricated cheaply but validly: one real step is saved by
trainer_client's ``Checkpointer`` (plain Orbax layout, ckptd manifest) with a state of
``profile.state_arrays`` small arrays on the mesh ``("replica", "data") = (4, 2)``; every other step
hard-links its Orbax data files and gets its own ``_CHECKPOINT_METADATA`` (its step and data position in
ckptd's training metadata) and its own manifest (``Manifest`` of the template with this step and training
metadata, checksummed as ``write_manifest`` does). The catalog then verifies every step for real (quick
validation against the manifest, sealing, fsync) at first sight.

The server is the real sidecar, ``python -m ckptd serve`` on 127.0.0.1 in its own process, with its
default refresh interval. The sequential client is httpx (what trainer_client uses) over one keep-alive
connection, in a lean process of its own (``bench/resume_client.py``), which then times trainer_client's
``CkptdClient.resume`` (answers parsed into plans) beside it. The burst comes from 64 raw sockets connected
beforehand (64 hosts failing over together), each sending one request at the same moment; the makespan is
from the first send to the last complete answer.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Figure, Profile, Results, percentile, rmtree, stop_process, timed
from bench.load64 import run_load64
from bench.resume_client import BUDGET_S as SEQUENTIAL_BUDGET_S
from bench.resume_client import REQUEST_TIMEOUT_S
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, CKPTD_MANIFEST
from trainer_client.core.format._manifest import read_manifest, write_manifest
from trainer_client.core.protocol import ResumeRequest, SliceAlive

JOB = "bench-job"
GLOBAL_BATCH = 64
PER_STEP = (CHECKPOINT_METADATA, CKPTD_MANIFEST)
BURST_BUDGET_S = 300.0  # bursts stop after this (but not before 2)
BURST_LIMIT_S = 300.0  # a burst not answered whole by then counts as this (a lower bound) and is reported


def _template_step(profile: Profile, directory: Path) -> Path:
    """One real step saved by trainer_client's Checkpointer: ``state_arrays`` arrays of f32[8, 16]."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from trainer_client.runtime.saving._checkpointing import Checkpointer

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "data"))
    sharding = NamedSharding(mesh, PartitionSpec(None, "data"))
    base = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    state = {"params": {f"layer{i:04d}": jax.device_put(base + i, sharding) for i in range(profile.state_arrays)}}
    ck = Checkpointer(str(directory), async_save=False)
    ck.save(1, state, data_position=GLOBAL_BATCH, global_batch=GLOBAL_BATCH, mesh=mesh, slices=[0, 1, 2, 3])
    ck.close()
    return directory / "1"


def _no_fsync(_tmp: str) -> None:
    """Fabricated steps need not survive a power cut (``write_manifest``'s ``sync``)."""


def fabricate(template: Path, job_dir: Path, steps: int) -> None:
    """``steps`` valid committed steps 1..steps in ``job_dir``, each with its own step metadata and manifest."""
    storage = Storage(str(template.parent))
    manifest = read_manifest(storage, str(template))
    assert manifest is not None and manifest.training is not None
    ckpt_meta = json.loads((template / CHECKPOINT_METADATA).read_text())
    files: list[str] = []
    dirs: set[str] = set()
    for current, _subdirs, names in os.walk(template):
        rel_dir = os.path.relpath(current, template)
        dirs.add(rel_dir)
        files.extend(os.path.normpath(os.path.join(rel_dir, n)) for n in names if n not in PER_STEP)
    job_dir.mkdir(parents=True, exist_ok=True)
    jobs = Storage(str(job_dir))
    training0 = manifest.training
    for step in range(1, steps + 1):
        step_dir = job_dir / str(step)
        for rel in sorted(dirs):
            (step_dir / rel).mkdir(parents=True, exist_ok=True)
        for rel in files:
            os.link(template / rel, step_dir / rel)
        training = training0.model_copy(update={"step": step, "data_position": step * GLOBAL_BATCH,
                                                "wall_time": training0.wall_time + step})
        ckpt_meta["custom_metadata"]["ckptd"] = training.model_dump(mode="json")
        (step_dir / CHECKPOINT_METADATA).write_text(json.dumps(ckpt_meta))
        # the bytes write_manifest writes (what a trainer writes today), without its fsync per file
        m = manifest.model_copy(update={"step": step, "training": training, "created_at": time.time()})
        write_manifest(jobs, str(step_dir), m, sync=_no_fsync)


def _rebuild_once(root: Path, db: Path) -> tuple[float, dict[str, int]]:
    from ckptd.catalog._catalog import Catalog

    rmtree(db.parent)
    db.parent.mkdir(parents=True)
    catalog = Catalog(Storage(str(root)), db)
    with timed() as t:
        catalog.rebuild()
    states: dict[str, int] = {}
    for info in catalog.checkpoints(JOB):
        states[info.state.value] = states.get(info.state.value, 0) + 1
    catalog.close()
    return t.seconds, states


def _verified_steps(db: Path) -> int:
    """Verified steps in the server's catalog, read from its SQLite file (read-only)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT COUNT(*) FROM steps WHERE job = ? AND state = 'verified'", (JOB,)).fetchone()
    finally:
        conn.close()
    return int(row[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(root: Path, state_dir: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["CKPTD_LOG_LEVEL"] = "warning"
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--host", "127.0.0.1", "--port", str(port),
         "--state-dir", str(state_dir)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 5400  # the first start verifies every step: ~30 min for 10,000 here
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ckptd exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("ckptd did not become ready in 5400 s")


def _request_body() -> bytes:
    """Slice 3 of 4 is down: 6 devices alive, resize (the planner shrinks the replica axis 4 -> 3)."""
    request = ResumeRequest(policy="resize", alive_devices=6,
                            slices=[SliceAlive(index=k, devices=2) for k in (0, 1, 2)])
    return request.model_dump_json().encode()


def _sequential(url: str, body: bytes, requests: int) -> dict[str, Any]:
    """The sequential series, from a lean client process of its own (``bench/resume_client.py`` says why)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run([sys.executable, "-m", "bench.resume_client", url, JOB, str(requests)], input=body,
                          capture_output=True, env=env, timeout=2 * SEQUENTIAL_BUDGET_S + 600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the resume client failed: {done.stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    if result["timeouts"]:
        print(f"    {result['timeouts']} requests not answered in {REQUEST_TIMEOUT_S:.0f}s", flush=True)
    return result


def _burst(url: str, body: bytes, n: int) -> tuple[float, list[float]]:
    """``n`` requests over ``n`` pre-connected sockets, sent at once; (makespan, per-request latencies)."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/jobs/{JOB}/resume HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    payload = head + body
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    sel = selectors.DefaultSelector()
    buffers: dict[int, bytearray] = {}
    done_at: dict[int, float] = {}
    try:
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        time.sleep(0.05)  # let the server accept every connection first
        for i, s in enumerate(socks):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, i)
            buffers[i] = bytearray()
        started = time.perf_counter()
        for s in socks:
            s.sendall(payload)
        while len(done_at) < n:
            if time.perf_counter() - started > BURST_LIMIT_S:  # counted as the limit: a lower bound
                print(f"    burst: {n - len(done_at)} answers missing after {BURST_LIMIT_S:.0f}s", flush=True)
                return BURST_LIMIT_S, [done_at.get(i, started + BURST_LIMIT_S) - started for i in range(n)]
            for key, _ in sel.select(timeout=1.0):
                i = key.data
                chunk = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                if not chunk:
                    raise RuntimeError("server closed a burst connection")
                buf = buffers[i]
                buf.extend(chunk)
                if _complete(buf):
                    done_at[i] = time.perf_counter()
                    sel.unregister(key.fileobj)
                    status = int(bytes(buf[9:12]))
                    if status != 200:
                        raise RuntimeError(f"burst answer {status}: {bytes(buf[:400])!r}")
        latencies = [done_at[i] - started for i in range(n)]
        return max(latencies), latencies
    finally:
        sel.close()
        for s in socks:
            s.close()


def _complete(buf: bytearray) -> bool:
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return False
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(buf) - end - 4 >= int(value.strip())
    raise RuntimeError("burst answer without Content-Length")


def run_service(profile: Profile, results: Results, workdir: Path) -> None:
    root, template_root, state = workdir / "root", workdir / "template", workdir / "state"
    job_dir = root / JOB
    with timed() as t:
        template = _template_step(profile, template_root)
    print(f"service: template step with {profile.state_arrays} arrays saved in {t.seconds:.1f}s", flush=True)
    with timed() as t:
        fabricate(template, job_dir, profile.steps)
    print(f"  fabricated {profile.steps} steps in {t.seconds:.1f}s", flush=True)
    meta_bytes = (job_dir / "1" / CHECKPOINT_METADATA).stat().st_size
    manifest_bytes = (job_dir / "1" / CKPTD_MANIFEST).stat().st_size
    files_per_step = sum(len(f) for _, _, f in os.walk(job_dir / "1"))
    results.context["service"] = {
        "steps": profile.steps, "state_arrays": profile.state_arrays, "files_per_step": files_per_step,
        "checkpoint_metadata_bytes": meta_bytes, "manifest_bytes": manifest_bytes, "fabricate_s": round(t.seconds, 1),
        "request": json.loads(_request_body()),
    }

    # -- the server --------------------------------------------------------------------------------------
    # The server's start is the catalog's first sight of the steps: verify, seal and fsync every one.
    proc, url, ready_s = _start_server(root, state / "server")
    print(f"  ckptd serving {url}: ready after {ready_s:.1f}s (first sight of {profile.steps} steps: verify + seal "
          "+ fsync each)", flush=True)
    results.measure("service.server_start_first_sight_s", [ready_s], "s",
                    "python -m ckptd serve until /readyz = 200, the first catalog build (verify, seal, fsync) included")
    try:
        body = _request_body()
        # (not GET .../checkpoints: it returns every step's training metadata, ~80 KB each here)
        verified = _verified_steps(state / "server" / "catalog.sqlite3")
        if verified != profile.steps:
            raise RuntimeError(f"the catalog verified {verified} of {profile.steps} fabricated steps")
        seq = _sequential(url, body, profile.resume_requests)
        plan = seq["plan"]
        if plan["step"] != profile.steps or plan["arrays"] != profile.state_arrays:
            raise RuntimeError(f"unexpected plan: step {plan['step']}, {plan['arrays']} arrays")
        results.context["service"]["plan"] = {**plan, "bytes": seq["answer_bytes"]}
        latencies, timeouts = seq["answered_ms"], seq["timeouts"]
        runs = max(1, min(5, len(latencies) // 100))
        size = len(latencies) // runs
        p99s = [percentile(latencies[k * size:(k + 1) * size], 99) for k in range(runs)]
        client_ms = seq["client_resume_ms"]
        results.measure("service.resume_latency_ms", latencies, "ms", "every sequential request, until its answer's "
                        "last byte")
        results.measure("service.client_resume_ms", client_ms, "ms", "trainer_client's CkptdClient.resume, "
                        "sequential: request built, answer parsed into a ResumePlan")
        results.figure(Figure("resume_p99_ms", p99s, "<=", 10.0, "ms",
                              f"p99 of POST /v1/jobs/{{job}}/resume until the answer's last byte, one client "
                              f"(its own process), sequential, {profile.steps} steps of {profile.state_arrays} "
                              f"arrays; samples: p99 of {runs} consecutive runs of {size}",
                              {"requests": len(latencies), "timeouts": timeouts,
                               "timeout_ms": REQUEST_TIMEOUT_S * 1000,
                               "p50_ms": round(percentile(latencies, 50), 3),
                               "p90_ms": round(percentile(latencies, 90), 3),
                               "p99_all_ms": round(percentile(latencies, 99), 3), "max_ms": round(max(latencies), 3),
                               "client_resume_p50_ms": round(percentile(client_ms, 50), 3),
                               "client_resume_p99_ms": round(percentile(client_ms, 99), 3)}))
        if profile.bursts > 1:
            _burst(url, body, 64)  # warm-up
        makespans: list[float] = []
        all_lat: list[float] = []
        deadline = time.monotonic() + BURST_BUDGET_S
        for i in range(profile.bursts):
            if i >= 2 and time.monotonic() > deadline:
                break
            makespan, lat = _burst(url, body, 64)
            makespans.append(makespan * 1000)
            all_lat.extend(x * 1000 for x in lat)
            print(f"    burst {i + 1}/{profile.bursts}: {makespan * 1000:.1f} ms", flush=True)
            time.sleep(0.2)
        results.figure(Figure("resume_burst64_makespan_ms", makespans, "<=", 250.0, "ms",
                              "64 resume requests sent at once over 64 connections opened beforehand, until the "
                              "last answer",
                              {"answers_missing_at_limit": sum(x >= BURST_LIMIT_S * 1000 for x in all_lat),
                                              "limit_ms": BURST_LIMIT_S * 1000,
                                              "per_request_p50_ms": round(percentile(all_lat, 50), 3),
                                              "per_request_max_ms": round(max(all_lat), 3)}))
        run_load64(profile, results, url, job_dir, body)
    finally:
        stop_process(proc, 15)
    results.progress()  # the figures so far reach results.json before the long rebuilds
    # -- catalog rebuilds, as at every restart of ckptd (the steps are verified and sealed by now) ------
    if profile.rebuilds < 1:
        return
    rebuilds: list[float] = []
    for i in range(profile.rebuilds):
        seconds, states = _rebuild_once(root, state / f"restart{i}" / "catalog.sqlite")
        rebuilds.append(seconds)
        print(f"    catalog rebuild {i + 1}/{profile.rebuilds}: {seconds:.2f}s {states}", flush=True)
    results.figure(Figure("catalog_rebuild_s_10k_steps", rebuilds, "<=", 10.0, "s",
                          f"Catalog.rebuild() of {profile.steps} verified steps ({profile.state_arrays} arrays each), "
                          "as at every ckptd start (fresh catalog database, warm page cache)",
                          {"steps": profile.steps, "first_sight_s": round(ready_s, 3)}))
    rmtree(root)
    rmtree(template_root)


__all__ = ["fabricate", "run_service"]
