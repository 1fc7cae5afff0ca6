"""The advisor's ``spare`` policy with measured costs: the switch to a hot spare comes from the job's events.

A run with ``ElasticOptions.spare_slices`` reports ``recovered`` with ``spares_used``; the time from
``failure_detected`` to ``slices_ready`` in those recoveries is what the spare policy waits instead of a
replacement (its restore and recompile are measured as for any recovery). The advisor takes it from the
history instead of its 60 s assumption, and the spare policy's goodput follows.
"""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.advisor._advisor import advise
from ckptd.advisor._job_history import event_measures, job_history
from trainer_client.core import protocol as p

T0 = 1_700_000_000.0


def _events(spare_wait: float, *, spares: bool = True) -> list[p.StoredEvent]:
    """A run with two recoveries on the same mesh: a spare took over (or not) after ``spare_wait`` seconds."""
    ev: list[tuple[str, float, dict[str, Any]]] = [
        ("start", 0.0, {}), ("slices_ready", 1.0, {}), ("initialized", 2.0, {}), ("first_step_done", 3.0, {}),
    ]
    for t in (100.0, 300.0):
        ev += [("failure_detected", t, {}), ("waiting_for_slices", t + 0.1, {}),
               ("slices_ready", t + spare_wait, {}), ("plan_received", t + spare_wait + 0.1, {}),
               ("restored", t + spare_wait + 0.5, {"tier": "memory"}), ("first_step_done", t + spare_wait + 1.5, {}),
               ("recovered", t + spare_wait + 1.5, {"mesh_before": [3, 2], "mesh_after": [3, 2],
                                                    "spares_used": [3] if spares else None})]
    return [p.StoredEvent(kind=kind, time=T0 + dt, run="r1", id=str(i), received_at=T0 + dt, **fields)
            for i, (kind, dt, fields) in enumerate(ev)]


def test_the_spare_switch_is_measured_from_recoveries_that_used_a_spare() -> None:
    measured = event_measures(_events(0.4))
    assert measured["spare_switch_time_s"].value == pytest.approx(0.4)
    assert "over 2" in measured["spare_switch_time_s"].note
    assert measured["memory_restore_time_s"].value == pytest.approx(0.5)
    # a pause that waited for the slice itself is no spare switch
    assert "spare_switch_time_s" not in event_measures(_events(40.0, spares=False))
    assert job_history([], _events(0.4)).spare_switch_time_s is not None


def test_the_spare_policy_uses_the_measured_switch_instead_of_the_assumed_one() -> None:
    given = dict(step_time_s=2.0, save_stall_s=5.0, persist_time_s=30.0, restore_time_s=60.0, recovery_time_s=60.0,
                 replace_time_s=3600.0, slices=16, mtbf_hours=6.0, min_failures=300)
    assumed = advise(p.AdviceQuery(**given), points=7)
    measured = advise(p.AdviceQuery(**given), job_history([], _events(0.4)), points=7)
    assert assumed.inputs["spare_switch_time_s"].source == "default"
    source = measured.inputs["spare_switch_time_s"]
    assert (source.source, source.value) == ("history", pytest.approx(0.4))
    spare = {a.policy: a for a in measured.policies}["spare"]
    spare_assumed = {a.policy: a for a in assumed.policies}["spare"]
    assert spare.badput.waiting < spare_assumed.badput.waiting
    assert spare.goodput > spare_assumed.goodput
