"""The runner's autopilot (trainer_client/runtime/autopilot/_autopilot_runner.py) on scripted costs and failures, on a
clock the test moves: the periods it owns shorten when failures come more often and lengthen in a quiet spell, small
changes do not move them (hysteresis), a period the user set is left alone and the others are chosen around it,
the replica pacer's overhead budget stays a floor, each change is an ``autopilot_decided`` event, and ``ckptd
advise`` given the same inputs answers with the same first-order periods (one model)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.advisor._advisor import advise
from trainer_client.core import protocol as p
from trainer_client.core.format._files import SNAPSHOT_PERSISTED_FILE
from trainer_client.core.format._snapshot_dirs import persisted_time
from trainer_client.runtime.autopilot._autopilot_costs import CostMeter
from trainer_client.runtime.autopilot._autopilot_runner import (
    DEFAULT_CHECKPOINT_PERIOD,
    MIN_INTERVAL_S,
    RunnerAutopilot,
)
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_pacing import KindCosts, smallest_period

STEP = 2.0  # seconds a step
STALL = 3.0  # a shared-memory snapshot blocks the loop this long
PERSIST = 40.0  # ckptd persists it this long after
H = 3600.0


class Clock:
    """The run's clock (monotonic and wall alike), moved by the test only."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Replicas:
    """The replica tier as the autopilot sees it: the pacer's measured costs, scripted."""

    def __init__(self, period: int | None = None, cost_s: float = 0.02, copy_s: float = 5.0,
                 host_bytes: int = 0) -> None:
        self.options = ReplicaOptions(period=period)
        self.off_reason: str | None = None
        self.autopilot_period: int | None = None
        self.cycles_closed = 0
        self.kind = KindCosts("pinned_host", copy_s, cost_s)
        self.host_bytes = host_bytes

    def turn_off(self, reason: str) -> None:
        self.off_reason = reason

    @property
    def paced_period(self) -> int:  # the pacer's choice: the smallest period within the overhead budget
        return smallest_period(STEP, self.kind.cost_s, self.kind.copy_s, self.options.overhead_budget)

    def measured(self) -> tuple[float, KindCosts] | None:
        return STEP, self.kind


