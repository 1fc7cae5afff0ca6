"""Load: 64 concurrent clients on list / latest-good / resume against a job of many catalogued steps, while a
deep validation and a GC run beside the server; no errors, latencies reported, ``/healthz`` stays fast.

The steps are fabricated cheaply but are real: one step written by plain Orbax is the template; every other
step hard-links its array files and gets its own ``_CHECKPOINT_METADATA`` (ckptd training metadata for that
step), commit marker and sealed manifest, so the catalog verifies each one exactly as it would a step
written by trainer_client. The root lives on tmpfs when there is one: the fsyncs ckptd does before it
first calls a step good would otherwise dominate the cold start (reported, not the subject here).

The server is ``ckptd serve`` in its own process; the 64 clients are keep-alive connections from two client
processes of their own (``bench/load_client.py``: with httpx in this process, the clients were the
bottleneck measured), each cycling a page of the list, latest-good and resume. Short form in CI (1,000
steps, 5 s), long form under ``make chaos`` (10,000 steps, 60 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.load_client import load_many
from tests.support.chaos_support import CkptdProcess, percentile, sized
from tests.support.helpers import clean_env
from tests.support.orbax_steps import training_metadata, write_orbax_steps
from trainer_client.core._storage import Storage
from trainer_client.core.format._manifest import Manifest, build_manifest, file_entry, write_manifest
from trainer_client.core.protocol import TrainingMetadata

pytestmark = pytest.mark.integration

JOB = "big"
CLIENTS = 64
LIVENESS_TIMEOUT_S = 3.0
ARRAYS: dict[str, dict[str, Any]] = {
    "params.w": {"shape": [4, 8], "dtype": "float32", "partition_spec": [None, "data"]},
    "step": {"shape": [], "dtype": "int32", "partition_spec": []},
}


@pytest.fixture
def fast_root() -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm) when there is one, else under the system temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="ckptd-load-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fabricate_steps(root: Path, job: str, count: int, template_dir: Path) -> None:
    """``count`` verified-to-be steps 1..count of ``job``, cloned from the Orbax step in ``template_dir``."""
    storage = Storage(str(root))
    files = build_manifest(storage, str(template_dir), step=1, writer="trainer_client").files
    meta0 = json.loads((template_dir / "_CHECKPOINT_METADATA").read_text())
    item_files = [
        p.relative_to(template_dir)
        for p in template_dir.rglob("*")
        if p.is_file() and p.relative_to(template_dir).parts[0] == "default"
    ]
    subdirs = sorted({p.parent for p in item_files})
    for step in range(1, count + 1):
        d = root / job / str(step)
        for sub in subdirs:
            (d / sub).mkdir(parents=True, exist_ok=True)
        for rel in item_files:
            os.link(template_dir / rel, d / rel)
        meta = json.loads(json.dumps(meta0))
        custom = meta["custom_metadata"]["ckptd"]
        custom.update(step=step, data_position=step * custom["global_batch"], wall_time=1.7e9 + step)
        (d / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
        (d / "commit_success.txt").write_text(f"Checkpoint commit was successful to {d}")
        training = TrainingMetadata.model_validate(custom)
        now = time.time()
        manifest = Manifest(
            step=step,
            writer="trainer_client",
            created_at=now,
            files=files,
            arrays=training.arrays,
            training=training,
            sealed_at=now,
            sealed={n: file_entry(storage, str(d / n)) for n in ("_CHECKPOINT_METADATA", "commit_success.txt")},
        )
        write_manifest(storage, str(d), manifest)


class HealthProbe:
    """``GET /healthz`` every 50 ms on its own connection; every latency kept (a failure counts as inf)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=20.0) as http:
            while not self._stop.wait(0.05):
                started = time.perf_counter()
                try:
                    ok = http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - started if ok else float("inf"))


