"""One soak trial: a slice lost from inside JAX at one phase of an elastic run, and the checks it must pass.

Phases (``PHASES``), each with a random slice, step and down time from the trial's own RNG:

- ``mid_step``: reading a step's result meets the dead slice (``to_host``);
- ``snapshot``: the memory tier's device-to-host shard copy (``MemoryTier._write``; of slice 0, which holds the
  replica it copies);
- ``persist``: right after a persistent save started, while it is written (by Orbax in this process, or by
  ckptd's persist worker from the memory tier);
- ``restore``: a loss mid-step, then a second slice lost inside the restore's transfer to the devices;
- ``precompile``: a background compile-ahead takes the slice down; the loop meets it;
- ``second_failure``: a loss mid-step, then a second slice lost during the recovery (while Manager waits, just
  before the restore, or in the first step after it);
- ``slice_returns`` (``resize``): the lost slice returns mid-recovery; the run shrinks, then grows back;
- ``ckptd_restart``: ckptd SIGKILLed when the failure is detected and restarted in the background;
- ``replica_copy``: a slice lost during the replica tier's copy into host memory: inside the copy's dispatch
  (the tier's worker copies the staged on-device copy to the host) or while the worker waits for the copy; the copy is
  dropped and the run restores from the replicas of the step held before (or a newer step in memory);
- ``two_slices`` (mesh 2 x 4: two replicas, each on two slices): two slices lost at once, one of each replica
  (no whole replica left: the restore falls back to the shared-memory tier or storage) or both of one replica
  (the other restores, unless memory holds a newer step);
- ``after_scale_up`` (``resize``): a loss, the run shrinks, the slice returns and the run grows back, and a
  slice (the one that returned, or another) is lost in the first step after the scale-up.

Every recovery restores from replicas (the replica snapshot tier, on by default), the shared-memory tier or
storage (``restored_from``). A trial succeeds when the run ends in this process, every armed fault went off,
every loss that hit a running attempt was recovered from, each restored step is one the run had (from replicas:
a step at or before the failure; from memory or storage: a step whose save had started) and its state equals
what the run had at that step (``StateRecord``: never a mixed-step state), every sample was read once in the
surviving trajectory, a ``pause`` run ends bitwise equal to the reference (a run without failures on its mesh),
a ``resize`` run ends on the full mesh again, and ckptd is up.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from examples.elastic_mlp import TrainLog
from soak.harness import BATCH, MESH, SLICES, STEPS, TWO_REPLICAS, Policy, Soak, StateRecord
from trainer_client.runtime.elastic._elastic import ElasticResult, ElasticRunner, Event

PHASES = ("mid_step", "snapshot", "persist", "restore", "precompile", "second_failure", "slice_returns",
          "ckptd_restart", "replica_copy", "two_slices", "after_scale_up")
TIERS = ("replicas", "memory", "storage")
TIMINGS = ("detect", "wait", "plan", "restore", "compile", "first_step")
WAIT_S = 60.0  # the longest a trial's hook holds the loop for something to happen in the background


@dataclass
class Trial:
    index: int
    phase: str
    variant: str = ""
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=dict)
    lost_steps: list[int] = field(default_factory=list)
    restored_from: list[str] = field(default_factory=list)  # the tier of each slice-loss recovery
    restores: list[tuple[int, str]] = field(default_factory=list)  # each restore's step and StateRecord verdict
    replicas_unusable: int = 0  # events: the replicas had no whole copy, ckptd asked again without them


class _Scenario:
    """The hooks of one trial: ``hook(step)`` at every step, ``on_event(event)`` for every event."""

    def __init__(self, soak: Soak, trial: Trial, rng: random.Random) -> None:
        self.soak, self.trial, self.phase = soak, trial, trial.phase
        # the memory tier copies one replica of each shard: replica 0's, on slice 0 (the snapshot phase's target)
        self.lost = 0 if self.phase == "snapshot" else rng.randrange(SLICES)
        self.second = rng.choice([k for k in range(SLICES) if k != self.lost])
        self.at = rng.randint(11, 22)
        self.down = round(rng.uniform(0.2, 1.0), 3)
        self.nth = rng.randint(1, 3)
        self.runner: ElasticRunner | None = None
        self.fired_before = len(soak.injector.fired)  # the injector lives for the whole soak
        self.armed_first = False
        self.armed_second = False
        self.expect_recoveries = 1
        self.restores = 0
        self.waited_for_return = False
        self.waited_after = 0  # after_scale_up: the restores after which the hook waited for the slice back
        self.scaled_up = False
        self.held_at_plan: list[int | None] = []  # the step the replica tier held when each plan came
        if self.phase == "replica_copy":
            trial.variant = rng.choice(["dispatch", "wait"])
            self.nth = 1  # the first array's copy to the host that involves the lost slice
        elif self.phase == "two_slices":
            trial.variant = rng.choice(["across_replicas", "one_replica"])
            if trial.variant == "across_replicas":  # replica r lives on slices 2r and 2r + 1
                self.lost, self.second = rng.choice([0, 1]), rng.choice([2, 3])
            else:
                self.lost = 2 * rng.randrange(2)
                self.second = self.lost + 1
        elif self.phase == "after_scale_up":
            trial.variant = rng.choice(["returned", "other"])
            self.at = rng.randint(11, 17)  # room for two shrinks and two regrows before the last step
            self.expect_recoveries = 2
        if self.phase == "second_failure":
            trial.variant = rng.choice(["during_wait", "before_restore", "first_step"])
            self.expect_recoveries = 1 if trial.variant == "during_wait" else 2
        elif self.phase == "restore":
            self.expect_recoveries = 2
        elif self.phase == "persist":
            trial.variant = rng.choice(["orbax", "ckptd"])
        if self.phase == "precompile":
            soak.injector.fail_during("compile", self.lost, down_for_s=self.down)
            self.armed_first = True

    @property
    def policy(self) -> Policy:
        return "resize" if self.phase in ("slice_returns", "after_scale_up") else "pause"

    @property
    def mesh(self) -> tuple[int, ...]:
        return TWO_REPLICAS if self.phase == "two_slices" else MESH

    @property
    def memory_tier(self) -> bool:
        return not (self.phase == "persist" and self.trial.variant == "orbax")

    @property
    def fired(self) -> bool:
        """A fault of this trial went off inside JAX."""
        return len(self.soak.injector.fired) > self.fired_before

    def _arm_first(self, **kwargs: Any) -> None:
        if not self.armed_first:
            self.armed_first = True
            down = None if self.phase in ("slice_returns", "after_scale_up") else self.down
            self.soak.injector.fail_during("to_host", self.lost, down_for_s=down, **kwargs)

    def hook(self, step: int) -> None:
        injector = self.soak.injector
        if self.phase == "replica_copy" and step == self.at and not self.armed_first:
            self.armed_first = True
            if self.trial.variant == "dispatch":  # the next snapshot's copy to the host, dispatched by the worker
                injector.fail_during("to_device", self.lost, nth=self.nth, down_for_s=self.down,
                                     inside="ReplicaTier._complete")
            else:  # the tier's worker waiting for a copy
                injector.fail_during("block", self.lost, down_for_s=self.down, inside="ReplicaTier._complete_copies")
        elif self.phase == "two_slices" and step == self.at and not self.armed_first:
            self.armed_first = True  # one read of the step's result meets both: lost at once
            injector.fail_during("to_host", self.lost, down_for_s=self.down)
            injector.fail_during("to_host", self.second, down_for_s=self.down)
        elif self.phase == "after_scale_up":
            self._after_scale_up(step)
        if self.phase == "precompile" and step >= 12 and not self.fired:
            _wait(lambda: self.fired, "the background compile to take the slice down")
        elif self.phase == "snapshot" and step == self.at:
            self._arm_first(nth=min(self.nth, 2), inside="MemoryTier._write")
        elif self.phase in ("mid_step", "restore", "second_failure", "slice_returns", "ckptd_restart") \
                and step == self.at:
            self._arm_first()
        runner = self.runner
        if self.phase == "slice_returns" and self.restores and runner is not None and not self.waited_for_return \
                and self.lost not in runner.manager.active_slice_indices:  # not grown back yet
            self.waited_for_return = True  # back mid-recovery: the monitor sees it, the next boundary grows back
            manager = runner.manager
            _wait(lambda: self.lost in manager.available_inactive_slices | manager.active_slice_indices,
                  "the monitor to see the slice back")

    def _after_scale_up(self, step: int) -> None:
        runner = self.runner
        if step == self.at:
            self._arm_first()
        elif runner is not None and self.restores > self.waited_after:
            manager = runner.manager
            missing = set(range(SLICES)) - set(manager.active_slice_indices)
            if missing:  # shrunk: wait for the monitor to see the slice back; the next boundary grows back
                self.waited_after = self.restores
                _wait(lambda: missing <= manager.available_inactive_slices | set(manager.active_slice_indices),
                      "the monitor to see the slice back")

    def _on_scale_up_event(self, kind: str) -> None:
        """after_scale_up: each lost slice healthy again once the shrink is planned (the restore is on 3 slices);
        the first step after the regrow's restore loses a slice again (down until the next shrink is planned)."""
        slices = self.soak.slices
        if kind == "plan_received":
            for k in set(range(SLICES)) - slices.healthy_now():
                slices.bring_back(k)
        elif kind == "restored" and self.scaled_up and not self.armed_second:
            self.armed_second = True
            victim = self.lost if self.trial.variant == "returned" else self.second
            self.soak.injector.fail_during("to_host", victim, down_for_s=None)

    def on_event(self, event: Event) -> None:
        kind, soak, variant = event.kind, self.soak, self.trial.variant
        fired = self.fired
        if kind == "checkpoint_started" and self.phase == "persist" and event.step == 20 \
                and event.fields.get("tier") in ("storage", "memory+persist"):
            self._arm_first()  # the next read of a result, while the save of step 20 is written
        elif kind == "restored":
            self.restores += 1
        elif kind == "plan_received":
            replicas = self.runner.replicas if self.runner is not None else None
            self.held_at_plan.append(replicas.held_step() if replicas is not None else None)
        elif kind == "replicas_unusable":
            self.trial.replicas_unusable += 1
        elif kind == "scale_up_detected":
            self.scaled_up = True
        if self.phase == "after_scale_up" and fired:
            self._on_scale_up_event(kind)
        if not fired or self.armed_second:
            return
        if self.phase == "slice_returns" and kind == "plan_received":
            self.armed_second = True
            soak.slices.bring_back(self.lost)  # planned on 3 slices; the 4th is healthy again before the restore
        elif self.phase == "restore" and kind == "plan_received":
            self.armed_second = True
            soak.injector.fail_during("to_device", self.second, nth=self.nth, down_for_s=self.down)
        elif self.phase == "second_failure" and (variant, kind) == ("during_wait", "waiting_for_slices"):
            self.armed_second = True
            soak.slices.take_down(self.second, self.down)  # Manager waits for it too
        elif self.phase == "second_failure" and (variant, kind) == ("before_restore", "slices_ready"):
            self.armed_second = True
            soak.injector.fail_during("to_device", self.second, down_for_s=self.down)
        elif self.phase == "second_failure" and (variant, kind) == ("first_step", "restored"):
            self.armed_second = True
            soak.injector.fail_during("to_host", self.second, down_for_s=self.down)
        elif self.phase == "ckptd_restart" and kind == "failure_detected":
            self.armed_second = True
            soak.ckptd.kill()
            soak.ckptd.restart_in_background()


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"soak: waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.02)


