"""The goodput advisor: first-order periods, policy choice, history, and its CLI and HTTP faces."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptd.advisor._advisor import advise, resolve_inputs
from ckptd.advisor._job_history import job_history
from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main
from ckptd.errors import MissingInputs
from ckptd.events._events import EventStore
from tests.support.helpers import REPO
from tests.support.server import app_over
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage

# Costs every scenario shares; each test sets the failure rate, the slices and what it is about.
BASE: dict[str, Any] = dict(step_time_s=2.0, save_stall_s=5.0, persist_time_s=30.0, restore_time_s=60.0,
                            recovery_time_s=60.0, min_failures=300)
FAST = 9  # sweep points


def query(**values: Any) -> p.AdviceQuery:
    return p.AdviceQuery(**{**BASE, **values})


def by_policy(advice: p.Advice) -> dict[str, p.PolicyAdvice]:
    return {a.policy: a for a in advice.policies}


# ---- first-order periods and their confirmation ---------------------------------------------------------


def test_young_daly_is_sqrt_of_two_save_cost_mtbf_and_the_simulation_agrees() -> None:
    advice = advise(query(slices=16, mtbf_hours=20, replace_time_s=600, memory_tier=False, save_stall_s=30,
                          min_failures=1500))
    assert advice.young_daly.period_s == pytest.approx(math.sqrt(2 * 30 * 20 * 3600))
    assert advice.young_daly.persistent_period_s is None
    for a in advice.policies:
        assert a.memory_period_s is None
        assert a.persistent_period_s == pytest.approx(advice.young_daly.period_s, rel=0.10)
        assert a.persistent_period_steps == round(a.persistent_period_s / 2.0)
    assert advice.disagreement == []
    assert any("within 10% of Young/Daly" in r for r in advice.reasoning)


def test_says_why_young_daly_and_the_simulation_disagree_when_failures_are_frequent() -> None:
    advice = advise(query(slices=16, mtbf_hours=1, save_stall_s=600, replace_time_s=600, memory_tier=False,
                          min_failures=2000))
    best = by_policy(advice)[advice.recommended]
    assert best.persistent_period_s < 0.9 * advice.young_daly.period_s
    assert advice.young_daly.daly_period_s < advice.young_daly.period_s
    assert advice.disagreement, advice.reasoning
    assert f"Under {best.policy} the simulated optimum" in " ".join(advice.disagreement)
    assert any("Failures are frequent" in r and "Daly's higher-order estimate" in r for r in advice.disagreement)


def test_a_memory_tier_snapshots_more_often_than_it_persists() -> None:
    # Persisting steals 20 s of training; a quarter of failures lose host memory and fall back to it.
    advice = advise(query(slices=16, mtbf_hours=2, replace_time_s=600, persist_overhead_s=20.0,
                          host_loss_fraction=0.25))
    mtbf = 2 * 3600.0
    assert advice.young_daly.period_s == pytest.approx(math.sqrt(2 * 5.0 * mtbf / 0.75))
    assert advice.young_daly.persistent_period_s == pytest.approx(math.sqrt(2 * 20.0 * mtbf / 0.25))
    for a in advice.policies:
        assert a.memory_period_steps is not None
        assert a.persistent_period_steps >= 2 * a.memory_period_steps
        assert a.memory_period_s == pytest.approx(advice.young_daly.period_s, rel=0.25)


# ---- the policy choice ------------------------------------------------------------------------------


def test_recommends_resize_when_replacing_a_slice_takes_longer_than_the_mtbf() -> None:
    advice = advise(query(slices=16, mtbf_hours=4, replace_time_s=8 * 3600, resize_recovery_time_s=120),
                    points=FAST)
    pol = by_policy(advice)
    assert advice.recommended == "resize"
    assert pol["pause"].badput.waiting > 0.5  # most of the time spent waiting for slices
    assert pol["resize"].goodput > pol["pause"].goodput + 0.3
    assert any(r.startswith("Resize, because replacing a slice takes 8 h") for r in advice.reasoning)


def test_recommends_pause_when_degraded_running_is_expensive() -> None:
    # Two slices: losing one leaves 25% throughput (half the chips at half efficiency), and the resize
    # recompile takes 20 min while a replacement comes in 5.
    advice = advise(query(slices=2, mtbf_hours=10, replace_time_s=300, resize_recovery_time_s=1200,
                          degraded_efficiency=0.5), points=FAST)
    pol = by_policy(advice)
    assert advice.recommended == "pause"
    assert pol["resize"].badput.degraded + pol["resize"].badput.recompile > pol["pause"].badput.waiting
    # a spare would beat pause on raw goodput, but it is a third of the chips: charged per provisioned chip
    assert pol["spare"].goodput_per_chip == pytest.approx(pol["spare"].goodput * 2 / 3)
    assert pol["spare"].goodput_per_chip < pol["pause"].goodput_per_chip
    assert any(r.startswith("Pause, because running on 1 of 2 slices") for r in advice.reasoning)


def test_recommends_a_hot_spare_when_replacement_is_slow_and_resharding_expensive() -> None:
    advice = advise(query(slices=64, mtbf_hours=6, replace_time_s=3600, resize_recovery_time_s=900,
                          spare_switch_time_s=30), points=FAST)
    pol = by_policy(advice)
    assert advice.recommended == "spare"
    assert pol["spare"].downtime_per_failure_s < pol["resize"].downtime_per_failure_s
    assert pol["spare"].goodput_per_chip > max(pol["pause"].goodput_per_chip, pol["resize"].goodput_per_chip)


def test_lost_steps_per_failure_follow_the_period() -> None:
    advice = advise(query(slices=8, mtbf_hours=10, replace_time_s=600, memory_tier=False, min_failures=1000),
                    points=FAST)
    for a in advice.policies:
        # about half a period, plus a persist time (15 steps) for failures before the newest save is persisted
        half = a.persistent_period_steps / 2
        assert half < a.lost_steps_per_failure < half + 15 + 0.15 * half
        assert sum(a.badput.model_dump().values()) + a.goodput == pytest.approx(1.0)


# ---- inputs --------------------------------------------------------------------------------------------


def test_names_the_missing_inputs() -> None:
    with pytest.raises(MissingInputs) as info:
        advise(p.AdviceQuery(step_time_s=1.0, save_stall_s=1.0))
    assert info.value.names == ["persist_time_s", "restore_time_s", "recovery_time_s", "replace_time_s", "slices",
                                "mtbf_hours|failures_per_slice_day"]
    # inputs that contradict each other are given a meaning, not refused: tests/server/api/test_schema_rules.py


def test_inputs_say_where_they_come_from() -> None:
    inputs = resolve_inputs(query(slices=64, failures_per_slice_day=0.5, replace_time_s=60))
    assert inputs["save_stall_s"].source == "given"
    assert inputs["detect_time_s"].source == "default" and inputs["detect_time_s"].note.startswith("assumption")
    assert inputs["mtbf_hours"].source == "derived"
    assert inputs["mtbf_hours"].value == pytest.approx(24 / (0.5 * 64))
    assert inputs["memory_restore_time_s"].value == 5.0  # = the save stall
    assert inputs["scale_up_time_s"].value == 5.0 + 60.0


def _committed_step(job_dir: Path, step: int, wall: float, *, persist: float = 42.0,
                    slices: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """A finalized step directory in Orbax's layout with ckptd training metadata (no array bytes)."""
    d = job_dir / str(step)
    (d / "default").mkdir(parents=True)
    training = {"step": step, "data_position": step * 64, "global_batch": 64,
                "mesh": {"axis_names": ["replica", "data"], "shape": [4, 2]}, "slices": list(slices),
                "wall_time": wall}
    meta = {"item_handlers": {"default": "x"}, "commit_timestamp_nsecs": int((wall + persist) * 1e9),
            "custom_metadata": {"ckptd": training}}
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    (d / "default" / "_METADATA").write_text("{}")
    (d / "commit_success.txt").write_text("ok")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Job ``llm``: saves every 100 steps, 610 s apart (6.1 s per step), committed 42 s after they began, on 4
    slices. Job ``bare``: one step, no history to speak of."""
    root = tmp_path / "root"
    for i, step in enumerate((100, 200, 300, 400)):
        _committed_step(root / "llm", step, 1_700_000_000.0 + 610.0 * i)
    _committed_step(root / "bare", 7, 1_700_000_000.0)
    return root


def test_history_gives_step_time_persist_time_slices_and_period(root: Path) -> None:
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()
    hist = job_history(cat.checkpoints("llm"))
    assert hist.step_time_s is not None and hist.step_time_s.value == pytest.approx(6.1)
    assert hist.persist_time_s is not None and hist.persist_time_s.value == pytest.approx(42.0, abs=1e-3)
    assert hist.slices is not None and hist.slices.value == 4
    assert hist.checkpoint_period_steps is not None and hist.checkpoint_period_steps.value == 100
    bare = job_history(cat.checkpoints("bare"))
    assert bare.step_time_s is None and bare.checkpoint_period_steps is None and bare.slices is not None
    assert job_history([]).values() == {}


def _elastic_events(job_dir: Path) -> None:
    """Events of job ``llm`` (6.1 s per step): a start restored from storage, three saves, a recovery from
    storage on the same mesh and one from host memory onto a smaller mesh."""
    t = 1_700_000_000.0
    ev = [
        ("start", 0.0, {}), ("slices_ready", 1.0, {}), ("restored", 3.0, {"detail": "from storage: /ckpt/llm/100"}),
        ("first_step_done", 13.0, {}),  # a new process: its first step counts for no recompile
        ("checkpoint_started", 20.0, {"blocked_seconds": 1.5}), ("checkpoint_started", 30.0, {"blocked_seconds": 2.5}),
        ("checkpoint_started", 40.0, {"blocked_seconds": 0.5}),
        ("failure_detected", 50.0, {}), ("waiting_for_slices", 51.0, {}), ("slices_ready", 80.0, {}),
        ("plan_received", 81.0, {}), ("restored", 84.0, {"detail": "from storage: /ckpt/llm/200"}),
        ("first_step_done", 110.0, {}),
        ("recovered", 110.0, {"recovery_seconds": 60.0, "mesh_before": [4, 2], "mesh_after": [4, 2]}),
        ("failure_detected", 200.0, {}), ("slices_ready", 201.0, {}),
        ("restored", 202.5, {"detail": "from memory: /dev/shm/ckptd/llm/300"}), ("first_step_done", 240.0, {}),
        ("recovered", 240.0, {"recovery_seconds": 40.0, "mesh_before": [4, 2], "mesh_after": [3, 2]}),
    ]
    EventStore(Storage(str(job_dir.parent))).append(job_dir.name, [
        p.ElasticEvent(kind=kind, time=t + dt, run="r1", id=str(i), **fields)  # type: ignore[arg-type]
        for i, (kind, dt, fields) in enumerate(ev)])


def test_history_gives_stall_restore_and_recompile_times_from_the_events(root: Path) -> None:
    _elastic_events(root / "llm")
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()
    hist = job_history(cat.checkpoints("llm"), EventStore(Storage(str(root))).load("llm")).values()
    assert hist["save_stall_s"].value == pytest.approx(1.5)
    assert hist["restore_time_s"].value == pytest.approx(3.0)  # slices ready -> restored: 2 s and 4 s
    assert hist["memory_restore_time_s"].value == pytest.approx(1.5)
    # restored -> first step, less one step of 6.1 s
    assert hist["recovery_time_s"].value == pytest.approx(26.0 - 6.1)
    assert hist["resize_recovery_time_s"].value == pytest.approx(37.5 - 6.1)
    assert "over 2" in hist["restore_time_s"].note and "storage" in hist["restore_time_s"].note


# ---- the command and the route ----------------------------------------------------------------------


GIVEN = ["--save-stall", "1", "--restore-time", "30", "--recovery-time", "20", "--replace-time", "600",
         "--mtbf-hours", "10", "--min-failures", "200", "--points", "7"]


def test_cli_fills_inputs_from_the_history(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", f"{root}/llm", *GIVEN, "--json"]) == 0
    advice = p.Advice.model_validate_json(capsys.readouterr().out)
    assert advice.job == "llm"
    assert advice.inputs["step_time_s"].source == "history"
    assert advice.inputs["step_time_s"].value == pytest.approx(6.1)
    assert advice.inputs["slices"].value == 4
    assert advice.inputs["save_stall_s"].source == "given"
    assert advice.current_period_goodput is not None  # the job's period of 100 steps, simulated
    assert main(["advise", f"{root}/llm", *GIVEN]) == 0
    text = capsys.readouterr().out
    assert f"recommended: {advice.recommended}" in text and "step_time_s" in text and "history" in text


def test_cli_says_what_is_missing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--save-stall", "1"]) == 1  # no job: nothing measured, nothing assumed
    err = capsys.readouterr().err
    assert "--step-time" in err and "--restore-time" in err and "--mtbf-hours or --failures-per-slice-day" in err
    assert main(["advise", f"{root}/bare", "--save-stall", "1"]) == 1  # one step: no step time to measure
    err = capsys.readouterr().err
    assert "--step-time" in err and "--restore-time" not in err and "--slices" not in err  # assumed, measured
    assert main(["advise", f"{root}/nope", *GIVEN]) == 1
    assert main(["advise", f"{root}/llm", *GIVEN, "--host-loss-fraction", "2"]) == 2


def test_cli_takes_stall_restore_and_recovery_times_from_the_events(root: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _elastic_events(root / "llm")
    rate = ["--replace-time", "600", "--mtbf-hours", "10", "--min-failures", "200", "--points", "5", "--json"]
    assert main(["advise", f"{root}/llm", *rate]) == 0, capsys.readouterr().err
    inputs = p.Advice.model_validate_json(capsys.readouterr().out).inputs
    for name, value in (("save_stall_s", 1.5), ("restore_time_s", 3.0), ("memory_restore_time_s", 1.5),
                        ("recovery_time_s", 19.9), ("resize_recovery_time_s", 31.4)):
        assert inputs[name].source == "history" and inputs[name].value == pytest.approx(value), name
    assert main(["advise", f"{root}/llm", *rate, "--restore-time", "30"]) == 0  # a flag overrides the history
    inputs = p.Advice.model_validate_json(capsys.readouterr().out).inputs
    assert inputs["restore_time_s"].source == "given" and inputs["restore_time_s"].value == 30


def _demo_events(job_dir: Path) -> None:
    """Events as ``make demo`` records them: saves, a slice lost and the run resized from host memory onto 3 slices,
    the slice back and the run grown again from memory: no restore from storage, no recovery on the same mesh, no
    wait for a replacement."""
    t = 1_700_000_000.0
    ev = [
        ("start", 0.0, {}), ("slices_ready", 0.3, {}), ("initialized", 1.3, {"step": 0}),
        ("first_step_done", 3.1, {"step": 1}),
        *[("checkpoint_started", 3.5 + i, {"step": 5 * i, "blocked_seconds": 0.014}) for i in range(1, 20)],
        ("failure_detected", 24.8, {"step": 150}), ("waiting_for_slices", 25.4, {}), ("slices_ready", 25.5, {}),
        ("plan_received", 25.5, {"step": 145}), ("restored", 25.55, {"step": 145, "detail": "from memory: /shm/145"}),
        ("first_step_done", 27.5, {"step": 146}),
        ("recovered", 27.5, {"recovery_seconds": 2.6, "lost_steps": 5, "mesh_before": [4, 2], "mesh_after": [3, 2]}),
        ("scale_up_detected", 29.0, {"step": 260}), ("slices_ready", 29.6, {}),
        ("restored", 29.65, {"step": 260, "detail": "from memory: /shm/260"}), ("first_step_done", 30.0, {"step": 261}),
        ("recovered", 30.0, {"recovery_seconds": 0.96, "lost_steps": 0, "mesh_before": [3, 2], "mesh_after": [4, 2]}),
        ("finished", 31.5, {"step": 399}),
    ]
    EventStore(Storage(str(job_dir.parent))).append(job_dir.name, [
        p.ElasticEvent(kind=kind, time=t + dt, run="r1", id=str(i), **fields)  # type: ignore[arg-type]
        for i, (kind, dt, fields) in enumerate(ev)])


def test_cli_answers_for_the_demos_job_saying_what_it_assumed(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ckptd advise ROOT/JOB`` on a job like the demo's exited 1 ("missing: --restore-time ..."): what the job's
    steps and events measured is used, the rest is assumed and labelled so, in the answer and on stderr."""
    _demo_events(root / "llm")
    quick = ["--min-failures", "200", "--points", "5"]
    assert main(["advise", f"{root}/llm", *quick, "--json"]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    inputs = p.Advice.model_validate_json(out.out).inputs
    for name in ("step_time_s", "persist_time_s", "slices", "save_stall_s", "memory_restore_time_s",
                 "resize_recovery_time_s"):
        assert inputs[name].source == "history", name
    assert (inputs["restore_time_s"].source, inputs["restore_time_s"].value) == ("derived", pytest.approx(42.0))
    assert inputs["recovery_time_s"].value == inputs["resize_recovery_time_s"].value
    assert (inputs["replace_time_s"].source, inputs["mtbf_hours"].source) == ("default", "default")
    for name in ("restore_time_s", "recovery_time_s", "replace_time_s", "mtbf_hours"):
        assert inputs[name].note.startswith("assumption, not in the job's history"), name
    recovery = float(inputs["recovery_time_s"].value)
    assert out.err.splitlines() == [
        f"ckptd: advise: assumed, not in the history of job llm: --restore-time 42, --recovery-time {recovery:.3g}, "
        "--replace-time 600, --mtbf-hours 24 (the inputs say why; a flag sets any of them)"]
    assert main(["advise", f"{root}/llm", *quick, "--mtbf-hours", "6", "--replace-time", "60"]) == 0
    out = capsys.readouterr()
    assert "--mtbf-hours" not in out.err and "--replace-time" not in out.err  # given: not assumed
    assert "recommended:" in out.out and "assumption, not in the job's history: = persist_time_s" in out.out


@pytest.fixture
def client(root: Path, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_over(root, tmp_path)) as c:
        yield c


def test_api_answers_the_same_advice(client: TestClient) -> None:
    params = {"save_stall_s": 1, "restore_time_s": 30, "recovery_time_s": 20, "replace_time_s": 600,
              "mtbf_hours": 10, "min_failures": 200}
    resp = client.get("/v1/jobs/llm/advice", params=params)
    assert resp.status_code == 200, resp.text
    advice = p.Advice.model_validate(resp.json())
    assert advice.job == "llm" and advice.inputs["persist_time_s"].source == "history"
    assert {a.policy for a in advice.policies} == {"pause", "resize", "spare"}
    assert len(advice.policies[0].sweep) == 13
    assert p.ROUTE_ADVICE in client.get("/openapi.json").json()["paths"]


def test_api_takes_the_times_from_the_events(root: Path, client: TestClient) -> None:
    _elastic_events(root / "llm")
    resp = client.get("/v1/jobs/llm/advice", params={"replace_time_s": 600, "mtbf_hours": 10, "min_failures": 200})
    assert resp.status_code == 200, resp.text
    inputs = p.Advice.model_validate(resp.json()).inputs
    assert inputs["recovery_time_s"].source == "history" and inputs["save_stall_s"].value == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("job", "params", "code"),
    [
        ("llm", {"save_stall_s": 1}, p.ErrorCode.MISSING_INPUT),
        ("llm", {"save_stall_s": -1}, p.ErrorCode.INVALID_REQUEST),
        ("llm", {"stall": 1}, p.ErrorCode.INVALID_REQUEST),
        ("nope", {}, p.ErrorCode.JOB_NOT_FOUND),
        (".hidden", {}, p.ErrorCode.INVALID_JOB_NAME),
    ],
)
def test_api_errors(client: TestClient, job: str, params: dict[str, Any], code: p.ErrorCode) -> None:
    resp = client.get(f"/v1/jobs/{job}/advice", params=params)
    assert resp.status_code == p.ERROR_STATUS[code], resp.text
    body = p.ErrorBody.model_validate(resp.json())
    assert body.code is code
    if code is p.ErrorCode.MISSING_INPUT:
        assert body.detail is not None and "mtbf_hours|failures_per_slice_day" in body.detail["missing"]  # type: ignore[operator]
        assert "step_time_s" not in body.detail["missing"]  # type: ignore[operator]


def test_protocol_doc_describes_the_route_and_the_cli() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    assert f"`GET {p.ROUTE_ADVICE}`" in doc and "`MISSING_INPUT`" in doc and "ckptd advise" in doc
