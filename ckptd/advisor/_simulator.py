"""A discrete-event simulator of a long training run on many slices: where does the wall time go?

Why it exists: the checkpoint period and the recovery policy (wait for the lost slice, continue on fewer
slices, or swap in a hot spare) trade save stalls against lost work, and idle chips against degraded
running. Closed forms (Young/Daly) cover only part of that; the advisor (``ckptd.advisor._advisor``) sweeps this
simulator to confirm them and to compare policies. It never imports jax.

The model, kept simple on purpose (times in seconds; *work* is training progress in seconds of
full-speed training, so ``steps = work / step_time``):

- The job has ``slices`` slices. Every slice that belongs to the job and is healthy fails independently
  (Poisson: ``PoissonFailures``), or failures are replayed at given times (``TraceFailures``; both in
  ``ckptd.advisor._failures``). A failed
  slice is repaired (or replaced) ``replace_time`` after it failed. Idle hot spares do not fail.
- Saves happen at fixed work levels: a memory snapshot every ``memory_period`` of work (training stalls
  ``save_stall``), every ``j``-th of them also persisted (``persistent_period = j x memory_period``). A
  persist runs in the background for ``persist_time`` and stalls training only by ``persist_overhead``
  (interference) -- and by the wait when the previous persist is still running (Orbax waits too). Without
  a memory tier every save is a persistent one (stall ``save_stall``, usable ``persist_time`` later).
- A failure loses the work since the newest usable checkpoint: the newest memory snapshot when the host
  memory holding it survives (probability ``1 - host_loss_fraction``), else the newest persistent
  checkpoint whose persist has finished. A save cut by the failure does not count; a failure also
  aborts an unfinished persist.
- Recovery, in order: ``detect_time``; then the wait (``pause``: until every slice is back;
  ``spare``: ``spare_switch_time`` when a spare is free, else as pause; ``resize``: only while fewer
  than ``min_slices`` are healthy); then the restore (``memory_restore_time`` or ``restore_time``); then
  the recompile (``recovery_time`` on the same mesh, ``resize_recovery_time`` on a new one). A failure
  during recovery starts it again from detection, unless the horizon has passed (a recovery that failures
  keep interrupting ends the run there instead of never).
- ``resize`` runs on the healthy slices at ``active / slices x degraded_efficiency`` of full throughput;
  when a repaired slice returns it regrows, paying ``scale_up_time`` after a save of the current state
  (nothing lost). A repaired slice becomes a hot spare again in ``spare``.
- Goodput = work kept at the end / wall time. The badput causes add up with it to the wall time: save
  stalls (``checkpoint``), ``detection``, ``waiting`` for slices, ``restore``, ``recompile``, ``lost``
  work redone, ``degraded`` throughput and ``scale_up``.

Between two events (failure, slice return) the run is deterministic, so it is advanced in closed form:
the cost is per failure, not per step or per save (54 days on 16,384 chips take milliseconds). A
``WorkBudget`` (``ckptd.advisor._budget``) is charged every failure: it bounds the work and the wall time.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ckptd.advisor._budget import WorkBudget
from ckptd.advisor._failures import FailureSource
from ckptd.advisor._sim_model import CAUSES, POLICIES, JobModel, Policy, Schedule, SimResult

_EPS = 1e-9


class _Run:
    """One simulated run; ``simulate`` is the entry point."""

    def __init__(self, job: JobModel, policy: Policy, schedule: Schedule, failures: FailureSource,
                 horizon: float, seed: int, budget: WorkBudget) -> None:
        self.job, self.policy, self.failures, self.horizon = job, policy, failures, horizon
        self.budget = budget
        self.limit = None if budget.per_run is None else 2 * budget.per_run  # failures this run may simulate
        self.charged = 0
        self.memory_tier = schedule.memory_period is not None
        self.tm, self.j = schedule.base, schedule.multiple
        self._rng = np.random.default_rng(seed + 1_000_003)
        self._uniforms: list[float] = []
        self.t = 0.0
        self.work = 0.0  # training position, in work seconds
        self.last_mem = 0.0  # newest usable memory snapshot (work level)
        self.last_per = 0.0  # newest finished persistent checkpoint (work level)
        self.from_memory = True  # the restore point is in host memory (False once a host took it along)
        self.missing = 0  # job positions without a healthy slice
        self.mesh = job.slices  # slices the compiled program runs on
        self.spares_free = job.spares if policy == "spare" else 0
        self.repairs: list[float] = []  # heap: when each failed slice is back
        self.result = SimResult(policy, 0.0, 0.0, dict.fromkeys(CAUSES, 0.0))

    @property
    def exposed(self) -> int:
        return self.job.slices - self.missing

    def _uniform(self) -> float:
        if not self._uniforms:
            self._uniforms = self._rng.random(4096).tolist()
        return self._uniforms.pop()

    # ---- failures and repairs ----------------------------------------------------------------

    def _collect_repairs(self) -> None:
        while self.repairs and self.repairs[0] <= self.t + _EPS:
            heapq.heappop(self.repairs)
            if self.policy == "spare" and self.missing == 0:
                self.spares_free += 1  # the repaired slice waits as a hot spare
            else:
                self.missing -= 1

    def _fail(self, running: bool) -> None:
        """A failure at ``self.t``: a slice goes for repair and work falls back to the restore point."""
        self.budget.charge()
        self.charged += 1
        if self.limit is not None and self.charged >= self.limit and self.horizon > self.t:
            self.horizon = self.t  # twice its share of the budget: the run ends here (recoveries never finishing)
            self.budget.cut_short += 1
        self.failures.consume()
        if self.exposed <= 0:
            return  # a replayed failure with no slice left to hit
        self._collect_repairs()
        self.result.failures += 1
        self.missing += 1
        heapq.heappush(self.repairs, self.t + self.job.replace_time)
        host_lost = self._uniform() < self.job.host_loss_fraction
        if host_lost:
            self.last_mem = self.last_per
        self.from_memory = self.memory_tier and not host_lost and (self.from_memory or running)
        target = self.last_mem if self.memory_tier else self.last_per
        lost = self.work - target
        self.work = target
        self.result.badput["lost"] += lost
        if running:
            self.result.interruptions += 1
            self.result.lost_work.append(lost)

    def _phase(self, duration: float, cause: str) -> bool:
        """Spend ``duration`` not training; False (after handling it) when a failure cuts it short."""
        tf = self.failures.next_failure(self.t, self.exposed)
        if tf < self.t + duration:
            self.result.badput[cause] += tf - self.t
            self.t = tf
            self._fail(running=False)
            return False
        self.result.badput[cause] += duration
        self.t += duration
        return True

    def _wait_for_slices(self) -> bool:
        self._collect_repairs()
        if self.policy == "spare" and self.missing > 0 and self.spares_free > 0:
            used = min(self.missing, self.spares_free)
            self.spares_free -= used
            self.missing -= used
            if not self._phase(self.job.spare_switch_time, "waiting"):
                return False
        need = self.job.min_slices if self.policy == "resize" else self.job.slices
        while self.exposed < need:
            back = self.repairs[0]
            tf = self.failures.next_failure(self.t, self.exposed)
            if tf < back:
                self.result.badput["waiting"] += tf - self.t
                self.t = tf
                self._fail(running=False)
                return False
            self.result.badput["waiting"] += back - self.t
            self.t = back
            self._collect_repairs()
        return True

    def _recover(self) -> None:
        """From a failure to the first productive step; a failure on the way starts it again."""
        job = self.job
        while self.t < self.horizon:
            if not self._phase(job.detect_time, "detection") or not self._wait_for_slices():
                continue
            from_memory = self.from_memory
            if not self._phase(job.memory_restore if from_memory else job.restore_time, "restore"):
                continue
            new_mesh = self.exposed if self.policy == "resize" else job.slices
            if not self._phase(job.resize_recovery if new_mesh != self.mesh else job.recovery_time, "recompile"):
                continue
            self.mesh = new_mesh
            self.last_mem = self.work
            self.from_memory = True
            if from_memory:
                self.result.restores_from_memory += 1
            else:
                self.result.restores_from_persistent += 1
            return

    def _scale_up(self) -> None:
        """Repaired slices rejoin a resized job: save (nothing lost), reshard, recompile."""
        self.last_mem = self.last_per = self.work
        self.from_memory = True
        if self._phase(self.job.scale_up, "scale_up"):
            self.mesh = self.exposed
        else:
            self._recover()

    # ---- running ------------------------------------------------------------------------------

    def _run_until(self, t_end: float) -> None:
        """Train from ``self.t`` to ``t_end`` on ``self.mesh`` slices, saving on schedule (closed form)."""
        job, tm, j = self.job, self.tm, self.j
        r = job.rate(self.mesh)
        t0, w0, s, o, d = self.t, self.work, job.save_stall, job.persist_overhead, job.persist_time
        # Each persistent save but the first of this stretch waits for the previous persist to finish.
        wait = max(0.0, d - (j * tm / r + (j - 1) * s))
        k0 = math.floor(w0 / tm + _EPS)
        kj0 = k0 // j

        def stalls(n: int) -> float:  # stall time of saves 1..n
            p = (k0 + n) // j - kj0
            return n * s + p * o + (wait * (p - 1) if p > 1 else 0.0)

        def start(i: int) -> float:  # wall time at which save i (work level (k0 + i) * tm) begins
            return t0 + ((k0 + i) * tm - w0) / r + stalls(i - 1)

        n = 0
        if start(1) <= t_end:
            cycle = tm / r + s + (o + wait) / j
            lo = max(1, int((t_end - start(1)) / cycle) - j - 2)
            while start(lo) > t_end:
                lo = max(1, lo - 2 * j - 2)
            hi = lo + j + 4
            while start(hi) <= t_end:
                hi = lo + 2 * (hi - lo)
            while hi - lo > 1:  # start(lo) <= t_end < start(hi)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if start(mid) <= t_end else (lo, mid)
            n = lo
        if n == 0:
            stall, done, self.work = 0.0, 0, w0 + r * (t_end - t0)
        else:
            began = start(n)
            stall_n = stalls(n) - stalls(n - 1)
            if t_end < began + stall_n:  # cut inside save n: it does not count
                stall, done, self.work = stalls(n - 1) + (t_end - began), n - 1, (k0 + n) * tm
            else:
                stall, done = stalls(n), n
                self.work = (k0 + n) * tm + r * (t_end - began - stall_n)
        self.result.badput["checkpoint"] += stall
        self.result.badput["degraded"] += (1.0 - r) * (t_end - t0 - stall)
        if done >= 1:
            self.last_mem = (k0 + done) * tm
            kp = (k0 + done) // j * j  # the newest persistent save begun and not cut
            i = kp - k0
            if i >= 1:
                finished = start(i) + stalls(i) - stalls(i - 1) + d
                if finished <= t_end + _EPS:
                    self.last_per = kp * tm
                elif i - j >= 1:
                    self.last_per = (kp - j) * tm
        self.t = t_end

    def run(self) -> SimResult:
        while self.t < self.horizon:
            tf = self.failures.next_failure(self.t, self.exposed)
            back = self.repairs[0] if self.policy == "resize" and self.repairs else math.inf
            if self.policy == "resize" and self.exposed > self.mesh:
                back = self.t  # slices came back during the last recovery
            t_end = min(tf, back, self.horizon)
            self._run_until(t_end)
            if t_end >= self.horizon:
                break
            if tf <= back:
                self._fail(running=True)
                self._recover()
            else:
                self._collect_repairs()
                self._scale_up()
        self.result.wall = self.t
        self.result.useful = self.work
        return self.result


def simulate(job: JobModel, policy: Policy, schedule: Schedule, *, horizon: float,
             failures: FailureSource, seed: int = 0, budget: WorkBudget | None = None) -> SimResult:
    """Simulate ``horizon`` seconds of wall time (a recovery under way at the end may run past it).
    ``budget``: the work allowed (default: unbounded), shared by the runs of one answer."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    if not horizon > 0:
        raise ValueError("horizon must be > 0")
    return _Run(job, policy, schedule, failures, horizon, seed, budget or WorkBudget()).run()


__all__ = ["simulate"]
