"""HTTP conformance, one rule at a time; tests/server/api/test_hostile.py runs schemathesis
with every check and phase over the whole API.

A 405 lists every method of its path in ``Allow``; a schema-valid advice request the job's history cannot
complete is a 409 (not a 422 for a request the schema calls valid); an undeclared query parameter on a
``/v1`` route is refused by name; events' ``?kind=`` filters; a body that is not sent as JSON is a 415 and
one that is not JSON says so; a step number is one JSON carries exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from ckptd.api._app import create_app
from tests.support.helpers import make_settings
from trainer_client.core import protocol as p


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    (tmp_path / "root" / "fresh").mkdir(parents=True)  # a job with no step and no history yet
    with TestClient(create_app(make_settings(tmp_path / "root", tmp_path / "state"))) as client:
        client.app.state.catalog.rebuild()  # type: ignore[attr-defined]
        yield client


def _error(response: httpx.Response, code: p.ErrorCode) -> p.ErrorBody:
    assert response.status_code == p.ERROR_STATUS[code], response.text
    error = p.ErrorBody.model_validate(response.json())
    assert error.code is code, error
    return error


def test_a_405_lists_every_method_of_its_path(client: TestClient) -> None:
    for method, path, allowed in [
        ("DELETE", "/v1/jobs/fresh/events", ["GET", "HEAD", "POST"]),  # two routes share the path
        ("PUT", "/v1/jobs/fresh/resume", ["POST"]),
        ("TRACE", p.ROUTE_JOBS, ["GET", "HEAD"]),
        ("POST", p.ROUTE_HEALTHZ, ["GET", "HEAD"]),
    ]:
        response = client.request(method, path)
        error = _error(response, p.ErrorCode.METHOD_NOT_ALLOWED)
        assert response.headers["allow"] == ", ".join(allowed), (method, path)
        assert error.detail == {"allow": allowed}


def test_advice_the_history_cannot_complete_is_a_conflict_not_a_bad_request(client: TestClient) -> None:
    """Every advice input is optional in the schema (the history fills them in): without a history, the
    request is valid and the job's state is what is missing."""
    error = _error(client.get("/v1/jobs/fresh/advice"), p.ErrorCode.MISSING_INPUT)
    assert p.ERROR_STATUS[p.ErrorCode.MISSING_INPUT] == 409
    assert "step_time_s" in str(error.detail)
    schema = client.get("/openapi.json").json()
    assert "409" in schema["paths"][p.ROUTE_ADVICE]["get"]["responses"]


def test_undeclared_query_parameters_are_refused_by_name(client: TestClient) -> None:
    for path in (p.ROUTE_JOBS, "/v1/jobs/fresh/checkpoints", "/v1/jobs/fresh/events", "/v1/jobs/fresh/goodput",
                 "/v1/jobs/fresh/advice?step_time_s=1"):
        joiner = "&" if "?" in path else "?"
        error = _error(client.get(f"{path}{joiner}limt=5&zz=1"), p.ErrorCode.INVALID_REQUEST)
        assert error.detail == {"errors": [{"loc": ["query", "limt"], "msg": "not a parameter of this operation"},
                                           {"loc": ["query", "zz"], "msg": "not a parameter of this operation"}]}
    response = client.post("/v1/jobs/fresh/resume?dry_run=1", json={"alive_devices": 8})
    assert _error(response, p.ErrorCode.INVALID_REQUEST).detail["errors"][0]["loc"] == ["query", "dry_run"]  # type: ignore[index]
    # a single parameter given twice (FastAPI kept the last) and numbers or booleans not written as JSON
    for query, msg in [("limit=5&limit=7", "given more than once"), ("limit=%C2%A05", "not a JSON integer"),
                       ("limit=1_000", "not a JSON integer"), ("since=inf", "not a JSON number"),
                       ("since=.5", "not a JSON number")]:
        error = _error(client.get(f"/v1/jobs/fresh/events?{query}"), p.ErrorCode.INVALID_REQUEST)
        assert error.detail == {"errors": [{"loc": ["query", query.split("=")[0]], "msg": msg}]}, query
    assert _error(client.get("/v1/jobs/fresh/advice?step_time_s=1&memory_tier=on"),
                  p.ErrorCode.INVALID_REQUEST).detail == {"errors": [{"loc": ["query", "memory_tier"],
                                                                      "msg": "not a JSON boolean"}]}
    assert client.get("/v1/jobs/fresh/events?since=1.5e9&limit=10").status_code == 200
    # declared ones pass; the probes and the dashboard ignore queries (the page reads its own ?job=)
    assert client.get("/v1/jobs/fresh/events?limit=5&since=0").status_code == 200
    for path in (f"{p.ROUTE_HEALTHZ}?x=1", f"{p.ROUTE_READYZ}?x=1", "/?job=fresh", "/metrics?x=1"):
        assert client.get(path).status_code == 200, path