def run_trial(soak: Soak, index: int, phase: str, rng: random.Random) -> Trial:
    """Run one trial; never raises (a failure is the trial's verdict, with its problems)."""
    trial = Trial(index, phase)
    soak.reset_slices()
    started = time.monotonic()
    result: ElasticResult[Any] | None = None
    log = TrainLog()
    try:
        scenario = _Scenario(soak, trial, rng)
        runner = soak.runner(f"trial-{index:04d}", scenario.policy, memory_tier=scenario.memory_tier,
                             on_event=scenario.on_event, mesh=scenario.mesh)
        scenario.runner = runner
        record = StateRecord(soak.injector, soak.trajectory[scenario.mesh] if scenario.policy == "pause" else {})
        result = soak.train(runner, log, scenario.hook, record)
        trial.restores = record.restores
        if soak.injector.armed:
            trial.problems.append(f"{soak.injector.armed} armed fault(s) never went off")
        _check(trial, scenario, result, log)
    except Exception as exc:  # the run failed: that is the trial's verdict
        trial.problems.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
    problem = soak.ckptd.settle()
    if problem:
        trial.problems.append(problem)
    trial.seconds = round(time.monotonic() - started, 3)
    if result is not None:
        _measure(trial, result, log, soak)
    trial.ok = not trial.problems
    return trial


