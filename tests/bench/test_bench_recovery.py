"""The recovery benchmark's phases (bench/recovery.py): consecutive, from the runner's events and the bench's
own marks, summing to the time from the first mark to the last; a missing event is an error, not a zero."""

from __future__ import annotations

import itertools

import pytest

from bench.recovery import INPROCESS_PHASES, RELAUNCH_PHASES, event_marks, split_phases


def test_the_phases_are_consecutive_and_sum_to_the_whole() -> None:
    for spec in (INPROCESS_PHASES, RELAUNCH_PHASES):
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spec)), spec
        marks = {mark: float(i) ** 2 for i, mark in enumerate([spec[0][1], *(b for _, _, b in spec)])}
        phases = split_phases(marks, spec)
        assert list(phases) == [name for name, _, _ in spec]
        assert sum(phases.values()) == pytest.approx(marks[spec[-1][2]] - marks[spec[0][1]])


def test_the_in_process_marks_are_the_events_after_the_failure() -> None:
    """The first attempt's own ``first_step_done`` (before the failure) is not the recovery's."""
    timeline = [("start", 1.0), ("first_step_done", 2.0), ("failure_detected", 5.0), ("waiting_for_slices", 5.5),
                ("slices_ready", 5.6), ("plan_received", 5.7), ("restored", 5.9), ("first_step_done", 6.0)]
    marks = event_marks(timeline, after=4.9)
    marks["raised"] = 4.9
    phases = split_phases(marks, INPROCESS_PHASES)
    assert phases["first_step"] == pytest.approx(0.1)
    assert sum(phases.values()) == pytest.approx(1.1)


def test_a_missing_event_is_an_error() -> None:
    with pytest.raises(ValueError, match="restored"):
        split_phases({"raised": 0.0, "failure_detected": 0.1, "waiting_for_slices": 0.2, "slices_ready": 0.3,
                      "plan_received": 0.4, "first_step_done": 0.5}, INPROCESS_PHASES)
