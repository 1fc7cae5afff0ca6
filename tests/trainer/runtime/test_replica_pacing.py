"""The replica tier's pacing: the period and memory kind chosen from measured step and copy times
(trainer_client/runtime/replicas/_replica_pacing.py), and the runner's use of it on a real (CPU) tier."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import pytest

from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_pacing import (
    WARMUP_STEPS,
    KindCosts,
    PaceMeter,
    choose,
    expected_lost_steps,
    overhead,
    smallest_period,
    worth_changing,
)
from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas

# measured on a TPU v5e chip (docs/benchmarks.md, "Device profile"): a 5.22 GB state, 0.275 s a step, a snapshot's
# whole cost to the loop ~0.25 s, its copy to pinned host memory 6.3 s, to unpinned host memory 2.1 s
STEP, COST, PINNED_S, UNPINNED_S = 0.275, 0.25, 6.3, 2.1


def test_the_period_is_the_smallest_within_the_budget_that_lets_each_copy_finish() -> None:
    period = smallest_period(STEP, COST, PINNED_S)
    assert period * STEP >= PINNED_S  # one copy in flight: it ends before the next is due
    assert overhead(period, STEP, COST) <= 0.02 < overhead(period - 1, STEP, COST)  # and no more than that needs
    # a cheap snapshot: the copy's own time sets the period
    cheap = smallest_period(STEP, 0.001, PINNED_S)
    assert cheap * STEP >= PINNED_S and (cheap - 1) * STEP < 1.25 * PINNED_S
    # a copy faster than a step and a cheap snapshot: every step
    assert smallest_period(1.0, 0.001, 0.1) == 1
    # a snapshot that costs 10% of a step: every 5th step keeps it within 2%
    assert smallest_period(1.0, 0.1, 0.1) == 5
    assert smallest_period(1.0, 0.1, 0.1, budget=0.05) == 2


def test_the_kind_a_failure_costs_least_with_is_chosen() -> None:
    nbytes = 5_222_538_244
    fast_copy = KindCosts("unpinned_host", UNPINNED_S, 0.05, restore_Bps=4.9e9)
    slow_copy = KindCosts("pinned_host", PINNED_S, 0.05, restore_Bps=14.1e9)
    choice = choose(STEP, [slow_copy, fast_copy], nbytes)
    assert choice.kind == "unpinned_host"  # fewer steps lost outweighs the slower restore here
    assert choice.expected_lost_steps == pytest.approx(expected_lost_steps(choice.period, STEP, UNPINNED_S))
    assert choice.overhead <= 0.02 and "pinned_host 6.30s" in choice.reason
    # the same copy costing the loop 2 s a snapshot (steps slowed while it runs): pinned memory wins
    costly = KindCosts("unpinned_host", UNPINNED_S, 2.0, restore_Bps=4.9e9)
    assert choose(STEP, [slow_copy, costly], nbytes).kind == "pinned_host"
    fields = choice.fields()
    assert fields["replica_period"] == choice.period and fields["replica_memory_kind"] == "unpinned_host"


def test_a_new_choice_needs_a_real_change() -> None:
    kinds = [KindCosts("pinned_host", PINNED_S, COST)]
    current = choose(STEP, kinds, 1)
    assert not worth_changing(current, choose(STEP * 1.05, kinds, 1))  # within the hysteresis
    assert worth_changing(current, choose(STEP, [KindCosts("pinned_host", PINNED_S, COST * 1.5)], 1))  # over budget
    assert worth_changing(current, choose(STEP * 3, kinds, 1))  # far fewer steps needed
    assert worth_changing(None, current)


def test_the_meter_charges_a_snapshot_every_step_it_touched() -> None:
    meter = PaceMeter()
    t = 0.0
    for _ in range(WARMUP_STEPS + 2):  # idle steps: 1 s each
        meter.boundary(t)
        t += 1.0
    meter.boundary(t)
    assert meter.step_s() == pytest.approx(1.0) and meter.costs(100) is None  # no snapshot measured yet
    meter.copy_started("pinned_host", t + 0.01)  # dispatched at this boundary
    for extra in (0.1, 0.2, 0.2, 0.2):  # the step after it is blocked 0.1 s, the ones beside the copy 20% slower
        t += 1.0 + extra
        meter.boundary(t)
    meter.copy_done("pinned_host", 5.01, t - 0.5, settled=t - 0.4)  # landed inside the last step
    assert meter.kinds_measured() == []  # its cycle closes at the next boundary
    t += 1.3  # the step in which the copy landed and the previous snapshot's memory went back: 0.3 s more
    meter.boundary(t)
    t += 1.0
    meter.boundary(t)
    costs = meter.costs(100)
    assert costs is not None
    step, (kind,) = costs
    assert step == pytest.approx(1.0)
    assert kind.kind == "pinned_host" and kind.cost_s == pytest.approx(0.1 + 3 * 0.2 + 0.3)
    assert kind.copy_s == pytest.approx(t - 2.3 - 0.5 - 5.01)
    meter.reset_steps()
    assert meter.step_s() is None and meter.kinds_measured() == ["pinned_host"]  # copies' costs kept


def _snapshots_with_a_slow_tail(kinds: list[str]) -> PaceMeter:
    """Idle steps of 1 s, then a snapshot every 10 steps into ``kinds`` in turn: its cycle is one step 0.1 s
    longer, and the two steps after its cycle closed run 0.05 s slower (the host memory let go late, say)."""
    meter = PaceMeter()
    t = 0.0
    for _ in range(WARMUP_STEPS + 2):  # the baseline
        meter.boundary(t)
        t += 1.0
    meter.boundary(t)
    for kind in kinds:
        meter.copy_started(kind, t)
        meter.copy_done(kind, t, t + 0.5)
        t += 1.1
        meter.boundary(t)
        for extra in (0.05, 0.05, 0, 0, 0, 0, 0, 0, 0):
            t += 1.0 + extra
            meter.boundary(t)
    return meter


def test_what_the_loop_loses_outside_the_cycles_is_charged_to_the_snapshots() -> None:
    """The meter charges each snapshot what the loop lost in the recent window, not only what its cycles saw; a
    window that mixes kinds (the first snapshots measure each) is not used."""
    costs = _snapshots_with_a_slow_tail(["pinned_host"] * 4).costs(100)
    assert costs is not None
    step, (kind,) = costs
    assert step == pytest.approx(1.0)  # the idle steps' median: the two slow ones a period are the fewer
    # a cycle alone says 0.1 s; the loop lost 4 x (0.1 + 2 x 0.05) = 0.8 s over 4 snapshots
    assert kind.cost_s == pytest.approx(0.1 + 2 * 0.05)

    mixed = _snapshots_with_a_slow_tail(["pinned_host", "unpinned_host"] * 2).costs(100)
    assert mixed is not None
    assert all(k.cost_s == pytest.approx(0.1) for k in mixed[1])


def test_an_attempts_first_steps_are_not_charged_to_its_snapshots() -> None:
    """After a recovery (``reset_steps``) the first step compiles or waits for the restore's transfers: seconds that
    no snapshot cost. With failures every few dozen steps every window holds one; charged to the snapshots, they
    pushed the pacer's period up as failures came faster."""
    meter = _snapshots_with_a_slow_tail(["pinned_host"] * 4)
    meter.reset_steps()
    t = 1000.0
    for first in (5.0, 2.0, 1.0, 1.0, 1.0, 1.0):  # the attempt's first steps: a restore, a compile, then steady
        meter.boundary(t)
        t += first
    meter.boundary(t)
    for _ in range(4):  # the same snapshots as before: 0.1 s in the cycle and 2 x 0.05 s after it
        meter.copy_started("pinned_host", t)
        meter.copy_done("pinned_host", t, t + 0.5)
        t += 1.1
        meter.boundary(t)
        for extra in (0.05, 0.05, 0, 0, 0, 0, 0, 0, 0):
            t += 1.0 + extra
            meter.boundary(t)
    costs = meter.costs(100)
    assert costs is not None
    assert costs[1][0].cost_s == pytest.approx(0.1 + 2 * 0.05)  # not (6 s over 4 snapshots) more