def _check(trial: Trial, scenario: _Scenario, result: ElasticResult[Any], log: TrainLog) -> None:
    soak = scenario.soak
    problems = trial.problems
    if result.pid != os.getpid():
        problems.append(f"ended in pid {result.pid}, not {os.getpid()}")
    downs = [r for r in result.recoveries if r.kind == "slice_down"]
    if len(downs) != scenario.expect_recoveries:
        problems.append(f"{len(downs)} slice-loss recoveries, expected {scenario.expect_recoveries}")
    if not scenario.fired:
        problems.append("no fault went off inside JAX")
    for r in downs:
        tier = tier_of(r.restored_from)
        saved = {e.step for e in result.events if e.kind == "checkpoint_started" and e.t <= r.detected_t}
        interrupted = tier == "interrupted" and r is not downs[-1]  # a later recovery restored
        if r.restored_step is None or r.restored_step > r.failed_at_step or (tier not in TIERS and not interrupted) \
                or (tier in ("memory", "storage") and r.restored_step not in saved):
            problems.append(f"recovery from step {r.failed_at_step} restored step {r.restored_step} from "
                            f"{r.restored_from} (saved before: {sorted(s for s in saved if s is not None)})")
    differs = [step for step, verdict in trial.restores if verdict == "DIFFERS"]
    if differs:
        problems.append(f"restored step(s) {differs} differ from every state the run had at that step")
    _check_phase(trial, scenario, result, downs)
    expected = [(s * BATCH, (s + 1) * BATCH) for s in range(STEPS)]
    if [log.samples.get(s) for s in range(STEPS)] != expected:
        problems.append("a sample was skipped or read twice")
    if scenario.policy == "pause":
        final = [np.asarray(x) for x in _leaves(result.value)]
        reference = soak.reference[scenario.mesh]
        if len(final) != len(reference) or not all(
                a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(final, reference, strict=False)):
            problems.append("the final state differs from the run without failures")
    else:
        last = result.recoveries[-1] if result.recoveries else None
        if last is None or (last.kind, last.mesh_after, last.lost_steps) != ("scale_up", [4, 2], 0):
            problems.append(f"did not grow back to the full mesh without loss: {last}")


