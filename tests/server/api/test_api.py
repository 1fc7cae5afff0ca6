"""The HTTP API (ckptd.api._app) in process, through FastAPI's TestClient, over steps written by Orbax."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.config import Settings
from tests.support.golden import add_odd_steps, tmp_step
from tests.support.helpers import REPO, make_settings
from tests.support.orbax_steps import model_parallel_metadata, training_metadata, write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, EVENTS_DIR, TMP_DIR_SUFFIX
from trainer_client.errors import StorageError

TOKEN = "s3cret"

# A copied step keeps no ckptd files: it must look like a fresh step to the catalog, which adopts it.
_CKPTD_FILES = shutil.ignore_patterns("ckptd_*")


@pytest.fixture(scope="module")
def golden_root(
    tmp_path_factory: pytest.TempPathFactory,
    ) -> Path:
    """plain: steps 1, 2, 3 by plain Orbax; meta: steps 10, 20 with ckptd training metadata;
    tp: step 7 whose ckptd metadata records a (data=2, model=4) mesh."""
    root = tmp_path_factory.mktemp("api-golden")
    write_orbax_jobs(
        {root / "plain": [1, 2, 3], root / "meta": [10, 20], root / "tp": [7]},
        custom_metadata={10: training_metadata(10), 20: training_metadata(20),
                         7: model_parallel_metadata(7)},
    )
    return root


def _populate(golden: Path, dst: Path) -> Path:
    """Copy the golden root and add: plain/4 (tmp: writing), plain/5 (corrupt), a job "empty" with only a
    tmp step, and a ".hidden" directory holding a committed step (not a valid job name)."""
    shutil.copytree(golden, dst)
    plain = dst / "plain"
    add_odd_steps(plain, 3, writing=tmp_step(4, "-1"), corrupt=5)
    shutil.copytree(plain / "3", dst / "empty" / f"7{TMP_DIR_SUFFIX}")
    shutil.copytree(plain / "1", dst / ".hidden" / "1")
    return dst


def _app(root: Path, state: Path, make_settings: Callable[..., Settings], *, rebuild: bool = True,
         **overrides: Any) -> Any:
    settings = make_settings(root, state, **overrides)
    catalog = Catalog(Storage(str(root)), state / "catalog.sqlite3")
    if rebuild:
        catalog.rebuild()
    return create_app(settings, catalog, background=False)


@pytest.fixture(scope="module")
def root(golden_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _populate(golden_root, tmp_path_factory.mktemp("api") / "root")


@pytest.fixture(scope="module")
def client(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(_app(root, tmp_path_factory.mktemp("api-state"), make_settings)) as c:
        yield c


@pytest.fixture
def private_client(golden_root: Path, tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    """A client over a root of its own, for tests that change storage."""
    root = _populate(golden_root, tmp_path / "root")
    (tmp_path / "state").mkdir()
    with TestClient(_app(root, tmp_path / "state", make_settings)) as c:
        yield c, root


def assert_error(resp: httpx.Response, code: p.ErrorCode) -> p.ErrorBody:
    """The one error body, with ``code`` and the HTTP status the protocol assigns to it."""
    assert resp.status_code == p.ERROR_STATUS[code], resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = p.ErrorBody.model_validate(resp.json())
    assert body.code is code, body
    assert body.message
    return body


def resume(client: TestClient, job: str, **body: Any) -> httpx.Response:
    return client.post(f"/v1/jobs/{job}/resume", json=body)


# ---- health ----------------------------------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "detail": {}}


def test_readyz_when_ready(client: TestClient, root: Path) -> None:
    resp = client.get("/readyz")
    assert resp.status_code == 200
    health = p.Health.model_validate(resp.json())
    assert health.status == "ok"
    assert health.detail["root"] == str(root)
    assert isinstance(health.detail["last_refresh"], float)


def test_not_ready_until_the_catalog_is_built(
    root: Path, tmp_path: Path
) -> None:
    with TestClient(_app(root, tmp_path, make_settings, rebuild=False)) as c:
        assert c.get("/healthz").status_code == 200  # alive, just not ready
        resp = c.get("/readyz")
        assert resp.status_code == 503
        assert p.Health.model_validate(resp.json()).status == "not_ready"
        assert_error(c.get("/v1/jobs"), p.ErrorCode.NOT_READY)
        assert_error(c.get("/v1/jobs/plain/checkpoints/latest-good"), p.ErrorCode.NOT_READY)
        assert_error(resume(c, "plain", alive_devices=8), p.ErrorCode.NOT_READY)


# ---- jobs and checkpoints --------------------------------------------------------------------------


def test_list_jobs(client: TestClient, root: Path) -> None:
    resp = client.get("/v1/jobs")
    assert resp.status_code == 200
    jobs = {j.name: j for j in p.JobList.model_validate(resp.json()).jobs}
    assert set(jobs) == {"empty", "meta", "plain", "tp"}  # ".hidden" is not a job name
    assert jobs["plain"] == p.JobInfo(name="plain", path=str(root / "plain"), steps=5, latest_step=5,
                                      latest_good_step=3)
    assert jobs["meta"].latest_good_step == 20
    assert jobs["empty"].latest_good_step is None and jobs["empty"].steps == 1


def test_checkpoints_list_with_states(client: TestClient, root: Path) -> None:
    resp = client.get("/v1/jobs/plain/checkpoints")
    assert resp.status_code == 200
    listing = p.CheckpointList.model_validate(resp.json())
    assert listing.job == "plain"
    assert [(c.step, c.state) for c in listing.checkpoints] == [
        (1, p.StepState.VERIFIED),
        (2, p.StepState.VERIFIED),
        (3, p.StepState.VERIFIED),
        (4, p.StepState.WRITING),
        (5, p.StepState.CORRUPT),
    ]
    by_step = {c.step: c for c in listing.checkpoints}
    assert by_step[3].path == str(root / "plain" / "3") and by_step[3].committed_at is not None
    assert by_step[4].reason is not None and "tmp" in by_step[4].reason
    assert by_step[5].reason is not None and CHECKPOINT_METADATA in by_step[5].reason

    meta = p.CheckpointList.model_validate(client.get("/v1/jobs/meta/checkpoints").json())
    training = meta.checkpoints[-1].training
    assert training is not None and (training.step, training.data_position) == (20, 1280)


def test_latest_good(client: TestClient, root: Path) -> None:
    resp = client.get("/v1/jobs/plain/checkpoints/latest-good")
    assert resp.status_code == 200
    info = p.CheckpointInfo.model_validate(resp.json())
    assert (info.step, info.state, info.path) == (3, p.StepState.VERIFIED, str(root / "plain" / "3"))
    meta = p.CheckpointInfo.model_validate(client.get("/v1/jobs/meta/checkpoints/latest-good").json())
    assert meta.step == 20 and meta.training is not None and meta.training.global_batch == 64


def test_latest_good_404s(client: TestClient) -> None:
    body = assert_error(client.get("/v1/jobs/empty/checkpoints/latest-good"), p.ErrorCode.NO_GOOD_CHECKPOINT)
    assert "empty" in body.message
    body = assert_error(client.get("/v1/jobs/nope/checkpoints/latest-good"), p.ErrorCode.JOB_NOT_FOUND)
    assert "nope" in body.message
    assert_error(client.get("/v1/jobs/nope/checkpoints"), p.ErrorCode.JOB_NOT_FOUND)


def test_a_job_and_a_step_that_appear_after_the_scan_are_served(
    private_client: tuple[TestClient, Path],
) -> None:
    client, root = private_client
    shutil.copytree(root / "plain", root / "late", ignore=_CKPTD_FILES)  # no refresh in between (background=False)
    info = p.CheckpointInfo.model_validate(client.get("/v1/jobs/late/checkpoints/latest-good").json())
    assert info.step == 3
    shutil.copytree(root / "plain" / "3", root / "plain" / "6", ignore=_CKPTD_FILES)
    plan = p.ResumePlan.model_validate(resume(client, "plain", alive_devices=8).json())
    assert plan.step == 6  # a resume rescans its job first
    shutil.rmtree(root / "late")
    gone = resume(client, "late", alive_devices=8)  # the rescan finds nothing to serve
    assert gone.status_code == 404
    assert p.ErrorBody.model_validate(gone.json()).code in {p.ErrorCode.JOB_NOT_FOUND,
                                                           p.ErrorCode.NO_GOOD_CHECKPOINT}


# ---- resume ----------------------------------------------------------------------------------------


def test_resume_shrinks_the_replica_axis(client: TestClient, root: Path) -> None:
    resp = resume(client, "plain", policy="resize", alive_devices=6)
    assert resp.status_code == 200, resp.text
    plan = p.ResumePlan.model_validate(resp.json())
    assert (plan.job, plan.step, plan.path) == ("plain", 3, str(root / "plain" / "3"))
    assert plan.policy == "resize" and plan.source == "ckptd"
    assert plan.saved_mesh == p.MeshSpec(axis_names=["replica", "data"], shape=[4, 2])
    assert plan.mesh == p.MeshSpec(axis_names=["replica", "data"], shape=[3, 2])
    assert plan.idle_devices == 0
    # plain Orbax: specs from _sharding, shapes and dtypes from the arrays' zarr metadata
    assert set(plan.arrays) == {"params.w", "step"}
    w = plan.arrays["params.w"]
    assert (w.partition_spec, w.shape, w.dtype) == ([None, "data"], [4, 8], "float32")
    assert (plan.arrays["step"].shape, plan.arrays["step"].partition_spec) == ([], [])
    assert plan.bytes_per_device == 4 * 8 * 4 // 2 + 4
    assert plan.data_position is None  # plain Orbax records no data position
    assert any("resized" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("alive", "policy", "shape", "idle"),
    [(8, "pause", [4, 2], 0), (8, "resize", [4, 2], 0), (7, "resize", [3, 2], 1), (2, "resize", [1, 2], 0),
     (1, "resize", [1, 1], 0), (16, "pause", [8, 2], 0)],
)
def test_resume_mesh_for_the_devices_alive(
    client: TestClient, alive: int, policy: str, shape: list[int], idle: int
) -> None:
    plan = p.ResumePlan.model_validate(resume(client, "plain", policy=policy, alive_devices=alive).json())
    assert (plan.mesh.shape, plan.idle_devices) == (shape, idle)


def test_resume_with_training_metadata(client: TestClient, root: Path) -> None:
    resp = resume(client, "meta", alive_devices=6, slices=[{"index": 0, "devices": 2},
                                                          {"index": 1, "devices": 2},
                                                          {"index": 3, "devices": 2}])
    assert resp.status_code == 200, resp.text
    plan = p.ResumePlan.model_validate(resp.json())
    assert (plan.step, plan.data_position) == (20, 1280)
    # 64 samples do not split over 6 devices at <= 8 per device: the nearest split is 2 x 30, stated as such
    assert plan.batch is not None and not plan.batch.exact and plan.batch.base_global_batch == 64
    assert (plan.global_batch, plan.batch.accumulation_steps, plan.batch.micro_batch) == (60, 2, 30)
    assert plan.batch.lr_scale == 60 / 64
    assert plan.mesh.shape == [3, 2]
    assert plan.arrays["params.w"].partition_spec == [None, "data"] and not plan.arrays["params.w"].changed
    # opt.mu was sharded on replica=4 over a dimension of 4: it no longer divides by 3.
    mu = plan.arrays["opt.mu"]
    assert mu.changed and mu.partition_spec == [None, "data"] and mu.shape == [4, 8]
    assert any(note.startswith("opt.mu") for note in plan.notes)


THREE_OF_FOUR = [{"index": 0, "devices": 2}, {"index": 1, "devices": 2}, {"index": 3, "devices": 2}]


@pytest.mark.parametrize(("held", "tier", "step"), [
    ({"step": 25, "slices": [[0], [1], [2], [3]]}, "replicas", 25),  # newer than storage, a replica survives
    ({"step": 20, "slices": [[2], [3]]}, "replicas", 20),  # equal to storage: the faster tier
    ({"step": 15, "slices": [[0], [1]]}, "storage", 20),  # older than storage
    ({"step": 25, "slices": [[2], [0, 2]]}, "storage", 20),  # no replica whole on the slices alive
])
def test_resume_decides_across_tiers_with_the_trainer_s_replicas(
    client: TestClient, root: Path, held: dict[str, Any], tier: str, step: int
) -> None:
    """The request's ``replicas`` is a candidate of the one decision, and the client's storage fallback, from
    the same request, gives the same plan (only who made it differs)."""
    resp = resume(client, "meta", alive_devices=6, slices=THREE_OF_FOUR, replicas=held)
    assert resp.status_code == 200, resp.text
    plan = p.ResumePlan.model_validate(resp.json())
    assert (plan.tier, plan.step, plan.source) == (tier, step, "ckptd")
    assert plan.mesh.shape == [3, 2] and plan.slices_used == [0, 1, 3]
    if tier == "replicas":  # laid out as storage's step 20 is, no path: the trainer holds it
        assert plan.path == "" and plan.data_position is None and plan.arrays["opt.mu"].changed
    else:
        assert plan.path == str(root / "meta" / "20") and plan.data_position == 1280
    request = p.ResumeRequest.model_validate({"alive_devices": 6, "slices": THREE_OF_FOUR, "replicas": held})
    with CkptdClient(root=str(root)) as ckptd:
        scanned = ckptd.resume_from_storage("meta", request)
    assert scanned.source == "storage_scan"
    assert scanned.model_dump(exclude={"source"}) == plan.model_dump(exclude={"source"})


def test_resume_without_replicas_in_the_request_is_answered_as_before(client: TestClient) -> None:
    resp = resume(client, "meta", alive_devices=6, slices=THREE_OF_FOUR)
    assert resp.status_code == 200 and "replicas" not in resp.text
    assert "replicas" not in p.ResumeRequest(alive_devices=6).model_dump_json()  # old ckptd reads new clients'


def test_a_restored_event_carries_the_tier_the_plan_named(private_client: tuple[TestClient, Path]) -> None:
    client, _ = private_client
    event = {"kind": "restored", "time": 1.0, "step": 25, "tier": "replicas", "detail": "from replicas"}
    assert client.post("/v1/jobs/meta/events", json={"events": [event]}).status_code == 200
    stored = client.get("/v1/jobs/meta/events").json()["events"]
    assert [(e["kind"], e["tier"]) for e in stored] == [("restored", "replicas")]


def test_resume_explicit_step(client: TestClient, root: Path) -> None:
    plan = p.ResumePlan.model_validate(resume(client, "plain", alive_devices=8, step=2).json())
    assert (plan.step, plan.path) == (2, str(root / "plain" / "2"))


def test_resume_errors(client: TestClient) -> None:
    pause = resume(client, "plain", policy="pause", alive_devices=6)
    body = assert_error(pause, p.ErrorCode.NOT_ENOUGH_DEVICES)
    assert "8" in body.message and "6" in body.message
    assert_error(resume(client, "plain", alive_devices=0), p.ErrorCode.NOT_ENOUGH_DEVICES)
    # (data=2, model=4): the model axis needs 4 devices whatever the data axis does.
    body = assert_error(resume(client, "tp", alive_devices=3), p.ErrorCode.NO_VALID_MESH)
    assert "model" in body.message
    assert p.ResumePlan.model_validate(resume(client, "tp", alive_devices=6).json()).mesh.shape == [1, 4]
    body = assert_error(resume(client, "plain", alive_devices=8, step=4), p.ErrorCode.STEP_NOT_GOOD)
    assert "writing" in body.message
    body = assert_error(resume(client, "plain", alive_devices=8, step=5), p.ErrorCode.STEP_NOT_GOOD)
    assert "corrupt" in body.message
    assert_error(resume(client, "plain", alive_devices=8, step=99), p.ErrorCode.STEP_NOT_FOUND)
    assert_error(resume(client, "empty", alive_devices=8), p.ErrorCode.NO_GOOD_CHECKPOINT)
    assert_error(resume(client, "nope", alive_devices=8), p.ErrorCode.JOB_NOT_FOUND)
    # slices that do not hold alive_devices are not an error: planned for alive_devices (test_schema_rules.py)
    mismatch = resume(client, "plain", alive_devices=6, slices=[{"index": 0, "devices": 2}])
    assert mismatch.status_code == 200 and mismatch.json()["slices_used"] == []


# ---- bad input: 4xx with the error body, never a 500 -----------------------------------------------

BAD_JOB_SEGMENTS = {
    "%2E%2E": p.ErrorCode.INVALID_JOB_NAME,  # ".." that reaches the server
    "..": p.ErrorCode.ROUTE_NOT_FOUND,  # the client normalizes the path: /v1/checkpoints
    ".hidden": p.ErrorCode.INVALID_JOB_NAME,  # exists on storage, but is not a job name
    "%2E": p.ErrorCode.INVALID_JOB_NAME,
    "a%2Fb": p.ErrorCode.ROUTE_NOT_FOUND,  # decodes to two segments
    "x" * 129: p.ErrorCode.INVALID_JOB_NAME,
    "y" * 5000: p.ErrorCode.INVALID_JOB_NAME,
    "%00": p.ErrorCode.INVALID_JOB_NAME,
    "plain%00": p.ErrorCode.INVALID_JOB_NAME,
    "%FF%FE": p.ErrorCode.INVALID_JOB_NAME,
    "a%20b": p.ErrorCode.INVALID_JOB_NAME,
    "%E2%80%AEplain": p.ErrorCode.INVALID_JOB_NAME,
    "-%0Aplain": p.ErrorCode.INVALID_JOB_NAME,
}


@pytest.mark.parametrize("segment", list(BAD_JOB_SEGMENTS), ids=lambda s: s[:20])
def test_invalid_job_names(client: TestClient, segment: str) -> None:
    code = BAD_JOB_SEGMENTS[segment]
    for method, suffix in (("GET", "checkpoints"), ("GET", "checkpoints/latest-good"), ("POST", "resume")):
        resp = client.request(method, f"/v1/jobs/{segment}/{suffix}", json={"alive_devices": 8})
        body = assert_error(resp, code)
        assert len(body.message) < 400  # a long name is shortened in the message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=0, max_size=200))
def test_any_job_name_gets_an_answer_not_a_500(client: TestClient, name: str) -> None:
    resp = client.get(f"/v1/jobs/{quote(name, safe='')}/checkpoints/latest-good")
    assert resp.status_code < 500
    if resp.status_code != 200:
        body = p.ErrorBody.model_validate(resp.json())
        assert resp.status_code == p.ERROR_STATUS[body.code]


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"", "application/json"),
        (b"[]", "application/json"),
        (b"null", "application/json"),
        (b'"alive_devices"', "application/json"),
        (b"{}", "application/json"),
        (b'{"alive_devices": "six"}', "application/json"),
        (b'{"alive_devices": 6.5}', "application/json"),
        (b'{"alive_devices": -1}', "application/json"),
        (b'{"alive_devices": 2000000}', "application/json"),
        (b'{"alive_devices": null}', "application/json"),
        (b'{"alive_devices": NaN}', "application/json"),
        (b'{"alive_devices": Infinity}', "application/json"),
        (b'{"alive_devices": 1e400}', "application/json"),
        (b'{"alive_devices": 6, "policy": "maybe"}', "application/json"),
        (b'{"alive_devices": 6, "step": -1}', "application/json"),
        (json.dumps({"alive_devices": 6, "step": p.MAX_STEP + 1}).encode(), "application/json"),
        (b'{"alive_devices": 6, "step": "latest"}', "application/json"),
        (b'{"alive_devices": 6, "colour": "blue"}', "application/json"),
        (b'{"alive_devices": 6, "slices": [{"index": -1, "devices": 2}]}', "application/json"),
        (b'{"alive_devices": 6, "slices": {"index": 0}}', "application/json"),
        ("\u00e9".encode("latin-1"), "application/json"),
    ],
)
def test_invalid_resume_bodies_are_422(client: TestClient, content: bytes, content_type: str) -> None:
    resp = client.post("/v1/jobs/plain/resume", content=content, headers={"content-type": content_type})
    body = assert_error(resp, p.ErrorCode.INVALID_REQUEST)
    if body.message == "the request does not match the API":
        assert body.detail is not None and isinstance(body.detail["errors"], list) and body.detail["errors"]


@pytest.mark.parametrize("body", [
    {"device_memory_bytes": 10**20, "memory_headroom_bytes": 10**400},  # no float holds either
    {"device_memory_bytes": 10**400, "memory_headroom_bytes": 10**20},
    {"device_memory_bytes": 10**400},
    {"memory_headroom_bytes": 10**400},
    {"device_memory_bytes": p.MAX_DEVICE_BYTES + 1},
])
def test_device_memory_no_float_holds_is_422_not_a_500(client: TestClient, body: dict[str, int]) -> None:
    for job in ("plain", "meta", "tp"):  # tp: the plan would print the sizes of a state that does not fit
        resp = client.post(f"/v1/jobs/{job}/resume", content=json.dumps({"alive_devices": 8, **body}),
                           headers={"content-type": "application/json"})
        assert_error(resp, p.ErrorCode.INVALID_REQUEST)


def test_device_memory_at_the_bound_is_planned(client: TestClient) -> None:
    resp = resume(client, "tp", alive_devices=8, device_memory_bytes=p.MAX_DEVICE_BYTES)
    assert resp.status_code == 200, resp.text
    body = assert_error(resume(client, "tp", alive_devices=8, device_memory_bytes=p.MAX_DEVICE_BYTES,
                               memory_headroom_bytes=p.MAX_DEVICE_BYTES), p.ErrorCode.DOES_NOT_FIT)
    assert "8192.00 TiB headroom" in body.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values | st.fixed_dictionaries({"alive_devices": json_values}, optional={
    "policy": json_values, "step": json_values, "slices": json_values}))
def test_any_resume_body_gets_an_answer_not_a_500(client: TestClient, body: Any) -> None:
    resp = client.post("/v1/jobs/plain/resume", json=body)
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        error = p.ErrorBody.model_validate(resp.json())
        assert resp.status_code == p.ERROR_STATUS[error.code]


class _BrokenCatalog(Catalog):
    """A catalog whose storage fails on one read and that has a bug on another."""

    def latest_good(self, job: str, at_most: int | None = None) -> p.CheckpointInfo | None:
        raise StorageError("cannot list gs://bucket/ckpt/plain: 503 Service Unavailable")

    def jobs(self) -> list[p.JobInfo]:
        raise RuntimeError("internal detail that must not leak")


def test_storage_errors_and_bugs_still_get_the_error_body(
    root: Path, tmp_path: Path
) -> None:
    catalog = _BrokenCatalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    app = create_app(make_settings(root, tmp_path), catalog, background=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        body = assert_error(c.get("/v1/jobs/plain/checkpoints/latest-good"), p.ErrorCode.STORAGE_ERROR)
        assert "gs://bucket/ckpt/plain" in body.message
        resp = c.get("/v1/jobs")
        body = assert_error(resp, p.ErrorCode.INTERNAL)
        assert "must not leak" not in resp.text
        assert c.get("/v1/jobs/plain/checkpoints").status_code == 200  # the rest keeps working


def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing-here"), p.ErrorCode.ROUTE_NOT_FOUND)
    assert_error(client.get("/v2/jobs"), p.ErrorCode.ROUTE_NOT_FOUND)
    assert_error(client.get("/v1/jobs/plain/checkpoints/latest"), p.ErrorCode.ROUTE_NOT_FOUND)
    assert_error(client.delete("/v1/jobs"), p.ErrorCode.METHOD_NOT_ALLOWED)
    assert_error(client.get("/v1/jobs/plain/resume"), p.ErrorCode.METHOD_NOT_ALLOWED)


# ---- auth ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_client(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    app = _app(root, tmp_path_factory.mktemp("api-token"), make_settings, token=TOKEN)
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs"),
        ("GET", "/v1/jobs/plain/checkpoints"),
        ("GET", "/v1/jobs/plain/checkpoints/latest-good"),
        ("POST", "/v1/jobs/plain/resume"),
        ("GET", "/v1/no-such-route"),
    ],
)
def test_v1_routes_need_the_bearer_token(token_client: TestClient, method: str, path: str) -> None:
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
             {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer "}]
    for headers in wrong:
        resp = token_client.request(method, path, headers=headers, json={"alive_devices": 8})
        assert_error(resp, p.ErrorCode.UNAUTHORIZED)
        assert TOKEN not in resp.text
    resp = token_client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"},
                                json={"alive_devices": 8})
    assert resp.status_code == (404 if "no-such" in path else 200), resp.text
    assert TOKEN not in resp.text


def test_open_routes_need_no_token(token_client: TestClient) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert token_client.get(path).status_code == 200, path


def test_token_never_echoed_in_error_bodies(token_client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    json_auth = {**auth, "content-type": "application/json"}
    for resp in (
        token_client.post("/v1/jobs/plain/resume", content=b"{bad", headers=json_auth),
        # validation errors do not echo the input, whatever it holds
        token_client.post("/v1/jobs/plain/resume", json={"alive_devices": TOKEN}, headers=auth),
        token_client.get("/v1/jobs/%2E%2E/checkpoints", headers=auth),
        token_client.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN[:-1]}"}),
    ):
        assert resp.status_code >= 400
        p.ErrorBody.model_validate(resp.json())
        assert TOKEN not in resp.text


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTD_ROOT", str(tmp_path))
    monkeypatch.setenv("CKPTD_HOST", "0.0.0.0")
    monkeypatch.setenv("CKPTD_PORT", "9123")
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    monkeypatch.setenv("CKPTD_STATE_DIR", str(tmp_path / "state"))
    s = Settings()
    assert (s.storage.root, s.serve.host, s.serve.port, s.auth.token) == (str(tmp_path), "0.0.0.0", 9123, TOKEN)
    assert s.storage.catalog_path() == tmp_path / "state" / "catalog.sqlite3"
    monkeypatch.setenv("CKPTD_PORT", "70000")
    with pytest.raises(ValueError):
        Settings()


# ---- metrics and OpenAPI ---------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics(client: TestClient) -> None:
    client.get("/v1/jobs")
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    assert "ckptd_latest_good_step" in resp.text
    samples = _samples(resp.text)
    assert samples[("ckptd_latest_good_step", (("ckpt_job", "plain"),))] == 3
    assert samples[("ckptd_latest_good_step", (("ckpt_job", "meta"),))] == 20
    assert ("ckptd_latest_good_step", (("ckpt_job", "empty"),)) not in samples
    assert samples[("ckptd_steps", (("ckpt_job", "plain"), ("state", "corrupt")))] == 1
    assert samples[("ckptd_steps", (("ckpt_job", "plain"), ("state", "verified")))] == 3
    assert samples[("ckptd_http_requests_total", (("route", "/v1/jobs"), ("status", "200")))] >= 1


def test_metrics_forget_steps_and_jobs_that_are_gone(private_client: tuple[TestClient, Path]) -> None:
    client, root = private_client
    before = _samples(client.get("/metrics").text)
    assert before[("ckptd_latest_good_step", (("ckpt_job", "meta"),))] == 20
    for step in ("10", "20"):
        shutil.rmtree(root / "meta" / step)
    shutil.rmtree(root / "plain")
    client.app.state.catalog.refresh()  # type: ignore[attr-defined]
    after = _samples(client.get("/metrics").text)
    assert ("ckptd_latest_good_step", (("ckpt_job", "meta"),)) not in after
    assert ("ckptd_latest_good_step", (("ckpt_job", "plain"),)) not in after
    assert ("ckptd_steps", (("ckpt_job", "plain"), ("state", "verified"))) not in after


def test_openapi_documents_every_route(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert set(spec["paths"]) >= {
        p.ROUTE_HEALTHZ, p.ROUTE_READYZ, p.ROUTE_METRICS, p.ROUTE_JOBS, p.ROUTE_CHECKPOINTS,
        p.ROUTE_LATEST_GOOD, p.ROUTE_RESUME, p.ROUTE_PEER_FETCH,
    }
    assert "ErrorBody" in spec["components"]["schemas"]
    assert "409" in spec["paths"][p.ROUTE_RESUME]["post"]["responses"]


def test_protocol_doc_matches_the_code() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    table = {m[1]: int(m[2]) for m in re.finditer(r"^\| `([A-Z_]+)`\s*\| (\d{3}) ", doc, re.M)}
    assert table == {code.value: status for code, status in p.ERROR_STATUS.items()}
    for route in (p.ROUTE_HEALTHZ, p.ROUTE_READYZ, p.ROUTE_METRICS, p.ROUTE_JOBS, p.ROUTE_CHECKPOINTS,
                  p.ROUTE_LATEST_GOOD, p.ROUTE_RESUME, p.ROUTE_PEER_FETCH):
        assert f"`{route}`" in doc or f" {route}`" in doc, route
    for state in p.StepState:
        assert f"| `{state.value}`" in doc, state


# ---- numbers no float holds, in events -------------------------------------------------------------

_HUGE = 10**400  # JSON allows any number of digits


@pytest.mark.parametrize("field", [{"lost_steps": _HUGE}, {"replica_bytes_held": _HUGE}, {"persist_bytes": _HUGE},
                                   {"pid": _HUGE}, {"mesh_after": [2, _HUGE]}, {"replica_skips": _HUGE},
                                   {"autopilot_failures_seen": _HUGE}, {"lost_steps": p.MAX_COUNT + 1}])
def test_an_event_count_no_float_holds_is_422_and_goodput_still_answers(private_client: tuple[TestClient, Path],
                                                                         field: dict[str, Any]) -> None:
    client, _ = private_client
    event = {"kind": "recovered", "time": 100.0, "step": 3, "id": "r:1", "run": "r", **field}
    resp = client.post("/v1/jobs/plain/events", content=json.dumps({"events": [event]}),
                       headers={"content-type": "application/json"})
    assert_error(resp, p.ErrorCode.INVALID_REQUEST)
    assert client.get("/v1/jobs/plain/goodput").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("field", ['"time": 1e400', '"time": 100.0, "t": -1e400', '"time": 100.0, "t": NaN',
                                   '"time": 100.0, "recovery_seconds": Infinity',
                                   '"time": 100.0, "blocked_seconds": 1e400'])
def test_an_event_at_an_infinite_time_or_of_infinite_seconds_is_422(private_client: tuple[TestClient, Path],
                                                                    field: str) -> None:
    """Seconds are finite: an event at time 1e400 (JSON's way to an infinite float) counted in no goodput window
    and skewed every figure after it."""
    client, _ = private_client
    body = '{"events": [{"kind": "recovered", "step": 3, "id": "r:1", "run": "r", ' + field + "}]}"
    resp = client.post("/v1/jobs/plain/events", content=body, headers={"content-type": "application/json"})
    assert_error(resp, p.ErrorCode.INVALID_REQUEST)
    assert client.get("/v1/jobs/plain/events").json()["events"] == []


def test_a_stored_event_count_no_float_holds_makes_its_file_unreadable(golden_root: Path, tmp_path: Path) -> None:
    root = _populate(golden_root, tmp_path / "root")
    events = root / "plain" / EVENTS_DIR
    events.mkdir(parents=True)
    good = {"kind": "start", "time": 50.0, "received_at": 50.0, "id": "a", "run": "r"}
    bad = {"kind": "recovered", "time": 100.0, "step": 3, "received_at": 100.0, "id": "b", "run": "r",
           "lost_steps": _HUGE}
    for k, event in enumerate((good, bad)):
        (events / f"0000000000000000{k + 1}-1-00000{k + 1}-abcd.json").write_text(json.dumps(
            {"format": "ckptd-events/1", "job": "plain", "received_at": 1.0, "events": [event]}))
    (tmp_path / "state").mkdir()
    with TestClient(_app(root, tmp_path / "state", make_settings)) as c:
        resp = c.get("/v1/jobs/plain/goodput")
        assert resp.status_code == 200, resp.text  # the forged file is skipped, not an OverflowError
        assert [e["id"] for e in c.get("/v1/jobs/plain/events").json()["events"]] == ["a"]
        assert c.get("/metrics").status_code == 200


@pytest.mark.parametrize(("field", "value"), [("wall_time", "1e400"), ("lr_scale", "1e400"),
                                              ("base_global_batch", "1" + "0" * 400),
                                              ("max_per_device_batch", "1" + "0" * 400),
                                              ("data_parallel_size", str(p.MAX_COUNT + 1))])
def test_training_metadata_with_an_infinite_number_makes_its_step_unusable_not_the_job(
        golden_root: Path, tmp_path: Path, field: str, value: str) -> None:
    root = _populate(golden_root, tmp_path / "root")
    metadata = root / "meta" / "10" / CHECKPOINT_METADATA
    doc = json.loads(metadata.read_text())
    training = doc["custom_metadata"]["ckptd"]
    if field != "wall_time":
        training["batch"] = {"mode": "keep_global_batch", "base_global_batch": 64, "global_batch": 64,
                             "accumulation_steps": 1, "micro_batch": 64, "per_device_batch": 8,
                             "max_per_device_batch": 8, "data_parallel_size": 8}
        training["batch"][field] = "@@"
    else:
        training[field] = "@@"
    metadata.write_text(json.dumps(doc).replace('"@@"', value))  # 1e400: JSON's own way to an infinite float
    (tmp_path / "state").mkdir()
    with TestClient(_app(root, tmp_path / "state", make_settings)) as c:
        listed = c.get("/v1/jobs/meta/checkpoints")
        assert listed.status_code == 200, listed.text
        states = {cp["step"]: cp["state"] for cp in listed.json()["checkpoints"]}
        assert states[20] == "verified" and states[10] not in ("verified", "committed")
        plan = resume(c, "meta", alive_devices=8)
        assert plan.status_code == 200, plan.text
        assert plan.json()["step"] == 20
        assert resume(c, "meta", alive_devices=6, step=10).status_code == 409  # the step is not usable: no 500
        assert c.get("/v1/jobs/meta/goodput").status_code == 200


@pytest.mark.parametrize("shape", [[10**400], [2**53] * 40])  # bytes no float holds, per device
def test_a_declared_array_too_large_for_a_float_is_a_does_not_fit_not_a_500(golden_root: Path, tmp_path: Path,
                                                                            shape: list[int]) -> None:
    root = _populate(golden_root, tmp_path / "root")
    metadata = root / "meta" / "10" / CHECKPOINT_METADATA
    doc = json.loads(metadata.read_text())
    doc["custom_metadata"]["ckptd"]["arrays"]["opt.huge"] = {"shape": shape, "dtype": "float32",
                                                             "partition_spec": [None] * len(shape)}
    metadata.write_text(json.dumps(doc))
    (tmp_path / "state").mkdir()
    with TestClient(_app(root, tmp_path / "state", make_settings)) as c:
        for alive in (8, 6):
            body = assert_error(resume(c, "meta", alive_devices=alive, step=10, device_memory_bytes=10**12),
                                p.ErrorCode.DOES_NOT_FIT)
            # the array is not sharded: each device would hold all of it (and the rest of the state)
            assert f"needs ~10^{len(str(math.prod(shape) * 4)) - 1} B per device" in body.message
