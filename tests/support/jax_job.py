"""A multi-process JAX job on CPU for tests: N real processes joined by ``jax.distributed`` on 127.0.0.1, 4 CPU
devices each (one global mesh of 4 N), gloo collectives. A test hands ``run_job`` a script that starts with
``PREAMBLE`` (which gives it ``port``, ``index``, ``shm`` — the process's own shared-memory directory —
``root`` and ``mesh``); each process's last stdout line comes back. Workers that outstay the timeout are
SIGKILLed: a jax.distributed process takes SIGTERM as a preemption notice, not an end (docs/multihost.md).

``TrainerJob``: the whole of a multi-host job as deployed — a ``ckptd serve`` per host (its own shared-memory
directory and state, one storage root, the leader lease on) and, per incarnation, a trainer process per host
(examples/multihost_trainer.py, the demo's trainer) that announces the phases of its saves (``PHASE`` lines:
the copy into shared memory, a save through Orbax), so that a test can SIGKILL one at a chosen point of a
persist and restart them all as JobSet would."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.multihost_demo import Trainer as DemoTrainer
from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import REPO, clean_env, free_port
from tests.support.sockets import no_tcp_reason

FOUR_DEVICES = "--xla_force_host_platform_device_count=4"
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
    if (reason := no_tcp_reason()) is not None:  # jax.distributed's coordinator listens on TCP
        pytest.skip(reason)
    port = str(free_port())
    env = clean_env(XLA_FLAGS=FOUR_DEVICES)
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


# The demo's trainer, its saves announced: ``PHASE memory-write <step>`` as its snapshot's copy into shared memory
# starts (the copy is widened by ``pause`` seconds either side, the only change to what it does, so that a kill
# can land inside it), ``PHASE orbax-save <step>`` as a save through Orbax directly starts (Orbax writes it in the
# background). argv: pause, then the trainer's own arguments.
TRAINER = """
import sys, time
from trainer_client.runtime.saving import _checkpointing as checkpointing
from trainer_client.runtime.memory import _memory_tier as memory_tier
pause = float(sys.argv[1])
write = memory_tier.MemoryTier._write
save = checkpointing.Checkpointer.save_with_metadata


def say(what, step):
    print(f"PHASE {what} {step}", flush=True)


def slow_write(tmp, plan, **kwargs):
    say("memory-write", tmp.name.split(".")[0])
    time.sleep(pause)
    out = write(tmp, plan, **kwargs)
    time.sleep(pause)
    return out


def announced_save(self, step, *args, **kwargs):
    say("orbax-save", step)
    return save(self, step, *args, **kwargs)


memory_tier.MemoryTier._write = staticmethod(slow_write)
checkpointing.Checkpointer.save_with_metadata = announced_save
from examples.multihost_trainer import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class Trainer(DemoTrainer):
    """One trainer process of one incarnation (the demo's record of one), with the phases of its saves."""

    phases: list[tuple[str, int]] = field(default_factory=list)

    def follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PHASE "):
                what, step = line.split()[1:3]
                self.phases.append((what, int(step)))
            elif line.startswith("EVENT "):
                self.events.append(json.loads(line[6:]))

    def report(self) -> dict[str, Any]:
        """What the trainer wrote at its end (examples/multihost_trainer.py, ``--result``)."""
        answer: dict[str, Any] = json.loads(self.result.read_text())
        return answer


def served_step(url: str, job: str) -> int | None:
    """The step a ckptd serves as the job's latest good one (None: none, or it does not answer)."""
    try:
        answer = httpx.get(f"{url}/v1/jobs/{job}/checkpoints/latest-good", timeout=5)
    except httpx.HTTPError:
        return None
    step = answer.json().get("step") if answer.status_code == 200 else None
    return int(step) if step is not None else None


