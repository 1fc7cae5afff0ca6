"""Elastic events on storage (ckptd.events._events, POST/GET /v1/jobs/{job}/events), goodput over HTTP, and the
metrics fed by events and by the commit tracker (ckptd._metrics, ckptd.catalog._commit_tracker).

The root is written by plain Orbax in a subprocess whose job directory already holds ckptd's events
directory: Orbax must save, list and restore around it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.config import Settings
from ckptd.events._events import EventStore
from tests.support.golden import copy_root
from tests.support.helpers import clean_env, make_settings, wait_until
from tests.support.orbax_steps import training_metadata
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import EVENTS_DIR
from trainer_client.core.format._manifest import read_manifest

TOKEN = "s3cret"
_CKPTD_FILES = shutil.ignore_patterns("ckptd_*")

# Plain Orbax, in its own interpreter, on a job directory that already holds .ckptd/events/.
_ORBAX_AROUND_EVENTS = r"""
import json, sys
import jax, jax.numpy as jnp
import orbax.checkpoint as ocp
job_dir, meta = sys.argv[1], json.loads(sys.argv[2])
mgr = ocp.CheckpointManager(job_dir, options=ocp.CheckpointManagerOptions(max_to_keep=None))
for step in (10, 20):
    state = {"w": jnp.arange(8, dtype=jnp.float32) + step}
    mgr.save(step, args=ocp.args.StandardSave(state), custom_metadata=meta[str(step)])