def _check_phase(trial: Trial, scenario: _Scenario, result: ElasticResult[Any], downs: list[Any]) -> None:
    """What the replica tier's phases must show beyond every trial's checks."""
    problems, phase, variant = trial.problems, scenario.phase, trial.variant
    tiers = [tier_of(r.restored_from) for r in downs]
    # from replicas, or from a newer step in memory or storage (ckptd takes the newest whole step; of equal
    # steps, the replicas): the step the replicas held when the plan came, or older, is never taken elsewhere
    held = scenario.held_at_plan[0] if scenario.held_at_plan else None
    newest = bool(downs) and (tiers[0] == "replicas" or held is None or (downs[0].restored_step or 0) > held)
    if phase == "replica_copy":
        failures = [e.fields.get("replica_failures") or 0 for e in result.events if e.kind == "recovered"]
        if not failures or max(failures) < 1:
            problems.append(f"the replica tier counted no failed copy (recovered events: {failures})")
        if len(tiers) != 1 or not newest:
            problems.append(f"a failed copy left no whole snapshot: restored from {tiers}, replicas held {held}")
        if not any(verdict == "equal" for _, verdict in trial.restores):
            problems.append(f"no restore was checked against the run's state: {trial.restores}")
        if variant == "dispatch" and downs and (downs[0].restored_step or 0) >= downs[0].failed_at_step:
            problems.append(f"the step whose copy failed ({downs[0].failed_at_step}) was restored")
    elif phase == "two_slices":
        if variant == "across_replicas" and (not tiers or tiers[0] not in ("memory", "storage")):
            problems.append(f"no whole replica left: restored from {tiers}, expected memory or storage")
        elif variant == "one_replica" and not newest:
            problems.append(f"one whole replica left: restored from {tiers}, the replicas held step {held}")
        if not any(verdict == "equal" for _, verdict in trial.restores):
            problems.append(f"no restore was checked against the run's state: {trial.restores}")
    elif phase == "after_scale_up":
        kinds = [r.kind for r in result.recoveries]
        if kinds != ["slice_down", "scale_up", "slice_down", "scale_up"]:
            problems.append(f"recoveries {kinds}: expected a loss, the regrow, a loss right after it, the regrow")


