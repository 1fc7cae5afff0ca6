"""While a job's committed steps are still being verified, "no good checkpoint" is never the answer: the
sidecar says 503 NOT_READY with Retry-After, and the client waits or scans storage (docs/protocol.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.support.helpers import wait_until
from tests.support.orbax_steps import write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.errors import CkptdUnavailable

RESUME = p.ResumeRequest(policy="resize", alive_devices=8).model_dump(mode="json")


def test_committed_steps_being_verified_answer_not_ready_not_absent(tmp_path: Path, ckptd_server: Any) -> None:
    root = tmp_path / "root"
    write_orbax_jobs({root / "job": [1, 2]})  # plain Orbax: committed, adopted once settled
    (root / "empty").mkdir()
    now = time.time()
    for path in (root / "job").rglob("*"):  # as if just written: adopted 6 s from now
        os.utime(path, (now, now))
    server = ckptd_server(root, adopt_after_s=6.0, refresh_interval_s=0.2)
    with server.client() as http:
        for method, route, body in (("GET", p.ROUTE_LATEST_GOOD, None), ("POST", p.ROUTE_RESUME, RESUME)):
            answer = http.request(method, route.format(job="job"), json=body)
            assert answer.status_code == 503, answer.text
            assert answer.json()["code"] == "NOT_READY" and "step 2" in answer.json()["message"]
            assert int(answer.headers["Retry-After"]) >= 1
        # a step asked for by number is pending too, not "not good"
        answer = http.post(p.ROUTE_RESUME.format(job="job"), json={**RESUME, "step": 1})
        assert answer.status_code == 503 and answer.json()["code"] == "NOT_READY", answer.text
        # a job with no committed step at all: that is "none"
        answer = http.get(p.ROUTE_LATEST_GOOD.format(job="empty"))
        assert answer.status_code == 404 and answer.json()["code"] == "NO_GOOD_CHECKPOINT"
    # the client does not take "not yet" for "none": it retries, then (with a root) plans from storage
    with CkptdClient(ClientSettings(url=server.url, timeout_s=1.0)) as client:
        try:
            good = client.latest_good("job")
        except CkptdUnavailable:
            good = None  # still verifying after the client's retries: unavailable, not None
        else:
            assert good is not None and good.step == 2
    with CkptdClient(ClientSettings(url=server.url), root=str(root)) as client:
        plan = client.resume("job", p.ResumeRequest(policy="resize", alive_devices=8))
        assert plan.step == 2
    with server.client() as http:
        wait_until(lambda: http.get(p.ROUTE_LATEST_GOOD.format(job="job")).status_code == 200, timeout=30,
                   what="the adopted step answered")
        assert http.get(p.ROUTE_LATEST_GOOD.format(job="job")).json()["step"] == 2
