"""The peer channel's typed headers (``ckptd/peers/_headers.py``): every request and answer is parsed into its model
before anything reads it, and one missing a field, out of its bounds, of a wrong JSON type or with a field it does
not have ends the request with ``PeerError``, on the listener's side and on the caller's; the JSON the models send
is what the channel carried before them (the wire version stays ``CKPTDP2``)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.peers._headers import (
    MAX_HELD,
    MAX_PART_BYTES,
    MAX_STEP,
    GetAnswer,
    GetRequest,
    HeldAnswer,
    HeldRequest,
    JobsAnswer,
    JobsRequest,
    ListAnswer,
    ListRequest,
    PutAnswer,
    PutRequest,
    parse_answer,
    parse_request,
)
from ckptd.peers._protocol import MAGIC, PeerError, connect, listener_handshake
from ckptd.peers._requests import ask_part, jobs_kept, newest_copy
from ckptd.peers._server import PeerListener
from ckptd.peers._store import PartStore
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET
from trainer_client.core.format import MAX_META_BYTES
from trainer_client.core.protocol import MAX_HOSTS

JOB = "peerjob"
PUT: dict[str, Any] = {"op": "put", "job": JOB, "origin": 0, "count": 2, "step": 10, "held": [10], "meta": 100,
                       "data": 4096, "sender": "ab" * 16}


def test_each_request_sends_what_the_channel_always_carried() -> None:
    assert PutRequest.model_validate(PUT).wire() == PUT
    assert HeldRequest(job=JOB, origin=1, count=2, held=[3, 4], sender="x").wire() == {
        "op": "held", "job": JOB, "origin": 1, "count": 2, "held": [3, 4], "sender": "x"}
    assert GetRequest(job=JOB, origin=0, count=2, step=7, save_id=None).wire() == {
        "op": "get", "job": JOB, "origin": 0, "count": 2, "step": 7, "save_id": None}
    assert ListRequest(job=JOB, origin=0, count=2).wire() == {"op": "list", "job": JOB, "origin": 0, "count": 2}
    assert JobsRequest(origin=0, count=2).wire() == {"op": "jobs", "origin": 0, "count": 2}
    assert PutAnswer(have=False, holder="h").wire() == {"ok": True, "have": False, "holder": "h"}
    assert ListAnswer(copies=[(3, "ab-3"), (4, None)]).wire() == {"ok": True, "copies": [[3, "ab-3"], [4, None]]}
    assert parse_request(PUT) == PutRequest.model_validate(PUT)
    assert isinstance(parse_request({"op": "held", "job": JOB, "origin": 0, "count": 2, "held": []}), HeldRequest)


@pytest.mark.parametrize(("change", "why"), [
    ({"count": None}, "count"),  # missing
    ({"step": None}, "step"),
    ({"job": "../x"}, "not a job name"),
    ({"job": ""}, "not a job name"),
    ({"origin": 2}, "not one of 2 hosts"),
    ({"origin": -1}, "origin"),
    ({"count": 1}, "count"),
    ({"count": MAX_HOSTS + 1}, "count"),
    ({"step": -1}, "step"),
    ({"step": MAX_STEP + 1}, "step"),
    ({"step": True}, "step"),  # JSON's own types: a boolean is no step, nor a string or 10.0
    ({"step": "10"}, "step"),
    ({"step": 10.0}, "step"),
    ({"meta": 0}, "meta"),
    ({"meta": MAX_META_BYTES + 1}, "meta"),
    ({"data": MAX_PART_BYTES + 1}, "data"),
    ({"held": list(range(MAX_HELD + 1))}, "held"),
    ({"held": [1, -1]}, "held"),
    ({"held": "10"}, "held"),
    ({"sender": "x" * 65}, "sender"),
    ({"path": "/etc"}, "path"),  # a field the request does not have
    ({"op": "rm"}, "no such operation"),
    ({"op": None}, "no operation named"),
])
def test_a_request_missing_a_field_or_out_of_bounds_is_a_peer_error(change: dict[str, Any], why: str) -> None:
    header = {k: v for k, v in {**PUT, **change}.items() if v is not None}
    with pytest.raises(PeerError, match=why):
        parse_request(header)


@pytest.mark.parametrize(("answer", "model", "why"), [
    ({"ok": False, "error": "busy: 8 requests in progress"}, GetAnswer, "busy"),
    ({"ok": False}, GetAnswer, "refused"),
    ({"ok": "yes", "meta": 1, "data": 0}, GetAnswer, "ok"),
    ({"ok": True, "meta": 0, "data": 5}, GetAnswer, "meta"),
    ({"ok": True, "meta": 1}, GetAnswer, "data"),
    ({"ok": True, "meta": 1, "data": MAX_PART_BYTES + 1}, GetAnswer, "data"),
    ({"ok": True, "have": 1, "holder": "h"}, PutAnswer, "have"),
    ({"ok": True, "dropped": -1, "holder": "h"}, HeldAnswer, "dropped"),
    ({"ok": True, "copies": [[1]]}, ListAnswer, "copies"),
    ({"ok": True, "copies": [[-1, None]]}, ListAnswer, "copies"),
    ({"ok": True, "copies": [[1, "not a save"]]}, ListAnswer, "copies"),
    ({"ok": True, "jobs": ["../x"]}, JobsAnswer, "not a job name"),
    ({"ok": True, "jobs": [f"j{k}" for k in range(257)]}, JobsAnswer, "jobs"),
])
def test_an_answer_missing_a_field_or_out_of_bounds_is_a_peer_error(answer: dict[str, Any], model: type[Any],
                                                                    why: str) -> None:
    with pytest.raises(PeerError, match=why):
        parse_answer(answer, model)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[PeerListener]:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    served = PeerListener(PartStore(shm), SECRET.encode(), host="127.0.0.1", port=0)
    served.start()
    yield served
    served.stop()


def test_the_listener_ends_a_request_whose_header_is_missing_a_field(listener: PeerListener) -> None:
    with connect(f"127.0.0.1:{listener.port}", SECRET.encode(), 10) as chan:
        chan.send_header({k: v for k, v in PUT.items() if k != "data"})
        with pytest.raises(PeerError, match="data: Field required"):
            parse_answer(chan.recv_header(), PutAnswer)
    wait_until(lambda: listener.stats.refused == 1, timeout=10)
    assert not list(listener.store.shm_dir.iterdir())  # nothing charged, nothing written


@contextlib.contextmanager
def answering(answer: dict[str, Any]) -> Iterator[str]:
    """A listener holding the secret that answers every request with ``answer`` (a peer gone wrong)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError, PeerError):
            while True:
                conn, _ = server.accept()
                with conn:
                    chan = listener_handshake(conn, SECRET.encode(), 5)
                    chan.recv_header()
                    chan.send_header(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def test_the_caller_ends_a_request_whose_answer_is_out_of_bounds() -> None:
    with answering({"ok": True, "meta": 0, "data": 1 << 50}) as address, \
            connect(address, SECRET.encode(), 10) as chan, pytest.raises(PeerError, match="an answer refused"):
        ask_part(chan, JOB, 10, origin=0, count=2, save_id="ab-10")
    with answering({"ok": True, "copies": [[10, "ab-10"], [12, None], [11, "ab-11"]]}) as address, \
            connect(address, SECRET.encode(), 10) as chan:
        assert newest_copy(chan, JOB, 0, 2) == (12, None)  # a copy of no save id listed as such, not as "None"
    with answering({"ok": True, "jobs": "peerjob"}) as address, connect(address, SECRET.encode(), 10) as chan, \
            pytest.raises(PeerError, match="jobs"):
        jobs_kept(chan, 0, 2)
    assert MAGIC == b"CKPTDP2\n"  # the JSON is the same: the wire version is too