def tier_of(restored_from: str | None) -> str:
    """``replicas``, ``memory`` or ``storage`` from a recovery's ``restored_from`` (``memory: PATH``...);
    ``interrupted``: none, a second loss came before its restore completed (the next recovery restored)."""
    return (restored_from or "interrupted").split(":", 1)[0]


def _leaves(value: Any) -> list[Any]:
    import jax

    return list(jax.tree_util.tree_leaves(value))


def _measure(trial: Trial, result: ElasticResult[Any], log: TrainLog, soak: Soak) -> None:
    """Per slice-loss recovery: detect (the loss to failure_detected), wait, plan, restore, compile (restored to
    the first step's jitted call returned) and first step (to first_step_done), for the phases it completed."""
    events = result.events
    timings: dict[str, list[float]] = {name: [] for name in TIMINGS}
    for i, e in enumerate(events):
        if e.kind != "failure_detected":
            continue
        losses = [t for _, t in soak.losses if t <= e.wall_time]
        if losses:
            timings["detect"].append(e.wall_time - losses[-1])
        marks = {"failure_detected": e.wall_time}
        for later in events[i + 1:]:
            if later.kind in ("failure_detected", "scale_up_detected"):
                break
            if later.kind in ("slices_ready", "plan_received", "restored", "first_step_done"):
                marks.setdefault(later.kind, later.wall_time)
        order = [("wait", "failure_detected", "slices_ready"), ("plan", "slices_ready", "plan_received"),
                 ("restore", "plan_received", "restored")]
        for name, a, b in order:
            if a in marks and b in marks:
                timings[name].append(marks[b] - marks[a])
        if "restored" in marks and "first_step_done" in marks:
            dispatched = [t for _, t in log.dispatched if marks["restored"] <= t <= marks["first_step_done"]]
            if dispatched:
                timings["compile"].append(dispatched[0] - marks["restored"])
                timings["first_step"].append(marks["first_step_done"] - dispatched[0])
    trial.timings = {k: [round(v, 4) for v in vs] for k, vs in timings.items()}
    downs = [r for r in result.recoveries if r.kind == "slice_down"]
    trial.lost_steps = [r.lost_steps for r in downs if r.lost_steps is not None]
    trial.restored_from = [tier_of(r.restored_from) for r in downs]
    trial.recoveries = [{"kind": r.kind, "failed_at_step": r.failed_at_step, "restored_step": r.restored_step,
                         "lost_steps": r.lost_steps, "mesh_after": r.mesh_after, "restored_from": r.restored_from,
                         "seconds": None if r.seconds is None else round(r.seconds, 3)} for r in result.recoveries]


__all__ = ["PHASES", "TIERS", "TIMINGS", "Trial", "run_trial", "tier_of"]
