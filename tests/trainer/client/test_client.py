"""CkptdClient: retries on outages, falls back to storage only on outages, never on a refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._retry import RetryPolicy, retry
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.errors import CkptdRequestError, CkptdUnavailable, NoCheckpointError


def _client(handler: Any, root: str | None = None) -> tuple[CkptdClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)  # type: ignore[no-any-return]

    settings = ClientSettings(url="http://ckptd.test", token="tok", timeout_s=0.5, resume_deadline_s=2.0)
    return CkptdClient(settings, root=root, transport=httpx.MockTransport(record)), seen


def test_a_refusal_is_raised_with_its_code_and_not_retried(tmp_path: Path) -> None:
    body = {"code": "NOT_ENOUGH_DEVICES", "message": "policy 'pause' needs 8 devices"}
    client, seen = _client(lambda r: httpx.Response(409, json=body), root=str(tmp_path))
    with pytest.raises(CkptdRequestError) as err:
        client.resume("job", p.ResumeRequest(policy="pause", alive_devices=6))
    assert (err.value.status, err.value.code) == (409, "NOT_ENOUGH_DEVICES")
    assert len(seen) == 1
    assert seen[0].headers["authorization"] == "Bearer tok"


def test_an_outage_is_retried_then_answered_from_storage(tmp_path: Path) -> None:
    client, seen = _client(lambda r: httpx.Response(503, json={"code": "NOT_READY", "message": "x"}),
                           root=str(tmp_path))
    (tmp_path / "job").mkdir()
    with pytest.raises(NoCheckpointError):  # storage has nothing committed: said plainly
        client.resume("job", p.ResumeRequest(alive_devices=8))
    assert len(seen) == 4  # RetryPolicy(max_attempts=4)


def test_the_fallback_s_refusal_raises_what_ckptd_s_answer_raises(tmp_path: Path) -> None:
    """One mapping from a refusal's code to the exception, whether ckptd answered it or the fallback found it:
    a step asked for that is not there is ``CkptdRequestError`` 404 ``STEP_NOT_FOUND`` both ways."""
    (tmp_path / "job").mkdir()
    asked = p.ResumeRequest(alive_devices=8, step=5)
    body = {"code": "STEP_NOT_FOUND", "message": "job 'job' has no step 5"}
    answered, _ = _client(lambda r: httpx.Response(404, json=body), root=str(tmp_path))
    with pytest.raises(CkptdRequestError) as by_ckptd:
        answered.resume("job", asked)
    down, _ = _client(lambda r: httpx.Response(503, json={"code": "NOT_READY", "message": "x"}), root=str(tmp_path))
    with pytest.raises(CkptdRequestError) as by_fallback:
        down.resume("job", asked)
    for err in (by_ckptd.value, by_fallback.value):
        assert (err.status, err.code) == (404, "STEP_NOT_FOUND")
    assert "has no good step 5 in" in by_fallback.value.message


def test_with_ckptd_down_the_fallback_restores_from_the_replicas_the_request_names(tmp_path: Path) -> None:
    """The request's ``replicas`` reach ckptd as sent, and the fallback decides on them as ckptd does
    (docs/protocol.md, "Resume"): step 12 held in the hosts' memory, whole on slice 1, beats storage's step 10;
    with slice 1 lost it is storage's step 10."""
    write_orbax_jobs({tmp_path / "job": [10]}, custom_metadata={10: training_metadata(10)})
    client, seen = _client(lambda r: httpx.Response(503, json={"code": "NOT_READY", "message": "x"}),
                           root=str(tmp_path))
    held = p.ReplicasHeld(step=12, slices=[[0], [1]])
    alive = [p.SliceAlive(index=1, devices=2), p.SliceAlive(index=2, devices=2)]
    plan = client.resume("job", p.ResumeRequest(alive_devices=4, slices=alive, replicas=held))
    assert (plan.tier, plan.step, plan.source, plan.path) == ("replicas", 12, "storage_scan", "")
    assert plan.mesh.shape == [2, 2] and plan.slices_used == [1, 2]
    assert json.loads(seen[0].content)["replicas"] == {"step": 12, "slices": [[0], [1]]}
    lost = [p.SliceAlive(index=0, devices=2), p.SliceAlive(index=2, devices=2)]
    held = p.ReplicasHeld(step=12, slices=[[1]])
    plan = client.resume("job", p.ResumeRequest(alive_devices=4, slices=lost, replicas=held))
    assert (plan.tier, plan.step, plan.data_position) == ("storage", 10, 640)


