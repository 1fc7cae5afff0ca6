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
- ``ckptd_restart``: ckptd SIGKILLed when the failure is detected and restarted in the background.

A trial succeeds when the run ends in this process, every armed fault went off, every loss that hit a running
attempt was recovered from, each restored step is a saved one, every sample was read once in the surviving
trajectory, a ``pause`` run ends bitwise equal to the reference (a run without failures), a ``resize`` run
ends on the full mesh again, and ckptd is up.
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
from soak.harness import BATCH, SLICES, STEPS, Policy, Soak
from trainer_client.runtime._elastic import ElasticResult, ElasticRunner, Event

PHASES = ("mid_step", "snapshot", "persist", "restore", "precompile", "second_failure", "slice_returns",
          "ckptd_restart")
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
        return "resize" if self.phase == "slice_returns" else "pause"

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
            down = None if self.phase == "slice_returns" else self.down
            self.soak.injector.fail_during("to_host", self.lost, down_for_s=down, **kwargs)

    def hook(self, step: int) -> None:
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

    def on_event(self, event: Event) -> None:
        kind, soak, variant = event.kind, self.soak, self.trial.variant
        fired = self.fired
        if kind == "checkpoint_started" and self.phase == "persist" and event.step == 20 \
                and event.fields.get("tier") in ("storage", "memory+persist"):
            self._arm_first()  # the next read of a result, while the save of step 20 is written
        elif kind == "restored":
            self.restores += 1
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
                             on_event=scenario.on_event)
        scenario.runner = runner
        result = soak.train(runner, log, scenario.hook)
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
        if r.restored_step is None or r.restored_step % 5 or r.restored_step > r.failed_at_step:
            problems.append(f"recovery from step {r.failed_at_step} restored step {r.restored_step}")
    expected = [(s * BATCH, (s + 1) * BATCH) for s in range(STEPS)]
    if [log.samples.get(s) for s in range(STEPS)] != expected:
        problems.append("a sample was skipped or read twice")
    if scenario.policy == "pause":
        final = [np.asarray(x) for x in _leaves(result.value)]
        if len(final) != len(soak.reference) or not all(
                a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(final, soak.reference, strict=False)):
            problems.append("the final state differs from the run without failures")
    else:
        last = result.recoveries[-1] if result.recoveries else None
        if last is None or (last.kind, last.mesh_after, last.lost_steps) != ("scale_up", [4, 2], 0):
            problems.append(f"did not grow back to the full mesh without loss: {last}")


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
    trial.lost_steps = [r.lost_steps for r in result.recoveries if r.kind == "slice_down" and r.lost_steps is not None]
    trial.recoveries = [{"kind": r.kind, "failed_at_step": r.failed_at_step, "restored_step": r.restored_step,
                         "lost_steps": r.lost_steps, "mesh_after": r.mesh_after,
                         "seconds": None if r.seconds is None else round(r.seconds, 3)} for r in result.recoveries]


__all__ = ["PHASES", "TIMINGS", "Trial", "run_trial"]
