"""The trainer's request for its part back from a peer, on ckptd's API (``POST /v1/jobs/{job}/peer-fetch``,
docs/multihost.md, "Peer copies"): a malformed request is a 4xx with the one error body and fetches nothing, a
sidecar whose peer channel is off says so (``409 PEER_CHANNEL_OFF``), and two requests for one step while its
fetch runs share that fetch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from ckptd.peers import PeerService
from tests.server.peers.conftest import JOB, Tarpit, api_of, plant_holder, set_options
from tests.support.helpers import wait_until
from trainer_client.core import protocol as p

GOOD: dict[str, Any] = {"step": 10, "source": 1, "origin": 0, "count": 2, "save_id": "ab-10"}
MALFORMED: list[dict[str, Any]] = [
    {k: v for k, v in GOOD.items() if k != "count"},  # a field missing
    {**GOOD, "step": -1},
    {**GOOD, "step": p.MAX_STEP + 1},
    {**GOOD, "source": p.MAX_HOSTS},
    {**GOOD, "origin": -1},
    {**GOOD, "count": 1},
    {**GOOD, "count": p.MAX_HOSTS + 1},
    {**GOOD, "step": True},  # JSON's own types: no boolean or string is a number
    {**GOOD, "source": "1"},
    {**GOOD, "step": 10.5},
    {**GOOD, "save_id": "../../etc"},
    {**GOOD, "save_id": 7},
    {**GOOD, "path": "/dev/shm/x"},  # a field the request does not have
]


def refused(response: Any, status: int) -> p.ErrorBody:
    assert response.status_code == status, response.text
    error = p.ErrorBody.model_validate_json(response.content)
    assert p.ERROR_STATUS[error.code] == status
    return error


def test_a_malformed_fetch_request_is_a_4xx_with_the_error_body_and_fetches_nothing(
        pair: tuple[list[PeerService], list[Path]], api0: TestClient) -> None:
    (s0, _), (shm0, _) = pair
    url = p.ROUTE_PEER_FETCH.format(job=JOB)
    for body in MALFORMED:
        error = refused(api0.post(url, json=body), 422)
        assert error.code is p.ErrorCode.INVALID_REQUEST and error.detail and error.detail["errors"], body
    assert refused(api0.post(url, content=b"{oops", headers={"content-type": "application/json"}), 422).code \
        is p.ErrorCode.INVALID_REQUEST
    assert refused(api0.post(url, content=b"step=10", headers={"content-type": "text/plain"}), 415).code \
        is p.ErrorCode.UNSUPPORTED_MEDIA_TYPE
    for job in (".hidden", "a" * 129, "x y"):
        assert refused(api0.post(p.ROUTE_PEER_FETCH.format(job=job), json=GOOD), 400).code \
            is p.ErrorCode.INVALID_JOB_NAME
    assert refused(api0.get(url), 405).code is p.ErrorCode.METHOD_NOT_ALLOWED
    snapshot = s0.snapshot()
    assert (snapshot["fetched"], snapshot["fetch_failures"]) == (0, 0) and not (shm0 / JOB).exists()


def test_a_fetch_asked_of_a_sidecar_whose_peer_channel_is_off_says_so(tmp_path: Path) -> None:
    with api_of(None, tmp_path) as api:
        error = refused(api.post(p.ROUTE_PEER_FETCH.format(job=JOB), json=GOOD), 409)
        assert error.code is p.ErrorCode.PEER_CHANNEL_OFF and "peer channel is off" in error.message
        assert refused(api.post(p.ROUTE_PEER_FETCH.format(job=JOB), json={**GOOD, "step": -1}), 422).code \
            is p.ErrorCode.INVALID_REQUEST  # malformed is malformed, channel or not


def test_two_requests_for_one_step_share_its_fetch(pair: tuple[list[PeerService], list[Path]]) -> None:
    """The second request (a trainer asking again after its own timeout) waits for the fetch already running
    instead of starting another; a request once that fetch is answered starts a new one."""
    (s0, _), _ = pair
    set_options(s0, refill=False)
    pit = Tarpit()
    try:
        plant_holder(s0, JOB, 1, pit.address)
        asked = p.PeerFetchRequest.model_validate(GOOD)
        first = s0.fetch(JOB, asked)
        wait_until(lambda: pit.held() >= 1, timeout=20, what="the fetch held by the tarpit")
        assert s0.fetch(JOB, asked) is first and not first.done()
        assert s0.fetch(JOB, asked.model_copy(update={"step": 11})) is not first  # another step: a fetch of its own
    finally:
        pit.close()
    answer = first.result(timeout=60)  # its peer gone: answered, never raised
    assert not answer.ok and answer.error is not None and answer.error.startswith("from host 1: ")
    again = s0.fetch(JOB, asked)
    assert again is not first and not again.result(timeout=60).ok