def test_no_root_means_the_outage_is_raised() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client, seen = _client(refuse)
    with pytest.raises(CkptdUnavailable):
        client.resume("job", p.ResumeRequest(alive_devices=8))
    assert len(seen) == 4


def test_an_answer_that_is_not_a_plan_counts_as_an_outage(tmp_path: Path) -> None:
    """A 200 that is not ckptd's plan (a proxy's login page, a truncated body) is retried, then storage answers."""
    page = httpx.Response(200, text="<html>sign in</html>", headers={"content-type": "text/html"})
    client, seen = _client(lambda r: page, root=str(tmp_path))
    (tmp_path / "job").mkdir()
    with pytest.raises(NoCheckpointError):  # the storage scan ran: nothing committed there
        client.resume("job", p.ResumeRequest(alive_devices=8))
    assert len(seen) == 4
    client, _ = _client(lambda r: httpx.Response(200, json={"step": 3}))  # JSON, but not a plan
    with pytest.raises(CkptdUnavailable, match="no ResumePlan"):
        client.resume("job", p.ResumeRequest(alive_devices=8))


def test_latest_good_is_none_for_no_checkpoint() -> None:
    body = {"code": "NO_GOOD_CHECKPOINT", "message": "none"}
    client, _ = _client(lambda r: httpx.Response(404, json=body))
    assert client.latest_good("job") is None


def test_retry_gives_up_at_the_deadline() -> None:
    calls = []

    @retry(RetryPolicy(max_attempts=100, initial_backoff_s=0.05, multiplier=1.0, deadline_s=0.2),
           retry_on=(ValueError,))
    def flaky() -> None:
        calls.append(1)
        raise ValueError("no")

    with pytest.raises(ValueError):
        flaky()
    assert 2 <= len(calls) <= 5


def test_no_good_step_at_ckptd_but_a_committed_one_on_storage_is_not_a_fresh_start(tmp_path: Path) -> None:
    """ckptd cannot verify steps on read-only or full storage; the job must not start over from step 0."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer_client.runtime.saving._checkpointing import Checkpointer

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))
    ck = Checkpointer(str(tmp_path / "job"))
    ck.save(7, {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P(None, "data")))},
            data_position=56, global_batch=8, mesh=mesh, slices=[0, 1, 2, 3])
    ck.close()
    body = {"code": "NO_GOOD_CHECKPOINT", "message": "job 'job' has no verified checkpoint yet"}
    client, _ = _client(lambda r: httpx.Response(404, json=body), root=str(tmp_path))
    plan = client.resume("job", p.ResumeRequest(alive_devices=6))
    assert (plan.step, plan.source, plan.data_position) == (7, "storage_scan", 56)
    empty, _ = _client(lambda r: httpx.Response(404, json=body), root=str(tmp_path / "elsewhere"))
    with pytest.raises(NoCheckpointError):
        empty.resume("job", p.ResumeRequest(alive_devices=6))


def test_a_peer_fetch_is_one_typed_request_that_waits_for_the_fetch_and_a_refusal_is_raised() -> None:
    """The wiped host's request for its part (docs/multihost.md, "Peer copies"): the request's JSON, the answer
    parsed, a read timeout of its own (the fetch takes longer than any other request), never the storage fallback;
    a sidecar whose peer channel is off refuses at once (not retried)."""
    asked = p.PeerFetchRequest(step=10, source=1, origin=0, count=2, save_id="ab-10")
    client, seen = _client(lambda r: httpx.Response(200, json={"ok": False, "error": "from host 1: gone"}))
    assert client.peer_fetch("job", asked, timeout_s=42.0) == p.PeerFetchAnswer(ok=False, error="from host 1: gone")
    assert [(r.method, r.url.path) for r in seen] == [("POST", "/v1/jobs/job/peer-fetch")]
    assert json.loads(seen[0].content) == asked.model_dump(mode="json") and seen[0].headers["authorization"]
    assert seen[0].extensions["timeout"] == {"connect": 0.5, "read": 42.0, "write": 42.0, "pool": 42.0}
    off = {"code": "PEER_CHANNEL_OFF", "message": "this ckptd's peer channel is off"}
    client, seen = _client(lambda r: httpx.Response(409, json=off))
    with pytest.raises(CkptdRequestError) as err:
        client.peer_fetch("job", asked)
    assert (err.value.status, err.value.code, len(seen)) == (409, "PEER_CHANNEL_OFF", 1)
