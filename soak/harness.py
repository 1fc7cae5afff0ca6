"""What the soak's trials share, for the whole soak, in the one trainer process.

- ``Ckptd``: a real ``ckptd serve`` process (examples/demo.py starts it the way ``make demo`` does) on a fixed
  port, with the host-memory tier; a trial may SIGKILL it mid-recovery and restart it in the background.
- ``Soak``: the root, the shared-memory directory, one ``SimulatedSlices`` (4 slices of 2 CPU devices) with one
  ``InJaxFaults`` active for the whole soak (losses raised from inside JAX operations), the time of every slice
  loss, the runner each trial builds, the references (a run without failures on each mesh a trial uses: its
  state at every step and at the end), and ``sample``: the process's RSS, live arrays, live executables and
  threads between trials.
- ``StateRecord``: the state a run had at each step boundary, read to the host, and every restore checked
  against it: the restored step's values must be ones the run had at that step (never a mixed-step state).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import jax.extend.backend
import numpy as np

from bench.common import stop_process
from examples.demo import free_port, start_ckptd
from examples.elastic_mlp import TrainLog, make_train_fn
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticContext, ElasticResult, ElasticRunner
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.elastic._recovery import give_back_host_memory
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slices import SimulatedSlices

STEPS = 30  # steps of one trial; saves every 10 (persistent) and every 5 (memory tier)
BATCH = 48
SLICES = 4
MESH = (4, 2)  # (replica, data): one replica of the state on each slice
TWO_REPLICAS = (2, 4)  # two replicas, each on two slices: two slices lost, one of each, leave no whole replica
Policy = Literal["pause", "resize"]
Leaves = list[np.ndarray]


class Ckptd:
    """``ckptd serve`` on one port for the whole soak: started, SIGKILLed, restarted in the background."""

    def __init__(self, root: Path, state_dir: Path, shm_dir: Path, log: Path) -> None:
        self.root, self.state_dir, self.shm_dir, self.log = root, state_dir, shm_dir, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Any = None
        self.kills = 0
        self._restart: threading.Thread | None = None
        self._restart_error: BaseException | None = None

    def start(self) -> None:
        self.proc = start_ckptd(self.root, self.state_dir, self.shm_dir, self.port, self.log)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs (its persist worker ends when its stdin closes)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.kills += 1

    def restart_in_background(self) -> None:
        def restart() -> None:
            try:
                self.start()
            except BaseException as exc:  # reported by settle()
                self._restart_error = exc

        self._restart = threading.Thread(target=restart, name="soak-ckptd-restart", daemon=True)
        self._restart.start()

    def settle(self) -> str | None:
        """After a trial: ckptd running and ready again (restarted if it is not). What went wrong, if anything."""
        problem = None
        if self._restart is not None:
            self._restart.join(90)
            if self._restart.is_alive() or self._restart_error is not None:
                problem = f"ckptd restart failed: {self._restart_error or 'still starting after 90 s'}"
            self._restart, self._restart_error = None, None
        if self.proc is None or self.proc.poll() is not None:
            code = getattr(self.proc, "returncode", None)
            problem = problem or f"ckptd was not running after the trial (exit {code})"
            self.start()
        return problem

    def stop(self) -> None:
        if self._restart is not None:
            self._restart.join(90)
        if self.proc is not None:
            stop_process(self.proc, 60)


@dataclass(frozen=True)
class Sample:
    """The trainer process between trials."""

    after_trial: int
    rss_mib: float
    live_arrays: int
    live_executables: int
    threads: int
    rss_anon_mib: float = 0.0  # of the RSS: private memory (the rest: files and shared memory mapped)
    rss_shmem_mib: float = 0.0  # shared memory mapped (memory-tier snapshots still mapped)
    open_files: int = 0
    mappings: int = 0
    rss_untrimmed_mib: float = 0.0  # before the allocator's free pages went back to the OS
    # as the library left the process, before the harness collected garbage, cleared JAX's caches or trimmed the heap
    rss_raw_mib: float = 0.0
    live_arrays_raw: int = 0
    live_executables_raw: int = 0
    arrays_by_kind: str = ""  # the live arrays by shape, dtype and device count (when there are any)
    files_open: str = ""  # what the file descriptors point at
    held_by: str = ""  # when arrays are alive: what references one of them (a chain of referrers)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024.0, 1)
    return float("nan")


def rss_mib() -> float:
    return _status_mib("VmRSS")


def _arrays_by_kind() -> str:
    kinds = Counter(f"{a.dtype}{list(a.shape)}@{len(a.sharding.device_set)}" for a in jax.live_arrays())
    return ", ".join(f"{n} x {k}" for k, n in kinds.most_common(6))


def _held_by(depth: int = 8) -> str:
    """A chain of referrers of one live array (the first one that is not this function's own), for the report."""
    arrays = jax.live_arrays()
    if not arrays:
        return ""
    chain: list[str] = []
    obj: Any = arrays[0]
    here = sys._getframe()
    ignore = {id(arrays), id(here)}
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj) if id(r) not in ignore]
        if not refs:
            break
        obj = refs[0]
        ignore.add(id(obj))
        name = type(obj).__name__
        if isinstance(obj, type(here)):
            name += f"({obj.f_code.co_qualname}:{obj.f_lineno})"
        elif isinstance(obj, dict):
            name += "{" + ",".join(map(str, list(obj)[:4])) + "}"
        elif hasattr(obj, "getMessage"):
            name += f"({obj.name}: {str(obj.msg)[:60]})"
        chain.append(name)
    del arrays
    return " <- ".join(chain)


