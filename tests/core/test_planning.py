"""The period model (trainer_client/core/planning/_periods.py): Young/Daly per tier, tiers merged where their optima
would run out of order, the floors (copy, storage bandwidth and request rate), the host-memory budget, the bound on
steps lost, and the expected goodput it reports; and the optimum it picks is the maximum of its own goodput."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from trainer_client.core.planning import (
    Constraints,
    PlanInputs,
    TierCosts,
    choose,
    daly,
    evaluate,
    young_daly,
)

H = 3600.0
STEP = 0.25


def three_tiers(**storage: float) -> tuple[TierCosts, ...]:
    """Replicas (cheap, serve 70% of failures), shared memory (costly, 20%), storage (nested in memory, the rest)."""
    return (TierCosts("replicas", block_s=0.02, copy_s=5.0, restore_s=0.4, first_step_s=0.3, survives=0.7),
            TierCosts("memory", block_s=5.0, copy_s=5.0, restore_s=1.7, first_step_s=0.3, survives=0.9),
            TierCosts("storage", block_s=storage.get("block_s", 0.5), copy_s=storage.get("copy_s", 10.0),
                      restore_s=1.2, first_step_s=14.0, nested=True, write_bytes=5e9, requests=100.0))


def test_one_tier_is_young_daly() -> None:
    plan = choose(PlanInputs(STEP, (TierCosts("storage", block_s=2.0),), mtbf_s=3 * H))
    (block,) = plan.blocks
    assert block.period_s == pytest.approx(math.sqrt(2 * 2.0 * 3 * H)) == block.young_daly_s
    assert block.daly_s == pytest.approx(daly(2.0, 3 * H)) and block.bound is None
    assert plan.periods == (round(block.period_s / STEP),)


def test_each_tier_serves_the_failures_it_is_the_fastest_survivor_of() -> None:
    plan = choose(PlanInputs(STEP, three_tiers(block_s=10.0), mtbf_s=4 * H))
    by = {b.tiers: b for b in plan.blocks}
    # replicas: 70% of failures, memory: 20%, storage: 10%, each at sqrt(2 x its cost x MTBF / its share)
    assert by[("replicas",)].period_s == pytest.approx(young_daly(0.02, 4 * H / 0.7))
    assert by[("memory",)].period_s == pytest.approx(young_daly(5.0, 4 * H / 0.2))
    assert by[("storage",)].period_s == pytest.approx(young_daly(10.0, 4 * H / 0.1))
    assert [t.share for t in plan.tiers] == pytest.approx([0.7, 0.2, 0.1])
    replicas, memory, storage = plan.periods
    assert replicas is not None and memory is not None and storage is not None
    assert storage % memory == 0  # nested: persisted from a memory snapshot
    assert plan.feasible and plan.notes == ()


def test_tiers_whose_optima_would_run_out_of_order_are_saved_together() -> None:
    # a persist that costs little wants to be more frequent than the costly memory snapshot it is made from: both
    # are then saved at the steps of one block, at the optimum of their summed cost and failures
    plan = choose(PlanInputs(STEP, three_tiers(block_s=0.5), mtbf_s=4 * H))
    merged = plan.block("memory")
    assert merged.tiers == ("memory", "storage")
    assert merged.period_s == pytest.approx(young_daly(5.5, 4 * H / 0.3))
    assert plan.tier("memory").period_steps == plan.tier("storage").period_steps


@pytest.mark.parametrize(("constraints", "bound", "floor"), [
    (Constraints(), "copy", 600.0),
    (Constraints(storage_Bps=5e9 / 900), "storage bandwidth", 900.0),
    (Constraints(storage_requests_per_s=100 / 1200), "storage requests", 1200.0),
])
def test_a_floor_binds_the_period(constraints: Constraints, bound: str, floor: float) -> None:
    # storage's own optimum is ~85 s; its copy (600 s) or the storage's limits make it longer
    replicas, _, storage = three_tiers(block_s=0.01, copy_s=600.0)
    plan = choose(PlanInputs(STEP, (replicas, replace(storage, nested=False)), mtbf_s=4 * H, constraints=constraints))
    block = plan.block("storage")
    assert block.bound == bound and block.period_s == pytest.approx(floor)
    assert plan.tier("storage").period_steps == math.ceil(floor / STEP - 1e-9)
    assert plan.feasible


def test_shorter_periods_than_a_floor_are_reported_as_breaking_it() -> None:
    inputs = PlanInputs(STEP, three_tiers(), mtbf_s=4 * H, constraints=Constraints(storage_Bps=1e6))
    plan = evaluate(inputs, (20, 400, 400))
    assert not plan.feasible
    assert any("storage every 400 steps" in p and "storage bandwidth" in p for p in plan.problems)


def test_bounds_on_a_period_hold_and_a_fixed_period_is_kept() -> None:
    free = choose(PlanInputs(STEP, three_tiers(), mtbf_s=4 * H))
    r, m, s = free.periods
    assert r is not None and m is not None and s is not None and r > 8
    # the replica tier's overhead budget as a floor above its optimum: the period is the floor, named
    replicas, memory, storage = three_tiers()
    floored = choose(PlanInputs(STEP, (replace(replicas, min_period_s=4 * r * STEP, min_reason="overhead budget"),
                                       memory, storage), mtbf_s=4 * H))
    assert floored.periods[0] == 4 * r and floored.block("replicas").bound == "overhead budget"
    # a cap below the optimum: the cap
    capped = choose(PlanInputs(STEP, (replace(replicas, max_period_s=(r // 2) * STEP), memory, storage), mtbf_s=4 * H))
    assert capped.periods[0] == r // 2 and capped.block("replicas").bound == "bound" and capped.feasible
    # a fixed memory period (floor and cap at 70 steps): kept; storage, nested, is a multiple of it
    fixed = choose(PlanInputs(STEP, (replicas, replace(memory, min_period_s=70 * STEP, max_period_s=70 * STEP),
                                     storage), mtbf_s=4 * H))
    assert fixed.periods[1] == 70 and fixed.periods[2] is not None and fixed.periods[2] % 70 == 0
    # a fixed storage period under the memory tier's optimum: the two are saved together at it
    pinned = choose(PlanInputs(STEP, (replicas, memory, replace(storage, min_period_s=40 * STEP,
                                                                max_period_s=40 * STEP)), mtbf_s=4 * H))
    assert pinned.periods[1:] == (40, 40) and pinned.feasible
    # periods over a cap are a broken constraint
    over = evaluate(PlanInputs(STEP, (replace(replicas, max_period_s=10 * STEP), memory, storage), mtbf_s=4 * H),
                    (20, m, s))
    assert any("replicas every 20 steps" in p and "longer than its bound" in p for p in over.problems)
    with pytest.raises(ValueError, match="max_period_s"):
        TierCosts("x", block_s=1.0, max_period_s=0.0)


def test_a_host_memory_budget_leaves_an_optional_tier_off() -> None:
    tiers = tuple(t if t.name == "storage" else replace(t, optional=True, host_bytes=10e9) for t in three_tiers())
    free = choose(PlanInputs(STEP, tiers, mtbf_s=4 * H))
    assert None not in free.periods
    tight = choose(PlanInputs(STEP, tiers, mtbf_s=4 * H, constraints=Constraints(host_memory_bytes=15e9)))
    assert tight.feasible and sum(p is None for p in tight.periods) == 1
    # the tier left is the one worth more: replicas serve 70% of failures for almost nothing
    assert tight.tier("memory").period_steps is None and "memory off" in tight.notes
    # the memory tier's failures go to storage, which now takes a snapshot of its own (its cost and memory's)
    assert tight.tier("storage").share == pytest.approx(0.3)
    assert tight.block("storage").save_cost_s == pytest.approx(5.5)
    assert tight.expected.goodput < free.expected.goodput
    none_fit = choose(PlanInputs(STEP, tiers, mtbf_s=4 * H, constraints=Constraints(host_memory_bytes=1e9)))
    assert none_fit.periods[:2] == (None, None) and none_fit.feasible


def test_a_bound_on_steps_lost_shortens_the_periods() -> None:
    inputs = PlanInputs(STEP, three_tiers(), mtbf_s=4 * H)
    free = choose(inputs)
    bound = free.expected.lost_steps / 3
    bounded = choose(PlanInputs(STEP, three_tiers(), mtbf_s=4 * H, constraints=Constraints(max_lost_steps=bound)))
    assert bounded.feasible and bounded.expected.lost_steps <= bound
    assert bounded.expected.lost_steps > 0.9 * bound  # the smallest change that meets it
    assert all(b <= f for b, f in zip(bounded.periods, free.periods, strict=True) if b is not None and f is not None)
    assert bounded.expected.goodput < free.expected.goodput
    assert any("to keep the steps a failure loses within" in n for n in bounded.notes)
    # a copy longer than the bound allows: no period meets it, and the plan says so
    impossible = choose(PlanInputs(STEP, three_tiers(), mtbf_s=4 * H, constraints=Constraints(max_lost_steps=5)))
    assert not impossible.feasible and "over the bound of 5" in " ".join(impossible.problems)


def test_expected_goodput_adds_up_and_matches_its_formula() -> None:
    inputs = PlanInputs(STEP, (TierCosts("storage", block_s=2.0, copy_s=10.0, restore_s=30.0, first_step_s=20.0),),
                        mtbf_s=2 * H, detect_s=60.0)
    e = evaluate(inputs, (400,)).expected  # 100 s
    lost, recovery = 100 / 2 + 10.0, 60.0 + 30.0 + 20.0
    running = 1 - (lost + recovery) / (2 * H)
    assert e.goodput == pytest.approx(running / (1 + 2.0 / 100))
    assert e.goodput + e.overhead + e.lost + e.recovery == pytest.approx(1.0)
    assert e.lost_steps == pytest.approx(lost / STEP) and e.failures_per_day == pytest.approx(12.0)


@pytest.mark.parametrize("mtbf_h", [0.5, 1, 4, 8, 24])
def test_the_choice_is_the_best_of_its_own_goodput_nearby(mtbf_h: float) -> None:
    inputs = PlanInputs(STEP, three_tiers(block_s=3.0), mtbf_s=mtbf_h * H, detect_s=60.0)
    plan = choose(inputs)
    best = plan.expected.goodput
    r, m, s = plan.periods
    assert r is not None and m is not None and s is not None
    for factor in (0.5, 0.8, 1.25, 2.0):
        for periods in ((max(1, round(r * factor)), m, s), (r, max(r, round(m * factor)), s),
                        (r, m, max(m, round(s / m * factor)) * m)):
            # first order: within a hair of the best nearby (the exact maximum has Daly's corrections)
            assert evaluate(inputs, periods).expected.goodput <= best + 1e-4, periods


def test_no_failures_leave_every_tier_idle_and_inputs_are_checked() -> None:
    plan = choose(PlanInputs(STEP, three_tiers(), mtbf_s=math.inf))
    assert plan.expected.goodput > 0.9 and plan.blocks[0].bound == "idle"
    with pytest.raises(ValueError, match="block_s"):
        TierCosts("x", block_s=-1.0)
    with pytest.raises(ValueError, match="survives"):
        TierCosts("x", block_s=1.0, survives=1.5)
    with pytest.raises(ValueError, match="cannot be nested"):
        PlanInputs(STEP, (TierCosts("storage", 1.0, nested=True),), mtbf_s=H)
    with pytest.raises(ValueError, match="slowest tier on"):
        evaluate(PlanInputs(STEP, three_tiers(), mtbf_s=H), (1, 1, None))
