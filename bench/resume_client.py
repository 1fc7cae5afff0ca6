"""The sequential resume client of the service benchmark, run as its own lean process (no jax).

``python -m bench.resume_client URL JOB REQUESTS`` (the request body on stdin) sends ``REQUESTS`` resume
requests one after another over one keep-alive httpx connection, then the same number through
trainer_client's own ``CkptdClient.resume`` (request built, answer parsed into a ``ResumePlan``), and
prints one JSON object: the latencies of both, in ms.

Why a process of its own: the benchmark's parent holds jax, a state of 1,000 arrays and the results;
each answer it parsed there (~100 KB of JSON, thousands of objects) drove Python's cyclic garbage
collector through that whole heap every few dozen requests, ~100 ms each, and those pauses were the
"server's" p99. A trainer asks once per failure, from a process of its own, as this client does.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p

REQUEST_TIMEOUT_S = 120.0  # an answer slower than this counts as this (a lower bound) and is reported
BUDGET_S = 300.0  # each series stops after this (but not before 20 requests) when answers are slow
WARMUP = 5


def _series(ask: Callable[[], object], requests: int) -> tuple[list[float], int]:
    """``ask()`` ``WARMUP`` times, then timed ``requests`` times one after another; (latencies in ms, timeouts).
    A timed-out request counts as the time waited (a lower bound); three end the series."""
    for _ in range(WARMUP):
        ask()
    latencies: list[float] = []
    timeouts = 0
    deadline = time.monotonic() + BUDGET_S
    for n in range(requests):
        if n >= 20 and time.monotonic() > deadline:
            break
        started = time.perf_counter()
        try:
            ask()
        except httpx.TimeoutException:
            timeouts += 1
            if timeouts >= 3:
                break
        finally:
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies, timeouts


def answered(url: str, job: str, body: bytes, requests: int) -> tuple[list[float], int, int]:
    """Latencies (ms) from sending each request to the last byte of its answer; (latencies, timeouts, bytes)."""
    route = p.ROUTE_RESUME.format(job=job)
    size = [0]
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:

        def ask() -> None:
            r = client.post(route, content=body, headers={"content-type": "application/json"})
            if r.status_code != 200:
                raise RuntimeError(f"resume answered {r.status_code}: {r.text[:500]}")
            size[0] = len(r.content)

        latencies, timeouts = _series(ask, requests)
    return latencies, timeouts, size[0]


def through_client(url: str, job: str, body: bytes, requests: int) -> tuple[list[float], dict[str, Any]]:
    """Latencies (ms) of trainer_client's ``CkptdClient.resume``: serialise, ask, parse into a ResumePlan."""
    request = p.ResumeRequest.model_validate_json(body)
    with CkptdClient(ClientSettings(url=url, timeout_s=REQUEST_TIMEOUT_S)) as client:
        latencies, _ = _series(lambda: client.resume(job, request), requests)
        plan = client.resume(job, request)
    return latencies, {"step": plan.step, "mesh": plan.mesh.model_dump(), "arrays": len(plan.arrays)}


def main(argv: list[str]) -> int:
    url, job, requests = argv[0], argv[1], int(argv[2])
    body = sys.stdin.buffer.read()
    latencies, timeouts, size = answered(url, job, body, requests)
    client_latencies, plan = through_client(url, job, body, requests)
    json.dump({"answered_ms": latencies, "timeouts": timeouts, "answer_bytes": size,
               "client_resume_ms": client_latencies, "plan": plan}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