def _files_open() -> str:
    found: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[re.sub(r"\d+", "N", os.readlink(f"/proc/self/fd/{fd}"))] += 1
        except OSError:
            continue
    return ", ".join(f"{n} x {k}" for k, n in sorted(found.items()))


@dataclass
class StateRecord:
    """The state a run had at each step boundary (every version: an attempt may compute a step again), read to
    the host, and each restore's state checked against it (``restores``: step and verdict). A state is read only
    while no fault is armed: the read is a transfer to the host, and must not be the one a trial's fault meets."""

    injector: InJaxFaults
    reference: dict[int, Leaves] = field(default_factory=dict)  # a run without failures on the same mesh
    steps: dict[int, list[Leaves]] = field(default_factory=dict)
    restores: list[tuple[int, str]] = field(default_factory=list)  # (step, equal | DIFFERS | unread | unrecorded)

    def _read(self, state: Any) -> Leaves | None:
        if self.injector.armed:
            return None
        return [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(state)]

    def boundary(self, step: int, state: Any) -> None:
        leaves = self._read(state)
        if leaves is not None:
            self.steps.setdefault(step, []).append(leaves)

    def restored(self, step: int, state: Any) -> None:
        leaves = self._read(state)
        known = self.steps.get(step, []) + ([self.reference[step]] if step in self.reference else [])
        if leaves is None:
            verdict = "unread"
        elif not known:
            verdict = "unrecorded"
        else:
            verdict = "equal" if any(_same(leaves, had) for had in known) else "DIFFERS"
        self.restores.append((step, verdict))
        if leaves is not None:
            self.steps.setdefault(step, []).append(leaves)

    def wrap(self, train_fn: Callable[[ElasticContext], Any]) -> Callable[[ElasticContext], Any]:
        """``train_fn`` given a context that records each step boundary's state and checks each restore's."""
        record = self

        class Recording:
            def __init__(self, ctx: ElasticContext) -> None:
                self._ctx = ctx

            def __getattr__(self, name: str) -> Any:
                return getattr(self._ctx, name)

            def restore_or_init(self, *args: Any, **kwargs: Any) -> tuple[Any, int, int]:
                fresh = self._ctx.plan is None
                state, step, position = self._ctx.restore_or_init(*args, **kwargs)
                if fresh:
                    record.boundary(step, state)
                else:
                    record.restored(step, state)
                return state, step, position

            def step_boundary(self, step: int, state: Any, data_position: int) -> None:
                if step > self._ctx.start_step:  # the restored state is recorded by restore_or_init
                    record.boundary(step, state)
                self._ctx.step_boundary(step, state, data_position)

        return lambda ctx: train_fn(Recording(ctx))  # type: ignore[arg-type]


def _same(a: Leaves, b: Leaves) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


