"""The ``load64`` figures: 64 closed-loop clients on latest-good and resume while ``ckptd validate --deep``
runs beside the server, run by the service benchmark (``bench/service.py``) on its server and job.

The clients are processes of their own (``bench/load_client.py``: raw sockets, so the client's CPU is not
what is measured). One run is cut into windows by completion time; each window's answers per second and
p99 are the samples. ``GET /healthz`` by the same clients right after is recorded beside, for reference:
the HTTP framework's ceiling on this machine under the same background work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import Figure, Profile, Results, percentile, stop_process
from bench.load_client import load_many, windows

JOB = "bench-job"  # the service benchmark's job (bench/service.py)
LOAD_CLIENTS = 64
# (seconds of load, windows it is cut into: the samples), by profile; the reference (GET /healthz) runs a
# quarter as long. The quick profile is shorter and over its fewer steps (1,000): said in the keys' notes.
LOAD_RUN = {"full": (60.0, 6), "quick": (20.0, 4), "toy": (3.0, 3)}
LOAD_CLIENT_PROCESSES = 2


class _DeepValidation:
    """``ckptd validate --deep`` of the job, beside the server, for as long as the ``with`` lasts (started
    again whenever it finishes): the load benchmark's background work."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self._stop = False

    def _start(self) -> None:
        self.runs += 1
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptd", "validate", str(self.job_dir), "--deep"],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> _DeepValidation:
        self._start()

        def keep() -> None:
            while not self._stop:
                if self.proc is not None and self.proc.poll() is not None:
                    self._start()
                time.sleep(0.5)

        self._thread = threading.Thread(target=keep, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        if self.proc is not None:
            stop_process(self.proc, 5)


def run_load64(profile: Profile, results: Results, url: str, job_dir: Path, body: bytes) -> None:
    """64 closed-loop clients (two client processes) on latest-good and resume while a deep validation of
    the job runs beside the server; then GET /healthz the same way, the framework's ceiling here."""
    seconds, parts = LOAD_RUN[profile.name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    with _DeepValidation(job_dir) as validation:
        time.sleep(1.0)  # the validation under way (its imports done) before the clients start
        load = load_many(url, JOB, seconds, LOAD_CLIENTS, body, processes=LOAD_CLIENT_PROCESSES, env=env)
        trivial = load_many(url, JOB, max(2.0, seconds / 4), LOAD_CLIENTS, b"", processes=LOAD_CLIENT_PROCESSES,
                            mode="healthz", env=env)
    if load["error_count"]:
        raise RuntimeError(f"load64: {load['error_count']} errors: {load['errors'][:5]}")
    cut = [(rps, lat) for rps, lat in windows(load, parts) if lat]
    latencies = load["latencies_ms"]
    scope = (f"{LOAD_CLIENTS} closed-loop clients (keep-alive connections from {LOAD_CLIENT_PROCESSES} client "
             f"processes) alternating GET latest-good and POST resume for {seconds:g} s over {profile.steps} "
             f"steps of {profile.state_arrays} arrays, `ckptd validate --deep` of the job running beside"
             + ("" if profile.name == "full" else f" (the {profile.name} profile: fewer steps, a shorter run)"))
    details = {"requests": load["requests"], "seconds": round(load["elapsed_s"], 2), "rps_all": round(load["rps"], 1),
               "p50_ms": round(percentile(latencies, 50), 3), "p99_all_ms": round(percentile(latencies, 99), 3),
               "max_ms": round(max(latencies), 3), "deep_validations_started": validation.runs,
               "healthz_rps_same_run": round(trivial["rps"], 1),
               "healthz_p99_ms": round(percentile(trivial["latencies_ms"], 99), 3) if trivial["latencies_ms"] else None}
    results.measure("service.load64_healthz_rps", [rps for rps, _ in windows(trivial, 2)], "req/s",
                    f"GET /healthz by the same {LOAD_CLIENTS} clients right after, validation still beside: "
                    "the framework's ceiling on this machine, for reference")
    results.figure(Figure("load64_rps", [rps for rps, _ in cut], ">=", 1000.0, "req/s",
                          f"answers per second: {scope}; samples: {parts} windows of the run", details))
    results.figure(Figure("load64_p99_ms", [percentile(lat, 99) for _, lat in cut], "<=", 100.0, "ms",
                          f"p99 latency, request sent to answer's last byte: {scope}; samples: p99 of each of "
                          f"{parts} windows", details))


__all__ = ["run_load64"]
