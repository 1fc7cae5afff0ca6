"""``ckptd advise`` and the runner's autopilot answer from one period model (trainer_client/core/planning): for the
same inputs the advice's first-order periods are the autopilot's, and the advisor keeps no closed form of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptd.advisor._advisor import advise
from tests.support.helpers import REPO
from trainer_client.core import protocol as p
from trainer_client.core.planning import Autopilot, FailureHistory, FailurePrior, TierCosts

CASES = [  # (host_loss_fraction, persist_overhead_s, memory_tier): split tiers, merged ones, no memory tier
    (0.25, 20.0, True), (0.25, 0.0, True), (0.9, 5.0, True), (0.25, 5.0, False),
]


@pytest.mark.parametrize(("q", "overhead", "memory_tier"), CASES)
def test_the_advice_and_the_autopilot_choose_the_same_first_order_periods(q: float, overhead: float,
                                                                          memory_tier: bool) -> None:
    step, stall, persist, mtbf_h = 2.0, 5.0, 30.0, 2.0
    advice = advise(p.AdviceQuery(step_time_s=step, save_stall_s=stall, persist_time_s=persist, restore_time_s=60,
                                  recovery_time_s=60, replace_time_s=600, slices=16, mtbf_hours=mtbf_h,
                                  host_loss_fraction=q, persist_overhead_s=overhead, memory_tier=memory_tier,
                                  min_failures=50, horizon_days=1), points=3)
    if memory_tier:
        tiers = [TierCosts("memory", block_s=stall), TierCosts("storage", overhead, copy_s=persist, nested=True)]
        shares: tuple[float, ...] = (1 - q, q)
    else:
        tiers, shares = [TierCosts("storage", stall + overhead, copy_s=persist)], (1.0,)
    pilot = Autopilot(FailureHistory(FailurePrior(mtbf_s=mtbf_h * 3600, shares=shares)))
    decision = pilot.decide(step, tiers)
    first = decision.plan.blocks[0]
    yd = advice.young_daly
    assert yd.period_s == pytest.approx(first.young_daly_s)
    assert yd.save_cost_s == pytest.approx(first.save_cost_s) and yd.daly_period_s == pytest.approx(first.daly_s)
    if memory_tier:
        assert yd.persistent_period_s == pytest.approx(decision.plan.block("storage").period_s)
        assert decision.plan.tier("storage").first_order_s == pytest.approx(yd.persistent_period_s)
    else:
        assert yd.persistent_period_s is None


def test_the_advisor_keeps_no_period_formula_of_its_own() -> None:
    defined = {node.name for path in Path(REPO, "ckptd").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    assert not defined & {"young_daly", "daly"}
    assert not Path(REPO, "ckptd/advisor/_closed_forms.py").exists()
