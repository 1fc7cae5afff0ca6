"""Checkpoint periods from measured costs and failures: one jax-free model for ``ckptd advise`` (its first-order
periods) and the runner's autopilot (its live choice), so that the same inputs get the same answer.

``PlanInputs`` (per tier ``TierCosts``, the MTBF, ``Constraints``) goes to ``choose`` for the best ``Plan``, or to
``evaluate`` for what given periods are worth; ``FailureHistory`` estimates the MTBF and the shares of failures by
tier from a ``FailurePrior`` and the failures seen; ``Autopilot`` re-chooses with hysteresis. docs/planning.md
writes the model down.
"""

from trainer_client.core.planning._autopilot import DEFAULT_MIN_GAIN, FLOOR_MARGIN, FLOOR_WINDOW, Autopilot, Decision
from trainer_client.core.planning._failures import (
    DEFAULT_KEEP,
    EarlierRuns,
    FailureEstimate,
    FailureHistory,
    FailurePrior,
)
from trainer_client.core.planning._inputs import Constraints, PlanInputs, TierCosts
from trainer_client.core.planning._periods import (
    IDLE_MULTIPLE,
    MAX_PERIOD_STEPS,
    Block,
    Expected,
    Plan,
    TierPlan,
    choose,
    daly,
    evaluate,
    young_daly,
)

__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_MIN_GAIN",
    "FLOOR_MARGIN",
    "FLOOR_WINDOW",
    "IDLE_MULTIPLE",
    "MAX_PERIOD_STEPS",
    "Autopilot",
    "Block",
    "Constraints",
    "Decision",
    "EarlierRuns",
    "Expected",
    "FailureEstimate",
    "FailureHistory",
    "FailurePrior",
    "Plan",
    "PlanInputs",
    "TierCosts",
    "TierPlan",
    "choose",
    "daly",
    "evaluate",
    "young_daly",
]