@pytest.mark.timeout(3600)
@sized({"steps": 1_000, "seconds": 5.0}, {"steps": 10_000, "seconds": 60.0})
def test_concurrent_clients_during_deep_validation_and_gc(
    fast_root: Path, tmp_path: Path, size: dict[str, Any]
) -> None:
    steps, seconds = size["steps"], size["seconds"]
    root = fast_root / "root"
    template = fast_root / "template"
    t0 = time.monotonic()
    write_orbax_steps(template, [1], custom_metadata={1: training_metadata(1, arrays=ARRAYS)})
    fabricate_steps(root, JOB, steps, template / "1")
    fabricated_s = time.monotonic() - t0

    ckptd = CkptdProcess(root, tmp_path / "state", log_path=tmp_path / "ckptd.log", refresh_interval_s=2.0)
    ckptd.start()
    try:
        cold_start_s = ckptd.wait_ready(timeout=1200)
        good = httpx.get(f"{ckptd.url}/v1/jobs/{JOB}/checkpoints/latest-good", timeout=30).json()
        assert good["step"] == steps, good
        listed = httpx.get(f"{ckptd.url}/v1/jobs/{JOB}/checkpoints", timeout=60)  # the whole list, as before
        assert [c["state"] for c in listed.json()["checkpoints"]] == ["verified"] * steps
        list_bytes = len(listed.content)
        page = httpx.get(f"{ckptd.url}/v1/jobs/{JOB}/checkpoints", params={"limit": 100}, timeout=60)
        assert [c["step"] for c in page.json()["checkpoints"]] == list(range(steps, steps - 100, -1))
        page_bytes = len(page.content)

        env = clean_env()
        logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("validate", "gc")}
        validate = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "validate", f"{root}/{JOB}", "--deep"],
            env=env,
            stdout=logs["validate"],
            stderr=subprocess.STDOUT,
        )
        gc: list[subprocess.Popen[bytes]] = []

        def start_gc() -> None:  # half-way through: delete the oldest tenth while the clients go on
            time.sleep(seconds / 2)
            gc.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ckptd", "gc", f"{root}/{JOB}", "--keep-last", str(steps - steps // 10)],
                    env=env,
                    stdout=logs["gc"],
                    stderr=subprocess.STDOUT,
                )
            )

        gc_starter = threading.Thread(target=start_gc, daemon=True)
        with HealthProbe(ckptd.url) as probe:
            gc_starter.start()
            load = load_many(ckptd.url, JOB, seconds, CLIENTS, b'{"alive_devices": 6, "policy": "resize"}',
                             mode="all", env=env)
            requests, elapsed, errors, results = load["requests"], load["elapsed_s"], load["errors"], load["by_op"]
        gc_starter.join()
        validate_still_running = validate.poll() is None
        if validate_still_running:
            validate.kill()
        validate.wait(timeout=30)
        gc_rc = gc[0].wait(timeout=600)
        for f in logs.values():
            f.close()
    finally:
        ckptd.stop()

    lines = [
        f"[load] {steps} steps (fabricated in {fabricated_s:.1f}s, cold start to ready {cold_start_s:.1f}s, "
        f"list body {list_bytes / 1e6:.1f} MB, a page of 100 {page_bytes / 1e3:.0f} KB); {CLIENTS} clients for "
        f"{elapsed:.1f}s: {requests} requests "
        f"({requests / elapsed:.0f}/s), {load['error_count']} errors; deep validation "
        f"{'still running (killed)' if validate_still_running else 'finished'}, gc exit {gc_rc}"
    ]
    for name, values in sorted(results.items()):
        lines.append(
            f"[load]   {name:<12} n={len(values):>6} p50={percentile(values, 50):8.1f}ms "
            f"p99={percentile(values, 99):8.1f}ms max={max(values):8.1f}ms"
        )
    health = probe.latencies
    lines.append(
        f"[load]   {'healthz':<12} n={len(health):>6} p50={percentile(health, 50) * 1e3:8.1f}ms "
        f"p99={percentile(health, 99) * 1e3:8.1f}ms max={max(health) * 1e3:8.1f}ms"
    )
    print("\n".join(lines))
    assert not load["error_count"], errors[:10]
    assert gc_rc == 0, (tmp_path / "gc.log").read_text()[-2000:]
    assert all(results[name] for name in ("list", "latest-good", "resume"))
    # Responsive: every probe answered, within the liveness probe's timeout of deploy/k8s/jobset.yaml (3 s).
    assert len(health) >= 5 and max(health) < LIVENESS_TIMEOUT_S, "the server stopped answering /healthz promptly"
