"""A multi-process JAX job on CPU for tests: N real processes joined by ``jax.distributed`` on 127.0.0.1, 4 CPU
devices each (one global mesh of 4 N), gloo collectives. A test hands ``run_job`` a script that starts with
``PREAMBLE`` (which gives it ``port``, ``index``, ``shm`` — the process's own shared-memory directory —
``root`` and ``mesh``); each process's last stdout line comes back. Workers that outstay the timeout are
SIGKILLed: a jax.distributed process takes SIGTERM as a preemption notice, not an end (docs/multihost.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, clean_env, free_port

PREAMBLE = """
import json, sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, index, shm, root = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(sys.argv[5]),
                           process_id=index, initialization_timeout=60, heartbeat_timeout_seconds=10)
mesh = Mesh(np.array(jax.devices()).reshape(len(jax.devices())), ("data",))
"""


def run_job(script: str, base: Path, *extra: str, processes: int = 2, timeout_s: float = 120) -> list[str]:
    """Run ``script`` as every process of one job (process k's shared memory: ``base/shm<k>``, the storage
    root: ``base/root``; ``extra``: more arguments, from ``sys.argv[6]``); each process's last stdout line."""
    port = str(free_port())
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [subprocess.Popen([sys.executable, "-c", script, port, str(k), str(base / f"shm{k}"), str(base / "root"),
                               str(processes), *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(processes)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, stderr[-3000:]
            out.append((stdout.strip().splitlines() or [""])[-1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return out


__all__ = ["PREAMBLE", "run_job"]
