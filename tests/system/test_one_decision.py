"""One resume decision (docs/architecture.md, "The resume planner"): ckptd's answer and the client's storage
fallback gather what each tier holds in one place (``trainer_client/core/_resume_candidates.py``) and hand it to
the one decision, and a refusal means the same to both (``trainer_client/core/_refusals.py``). Here the same
inputs — steps on storage, a whole snapshot in shared memory, the replicas a request names, a step asked for,
a policy the devices cannot meet — go through ``CkptdClient.resume`` twice: answered by a real ckptd app, and
with ckptd down (the fallback). The plans are the same but for ``source``; a refusal raises the same exception
with the same code and status."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.errors import Refused
from tests.support.helpers import make_settings
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.peer_parts import write_part
from trainer_client.client._ckptd_client import CkptdClient, refusal_error
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._refusals import REFUSALS
from trainer_client.core._resume_decision import Refusal
from trainer_client.core._storage import Storage
from trainer_client.errors import CkptdError, CkptdRequestError, NoCheckpointError

JOB = "meta"
ALIVE = [p.SliceAlive(index=k, devices=2) for k in (0, 1, 3)]


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CkptdClient, CkptdClient]]:
    """``(answered, fallback)``: a client whose ckptd answers (the app over the root, its shared memory the
    client's), and one whose ckptd is down. Storage holds steps 10 and 20; shared memory a whole snapshot of 25."""
    base = tmp_path_factory.mktemp("one-decision")
    root, shm, state = base / "root", base / "shm", base / "state"
    write_orbax_jobs({root / JOB: [10, 20]}, custom_metadata={s: training_metadata(s) for s in (10, 20)})
    write_part(shm, JOB, 25, index=0, count=1)
    state.mkdir()
    catalog = Catalog(Storage(str(root)), state / "catalog.sqlite3")
    catalog.rebuild()
    settings = ClientSettings(url="http://ckptd.test", shm_dir=str(shm), timeout_s=0.5, resume_deadline_s=1.0,
                              report_events=False)
    with TestClient(create_app(make_settings(root, state, shm_dir=str(shm)), catalog, background=False)) as app:
        def forward(request: httpx.Request) -> httpx.Response:
            answer = app.request(request.method, request.url.path, content=request.content,
                                 headers={"content-type": "application/json"})
            return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

        def down(request: httpx.Request) -> httpx.Response:
            return httpx.Response(503, json={"code": "NOT_READY", "message": "down"})

        with CkptdClient(settings, root=str(root), transport=httpx.MockTransport(forward)) as answered, \
                CkptdClient(settings, root=str(root), transport=httpx.MockTransport(down)) as fallback:
            yield answered, fallback


def _both(sides: tuple[CkptdClient, CkptdClient], job: str, request: p.ResumeRequest) -> list[Any]:
    """What ``resume`` gives on each side: the plan, or the exception raised."""
    out: list[Any] = []
    for client in sides:
        try:
            out.append(client.resume(job, request))
        except CkptdError as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize(("asked", "tier", "step"), [
    ({}, "memory", 25),  # the snapshot in shared memory is newer than storage's step 20
    ({"use_memory_tier": False}, "storage", 20),
    ({"step": 20}, "storage", 20),
    ({"step": 10}, "storage", 10),
    ({"replicas": {"step": 30, "slices": [[0], [1]]}}, "replicas", 30),  # whole on slice 0: the newest
    ({"replicas": {"step": 25, "slices": [[0], [1]]}}, "replicas", 25),  # equal to memory's: the faster tier
    ({"replicas": {"step": 30, "slices": [[2]]}}, "memory", 25),  # slice 2 is lost: no replica whole
])
def test_the_same_inputs_give_the_same_plan_from_ckptd_and_from_the_fallback(
        sides: tuple[CkptdClient, CkptdClient], asked: dict[str, Any], tier: str, step: int) -> None:
    request = p.ResumeRequest.model_validate({"policy": "resize", "alive_devices": 6, "slices": ALIVE, **asked})
    answered, scanned = _both(sides, JOB, request)
    assert isinstance(answered, p.ResumePlan) and isinstance(scanned, p.ResumePlan), (answered, scanned)
    assert (answered.tier, answered.step, answered.source, scanned.source) == (tier, step, "ckptd", "storage_scan")
    assert scanned.model_dump(exclude={"source"}) == answered.model_dump(exclude={"source"})


@pytest.mark.parametrize(("job", "asked", "raised", "code", "status"), [
    (JOB, {"step": 15}, CkptdRequestError, "STEP_NOT_FOUND", 404),  # no tier holds the step asked for
    (JOB, {"policy": "pause"}, CkptdRequestError, "NOT_ENOUGH_DEVICES", 409),  # the newest step, not laid out
    ("nothing-here", {}, NoCheckpointError, None, None),  # nothing to resume from: a fresh start
])
def test_a_refusal_raises_the_same_from_ckptd_and_from_the_fallback(
        sides: tuple[CkptdClient, CkptdClient], job: str, asked: dict[str, Any], raised: type[CkptdError],
        code: str | None, status: int | None) -> None:
    request = p.ResumeRequest.model_validate({"policy": "resize", "alive_devices": 6, "slices": ALIVE, **asked})
    for err in _both(sides, job, request):
        assert type(err) is raised, err
        if isinstance(err, CkptdRequestError):
            assert (err.code, err.status) == (code, status)


@pytest.mark.parametrize("code", list(REFUSALS))
def test_every_refusal_of_the_table_means_the_same_to_ckptd_and_to_the_client(code: p.ErrorCode) -> None:
    """ckptd's error (``Refused.of``) and the client's exception (``refusal_error``) both read the one table: the
    status ckptd answers is the one the client's error carries, and only "nothing to resume from" is a fresh
    start (``NoCheckpointError``); a refusal ckptd answers with Retry-After is the table's."""
    told = "" if REFUSALS[code].words is not None else "the tier's or the planner's reason"  # worded by the table
    served = Refused.of(Refusal(code, told, step=5), JOB)
    assert served.code is code and served.message and served.retry_after_s == REFUSALS[code].retry_after_s
    raised = refusal_error(code.value, p.ERROR_STATUS[code], served.message)
    assert isinstance(raised, NoCheckpointError) is REFUSALS[code].nothing_to_resume
    if isinstance(raised, CkptdRequestError):
        assert (raised.code, raised.status, raised.message) == (code.value, p.ERROR_STATUS[code], served.message)
