"""The closed forms of the optimum checkpoint period (Young 1974, Daly 2006).

The advisor reports them beside the simulated optimum, and the simulator's tests check it against them
where their assumptions hold (exponential failures, restarts from the last save).
"""

from __future__ import annotations

import math


def young_daly(save_cost: float, mtbf: float) -> float:
    """First-order optimum period: sqrt(2 x save cost x MTBF) (Young 1974)."""
    return math.sqrt(2.0 * save_cost * mtbf)


def daly(save_cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum; equals the MTBF when the save cost reaches 2 x MTBF."""
    if save_cost >= 2.0 * mtbf:
        return mtbf
    x = math.sqrt(save_cost / (2.0 * mtbf))
    return math.sqrt(2.0 * save_cost * mtbf) * (1.0 + x / 3.0 + x * x / 9.0) - save_cost


__all__ = ["daly", "young_daly"]