class Run:
    """A scripted run: step boundaries ``STEP`` apart, the saves the periods in force make (each timed as the
    runner's events report them), failures recovered from a given tier."""

    def __init__(self, options: AutopilotOptions, *, replicas: Replicas | None = None, memory_tier: bool = True,
                 checkpoint_period: int | None = None, memory_period: int | None = None,
                 history: Any = None, **more: Any) -> None:
        self.clock = Clock()
        self.persisted: dict[int, float] = {}
        self.events: list[tuple[str, int | None, dict[str, Any]]] = []
        self.replicas = replicas
        self.memory_tier = memory_tier
        meter = CostMeter(clock=self.clock, wall=self.clock, persisted_at=self.persisted.get,
                          storage_busy=lambda: False)
        self.pilot = RunnerAutopilot(options, checkpoint_period=checkpoint_period, memory_period=memory_period,
                                     memory_tier=memory_tier, replicas=replicas, meter=meter, emit=self.emit,
                                     history=history, job="job", **more)
        if self.pilot.earlier is not None:
            assert self.pilot.earlier.wait(10)  # asked in the background: answered before the scripted run goes on
        self.step = 0
        self.stall = STALL
        self.in_force: list[tuple[int, int | None, int, bool]] = []  # per boundary: step, memory, persist, memory on

    def emit(self, kind: str, step: int | None = None, detail: str = "", **fields: Any) -> None:
        self.events.append((kind, step, fields))
        self.pilot.observe(kind, step, fields)

    def decided(self) -> list[dict[str, Any]]:
        return [fields for kind, _, fields in self.events if kind == "autopilot_decided"]

    def train(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            self.clock.now += STEP
            self.step += 1
            periods = self.pilot.at_boundary(self.step)
            self.in_force.append((self.step, periods.memory, periods.persist, periods.memory_tier))
            if self.replicas is not None and self.step % 5 == 0:
                self.replicas.cycles_closed += 1  # the pacer closes a measurement cycle now and then
            if self.step % periods.persist == 0:
                self.save("memory+persist" if self.memory_tier and periods.memory_tier else "storage")
            elif periods.memory and self.step % periods.memory == 0:
                self.save("memory")

    def save(self, tier: str) -> None:
        self.clock.now += self.stall
        self.emit("checkpoint_started", self.step, tier=tier, blocked_seconds=self.stall)
        if tier == "memory+persist":
            self.persisted[self.step] = self.clock.now + PERSIST

    def fail(self, tier: str = "replicas") -> None:
        for kind, seconds, fields in (("failure_detected", 30.0, {}), ("slices_ready", 5.0, {}),
                                      ("restored", 1.0, {"tier": tier}), ("first_step_done", 0.0, {}),
                                      ("recovered", 0.0, {"restored_from": tier})):
            self.clock.now += seconds
            self.emit(kind, self.step, **fields)

    def periods(self) -> tuple[int | None, int | None, int]:
        replicas = self.replicas.autopilot_period if self.replicas is not None else None
        return replicas, self.pilot.periods.memory, self.pilot.periods.persist


def test_the_first_choice_waits_for_costs_and_a_prior_and_is_an_event() -> None:
    run = Run(AutopilotOptions(mtbf_hours=8.0), replicas=Replicas())
    assert run.pilot.owned == {"replicas", "memory", "storage"} and run.pilot.off_reason is None
    assert run.periods() == (None, None, DEFAULT_CHECKPOINT_PERIOD)
    run.train(STEP * (DEFAULT_CHECKPOINT_PERIOD - 1))
    assert run.decided() == []  # no save timed yet
    run.train(60.0)
    (first,) = run.decided()
    assert first["autopilot_changed"] is True and first["autopilot_reason"] == "the first choice"
    assert first["autopilot_mtbf_source"] == "prior" and first["autopilot_mtbf_s"] == pytest.approx(8 * H, rel=0.01)
    assert first["autopilot_memory_block_s"] == STALL and first["autopilot_step_s"] == STEP
    replicas, memory, persist = run.periods()
    assert (first["autopilot_replicas_period"], first["autopilot_memory_period"],
            first["autopilot_storage_period"]) == (replicas, memory, persist)
    assert replicas is not None and memory is not None and replicas <= memory <= persist
    assert persist % memory == 0  # persisted from a memory snapshot
    # every field is one the event carries (the reporter sends them to ckptd as such)
    p.ElasticEvent(kind="autopilot_decided", time=1.0, **first)


def test_without_a_prior_the_run_waits_for_its_own_failures() -> None:
    run = Run(AutopilotOptions(min_failures=2), replicas=Replicas())
    start = run.clock.now
    run.train(600.0)
    run.fail()
    run.train(600.0)
    assert run.decided() == [] and run.periods() == (None, None, DEFAULT_CHECKPOINT_PERIOD)
    run.fail()
    second = run.clock.now
    run.train(60.0)
    (first,) = run.decided()  # at the first boundary after the recovery: the two failures' mean interval
    assert first["autopilot_mtbf_s"] == pytest.approx((second - start) / 2, abs=STEP)
    assert first["autopilot_mtbf_source"] == "prior"


class History:
    """ckptd's answer to ``GET /v1/jobs/{job}/goodput`` (or its failure to answer)."""

    def __init__(self, wall_s: float = 0.0, down_s: float = 0.0, recoveries: int = 0,
                 error: Exception | None = None) -> None:
        zero = p.GoodputCauses(checkpoint=0, waiting=0, restore=0, recompile=0, lost=0, startup=0, down=0)
        self.answer = p.Goodput(job="job", goodput=None, wall_seconds=wall_s, productive_seconds=0.0,
                                badput_seconds=zero.model_copy(update={"down": down_s}), badput=zero,
                                recoveries=recoveries)
        self.error = error
        self.asked: list[str] = []

    def goodput(self, job: str) -> p.Goodput:
        self.asked.append(job)
        if self.error is not None:
            raise self.error
        return self.answer


def test_the_jobs_earlier_runs_in_ckptd_are_the_prior_until_the_run_sees_its_own() -> None:
    """Earlier runs of the job: 10 h of wall time, 1 h of it with no run alive, 3 failures recovered. With
    ``min_failures=3`` the first choice needs no failure of this run: its prior is 9 h / 3 (this run's running time
    added, no failure yet); a configured MTBF asks nothing; a ckptd that cannot answer leaves the run waiting for
    its own failures, as without history."""
    history = History(wall_s=10 * H, down_s=1 * H, recoveries=3)
    run = Run(AutopilotOptions(min_failures=3), replicas=Replicas(), history=history)
    assert history.asked == ["job"]
    start = run.clock.now
    run.train(600.0)
    first = run.decided()[0]
    assert first["autopilot_mtbf_source"] == "prior"
    assert first["autopilot_mtbf_s"] == pytest.approx((9 * H + (run.clock.now - start)) / 3, rel=0.02)

    fewer = Run(AutopilotOptions(min_failures=4), replicas=Replicas(), history=History(10 * H, 1 * H, 3))
    fewer.train(600.0)
    assert fewer.decided() == []  # 3 earlier failures are not the 4 asked for
    fewer.fail()
    fewer.train(60.0)
    (chosen,) = fewer.decided()  # the run's own first failure makes 4
    assert chosen["autopilot_mtbf_s"] < 9 * H / 3

    configured = History(10 * H, 1 * H, 3)
    Run(AutopilotOptions(mtbf_hours=8.0), replicas=Replicas(), history=configured)
    assert configured.asked == []

    down = Run(AutopilotOptions(min_failures=3), replicas=Replicas(),
               history=History(error=OSError("ckptd at unix:///x did not answer")))
    down.train(600.0)
    assert down.decided() == [] and down.pilot.earlier is not None and down.pilot.earlier.value is None


def test_periods_shorten_when_failures_come_more_often_and_lengthen_in_a_quiet_spell() -> None:
    run = Run(AutopilotOptions(mtbf_hours=12.0), replicas=Replicas())
    run.train(600.0)
    calm = run.periods()
    for _ in range(6):  # failures every half hour: the estimate falls from 12 h
        run.train(0.5 * H)
        run.fail("memory")
    run.train(120.0)
    stormy = run.periods()
    assert all(s is not None and c is not None and s <= c for s, c in zip(stormy, calm, strict=True))
    assert stormy[1] is not None and calm[1] is not None and stormy[1] < calm[1]  # the memory tier's, at least
    last = run.decided()[-1]
    assert last["autopilot_mtbf_source"] == "history" and last["autopilot_mtbf_s"] < 2 * H
    assert last["autopilot_goodput_before"] < last["autopilot_goodput_after"]
    assert last["autopilot_failures_seen"] >= 3
    assert run.pilot.pilot is not None and run.pilot.pilot.history.estimate().failures == 6
    run.clock.now += 24 * H  # a quiet day (one long interval between boundaries: the median step time holds)
    run.train(600.0)  # the estimate grows at once, the periods lengthen again
    quiet = run.periods()
    assert quiet[1] is not None and stormy[1] is not None and quiet[1] > stormy[1]


def test_small_changes_do_not_move_the_periods() -> None:
    run = Run(AutopilotOptions(mtbf_hours=4.0), replicas=Replicas())
    run.train(600.0)
    decided = len(run.decided())
    periods = run.periods()
    run.stall = STALL * 1.05  # the snapshots cost 5% more: not worth a change
    run.train(3600.0)
    assert len(run.decided()) == decided and run.periods() == periods
    run.stall = STALL * 8  # eight times as costly: a change
    run.train(3600.0)
    assert len(run.decided()) > decided
    memory, before = run.periods()[1], periods[1]
    assert memory is not None and before is not None and memory > before


def test_off_the_periods_are_the_configured_ones() -> None:
    for run in (Run(AutopilotOptions(enabled=False, mtbf_hours=1.0), replicas=Replicas()),
                Run(AutopilotOptions(mtbf_hours=1.0), replicas=Replicas(), checkpoint_period=0)):
        assert run.pilot.off_reason is not None and run.pilot.off_reason.startswith("off")
    run = Run(AutopilotOptions(enabled=False, mtbf_hours=1.0), replicas=Replicas())
    run.train(600.0)
    assert run.decided() == [] and run.periods() == (None, None, DEFAULT_CHECKPOINT_PERIOD)


def test_periods_the_user_set_are_left_alone_and_the_others_chosen_around_them() -> None:
    every = Run(AutopilotOptions(mtbf_hours=4.0), replicas=Replicas(period=1), checkpoint_period=50,
                memory_period=10)
    assert every.pilot.owned == frozenset() and every.pilot.off_reason == "off: every period is set"
    every.train(600.0)
    assert every.decided() == [] and every.periods() == (None, 10, 50)
    replicas = Replicas(period=3)
    run = Run(AutopilotOptions(mtbf_hours=0.5), replicas=replicas, checkpoint_period=60)
    assert run.pilot.owned == {"memory"}
    run.train(600.0)
    for _ in range(3):
        run.fail()
        run.train(600.0)
    first = run.decided()[0]
    assert first["autopilot_replicas_period"] == 3 and first["autopilot_storage_period"] == 60
    _, memory, persist = run.periods()
    assert persist == 60 and replicas.autopilot_period is None  # the replica tier paces itself at 3: untouched
    assert memory is not None and memory <= 60


def test_the_replica_tiers_overhead_budget_stays_a_floor() -> None:
    # snapshots that cost the loop 1 s each: the pacer's 2% rule asks for one every 25 steps at least; at an MTBF
    # of 5 minutes the model alone would snapshot more often (every ~21 steps)
    replicas = Replicas(cost_s=1.0, copy_s=1.0)
    run = Run(AutopilotOptions(mtbf_hours=5 / 60), replicas=replicas)
    run.train(60.0)
    (first,) = run.pilot.decisions
    assert replicas.autopilot_period == smallest_period(STEP, 1.0, 1.0, replicas.options.overhead_budget) == 25
    assert first.plan.tier("replicas").bound == "overhead budget"
    assert first.plan.block("replicas").young_daly_s < 25 * STEP


def test_bounds_and_a_bound_on_steps_lost_are_kept() -> None:
    free = Run(AutopilotOptions(mtbf_hours=12.0), replicas=Replicas())
    free.train(60.0)
    _, memory, persist = free.periods()
    assert memory is not None and memory > 40 and persist > 200
    run = Run(AutopilotOptions(mtbf_hours=12.0, memory_bounds=(1, 40), persist_bounds=(1, 200)), replicas=Replicas())
    run.train(60.0)
    _, memory, persist = run.periods()
    assert memory is not None and memory <= 40 and persist <= 200
    lost = free.decided()[0]["autopilot_lost_steps"]
    bounded = Run(AutopilotOptions(mtbf_hours=12.0, max_lost_steps=lost / 2), replicas=Replicas())
    bounded.train(60.0)
    assert bounded.decided()[0]["autopilot_lost_steps"] <= lost / 2


def test_choices_are_made_at_most_every_interval_but_right_after_a_recovery() -> None:
    run = Run(AutopilotOptions(mtbf_hours=4.0, min_gain=0.0), replicas=Replicas())
    calls: list[int] = []
    decide: Callable[[int, float], None] = run.pilot._choose

    def counted(step: int, now: float) -> None:
        calls.append(step)
        decide(step, now)

    run.pilot._choose = counted  # type: ignore[method-assign]
    run.train(600.0)
    assert 0 < len(calls) <= 600.0 / MIN_INTERVAL_S + 1
    before = len(calls)
    run.fail()
    run.train(STEP)
    assert len(calls) == before + 1


def test_ckptd_advise_given_the_same_inputs_chooses_the_same_periods() -> None:
    run = Run(AutopilotOptions(mtbf_hours=2.0), replicas=None)
    run.train(600.0)
    decision = run.pilot.decisions[-1]
    inputs = decision.inputs
    memory, storage = inputs.tiers
    advice = advise(p.AdviceQuery(step_time_s=inputs.step_s, save_stall_s=memory.block_s,
                                  persist_time_s=storage.copy_s, persist_overhead_s=storage.block_s,
                                  host_loss_fraction=1 - memory.survives, mtbf_hours=inputs.mtbf_s / H,
                                  memory_tier=True, restore_time_s=60, recovery_time_s=60, replace_time_s=600,
                                  slices=16, min_failures=50, horizon_days=1), points=3)
    yd = advice.young_daly
    assert yd.mtbf_s == pytest.approx(inputs.mtbf_s)
    assert yd.period_s == pytest.approx(decision.plan.blocks[0].young_daly_s)
    assert yd.persistent_period_s == pytest.approx(decision.plan.block("storage").period_s)
    plan = decision.plan
    assert plan.tier("storage").period_steps == run.pilot.periods.persist
    assert max(1, round(plan.block("memory").period_s / STEP)) == run.pilot.periods.memory


@pytest.mark.parametrize("raw", [b'{"persisted_at": 1' + b"0" * 400 + b"}", b'{"persisted_at": Infinity}',
                                 b'{"persisted_at": NaN}', b'{"persisted_at": "x"}', b"[1]",
                                 b'{"persisted_at": true}', b" " * (1 << 20)])
def test_a_persisted_mark_whose_time_is_no_finite_number_is_not_a_persist(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / SNAPSHOT_PERSISTED_FILE).write_bytes(raw)
    assert persisted_time(tmp_path / "7") is None  # not an OverflowError, nor an infinite cost measured


def test_a_persisted_mark_gives_its_time(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / SNAPSHOT_PERSISTED_FILE).write_bytes(b'{"path": "x", "persisted_at": 12.5}')
    assert persisted_time(tmp_path / "7") == 12.5