def test_events_can_be_filtered_by_kind(client: TestClient) -> None:
    events = [{"kind": kind, "time": 1_700_000_000.0 + i, "id": f"e{i}"}
              for i, kind in enumerate(["start", "failure_detected", "recovered", "checkpoint_started", "finished"])]
    assert client.post("/v1/jobs/fresh/events", json={"events": events}).status_code == 200
    every = client.get("/v1/jobs/fresh/events").json()["events"]
    assert [e["kind"] for e in every] == [e["kind"] for e in events]
    some = client.get("/v1/jobs/fresh/events?kind=failure_detected&kind=recovered").json()["events"]
    assert [e["kind"] for e in some] == ["failure_detected", "recovered"]
    assert client.get("/v1/jobs/fresh/events?kind=aborted").json()["events"] == []
    for unknown in ("no_such_kind", "false", "Bad%20Kind"):
        _error(client.get(f"/v1/jobs/fresh/events?kind={unknown}"), p.ErrorCode.INVALID_REQUEST)
    schema = client.get("/openapi.json").json()["paths"][p.ROUTE_EVENTS]["get"]["parameters"]
    kind = next(q for q in schema if q["name"] == "kind")["schema"]["anyOf"][0]
    assert kind["items"]["enum"] == list(p.EVENT_KINDS)


def test_a_body_not_sent_as_json_is_a_415_and_one_that_is_not_json_says_so(client: TestClient) -> None:
    body = b'{"alive_devices": 8}'
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"):
        headers = {} if content_type is None else {"content-type": content_type}
        for path in ("/v1/jobs/fresh/resume", "/v1/jobs/fresh/events"):
            error = _error(client.post(path, content=body, headers=headers), p.ErrorCode.UNSUPPORTED_MEDIA_TYPE)
            assert error.detail == {"content_type": content_type or "(none)"}
            assert "Content-Type: application/json" in error.message
    for content_type in ("application/json", "application/json; charset=utf-8", "application/merge+json"):
        response = client.post("/v1/jobs/fresh/resume", content=body, headers={"content-type": content_type})
        assert response.status_code != 415, (content_type, response.text)  # read as JSON, judged on content
    error = _error(client.post("/v1/jobs/fresh/resume", content=b"{oops", headers={"content-type": "application/json"}),
                   p.ErrorCode.INVALID_REQUEST)
    assert error.message == "the body is not valid JSON: key must be a string (at byte 1)"
    schema = client.get("/openapi.json").json()
    assert "415" in schema["paths"][p.ROUTE_RESUME]["post"]["responses"]
    assert "415" in schema["paths"][p.ROUTE_EVENTS]["post"]["responses"]
    assert "415" not in schema["paths"][p.ROUTE_EVENTS]["get"]["responses"]


def test_a_step_is_a_number_json_carries_exactly(client: TestClient) -> None:
    """The schema's maximum step is exact in a double: 2**63 - 1 is not, and a generator or a JavaScript
    client that rounds 2**63 + 191 down to it sent a "valid" step the server refused."""
    assert p.MAX_STEP == 2**53 - 1 and float(p.MAX_STEP) == p.MAX_STEP
    _error(client.post("/v1/jobs/fresh/resume", json={"alive_devices": 8, "step": 2**53}), p.ErrorCode.INVALID_REQUEST)
    resume = client.get("/openapi.json").json()["components"]["schemas"]["ResumeRequest"]["properties"]["step"]
    assert max(branch.get("maximum", 0) for branch in resume["anyOf"]) == 2**53 - 1
