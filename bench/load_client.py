"""Closed-loop load on a ckptd server from processes of their own: the ``load64`` benchmark's clients.

``python -m bench.load_client URL JOB SECONDS CONNECTIONS [MODE]`` (the resume request's body on stdin)
opens ``CONNECTIONS`` keep-alive connections and on each one sends a request, waits for its whole answer,
and sends the next, for ``SECONDS`` (a closed loop: each connection is one client). ``MODE`` ``mixed``
(the default) alternates ``GET .../checkpoints/latest-good`` and ``POST .../resume``; ``all`` adds a page
of the list (``GET .../checkpoints?limit=100``, the load test's mix); ``healthz`` asks
``GET /healthz`` only (the framework's ceiling on this machine, for reference). It prints one JSON object:
requests answered, errors, the time, and every answer's latency in ms (also by request) and the wall-clock
time it completed.

Why raw sockets on asyncio, not httpx: the clients share the machine's two cores with the server, and
httpx spends more CPU per request than ckptd's answer does, so the client would be the bottleneck being
measured. The requests are built once; an answer is read by its ``Content-Length`` only. ``load_many``
runs several of these processes at once (each its own interpreter) and merges what they print.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from typing import Any

_HEAD_END = b"\r\n\r\n"


def requests_for(host: str, job: str, body: bytes, mode: str) -> list[tuple[str, bytes]]:
    """The raw requests one connection cycles through, each with its name."""
    host_line = f"Host: {host}\r\n"
    if mode == "healthz":
        return [("healthz", f"GET /healthz HTTP/1.1\r\n{host_line}\r\n".encode())]
    latest = f"GET /v1/jobs/{job}/checkpoints/latest-good HTTP/1.1\r\n{host_line}\r\n".encode()
    resume = (f"POST /v1/jobs/{job}/resume HTTP/1.1\r\n{host_line}Content-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    ops = [("latest-good", latest), ("resume", resume)]
    if mode == "all":  # the load test's mix: a page of the list too
        ops.insert(0, ("list", f"GET /v1/jobs/{job}/checkpoints?limit=100 HTTP/1.1\r\n{host_line}\r\n".encode()))
    return ops


async def _read_answer(reader: asyncio.StreamReader) -> int:
    """Read one whole answer; its status."""
    head = await reader.readuntil(_HEAD_END)
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
            break
    if length:
        await reader.readexactly(length)
    return status


async def _client(host: str, port: int, requests: list[tuple[str, bytes]], offset: int, deadline: float,
                  latencies: list[float], done: list[float], ops: list[int], errors: list[str]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    n = offset
    try:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            op = n % len(requests)
            writer.write(requests[op][1])
            try:
                status = await _read_answer(reader)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            if status not in (200, 304):
                errors.append(f"{requests[op][0]}: status {status}")
            else:
                latencies.append((time.perf_counter() - started) * 1000)
                done.append(time.time())
                ops.append(op)
            n += 1
    finally:
        writer.close()


async def run(url: str, job: str, seconds: float, connections: int, body: bytes, mode: str) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    requests = requests_for(f"{host}:{port}", job, body, mode)
    latencies: list[float] = []
    done: list[float] = []
    ops: list[int] = []
    errors: list[str] = []
    started = time.monotonic()
    deadline = started + seconds
    await asyncio.gather(*(_client(host, int(port), requests, k, deadline, latencies, done, ops, errors)
                           for k in range(connections)))
    by_op: dict[str, list[float]] = {name: [] for name, _ in requests}
    for op, ms in zip(ops, latencies, strict=True):
        by_op[requests[op][0]].append(round(ms, 3))
    return {"requests": len(latencies), "errors": errors[:20], "error_count": len(errors),
            "elapsed_s": time.monotonic() - started, "latencies_ms": [round(x, 3) for x in latencies],
            "done_at": [round(x, 4) for x in done], "by_op": by_op}


def load_many(url: str, job: str, seconds: float, connections: int, body: bytes, *, processes: int = 2,
              mode: str = "mixed", env: dict[str, str] | None = None) -> dict[str, Any]:
    """``connections`` clients spread over ``processes`` client processes started together; merged results
    (``rps``: answers per second from the first answer to the last; ``windows``: see ``windows``)."""
    per = [connections // processes + (1 if k < connections % processes else 0) for k in range(processes)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.load_client", url, job, str(seconds), str(n), mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for n in per if n]
    # Each process reads the body before it starts: feed them all at once (one after another, the second
    # would only start once the first had finished).
    outputs: list[tuple[bytes, bytes]] = [(b"", b"")] * len(procs)

    def feed(k: int) -> None:
        outputs[k] = procs[k].communicate(body, timeout=seconds + 300)

    feeders = [threading.Thread(target=feed, args=(k,), daemon=True) for k in range(len(procs))]
    for feeder in feeders:
        feeder.start()
    for feeder in feeders:
        feeder.join()
    merged: dict[str, Any] = {"requests": 0, "errors": [], "error_count": 0, "elapsed_s": 0.0, "latencies_ms": [],
                              "done_at": [], "by_op": {}}
    for proc, (out, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a load client failed: {err.decode()[-2000:]}")
        part = json.loads(out)
        merged["requests"] += part["requests"]
        merged["errors"].extend(part["errors"])
        merged["error_count"] += part["error_count"]
        merged["elapsed_s"] = max(merged["elapsed_s"], part["elapsed_s"])
        merged["latencies_ms"].extend(part["latencies_ms"])
        merged["done_at"].extend(part["done_at"])
        for name, values in part["by_op"].items():
            merged["by_op"].setdefault(name, []).extend(values)
    done = merged["done_at"]
    span = max(done) - min(done) if done else 0.0  # first to last answer over all processes
    merged["rps"] = merged["requests"] / span if span else 0.0
    return merged


def windows(result: dict[str, Any], count: int) -> list[tuple[float, list[float]]]:
    """The run cut into ``count`` equal windows by completion time: (answers per second, latencies in ms) of
    each: the samples (and their spread) of one run."""
    done, latencies = result["done_at"], result["latencies_ms"]
    if not done:
        return []
    first, last = min(done), max(done)
    width = (last - first) / count or 1.0
    parts: list[list[float]] = [[] for _ in range(count)]
    for at, ms in zip(done, latencies, strict=True):
        parts[min(count - 1, int((at - first) / width))].append(ms)
    return [(len(part) / width, part) for part in parts]


def main(argv: list[str]) -> int:
    url, job, seconds, connections = argv[0], argv[1], float(argv[2]), int(argv[3])
    mode = argv[4] if len(argv) > 4 else "mixed"
    body = sys.stdin.buffer.read()
    work = run(url, job, seconds, connections, body, mode)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(work)
    else:
        result = uvloop.run(work)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
