"""``python -m soak.autopilot``'s schedule and verdicts (soak/autopilot.py), on a scripted run's events: the periods
in force are read per step from the decisions, compared before the rate rose and over the second half after it, and
the steps lost at each failure against what the decision in force expected. The run itself (two minutes on a 2-core
machine) is the script's, recorded in docs/planning.md, "Autopilot in a run"."""

from __future__ import annotations

from typing import Any

from soak.autopilot import faults, in_force, verdicts
from trainer_client.runtime.elastic._run_record import ElasticResult, Event, Recovery


def _decided(step: int, memory: int, storage: int, lost: float, storage_bound: str | None = None) -> Event:
    return Event("autopilot_decided", step, float(step), fields={
        "autopilot_memory_period": memory, "autopilot_storage_period": storage, "autopilot_mtbf_s": 5.0,
        "autopilot_lost_steps": lost, "autopilot_goodput_before": None, "autopilot_goodput_after": 0.9,
        "autopilot_storage_bound": storage_bound})


def _failure(at: int, lost: int) -> Recovery:
    return Recovery("slice_down", at, 0.0, restored_step=at - lost, lost_steps=lost, restored_from="memory")


def _result(events: list[Event], recoveries: list[Recovery]) -> ElasticResult[Any]:
    return ElasticResult(None, 1, events, recoveries, 100)


def test_the_failures_come_more_often_after_the_change_each_on_another_slice() -> None:
    schedule = faults(100, 50, 20, 10)
    assert [f.at_step for f in schedule] == [20, 40, 60, 70, 80]
    assert {f.slice_index for f in schedule} <= {1, 2, 3} and schedule[0].slice_index != schedule[1].slice_index


def test_periods_in_force_are_read_per_step() -> None:
    decided = [_decided(10, 8, 16, 5.0), _decided(30, 4, 8, 3.0)]
    assert in_force(decided, 0, 10) == {"replicas": None, "memory": None, "storage": None}  # none in force yet
    assert in_force(decided, 10, 40) == {"replicas": None, "memory": 8, "storage": 16}  # 20 steps of 8, 10 of 4
    assert in_force(decided, 30, 40)["memory"] == 4


def test_the_verdicts() -> None:
    shorter = _result([_decided(10, 8, 16, 5.0), _decided(60, 4, 16, 3.0)], [_failure(20, 4), _failure(70, 2)])
    out = verdicts(shorter, 100, 50)
    assert out["periods_before_the_change"]["memory"] == 8 and out["periods_late_after_it"]["memory"] == 4
    assert out["periods_moved_the_right_way"] and out["lost_within_prediction"]
    assert (out["mean_lost_steps"], out["mean_predicted_lost_steps"]) == (3.0, 4.0)
    longer = _result([_decided(10, 8, 16, 5.0), _decided(60, 4, 32, 3.0)], [_failure(20, 9), _failure(70, 2)])
    out = verdicts(longer, 100, 50)  # storage lengthened; and more lost than expected
    assert not out["periods_moved_the_right_way"] and not out["lost_within_prediction"]
    unmoved = verdicts(_result([_decided(10, 8, 16, 5.0)], []), 100, 50)
    assert not unmoved["periods_moved_the_right_way"] and not unmoved["lost_within_prediction"]  # nothing to judge


def test_a_period_at_its_floor_late_is_not_judged_and_is_named() -> None:
    # storage lengthened because its floor (the persist's time) rose: the memory tier's answer is what is judged
    floor_rose = _result([_decided(10, 8, 16, 5.0), _decided(60, 4, 20, 3.0, storage_bound="copy")], [_failure(70, 2)])
    out = verdicts(floor_rose, 100, 50)
    assert out["set_by_a_floor_late"] == {"storage": "copy"}
    assert out["periods_moved_the_right_way"]
    # the same lengthening chosen freely still fails
    assert not verdicts(_result([_decided(10, 8, 16, 5.0), _decided(60, 4, 20, 3.0)], [_failure(70, 2)]), 100,
                        50)["periods_moved_the_right_way"]
    # a floor in force only on a few late steps does not take the tier out
    brief = _result([_decided(10, 8, 16, 5.0), _decided(60, 4, 20, 3.0, storage_bound="copy"),
                     _decided(80, 4, 20, 3.0)], [_failure(70, 2)])
    assert verdicts(brief, 100, 50)["set_by_a_floor_late"] == {}
    # every tier at its floor late: nothing left to judge, not a pass
    all_floors = _result([_decided(10, 8, 16, 5.0), _decided(60, 4, 20, 3.0, storage_bound="copy")], [])
    fields = all_floors.events[1].fields
    fields["autopilot_memory_bound"] = "copy"
    assert not verdicts(all_floors, 100, 50)["periods_moved_the_right_way"]

