"""Pages of a job's steps (``limit`` + cursor, newest first), conditional requests (``ETag`` / ``304``)
on the list, latest-good and resume, and the hot path that answers the latter two, through FastAPI's
TestClient over steps written by Orbax."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ckptd.api._listing import decode_cursor, encode_cursor
from ckptd.catalog._integrity import quarantine
from tests.support.orbax_steps import write_orbax_jobs
from tests.support.server import app_over
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage

JOB = "paged"
STEPS = 23
_CKPTD_FILES = shutil.ignore_patterns("ckptd_*")  # a copy must look like a fresh step: the catalog adopts it


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("paging-template")
    write_orbax_jobs({root / JOB: [1]})
    return root / JOB / "1"


def add_step(root: Path, template: Path, step: int) -> None:
    shutil.copytree(template, root / JOB / str(step), ignore=_CKPTD_FILES)


def _serve(template: Path, where: Path) -> Iterator[tuple[TestClient, Path]]:
    root = where / "root"
    for step in range(1, STEPS + 1):
        add_step(root, template, step)
    (where / "state").mkdir()
    with TestClient(app_over(root, where / "state")) as client:
        yield client, root


@pytest.fixture
def served(template: Path, tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    """A server over a root of its own, for tests that change storage."""
    yield from _serve(template, tmp_path)


@pytest.fixture(scope="module")
def shared(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    """A server for tests that only read."""
    yield from _serve(template, tmp_path_factory.mktemp("paging-shared"))


def walk(client: TestClient, limit: int, between: Any = None) -> list[int]:
    """Every step the pages give, in order; ``between(page_number)`` runs between two pages."""
    steps: list[int] = []
    params: dict[str, Any] = {"limit": limit}
    for n in range(1000):
        resp = client.get(f"/v1/jobs/{JOB}/checkpoints", params=params)
        assert resp.status_code == 200, resp.text
        page = p.CheckpointList.model_validate_json(resp.content)
        assert len(page.checkpoints) <= limit
        steps.extend(c.step for c in page.checkpoints)
        if page.next is None:
            return steps
        assert len(page.checkpoints) == limit  # only the last page is short
        if between is not None:
            between(n)
        params = {"limit": limit, "cursor": page.next}
    raise AssertionError("the pages never ended")


@pytest.mark.parametrize("limit", [1, 5, STEPS, 100])
def test_pages_give_every_step_once_newest_first(shared: tuple[TestClient, Path], limit: int) -> None:
    client, _ = shared
    assert walk(client, limit) == list(range(STEPS, 0, -1))


def test_without_limit_the_whole_list_oldest_first_as_before(shared: tuple[TestClient, Path]) -> None:
    client, _ = shared
    resp = client.get(f"/v1/jobs/{JOB}/checkpoints")
    assert resp.status_code == 200
    assert "next" not in resp.json()  # older clients parse it with their model (no such field)
    listed = p.CheckpointList.model_validate_json(resp.content)
    assert [c.step for c in listed.checkpoints] == list(range(1, STEPS + 1))
    assert {c.state for c in listed.checkpoints} == {p.StepState.VERIFIED}
    first = client.get(f"/v1/jobs/{JOB}/checkpoints", params={"limit": STEPS})
    assert p.CheckpointList.model_validate_json(first.content).checkpoints == listed.checkpoints[::-1]


def test_pages_are_stable_when_steps_arrive_and_leave_between_them(
    served: tuple[TestClient, Path], template: Path
) -> None:
    client, root = served

    def change(n: int) -> None:
        add_step(root, template, 100 + n)  # newer than every page: never in a later page
        shutil.rmtree(root / JOB / "1") if n == 1 else None  # an old step gc'd meanwhile: just not listed
        client.app.state.catalog.refresh_job(JOB)  # type: ignore[attr-defined]

    seen = walk(client, 4, between=change)
    assert seen == [s for s in range(STEPS, 0, -1) if s != 1]
    assert len(set(seen)) == len(seen)
    listed = [c.step for c in p.CheckpointList.model_validate_json(
        client.get(f"/v1/jobs/{JOB}/checkpoints").content).checkpoints]
    assert 100 in listed and 1 not in listed  # the catalog did see the changes


@pytest.mark.parametrize("params", [
    {"limit": 0}, {"limit": -1}, {"limit": p.MAX_PAGE_LIMIT + 1}, {"limit": "ten"}, {"limit": "1.5"},
    {"cursor": ""}, {"cursor": "not-a-cursor"}, {"cursor": "12.abc"}, {"cursor": "1" * 17 + ".00"},
    {"cursor": "12.XY"}, {"cursor": "12.00\n"}, {"limit": 5, "cursor": "%00"},
])
def test_a_bad_limit_or_cursor_is_the_one_422(shared: tuple[TestClient, Path], params: dict[str, Any]) -> None:
    client, _ = shared
    resp = client.get(f"/v1/jobs/{JOB}/checkpoints", params=params)
    assert resp.status_code == 422, resp.text
    body = p.ErrorBody.model_validate_json(resp.content)
    assert body.code is p.ErrorCode.INVALID_REQUEST


def test_every_cursor_of_the_pattern_is_served(shared: tuple[TestClient, Path]) -> None:
    client, _ = shared
    for cursor, first in [("9999999999999999.", STEPS), ("10.", 10), ("10.3130", 9), ("0.", None)]:
        resp = client.get(f"/v1/jobs/{JOB}/checkpoints", params={"cursor": cursor, "limit": 3})
        assert resp.status_code == 200, resp.text
        steps = [c["step"] for c in resp.json()["checkpoints"]]
        assert steps[:1] == ([first] if first is not None else [])
    assert decode_cursor(encode_cursor((-7, b"checkpoint_7"))) == (-7, b"checkpoint_7")
    with pytest.raises(ValueError):
        decode_cursor("7.zz")


# ---- ETag / If-None-Match -------------------------------------------------------------------------


def _conditional(client: TestClient, method: str, url: str, etag: str | None, **kw: Any) -> httpx.Response:
    headers = {"If-None-Match": etag} if etag else {}
    return client.request(method, url, headers=headers, **kw)


ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", f"/v1/jobs/{JOB}/checkpoints", {}),
    ("GET", f"/v1/jobs/{JOB}/checkpoints", {"params": {"limit": 5}}),
    ("GET", f"/v1/jobs/{JOB}/checkpoints/latest-good", {}),
    ("POST", f"/v1/jobs/{JOB}/resume", {"json": {"alive_devices": 8}}),
]


@pytest.mark.parametrize(("method", "url", "kw"), ROUTES)
def test_if_none_match_gets_304_until_the_answer_changes(
    served: tuple[TestClient, Path], template: Path, method: str, url: str, kw: dict[str, Any]
) -> None:
    client, root = served
    first = _conditional(client, method, url, None, **kw)
    assert first.status_code == 200, first.text
    etag = first.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"') and first.headers["cache-control"] == "no-cache"
    same = _conditional(client, method, url, etag, **kw)
    assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == etag
    for held in (f"W/{etag}", f'"other", {etag}', "*"):  # weak comparison, a list, any
        assert _conditional(client, method, url, held, **kw).status_code == 304
    assert _conditional(client, method, url, '"other"', **kw).status_code == 200

    # A new step, committed and verified: a new answer, a new tag; the old tag gets the new answer.
    add_step(root, template, STEPS + 1)
    client.app.state.catalog.refresh_job(JOB)  # type: ignore[attr-defined]
    after_new = _conditional(client, method, url, etag, **kw)
    assert after_new.status_code == 200 and after_new.headers["etag"] != etag
    assert str(STEPS + 1) in after_new.text
    etag = after_new.headers["etag"]

    # The newest step quarantined (by another ckptd: the catalog does not know yet): the answer is worked
    # out afresh, with its checks on storage, so the old tag does not get a 304 for a step no longer good.
    step_path = str(root / JOB / str(STEPS + 1))
    quarantine(Storage(str(root)), step_path, "test", ["bad"])
    if url.endswith("checkpoints"):
        client.app.state.catalog.confirmed_latest_good(JOB)  # type: ignore[attr-defined]  # a list is the catalog's view
    after_quarantine = _conditional(client, method, url, etag, **kw)
    assert after_quarantine.status_code == 200, after_quarantine.text
    assert after_quarantine.headers["etag"] != etag
    if "limit" not in kw.get("params", {}) and not url.endswith("checkpoints"):
        assert after_quarantine.json()["step"] == STEPS


def test_resume_tags_cover_every_input_of_the_request(shared: tuple[TestClient, Path]) -> None:
    client, _ = shared
    url = f"/v1/jobs/{JOB}/resume"
    bodies: list[dict[str, Any]] = [
        {"alive_devices": 8}, {"alive_devices": 4}, {"alive_devices": 8, "policy": "pause"},
        {"alive_devices": 8, "run_id": "a"}, {"alive_devices": 8, "run_id": "b"},
        {"alive_devices": 8, "allow_foreign_run": True}, {"alive_devices": 8, "allow_foreign_topology": True},
        {"alive_devices": 8, "use_memory_tier": False}, {"alive_devices": 8, "step": STEPS},
    ]
    tags = []
    for body in bodies:
        resp = client.post(url, json=body)
        assert resp.status_code == 200, (body, resp.text)
        tags.append(resp.headers["etag"])
        for other in tags[:-1]:  # another request's tag is never this one's 304
            assert client.post(url, json=body, headers={"If-None-Match": other}).status_code == 200
    assert len(set(tags)) == len(tags)
    assert client.post(url, json=bodies[0], headers={"If-None-Match": tags[0]}).status_code == 304


def test_errors_carry_no_etag_and_ignore_if_none_match(shared: tuple[TestClient, Path]) -> None:
    client, _ = shared
    resp = client.get("/v1/jobs/nope/checkpoints/latest-good", headers={"If-None-Match": "*"})
    assert resp.status_code == 404 and "etag" not in resp.headers
    resp = client.post(f"/v1/jobs/{JOB}/resume", json={"alive_devices": 8, "step": 999}, headers={"If-None-Match": "*"})
    assert resp.status_code == 404 and "etag" not in resp.headers


def test_the_client_walks_the_pages(shared: tuple[TestClient, Path]) -> None:
    from trainer_client.client._ckptd_client import CkptdClient

    client, _ = shared
    with CkptdClient(transport=client._transport) as ckptd:  # the TestClient's transport: its app
        ckptd._http.base_url = client.base_url
        assert [c.step for c in ckptd.iter_checkpoints(JOB, page_size=7)] == list(range(STEPS, 0, -1))
        assert [c.step for c in ckptd.checkpoints(JOB).checkpoints] == list(range(1, STEPS + 1))
        page = ckptd.checkpoints(JOB, limit=2)
        assert [c.step for c in page.checkpoints] == [STEPS, STEPS - 1] and page.next is not None


# ---- the hot path (ckptd/api/_hot_path.py) ---------------------------------------------------------


def test_the_hot_path_answers_as_the_routes_do(shared: tuple[TestClient, Path]) -> None:
    client, _ = shared
    svc = client.app.state.services  # type: ignore[attr-defined]
    rounds = svc.answers.rounds
    good = client.get(f"/v1/jobs/{JOB}/checkpoints/latest-good")
    plan = client.post(f"/v1/jobs/{JOB}/resume", json={"alive_devices": 8})
    assert good.status_code == plan.status_code == 200 and svc.answers.rounds == rounds + 2
    assert p.CheckpointInfo.model_validate_json(good.content).step == STEPS
    assert p.ResumePlan.model_validate_json(plan.content).step == STEPS
    counted = svc.metrics.requests.labels(p.ROUTE_RESUME, "200")._value.get()
    client.post(f"/v1/jobs/{JOB}/resume", json={"alive_devices": 8})
    assert svc.metrics.requests.labels(p.ROUTE_RESUME, "200")._value.get() == counted + 1  # labelled as the route
    # What the hot path leaves to FastAPI is refused as before, with its details.
    assert client.get(f"/v1/jobs/{JOB}/checkpoints/latest-good", params={"x": 1}).status_code == 422
    bad = client.post(f"/v1/jobs/{JOB}/resume", json={"alive_devices": "8"})
    assert bad.status_code == 422 and p.ErrorBody.model_validate_json(bad.content).detail
    text = client.post(f"/v1/jobs/{JOB}/resume", content=b"{}", headers={"content-type": "text/plain"})
    assert text.status_code == 415
    assert client.get("/v1/jobs/..bad/checkpoints/latest-good").status_code == 400
    assert client.get("/v1/jobs/nope/checkpoints/latest-good").json()["code"] == "JOB_NOT_FOUND"


def test_the_client_polls_latest_good_with_its_etag(served: tuple[TestClient, Path], template: Path) -> None:
    from trainer_client.client._ckptd_client import CkptdClient

    client, root = served
    requests = client.app.state.services.metrics.requests  # type: ignore[attr-defined]
    with CkptdClient(transport=client._transport) as ckptd:
        ckptd._http.base_url = client.base_url
        first = ckptd.latest_good(JOB)
        not_modified = requests.labels(p.ROUTE_LATEST_GOOD, "304")._value.get()
        again = ckptd.latest_good(JOB)
        assert again == first and again is not first and first is not None and first.step == STEPS
        assert requests.labels(p.ROUTE_LATEST_GOOD, "304")._value.get() == not_modified + 1  # answered 304
        add_step(root, template, STEPS + 1)
        client.app.state.catalog.refresh_job(JOB)  # type: ignore[attr-defined]
        newer = ckptd.latest_good(JOB)
        assert newer is not None and newer.step == STEPS + 1
        assert requests.labels(p.ROUTE_LATEST_GOOD, "304")._value.get() == not_modified + 1