def test_the_runner_measures_each_kind_then_snapshots_at_the_chosen_period() -> None:
    """A paced tier on CPU devices: no snapshot before the steps are timed, then one to each memory kind, then
    a choice reported through ``on_paced`` and snapshots every ``choice.period`` steps."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(devices, ("replica",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jax.device_put(jax.numpy.ones((64, 64)), replicated)}
    now = [0.0]
    paced: list[Any] = []
    replicas = RunnerReplicas(ReplicaOptions(when_busy="wait"), {0: devices},
                              on_paced=lambda step, new, old: paced.append((step, new, old)), clock=lambda: now[0])
    dispatched: list[int] = []
    try:
        for step in range(200):
            now[0] += 1.0  # a step of 1 s; the copies take no time on this clock
            replicas.boundary(step)
            if replicas.snapshot(step, state, data_position=step, iterator_state=None):
                dispatched.append(step)
                assert replicas.tier is not None and replicas.tier.wait(30)
        assert dispatched[0] >= WARMUP_STEPS  # not before the steps were timed
        assert replicas.tier is not None
        kinds = [k for k in ("pinned_host", "unpinned_host")
                 if k in {m.kind for m in devices[0].addressable_memories()}]
        assert len(paced) == 1 and paced[0][2] is None
        step, choice, _ = paced[0]
        assert choice.kind in kinds and choice.period >= 1 and choice.overhead <= 0.02
        after = [s for s in dispatched if s > step]
        assert after and all(b - a == choice.period for a, b in itertools.pairwise(after))
        assert replicas.stats_fields()["replica_period"] == choice.period
    finally:
        replicas.close()
