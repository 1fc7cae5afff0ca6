"""The autopilot in a real elastic run (the demo MLP on 4 fake CPU slices) against a real ckptd: it chooses the
persistent period the config left unset once a save is timed, the runner saves at the periods in force from then on
(and again after a recovery), the replica period the config set stays, and each decision reaches ckptd as an
``autopilot_decided`` event with its fields. Nothing here depends on how fast the machine is: the periods chosen
are read from the events, and every save is checked against the period in force when it was made."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import JOB, elastic_runner, every_sample_once, run_to_end
from trainer_client.core import protocol as p
from trainer_client.runtime.autopilot._autopilot_runner import DEFAULT_CHECKPOINT_PERIOD
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.elastic._elastic import Event
from trainer_client.runtime.slices._slices import SliceFault

pytestmark = pytest.mark.needs_devices(8)

STEPS = 60


def test_the_autopilot_chooses_applies_and_reports_the_periods_left_unset(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    events: list[Event] = []
    runner = elastic_runner(tmp_path, server.url, "pause", [SliceFault(2, at_step=40, down_for_s=0.3)],
                            on_event=events.append, checkpoint_period=None,
                            autopilot=AutopilotOptions(mtbf_hours=0.05))
    assert runner.autopilot.owned == {"storage"}  # the replica period is set (every step), there is no memory tier
    log = TrainLog()
    result = run_to_end(runner, make_train_fn(STEPS, log))
    assert result.pid == os.getpid() and every_sample_once(log, STEPS)
    decided = [e for e in events if e.kind == "autopilot_decided"]
    assert decided, [e.kind for e in events]
    first = decided[0]
    assert first.step is not None and first.step > DEFAULT_CHECKPOINT_PERIOD  # once the first save was timed
    assert first.fields["autopilot_reason"] == "the first choice" and first.fields["autopilot_replicas_period"] == 1
    # every periodic save was made at the period in force then (the training function saves its last step too)
    period = DEFAULT_CHECKPOINT_PERIOD
    for e in events:
        if e.kind == "autopilot_decided":
            period = e.fields["autopilot_storage_period"]
        elif e.kind == "checkpoint_started" and e.step != STEPS:
            assert e.step is not None and e.step % period == 0, (e.step, period)
    assert runner.autopilot.periods.persist == period
    assert runner.replicas is not None and runner.replicas.autopilot_period is None  # the set period is left alone
    # ckptd has them, every field as the runner sent it
    with server.client() as http:  # its url: TCP, or a unix socket (make test-device)
        stored = http.get(p.ROUTE_EVENTS.format(job=JOB), params={"kind": "autopilot_decided"}).json()["events"]
    assert [e["autopilot_storage_period"] for e in stored] == [e.fields["autopilot_storage_period"] for e in decided]
    assert stored[0]["autopilot_mtbf_s"] == pytest.approx(first.fields["autopilot_mtbf_s"])