mgr.wait_until_finished(); mgr.close()
fresh = ocp.CheckpointManager(job_dir)
restored = fresh.restore(fresh.latest_step(), args=ocp.args.StandardRestore({"w": jnp.zeros(8, jnp.float32)}))
print(json.dumps({"steps": list(fresh.all_steps()), "latest": fresh.latest_step(), "w0": float(restored["w"][0])}))
"""


def _event(t: float, kind: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "time": t, "step": step, "id": f"run1:{kind}:{t}", "run": "run1", **fields}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("events-golden")
    events_dir = root / "meta" / EVENTS_DIR
    events_dir.mkdir(parents=True)
    (events_dir / "00000000000000001-1-000001-abcd.json").write_text(json.dumps(
        {"format": "ckptd-events/1", "job": "meta", "received_at": 1.0,
         "events": [{"kind": "start", "time": 1.0, "received_at": 1.0, "id": "early"}]}))
    meta = {str(s): training_metadata(s) for s in (10, 20)}
    out = subprocess.run([sys.executable, "-c", _ORBAX_AROUND_EVENTS, str(root / "meta"), json.dumps(meta)],
                         env=clean_env(), capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return root, json.loads(out.stdout.strip().splitlines()[-1])


def _app(root: Path, state: Path, make_settings: Callable[..., Settings], **overrides: Any) -> Any:
    state.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(Storage(str(root)), state / "catalog.sqlite3")
    catalog.rebuild()
    return create_app(make_settings(root, state, **overrides), catalog, background=False)


@pytest.fixture
def env(golden: tuple[Path, dict[str, Any]], tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    root = copy_root(golden[0], tmp_path)
    with TestClient(_app(root, tmp_path / "state", make_settings)) as client:
        yield client, root


def test_plain_orbax_saves_lists_and_restores_around_the_events_directory(
    golden: tuple[Path, dict[str, Any]], env: tuple[TestClient, Path]
) -> None:
    root, orbax = golden
    assert orbax == {"steps": [10, 20], "latest": 20, "w0": 20.0}
    assert (root / "meta" / EVENTS_DIR).is_dir()  # Orbax left it alone
    client, _ = env
    assert [j["name"] for j in client.get("/v1/jobs").json()["jobs"]] == ["meta"]  # never a job ".ckptd"
    assert [c["step"] for c in client.get("/v1/jobs/meta/checkpoints").json()["checkpoints"]] == [10, 20]
    assert not p.is_valid_job_name(".ckptd")


def test_events_are_stored_on_storage_deduplicated_and_survive_a_restart(
    env: tuple[TestClient, Path], tmp_path: Path
) -> None:
    client, root = env
    t0 = time.time()
    batch = [_event(t0 + 2, "failure_detected", 25, detail="DATA_LOSS"), _event(t0 + 1, "checkpoint_started", 20,
             blocked_seconds=0.25), _event(t0 + 5, "recovered", 21, recovery_seconds=3.5, lost_steps=5,
                                           mesh_before=[4, 2], mesh_after=[3, 2])]
    ack = client.post("/v1/jobs/meta/events", json={"events": batch})
    assert ack.status_code == 200 and ack.json() == {"job": "meta", "accepted": 3, "duplicates": 0}
    assert client.post("/v1/jobs/meta/events", json={"events": batch}).json()["duplicates"] == 3  # a resend
    files = sorted(f.name for f in (root / "meta" / EVENTS_DIR).iterdir())
    assert len(files) == 2 and all(re.fullmatch(r"\d{17}-\d+-\d{6}-[0-9a-f]{8}\.json", f) for f in files[1:])
    listed = p.EventList.model_validate(client.get("/v1/jobs/meta/events").json())
    assert [e.kind for e in listed.events] == ["start", "checkpoint_started", "failure_detected", "recovered"]
    assert listed.events[-1].source == "trainer" and listed.events[-1].received_at >= t0
    assert listed.events[-1].mesh_after == [3, 2]
    since = client.get("/v1/jobs/meta/events", params={"since": t0 + 1.5, "limit": 1}).json()["events"]
    assert [e["kind"] for e in since] == ["recovered"]

    with TestClient(_app(root, tmp_path / "state2", make_settings)) as restarted:  # a new ckptd process
        again = restarted.get("/v1/jobs/meta/events").json()["events"]
        assert [e["id"] for e in again] == [e.id for e in listed.events]
        assert restarted.post("/v1/jobs/meta/events", json={"events": batch}).json()["accepted"] == 3
        assert len(restarted.get("/v1/jobs/meta/events").json()["events"]) == 4  # deduplicated on reading


def test_events_create_a_job_only_with_a_token_and_within_the_job_limit(
    golden: tuple[Path, dict[str, Any]], env: tuple[TestClient, Path], tmp_path: Path
) -> None:
    client, root = env
    assert client.get("/v1/jobs/fresh/events").json()["code"] == "JOB_NOT_FOUND"
    resp = client.post("/v1/jobs/fresh/events", json={"events": [_event(time.time(), "start")]})
    assert resp.status_code == 404, resp.text  # no token: anyone could create jobs
    body = p.ErrorBody.model_validate(resp.json())
    assert body.code is p.ErrorCode.JOB_NOT_FOUND and "token" in body.message
    assert not (root / "fresh").exists()
    (root / "made-by-training").mkdir()  # a job the training created (Orbax makes its directory first)
    assert client.post("/v1/jobs/made-by-training/events", json={"events": [_event(1.0, "start")]}).status_code == 200

    with_token = tmp_path / "with-token"
    shutil.copytree(golden[0], with_token)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(_app(with_token, tmp_path / "state-t", make_settings, token=TOKEN, max_jobs=3)) as authed:
        for job in ("fresh", "second"):  # the token's holder may create jobs: "meta" and these two are 3
            resp = authed.post(f"/v1/jobs/{job}/events", json={"events": [_event(time.time(), "start")]}, headers=auth)
            assert resp.status_code == 200, resp.text
            assert (with_token / job / EVENTS_DIR).is_dir()
        jobs = {j["name"]: j for j in authed.get("/v1/jobs", headers=auth).json()["jobs"]}
        assert set(jobs) == {"meta", "fresh", "second"} and jobs["fresh"]["steps"] == 0
        assert [e["kind"] for e in authed.get("/v1/jobs/fresh/events", headers=auth).json()["events"]] == ["start"]
        over = authed.post("/v1/jobs/third/events", json={"events": [_event(1.0, "start")]}, headers=auth)
        assert over.status_code == 409, over.text
        assert p.ErrorBody.model_validate(over.json()).code is p.ErrorCode.JOB_LIMIT
        assert not (with_token / "third").exists()
        for job in ("meta", "fresh"):  # the jobs there are unaffected
            again = authed.post(f"/v1/jobs/{job}/events", json={"events": [_event(2.0, "finished")]}, headers=auth)
            assert again.status_code == 200, again.text


@pytest.mark.parametrize(
    ("job", "body", "code"),
    [
        (".ckptd", {"events": [{"kind": "start", "time": 1.0}]}, p.ErrorCode.INVALID_JOB_NAME),
        ("..", {"events": [{"kind": "start", "time": 1.0}]}, p.ErrorCode.ROUTE_NOT_FOUND),
        ("meta", {"events": []}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "start", "time": 1.0}] * 1001}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "Start Now", "time": 1.0}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "start", "time": "1"}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "start", "time": 1.0, "step": True}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "start", "time": 1.0, "secret": 1}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "recovered", "time": 1.0, "lost_steps": -1}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"events": [{"kind": "start", "time": 1.0, "detail": "x" * 2001}]}, p.ErrorCode.INVALID_REQUEST),
        ("meta", {"batch": []}, p.ErrorCode.INVALID_REQUEST),
    ],
)
def test_hostile_event_batches_are_refused_and_nothing_is_stored(
    env: tuple[TestClient, Path], job: str, body: dict[str, Any], code: p.ErrorCode
) -> None:
    client, root = env
    resp = client.post(f"/v1/jobs/{job}/events", json=body)
    assert resp.status_code == p.ERROR_STATUS[code], resp.text
    assert p.ErrorBody.model_validate(resp.json()).code is code
    assert len(list((root / "meta" / EVENTS_DIR).iterdir())) == 1  # only the file Orbax ran around
    assert not (root / ".ckptd").exists()


def test_unreadable_event_files_are_skipped_and_said(env: tuple[TestClient, Path]) -> None:
    client, root = env
    client.post("/v1/jobs/meta/events", json={"events": [_event(100.0, "start"), _event(110.0, "finished", 5)]})
    (root / "meta" / EVENTS_DIR / "99999999999999999-1-000001-ffff.json").write_text("{not json")
    assert [e["kind"] for e in client.get("/v1/jobs/meta/events").json()["events"]] == ["start", "start", "finished"]
    goodput = p.Goodput.model_validate(client.get("/v1/jobs/meta/goodput").json())
    assert "1 unreadable event file(s) skipped" in goodput.notes
    assert goodput.wall_seconds == pytest.approx(109.0)  # the hand-written start at t=1 and this run's two
    assert client.get("/v1/jobs/nope/goodput").json()["code"] == "JOB_NOT_FOUND"
    assert client.get("/v1/jobs/meta/goodput", params={"step_time_s": 0}).json()["code"] == "INVALID_REQUEST"


def test_with_a_token_the_api_needs_it_and_the_dashboard_page_does_not(
    golden: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(golden[0], root)
    with TestClient(_app(root, tmp_path / "state", make_settings, token=TOKEN)) as client:
        body = {"events": [_event(1.0, "start")]}
        assert client.post("/v1/jobs/meta/events", json=body).json()["code"] == "UNAUTHORIZED"
        assert client.get("/v1/jobs/meta/goodput").status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/v1/jobs/meta/events", json=body, headers=auth).status_code == 200
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert TOKEN not in page.text and "Authorization" in page.text  # the page sends it, never holds it


def test_metrics_from_events_and_from_the_commit_tracker(env: tuple[TestClient, Path]) -> None:
    client, root = env
    app: Any = client.app
    tracker, catalog = app.state.tracker, app.state.catalog
    tracker.poll()  # takes stock: steps 10 and 20 were there before, they are not commits seen
    t0 = time.time()
    client.post("/v1/jobs/meta/events", json={"events": [
        _event(t0, "start"), _event(t0 + 1, "checkpoint_started", 10, blocked_seconds=0.02),
        _event(t0 + 2, "recovered", 11, recovery_seconds=4.0, lost_steps=3), _event(t0 + 3, "made_up_kind"),
        _event(t0 + 9, "finished", 20)]})
    # A new good step (a copy without ckptd's files is adopted) and a new bad one (a file truncated).
    job = root / "meta"
    shutil.copytree(job / "20", job / "30", ignore=_CKPTD_FILES)
    shutil.copytree(job / "20", job / "40")
    data = next((job / "40" / "default" / "ocdbt.process_0" / "d").iterdir())  # array bytes
    data.write_bytes(data.read_bytes()[:-1])
    catalog.refresh()
    tracker.poll(goodput=True)
    client.post("/v1/jobs/meta/resume", json={"alive_devices": 8})
    s = _samples(client.get("/metrics").text)
    job_label = (("ckpt_job", "meta"),)
    assert s[("ckptd_elastic_events_total", (("ckpt_job", "meta"), ("kind", "recovered")))] == 1
    assert s[("ckptd_elastic_events_total", (("ckpt_job", "meta"), ("kind", "other")))] == 1
    assert s[("ckptd_recovery_seconds_sum", job_label)] == 4.0
    assert s[("ckptd_lost_steps_total", job_label)] == 3
    assert s[("ckptd_save_stall_seconds_count", job_label)] == 1
    assert s[("ckptd_commits_total", job_label)] == 2  # 30 and 40: finalized by Orbax, whatever they hold
    storage = Storage(str(root))
    manifest = read_manifest(storage, str(job / "30"))
    assert manifest is not None
    bad = read_manifest(storage, str(job / "40"))
    expected = sum(f.size for m in (manifest, bad) if m for f in m.expected_files().values())
    assert s[("ckptd_committed_bytes_total", job_label)] == expected > 0
    assert s[("ckptd_save_duration_seconds_count", job_label)] == 2
    assert s[("ckptd_validation_failures_total", job_label)] == 1
    assert s[("ckptd_quarantined_steps", job_label)] == 1
    assert s[("ckptd_resume_requests_total", job_label)] == 1
    goodput = client.get("/v1/jobs/meta/goodput").json()["goodput"]
    assert s[("ckptd_goodput_ratio", job_label)] == pytest.approx(goodput)
    tracker.poll()  # nothing new: nothing counted twice
    again = _samples(client.get("/metrics").text)
    assert again[("ckptd_commits_total", job_label)] == 2
    assert again[("ckptd_validation_failures_total", job_label)] == 1


def test_a_scrape_reads_no_storage(env: tuple[TestClient, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = env
    app: Any = client.app
    t0 = time.time()
    for k in range(5):
        client.post("/v1/jobs/meta/events", json={"events": [
            _event(t0 + k * 1000 + i, "checkpoint_started", i, blocked_seconds=0.01) for i in range(1000)]})

    def no_storage(*_: Any, **__: Any) -> Any:
        raise AssertionError("a scrape touched storage")

    for obj in (app.state.catalog.storage, app.state.events.storage):
        for name in ("list_dir", "read_bytes", "read_json", "exists", "is_dir"):
            monkeypatch.setattr(obj, name, no_storage)
    monkeypatch.setattr(app.state.events, "load", no_storage)
    started = time.perf_counter()
    for _ in range(10):
        resp = client.get("/metrics")
        assert resp.status_code == 200, resp.text
    # Bounded work, kept as a bound: a scrape reads the counters kept as events arrive, never the 5000 events
    # again. About 5 ms a scrape here with the machine loaded; 0.25 s is fifty times that.
    assert (time.perf_counter() - started) / 10 < 0.25
    assert _samples(resp.text)[("ckptd_save_stall_seconds_count", (("ckpt_job", "meta"),))] == 5000


def test_retention_deletions_are_recorded_as_events(
    golden: tuple[Path, dict[str, Any]], tmp_path: Path, ckptd_server: Any
) -> None:
    root = tmp_path / "root"
    shutil.copytree(golden[0], root)
    server = ckptd_server(root, keep_last=1, gc_interval_s=0.2)
    with server.client() as http:
        def deleted() -> list[dict[str, Any]]:
            events = http.get("/v1/jobs/meta/events").json()["events"]
            return [e for e in events if e["kind"] == "retention_deleted"]

        (event,) = wait_until(deleted, timeout=15, what="a retention_deleted event")
        assert event["step"] == 10 and event["source"] == "ckptd" and "retention" in event["detail"]
        assert not (root / "meta" / "10").exists() and (root / "meta" / "20").exists()
    assert os.listdir(root / "meta" / EVENTS_DIR)



def test_on_gcs_every_sidecar_sees_every_sidecars_events(
    gcs_emulator: Any, tmp_path: Path
) -> None:
    """Two sidecars of one job (two EventStores) write to a gs:// root; a third ckptd, started later,
    serves all of it. Object stores cannot append: every batch is its own object, never overwritten."""
    root = gcs_emulator.gs("events-root")
    first, second = EventStore(Storage(root)), EventStore(Storage(root))
    t0 = time.time()
    first.append("llm", [p.ElasticEvent(**_event(t0, "start")), p.ElasticEvent(**_event(t0 + 2, "finished", 9))])
    second.append("llm", [p.ElasticEvent(**_event(t0 + 1, "failure_detected", 5))])
    second.append("llm", [p.ElasticEvent(**_event(t0 + 2, "finished", 9))])  # host 2 reports it too
    storage = Storage(root)
    names = [e.name for e in storage.list_dir(storage.join("llm", EVENTS_DIR))]
    assert len(names) == 3 and len(set(names)) == 3
    app = _gcs_app(root, tmp_path, make_settings)
    with TestClient(app) as client:
        assert [j["name"] for j in client.get("/v1/jobs").json()["jobs"]] == ["llm"]
        assert client.get("/v1/jobs/llm/checkpoints").json()["checkpoints"] == []
        kinds = [e["kind"] for e in client.get("/v1/jobs/llm/events").json()["events"]]
        assert kinds == ["start", "failure_detected", "finished"]
        ack = client.post("/v1/jobs/llm/events", json={"events": [_event(t0 + 3, "start")]}).json()
        assert ack["accepted"] == 1
        assert client.get("/v1/jobs/llm/goodput").json()["wall_seconds"] == pytest.approx(3.0)
    assert len(first.load("llm")) == 4  # the first sidecar sees what the third one stored


def _gcs_app(root: str, tmp_path: Path, make_settings: Callable[..., Settings]) -> Any:
    catalog = Catalog(Storage(root), ":memory:")
    catalog.rebuild()
    return create_app(make_settings(root, tmp_path), catalog, background=False)