class Soak:
    """The soak's shared state; a context manager (ckptd and the fault injector run inside it)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.root = workdir / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
        self.shm = Path(tempfile.mkdtemp(prefix="ckptd-soak-", dir=shm_base))
        self.ckptd = Ckptd(self.root, workdir / "ckptd-state", self.shm, workdir / "ckptd.log")
        self.slices = SimulatedSlices(num_slices=SLICES)
        self.injector = InJaxFaults(self.slices)
        self.losses: list[tuple[int, float]] = []  # (slice, time.time()) of every loss
        self.slices.add_loss_listener(lambda k: self.losses.append((k, time.time())))
        self.samples: list[Sample] = []
        self.reference: dict[tuple[int, ...], Leaves] = {}  # per mesh: the final state of a run without failures
        self.trajectory: dict[tuple[int, ...], dict[int, Leaves]] = {}  # per mesh: its state at each step

    def __enter__(self) -> Soak:
        self.ckptd.start()
        self.injector.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.injector.stop()
        self.ckptd.stop()
        shutil.rmtree(self.shm, ignore_errors=True)

    def reset_slices(self) -> None:
        """Every slice healthy, no fault left armed: where each trial starts."""
        self.injector.disarm()
        for k in self.slices.slice_to_devices:
            self.slices.bring_back(k)

    def runner(self, job: str, policy: Policy, *, memory_tier: bool, on_event: Any = None,
               mesh: tuple[int, ...] = MESH) -> ElasticRunner:
        (self.root / job).mkdir(parents=True, exist_ok=True)
        shm = str(self.shm) if memory_tier else None
        config = ElasticConfig(
            job=job, mesh_axes=("replica", "data"), mesh_shape=mesh, global_batch=BATCH, checkpoint_period=10,
            elastic=ElasticOptions(policy=policy, elastic_timeout_s=60),
            health=HealthOptions(poll_interval_s=0.05, scale_up_check_interval_s=0.0, monitor_interval_s=0.2),
            # a replica snapshot of every step, the loop waiting for a copy in flight: each trial knows which step
            # the tier holds (the runner's default paces snapshots from measured costs: on this CPU state, rarely)
            memory_tier=MemoryTierOptions(shm_dir=shm, memory_period=5 if memory_tier else None, max_snapshots=4,
                                          replicas=ReplicaOptions(period=1, when_busy="wait")),
        )
        client = CkptdClient(ClientSettings(url=self.ckptd.url, timeout_s=2.0, resume_deadline_s=3.0, shm_dir=shm,
                                            events_flush_timeout_s=5.0), root=str(self.root))
        return ElasticRunner(config, slices=self.slices, client=client, checkpoint_dir=str(self.root / job),
                             on_event=on_event)

    def train(self, runner: ElasticRunner, log: TrainLog, hook: Any = None,
              record: StateRecord | None = None) -> ElasticResult[Any]:
        train_fn = make_train_fn(STEPS, log, step_hook=hook)
        try:
            return runner.run(record.wrap(train_fn) if record is not None else train_fn)
        finally:
            runner.checkpointer.close()
            runner.client.close()

    def make_reference(self) -> None:
        """A run without failures on each mesh a ``pause`` trial uses: what the trial must end with, bit for bit
        (pause keeps the mesh), and its state at every step (what a restore of that step must give)."""
        for mesh in (MESH, TWO_REPLICAS):
            self.reset_slices()
            record = StateRecord(self.injector)
            name = "reference-" + "x".join(map(str, mesh))
            result = self.train(self.runner(name, "pause", memory_tier=True, mesh=mesh), TrainLog(), record=record)
            self.reference[mesh] = [np.asarray(x) for x in jax.tree_util.tree_leaves(result.value)]
            self.trajectory[mesh] = {step: versions[0] for step, versions in record.steps.items()}

    def sample(self, after_trial: int) -> Sample:
        """The process between trials, twice. First as the library left it (``*_raw``): the runner clears JAX's
        caches and trims the heap after every elastic event (``recovery.py``), not when a run ends, so the last
        attempt's executables and what JAX's caches hold are still there. Then as the runner leaves it after an
        event: garbage collected, JAX's caches cleared (what they hold is bounded by their LRU sizes:
        pathwaysutils' health checks, a pmap of a new bound method each time, leave up to a few hundred one-slice
        arrays in them), the heap's free pages given back to the OS (``rss_untrimmed_mib``: before that)."""
        backend = jax.extend.backend.get_backend()
        raw_rss, raw_arrays, raw_executables = rss_mib(), len(jax.live_arrays()), len(backend.live_executables())
        gc.collect()
        jax.clear_caches()
        gc.collect()
        untrimmed = rss_mib()
        give_back_host_memory()
        found = Sample(after_trial, round(rss_mib(), 1), len(jax.live_arrays()), len(backend.live_executables()),
                       threading.active_count(), rss_anon_mib=_status_mib("RssAnon"),
                       rss_shmem_mib=_status_mib("RssShmem"), open_files=len(os.listdir("/proc/self/fd")),
                       mappings=len(Path("/proc/self/maps").read_text().splitlines()), rss_untrimmed_mib=untrimmed,
                       rss_raw_mib=raw_rss, live_arrays_raw=raw_arrays, live_executables_raw=raw_executables,
                       arrays_by_kind=_arrays_by_kind(), files_open=_files_open(), held_by=_held_by())
        self.samples.append(found)
        return found


__all__ = ["BATCH", "MESH", "SLICES", "STEPS", "TWO_REPLICAS", "Ckptd", "Policy", "Sample", "Soak", "StateRecord",
           "rss_mib"]
