"""The peer fetch in the wire contract (``PeerFetchRequest``, ``PeerFetchAnswer``: docs/protocol.md, "POST
/v1/jobs/{job}/peer-fetch"): every field bounded on its own and of JSON's own type, unknown fields refused;
hosts that cannot be together are left to the answer (a rule between fields no schema states)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from trainer_client.core import protocol as p

GOOD: dict[str, Any] = {"step": 10, "source": 1, "origin": 0, "count": 2, "save_id": "3f9a1c-10"}


def test_a_request_within_its_bounds_parses_and_its_answer_says_why_only_when_not_ok() -> None:
    asked = p.PeerFetchRequest.model_validate(GOOD)
    assert asked.model_dump(mode="json") == GOOD
    assert p.PeerFetchRequest.model_validate({**GOOD, "save_id": None}).save_id is None
    assert p.PeerFetchRequest.model_validate({**GOOD, "step": 10.0}).step == 10  # JSON's one number type
    edges = {"step": p.MAX_STEP, "source": p.MAX_HOSTS - 1, "origin": p.MAX_HOSTS - 1, "count": p.MAX_HOSTS}
    assert p.PeerFetchRequest.model_validate({**GOOD, **edges}).count == p.MAX_HOSTS
    # the source the asker itself, an index past the hosts: each field valid, answered (not refused) by ckptd
    assert p.PeerFetchRequest.model_validate({**GOOD, "source": 0, "origin": 5}).origin == 5
    assert p.PeerFetchAnswer(ok=True).model_dump(mode="json") == {"ok": True}
    assert p.PeerFetchAnswer(ok=False, error="gone").model_dump(mode="json") == {"ok": False, "error": "gone"}
    assert p.ERROR_STATUS[p.ErrorCode.PEER_CHANNEL_OFF] == 409
    assert p.ROUTE_PEER_FETCH.format(job="llm") == "/v1/jobs/llm/peer-fetch"


@pytest.mark.parametrize("change", [
    {"step": None}, {"count": None},  # missing
    {"step": -1}, {"step": p.MAX_STEP + 1}, {"source": -1}, {"source": p.MAX_HOSTS}, {"origin": p.MAX_HOSTS},
    {"count": 1}, {"count": p.MAX_HOSTS + 1},
    {"step": True}, {"step": "10"}, {"step": 10.5}, {"count": [2]},  # JSON's own types only
    {"save_id": "10"}, {"save_id": "ABC-10"}, {"save_id": "a" * 33 + "-10"}, {"save_id": 10},
    {"path": "/dev/shm/job/10"},  # a field the request does not have
])
def test_a_request_out_of_its_bounds_is_refused(change: dict[str, Any]) -> None:
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValidationError):
        p.PeerFetchRequest.model_validate(body)
