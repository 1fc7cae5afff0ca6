"""Goodput from events (ckptd.advisor._goodput): every second of a scripted job history lands in the right cause.

The history (times in seconds from T0; a normal step takes 0.5 s, every save blocks 0.5 s):

run A  0 start, 0.5 slices ready, 1 initialized, 3 first step (1)       -> startup 0.5 + 0.5 + (2 - 0.5)
       8 save 10, 13.5 save 20                                          -> checkpoint 0.5 + 0.5
       16 failure at 25, 16.1 waiting, 20 slices ready                  -> waiting 4
       20.2 plan, 21 restored 20, 24 first step (21), recovered: lost 5  -> restore 1, recompile 3 - 0.5
       29 save 30, 34 finished                                          -> checkpoint 0.5
(no run from 34 to 40)                                                  -> down 6
run B  40 start, 40.5 slices ready, 41 restored 30, 42 first step (31)  -> startup 0.5, restore 0.5, recompile 0.5
       50 finished
A second host (run C) reports the same recovery at the same times: it counts once.
Wall 50 s; badput 19 s + lost 5 x 0.5 s = 21.5 s; goodput 28.5 / 50 = 0.57.
"""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.advisor._goodput import CAUSES, compute_goodput, step_time_from_events
from trainer_client.core.protocol import CheckpointInfo, StepState, StoredEvent, TrainingMetadata

T0 = 1_700_000_000.0


def ev(run: str, t: float, kind: str, step: int | None = None, **fields: Any) -> StoredEvent:
    return StoredEvent(kind=kind, time=T0 + t, step=step, run=run, id=f"{run}:{t}:{kind}", received_at=T0 + t,
                       **fields)


def history() -> list[StoredEvent]:
    recovered = {"recovery_seconds": 8.0, "lost_steps": 5, "restored_step": 20, "mesh_before": [4, 2],
                 "mesh_after": [3, 2]}
    return [
        ev("A", 0, "start"), ev("A", 0.5, "slices_ready"), ev("A", 1, "initialized", 0),
        ev("A", 3, "first_step_done", 1),
        ev("A", 8, "checkpoint_started", 10, blocked_seconds=0.5),
        ev("A", 13.5, "checkpoint_started", 20, blocked_seconds=0.5),
        ev("A", 16, "failure_detected", 25, detail="DATA_LOSS"), ev("A", 16.1, "waiting_for_slices"),
        ev("A", 20, "slices_ready"), ev("A", 20.2, "plan_received", 20), ev("A", 21, "restored", 20),
        ev("A", 24, "first_step_done", 21), ev("A", 24, "recovered", 21, **recovered),
        ev("A", 29, "checkpoint_started", 30, blocked_seconds=0.5), ev("A", 34, "finished", 40),
        ev("C", 16, "failure_detected", 25), ev("C", 20, "slices_ready"), ev("C", 21, "restored", 20),
        ev("C", 24, "first_step_done", 21), ev("C", 24, "recovered", 21, **recovered),
        ev("B", 40, "start"), ev("B", 40.5, "slices_ready"), ev("B", 41, "restored", 30),
        ev("B", 42, "first_step_done", 31), ev("B", 50, "finished", 50),
        StoredEvent(kind="retention_deleted", time=T0 + 60, step=10, received_at=T0 + 60, source="ckptd"),
    ]


def test_every_second_of_the_history_is_attributed() -> None:
    g = compute_goodput("job", history())
    assert (g.window_start, g.window_end, g.wall_seconds) == (T0, T0 + 50, 50)  # ckptd's own event: no run
    assert (g.step_time_s, g.step_time_source) == (pytest.approx(0.5), "events")
    expected = {"startup": 3.0, "waiting": 4.0, "restore": 1.5, "recompile": 3.0, "checkpoint": 1.5,
                "down": 6.0, "lost": 2.5}
    assert g.badput_seconds.model_dump() == pytest.approx(expected)
    assert g.productive_seconds == pytest.approx(28.5)
    assert g.goodput == pytest.approx(0.57)
    assert sum(g.badput.model_dump().values()) + g.goodput == pytest.approx(1.0)
    assert (g.runs, g.recoveries, g.lost_steps, g.events) == (3, 1, 5, 25)
    assert [(round(s.start - T0, 6), round(s.end - T0, 6), s.cause) for s in g.segments] == [
        (0, 2.5, "startup"), (16, 20, "waiting"), (20, 21, "restore"), (21, 23.5, "recompile"), (34, 40, "down"),
        (40, 40.5, "startup"), (40.5, 41, "restore"), (41, 41.5, "recompile")]
    assert g.notes == []


def test_a_given_step_time_wins_and_moves_time_between_recompile_and_lost() -> None:
    g = compute_goodput("job", history(), step_time_s=1.0)
    assert g.step_time_source == "given"
    assert g.badput_seconds.recompile == pytest.approx(2.0 + 0.0)  # (24 - 21) - 1 and (42 - 41) - 1
    assert g.badput_seconds.lost == pytest.approx(5.0)
    assert g.badput_seconds.startup == pytest.approx(0.5 + 0.5 + 1.0 + 0.5)


def test_without_a_step_time_the_steps_of_the_checkpoints_give_it_else_a_note() -> None:
    steady = [e for e in history() if e.kind not in ("checkpoint_started",)]
    assert step_time_from_events([steady]) is None
    checkpoints = [
        CheckpointInfo(step=s, state=StepState.VERIFIED, path=f"/r/job/{s}", training=TrainingMetadata(
            step=s, data_position=0, global_batch=8, mesh={"axis_names": ["data"], "shape": [8]},  # type: ignore[arg-type]
            wall_time=T0 + 0.25 * s))
        for s in (10, 20, 30)
    ]
    from_checkpoints = compute_goodput("job", steady, checkpoints)
    assert (from_checkpoints.step_time_s, from_checkpoints.step_time_source) == (pytest.approx(0.25), "checkpoints")
    assert from_checkpoints.badput_seconds.lost == pytest.approx(5 * 0.25)
    unknown = compute_goodput("job", steady)
    assert unknown.step_time_s is None and unknown.badput_seconds.lost == 0
    assert any("5 lost steps not counted" in n for n in unknown.notes)
    assert unknown.badput_seconds.recompile == pytest.approx(3.0 + 1.0)  # the whole first step


def test_no_trainer_events_means_no_goodput_not_a_made_up_one() -> None:
    only_ckptd = [e for e in history() if e.source == "ckptd"]
    for events in ([], only_ckptd):
        g = compute_goodput("job", events)
        assert g.goodput is None and g.wall_seconds == 0 and g.notes
        assert all(v == 0 for v in g.badput_seconds.model_dump().values())
    assert set(CAUSES) == set(compute_goodput("job", []).badput.model_dump())


def test_a_run_still_in_progress_counts_up_to_its_last_event() -> None:
    running = [e for e in history() if e.run == "A" and e.time <= T0 + 22]  # mid-restore
    g = compute_goodput("job", running)
    assert g.window_end == T0 + 21 and g.wall_seconds == 21
    assert g.badput_seconds.restore == pytest.approx(1.0)
    assert g.recoveries == 0
