"""trainer_client's background event reporter: training never waits on ckptd, events arrive once, in
order, in bounded batches; a ckptd that is down or hung costs dropped events, never a blocked step. And
the elastic runner, end to end against a real ckptd: its recovery is stored, served and turned into
goodput and metrics.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.elastic_mlp import TrainLog, jitted_step, make_train_fn
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._event_reporter import EventReporter
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.runtime.autopilot._autopilot_runner import EarlierRunsAsked
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault


class Recorder:
    """An httpx transport standing in for ckptd: answers from a script, records what it got."""

    def __init__(self, statuses: list[int | str] | None = None, gate: threading.Event | None = None) -> None:
        self.statuses = list(statuses or [])
        self.gate = gate
        self.calls: list[tuple[float, httpx.Request, list[dict[str, Any]]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.gate is not None:
            self.gate.wait(10)
        events = json.loads(request.content)["events"]
        self.calls.append((time.monotonic(), request, events))
        status = self.statuses.pop(0) if self.statuses else 200
        if status == "drop":
            raise httpx.ConnectError("connection refused", request=request)
        assert isinstance(status, int)
        return httpx.Response(status, json={"job": "j", "accepted": len(events), "duplicates": 0})

    def delivered(self) -> list[dict[str, Any]]:
        return [e for _, _, events in self.calls for e in events]


def _reporter(recorder: Recorder | None = None, url: str = "http://ckptd.test", **kw: Any) -> EventReporter:
    settings = ClientSettings(url=url, token="tok", timeout_s=0.5)
    transport = httpx.MockTransport(recorder) if recorder is not None else None
    return EventReporter(settings, "j", transport=transport, **kw)


def _report(reporter: EventReporter, n: int, start: int = 0) -> float:
    """Report n events; the seconds it took the caller."""
    t = time.perf_counter()
    for i in range(start, start + n):
        reporter.report("checkpoint_started", time=1000.0 + i, step=i, blocked_seconds=0.01)
    return time.perf_counter() - t


def test_events_arrive_once_in_order_in_bounded_batches_with_the_token() -> None:
    recorder = Recorder()
    reporter = _reporter(recorder, batch_size=200)
    with reporter._cond:  # hold the thread back until all are queued, so the batching is deterministic
        _report(reporter, 450)
    assert reporter.flush(5) is True
    assert [len(events) for _, _, events in recorder.calls] == [200, 200, 50]
    delivered = recorder.delivered()
    assert [e["step"] for e in delivered] == list(range(450))
    assert len({e["id"] for e in delivered}) == 450 and {e["run"] for e in delivered} == {reporter.run_id}
    assert {e["pid"] for e in delivered} == {os.getpid()}
    request = recorder.calls[0][1]
    assert request.url.path == "/v1/jobs/j/events" and request.headers["authorization"] == "Bearer tok"
    assert (reporter.sent, reporter.dropped, reporter.pending) == (450, 0, 0)
    assert reporter.close(1) is True


def test_no_answer_and_5xx_are_retried_with_growing_backoff() -> None:
    recorder = Recorder(["drop", 503, 500, 200])
    reporter = _reporter(recorder, initial_backoff_s=0.05)
    with reporter._cond:  # one batch of 5
        _report(reporter, 5)
    deadline = time.monotonic() + 30  # a wait, not a bound: ~0.4 s of backoffs
    while reporter.sent < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (reporter.sent, reporter.failures, reporter.dropped) == (5, 3, 0)
    times = [t for t, _, _ in recorder.calls]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 4 and gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2  # doubling backoff
    assert [e["step"] for e in recorder.delivered()[-5:]] == [0, 1, 2, 3, 4]
    reporter.close(1)


def test_a_refusal_drops_the_batch_instead_of_retrying_it(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder([422])
    reporter = _reporter(recorder)
    with caplog.at_level(logging.WARNING, logger="trainer_client.client._event_reporter"):
        with reporter._cond:  # one batch of 3
            _report(reporter, 3)
        reporter.flush(5)
    assert len(recorder.calls) == 1 and (reporter.sent, reporter.dropped) == (0, 3)
    assert "ckptd refused 3 event(s)" in caplog.text
    reporter.close(1)


def test_events_of_a_job_not_on_storage_yet_are_kept_until_it_is(tmp_path: Path, ckptd_server: Any) -> None:
    # no token: ckptd creates no job from an event post; the job appears with its first save
    server = ckptd_server(tmp_path)
    reporter = EventReporter(ClientSettings(url=server.url, timeout_s=2.0), "fresh", initial_backoff_s=0.05,
                             max_backoff_s=0.2)
    try:
        _report(reporter, 3)
        deadline = time.monotonic() + 30  # a wait, not a bound
        while reporter.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (reporter.sent, reporter.dropped, reporter.pending) == (0, 0, 3)  # refused for now, kept
        (tmp_path / "fresh").mkdir()  # what the first save does
        assert reporter.flush(10) is True
        assert (reporter.sent, reporter.dropped) == (3, 0)
    finally:
        reporter.close(1)
    with httpx.Client(base_url=server.url) as http:
        assert len(http.get("/v1/jobs/fresh/events").json()["events"]) == 3


def test_a_ckptd_that_stays_down_costs_dropped_events_never_time(
    tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = _reporter(url=f"http://127.0.0.1:{tcp_port}", max_buffer=50, initial_backoff_s=0.01)
    with caplog.at_level(logging.INFO, logger="trainer_client.client._event_reporter"):
        _report(reporter, 200)  # queued, not sent: the loop never waits on a ckptd that is down
        assert reporter.pending <= 50 and reporter.dropped >= 150 and reporter.sent == 0
        started = time.monotonic()
        assert reporter.flush(10) is False  # gives up at the first failed attempt, not after 10 s
        assert time.monotonic() - started < 5
        assert reporter.close(0.1) is False
    assert (reporter.dropped, reporter.pending, reporter.sent) == (200, 0, 0)
    assert "the event buffer is full" in caplog.text and "the run ended before ckptd took them" in caplog.text
    # a run without ckptd is told so, not warned: no ckptd ever answered it
    assert {r.levelno for r in caplog.records} == {logging.INFO} and "no ckptd answered this run" in caplog.text


def test_events_dropped_after_ckptd_took_some_are_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder([200] + ["drop"] * 50)  # ckptd answers once, then is gone
    reporter = _reporter(recorder, initial_backoff_s=0.01)
    _report(reporter, 1)
    assert reporter.flush(10) is True
    with caplog.at_level(logging.INFO, logger="trainer_client.client._event_reporter"):
        _report(reporter, 2, start=1)
        assert reporter.close(0.1) is False
    assert (reporter.sent, reporter.dropped) == (1, 2)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "the run ended before ckptd took them" in caplog.text


def test_a_hung_ckptd_does_not_hold_the_training_loop() -> None:
    gate = threading.Event()
    recorder = Recorder(gate=gate)
    reporter = _reporter(recorder)
    # every report returns while ckptd holds the first request: had one waited on it, this would never return
    _report(reporter, 100)
    assert reporter.sent == 0 and recorder.delivered() == []
    started = time.monotonic()
    assert reporter.flush(0.3) is False
    assert 0.25 < time.monotonic() - started < 2
    gate.set()
    assert reporter.flush(5) is True
    assert [e["step"] for e in recorder.delivered()] == list(range(100))
    reporter.close(1)


def test_an_invalid_event_is_logged_and_skipped_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    reporter = _reporter(recorder)
    with caplog.at_level(logging.WARNING, logger="trainer_client.client._event_reporter"):
        reporter.report("Not A Kind", time=1.0)
        reporter.report("recovered", time=1.0, lost_steps=-1)
        reporter.report("start", time=2.0, detail="x" * 5000)  # too long: cut, not refused
    assert reporter.flush(5)
    assert [e["kind"] for e in recorder.delivered()] == ["start"]
    assert len(recorder.delivered()[0]["detail"]) == 2000
    assert caplog.text.count("not reported") == 2
    reporter.close(1)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_elastic_runner_reports_a_recovery_that_ckptd_turns_into_goodput(
    tmp_path: Path, ckptd_server: Any
) -> None:
    jitted_step.cache_clear()  # the recovery must compile (the recompile badput below is measured)
    jax.clear_caches()
    server = ckptd_server(tmp_path)
    (tmp_path / "mlp").mkdir()
    config = ElasticConfig(job="mlp", mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48,
                           checkpoint_period=5, elastic=ElasticOptions(policy="resize", elastic_timeout_s=30),
                           health=HealthOptions(poll_interval_s=0.05),
                           memory_tier=MemoryTierOptions(replicas=ReplicaOptions(enabled=False)),  # from storage
                           compilation=CompilationOptions(precompile=False))  # no background compiles competing
    client = CkptdClient(ClientSettings(url=server.url, timeout_s=2.0, resume_deadline_s=3.0), root=str(tmp_path))
    runner = ElasticRunner(config, slices=SimulatedSlices(num_slices=4, faults=[SliceFault(3, 12, None)]),
                           client=client, checkpoint_dir=str(tmp_path / "mlp"))
    try:
        result = runner.run(make_train_fn(16, TrainLog()))
    finally:
        runner.checkpointer.close()
        client.close()
    assert runner.reporter is not None and (runner.reporter.dropped, runner.reporter.pending) == (0, 0)

    with server.client() as http:  # run() returned: its events are on storage already
        events = p.EventList.model_validate(http.get("/v1/jobs/mlp/events").json()).events
        kinds = [e.kind for e in events]
        assert kinds[0] == "start" and kinds[-1] == "finished" and len(events) == len(result.events)
        for kind in ("initialized", "failure_detected", "slices_ready", "plan_received", "restored", "recovered"):
            assert kind in kinds, kind
        assert {e.pid for e in events} == {os.getpid()} and len({e.run for e in events}) == 1
        (recovered,) = [e for e in events if e.kind == "recovered"]
        rec = result.recoveries[0]
        assert (recovered.lost_steps, recovered.restored_step, recovered.mesh_before, recovered.mesh_after) == (
            2, 10, [4, 2], [3, 2])
        assert recovered.recovery_seconds == pytest.approx(rec.seconds)
        assert recovered.restored_from == f"storage: {tmp_path / 'mlp' / '10'}" == rec.restored_from
        saves = [e for e in events if e.kind == "checkpoint_started"]
        assert [e.step for e in saves][:3] == [5, 10, 15] and all(e.blocked_seconds for e in saves)
        assert {e.tier for e in saves} == {"storage"}  # where each save went, as a field (the dashboard's lanes)
        assert {e.tier for e in events if e.kind == "restored"} == {"storage"}

        goodput = p.Goodput.model_validate(http.get("/v1/jobs/mlp/goodput").json())
        assert goodput.recoveries == 1 and goodput.lost_steps == 2 and goodput.step_time_source == "events"
        assert 0 < goodput.goodput < 1  # type: ignore[operator]
        bad = goodput.badput_seconds
        assert bad.restore > 0 and bad.recompile > 0 and bad.checkpoint > 0 and bad.lost > 0
        assert bad.waiting + bad.restore + bad.recompile <= recovered.recovery_seconds + 0.05  # type: ignore[operator]
        metrics = _samples(http.get("/metrics").text)
        assert metrics[("ckptd_elastic_events_total", (("ckpt_job", "mlp"), ("kind", "recovered")))] == 1
        assert metrics[("ckptd_lost_steps_total", (("ckpt_job", "mlp"),))] == 2
        assert metrics[("ckptd_save_stall_seconds_count", (("ckpt_job", "mlp"),))] == len(saves)

    # the job's next run learns from ckptd what this one saw: its autopilot's prior (docs/planning.md)
    with CkptdClient(ClientSettings(url=server.url, timeout_s=2.0)) as again:
        asked = EarlierRunsAsked(again, "mlp")
        assert asked.wait(30) and asked.value is not None
        assert asked.value.failures == 1
        assert asked.value.running_s == pytest.approx(goodput.wall_seconds - goodput.badput_seconds.down)
        assert asked.value.running_s > 0