@dataclass
class TrainerJob:
    """``hosts`` hosts over ``base``: host k's ckptd (``base/state<k>``, shared memory ``base/shm<k>``), one root
    ``base/root`` (or ``storage_url``, e.g. a ``gs://`` prefix on the GCS emulator, with ``env`` for every
    process); ``launch`` starts an incarnation's trainers (the demo's MLP, a persistent save every
    ``checkpoint_period`` steps, a memory-only one every ``memory_period``; without ``memory_tier`` every
    persistent save goes through Orbax directly). With 3 hosts (12 devices) the mesh is 3 replicas of 4."""

    base: Path
    hosts: int
    job: str
    steps: int = 40
    checkpoint_period: int = 15
    memory_period: int = 5
    memory_tier: bool = True
    pause_s: float = 0.0
    heartbeat_s: int = 5
    step_time_s: float = 0.0  # extra time per step (paces the job, so that a kill lands mid-run)
    sidecar_env: dict[str, str] = field(default_factory=dict)  # more ckptd settings
    storage_url: str | None = None  # the root on another storage (gs://...: the GCS emulator); else base/root
    env: dict[str, str] = field(default_factory=dict)  # for every process (sidecars, trainers): e.g. the emulator's
    sidecars: list[CkptdProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = self.base / "root"
        self.url = self.storage_url or str(self.root)  # the storage root, as every process is given it
        if self.storage_url is None:
            (self.root / self.job).mkdir(parents=True, exist_ok=True)
        self.shms = [self.base / f"shm{k}" for k in range(self.hosts)]
        self.sidecars = [CkptdProcess(self.url, self.base / f"state{k}", log_path=self.base / f"ckptd{k}.log", env={
            "CKPTD_SHM_DIR": str(self.shms[k]), "CKPTD_LEASE_TTL_S": "3", "CKPTD_MAX_SNAPSHOTS": "8",
            "CKPTD_PERSIST_DEVICES": str(4 * self.hosts), "CKPTD_LOG_LEVEL": "info", **self.env, **self.sidecar_env})
            for k in range(self.hosts)]

    def start(self) -> None:
        for shm in self.shms:
            shm.mkdir(mode=0o700, exist_ok=True)
        for sidecar in self.sidecars:
            sidecar.start()
        for sidecar in self.sidecars:
            sidecar.wait_ready(timeout=60)

    def launch(self, incarnation: int) -> list[Trainer]:
        """Every host's trainer, one job (a fresh coordinator port: a new incarnation, as a JobSet restart)."""
        coordinator = f"127.0.0.1:{free_port()}"
        replicas = 1 if 128 % (4 * self.hosts) == 0 else self.hosts  # the MLP's hidden size over the data axis
        trainers = []
        for k in range(self.hosts):
            result = self.base / f"trainer-{k}-run{incarnation}.json"
            cmd = [sys.executable, "-c", TRAINER, str(self.pause_s), "--index", str(k), "--count", str(self.hosts),
                   "--coordinator", coordinator, "--url", self.sidecars[k].url, "--shm", str(self.shms[k]),
                   "--root", self.url, "--job", self.job, "--steps", str(self.steps),
                   "--checkpoint-period", str(self.checkpoint_period), "--memory-period", str(self.memory_period),
                   "--heartbeat-s", str(self.heartbeat_s), "--step-time-s", str(self.step_time_s),
                   "--cache", str(self.base / "jax-cache"), "--result", str(result), "--replicas", str(replicas),
                   *([] if self.memory_tier else ["--no-memory-tier"])]
            with (self.base / f"trainer-{k}-run{incarnation}.log").open("w") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(XLA_FLAGS=FOUR_DEVICES, **self.env),
                                        stdout=subprocess.PIPE, stderr=log, text=True)
            trainer = Trainer(proc, k, result)
            threading.Thread(target=trainer.follow, daemon=True).start()
            trainers.append(trainer)
        return trainers

    def served(self) -> list[int | None]:
        return [served_step(sidecar.url, self.job) for sidecar in self.sidecars]

    def log(self, name: str) -> str:
        path = self.base / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    @staticmethod
    def kill(trainers: list[Trainer]) -> None:
        """SIGKILL whichever of ``trainers`` still run (a jax.distributed process takes SIGTERM as a preemption
        notice, not an end)."""
        for trainer in trainers:
            trainer.proc.kill()
            trainer.proc.wait()

    def stop(self, trainers: list[Trainer] | None = None) -> None:
        """``trainers`` killed, then every sidecar stopped."""
        self.kill(trainers or [])
        for sidecar in self.sidecars:
            sidecar.stop()


def wait_exit(trainers: list[Trainer], timeout_s: float) -> list[int | None]:
    """Each trainer's exit code once all ended, None for one still running ``timeout_s`` later."""
    deadline = time.monotonic() + timeout_s
    for trainer in trainers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            trainer.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [trainer.proc.poll() for trainer in trainers]


__all__ = ["PREAMBLE", "TRAINER", "Trainer", "TrainerJob", "run_job", "served_step", "wait_exit"]
