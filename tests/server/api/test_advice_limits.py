"""``GET /v1/jobs/{job}/advice`` under hostile inputs: every input bounded, the simulation's work bounded, advice
never starving the resume path, and liveness that sees a wedged handler pool."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ckptd.advisor._advisor import advise
from ckptd.advisor._budget import WorkBudget
from ckptd.errors import Busy
from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import SteppingClock, wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.server import StartServer, app_over
from trainer_client.core import protocol as p

COSTS: dict[str, Any] = dict(step_time_s=2.0, save_stall_s=5.0, persist_time_s=30.0, restore_time_s=60.0,
                             recovery_time_s=60.0, replace_time_s=600.0, slices=4)
# In range and within the default budget (~80 runs of 2,000 failures: seconds); SLOWER needs a larger budget.
SLOW: dict[str, Any] = {**COSTS, "mtbf_hours": 1.0, "min_failures": 2_000}
SLOWER: dict[str, Any] = {**SLOW, "min_failures": 20_000}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Job ``llm``: one step (10) with ckptd training metadata, written by plain Orbax."""
    root = tmp_path_factory.mktemp("advice-limits")
    write_orbax_jobs({root / "llm": [10]}, custom_metadata={10: training_metadata(10)})
    return root


@pytest.fixture
def client(root: Path, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_over(root, tmp_path, advice_timeout_s=1.0)) as c:
        yield c


def _advice(client: TestClient | httpx.Client, **query: Any) -> httpx.Response:
    return client.get("/v1/jobs/llm/advice", params=query)


# ---- every input bounded; what would overflow or never end is refused at once ---------------------------


@pytest.mark.parametrize("query", [
    # never finished: a detection far longer than the MTBF restarts every recovery; failures every 1e-297 s
    {"detect_time_s": 1e9, "mtbf_hours": 1, "slices": 2, "replace_time_s": 0},
    {"mtbf_hours": 1e-300},
    {"failures_per_slice_day": 1e-300},
    # were 500 OverflowError
    {"mtbf_hours": "inf"},
    {"mtbf_hours": 1e308},
    {"mtbf_hours": 1, "save_stall_s": 1e308},
    {"mtbf_hours": "nan"},
    {"mtbf_hours": 1, "step_time_s": 1e-300},
    {"mtbf_hours": 1, "checkpoint_period_steps": 10**30},
    # (in range one by one and a job failing every 0.9 ms together is advised at the MTBF's bound, and more
    # simulation than the budget on a shorter horizon: tests/server/api/test_schema_rules.py)
])
def test_out_of_range_inputs_are_refused_at_once(client: TestClient, query: dict[str, Any]) -> None:
    clock = SteppingClock(0.0)  # every simulation's budget reads it first (its deadline)
    client.app.state.services.advice.clock = clock  # type: ignore[attr-defined]
    resp = _advice(client, **{**COSTS, **query})
    assert clock.reads == 0  # refused before any simulation began: counted, not timed
    assert resp.status_code == 422, resp.text
    assert p.ErrorBody.model_validate(resp.json()).code is p.ErrorCode.INVALID_REQUEST


def test_a_simulation_past_its_deadline_answers_503_with_retry_after(client: TestClient) -> None:
    clock = SteppingClock(0.6)  # the app's advice_timeout_s is 1 s: past it at the second look at the clock
    client.app.state.services.advice.clock = clock  # type: ignore[attr-defined]
    resp = _advice(client, **SLOW)
    assert clock.reads == 3  # the deadline set, then two looks (every 256 simulated failures): the second past it
    assert resp.status_code == 503, resp.text
    assert p.ErrorBody.model_validate(resp.json()).code is p.ErrorCode.BUSY
    assert int(resp.headers["Retry-After"]) > 0


def test_the_budget_bounds_a_recovery_that_failures_keep_interrupting() -> None:
    # In range: detection takes a day, the job fails every minute; every recovery is restarted ~1,440 times over.
    query = p.AdviceQuery(**{**COSTS, "detect_time_s": 86_400, "mtbf_hours": 1 / 60, "horizon_days": 1,
                             "min_failures": 10})
    # The failures' count bounds the work (its 10 s deadline only guards the test): 0.01 s here, loaded.
    advice = advise(query, budget=WorkBudget(max_failures=200_000, timeout_s=10.0))
    assert all(a.goodput < 0.01 for a in advice.policies)  # it never trains: the answer says so
    with pytest.raises(Busy):  # past its deadline at the second look, however fast the machine
        advise(p.AdviceQuery(**SLOW), budget=WorkBudget(timeout_s=0.2, clock=SteppingClock(0.15)))
    # more than the budget: simulated on a shorter horizon, within it, quickly (0.7 s here with the machine
    # loaded, 1.4 s for the whole horizon; the bound is fifteen times the first)
    started = time.monotonic()
    shorter = advise(p.AdviceQuery(**SLOW), budget=WorkBudget(max_failures=100_000))
    assert time.monotonic() - started < 10.0 and any("CKPTD_ADVICE_MAX_FAILURES" in r for r in shorter.reasoning)


# ---- advice never starves the resume path; a wedged pool fails liveness -------------------------------------


def _simulating() -> bool:
    """Some thread of this process is inside the advisor right now."""
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            if "ckptd/advisor/" in f.f_code.co_filename.replace("\\", "/"):
                return True
            f = f.f_back
    return False


def test_resume_and_latest_good_answer_while_hostile_advice_piles_up(ckptd_server: StartServer, root: Path) -> None:
    server = ckptd_server(root, advice_timeout_s=6.0, advice_max_failures=10_000_000)
    with ThreadPoolExecutor(12) as pool, httpx.Client(base_url=server.url, timeout=30) as http:
        piled = [pool.submit(_advice, http, **SLOWER) for _ in range(12)]
        # all but one are refused at once; before, all took a handler thread each and kept it
        wait_until(lambda: sum(f.done() for f in piled) >= 11, timeout=10, what="11 advice requests refused")
        assert _simulating()
        # Bounded, kept as a bound: each answer takes 0.1-0.2 s here with the machine loaded and the simulation
        # holding a core; one that waited for the advice would wait out most of its 6 s. 3 s is fifteen times the
        # slowest seen, and half that.
        with httpx.Client(base_url=server.url, timeout=10) as fast:
            for _ in range(3):
                for resp in (fast.post("/v1/jobs/llm/resume", json={"alive_devices": 8}),
                             fast.get("/v1/jobs/llm/checkpoints/latest-good"), fast.get("/healthz")):
                    assert resp.status_code == 200, resp.text
                    assert resp.elapsed.total_seconds() < 3.0, (resp.request.url, resp.elapsed)
        answers = [f.result() for f in piled]
    busy = [r for r in answers if r.status_code == 503]
    assert len(busy) >= 11 and all(r.json()["code"] == "BUSY" and int(r.headers["Retry-After"]) > 0 for r in busy)
    assert {r.status_code for r in answers} <= {200, 503}


def test_advice_stops_when_its_client_leaves(ckptd_server: StartServer, root: Path) -> None:
    server = ckptd_server(root, advice_timeout_s=120.0, advice_max_failures=10_000_000)
    with httpx.Client(base_url=server.url, timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
        _advice(http, **SLOWER)
    wait_until(lambda: not _simulating(), timeout=5, what="the advice to stop once its client left")
    with server.client() as http:  # and its slot is free again
        assert _advice(http, **COSTS, mtbf_hours=10, min_failures=100).status_code == 200


def test_a_wedged_handler_pool_fails_liveness(ckptd_server: StartServer, root: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    server = ckptd_server(root, worker_threads=2, wedged_after_s=0.5)
    catalog = server.server.config.app.state.catalog
    release = threading.Event()
    jobs = catalog.jobs

    def stuck() -> list[p.JobInfo]:
        release.wait(30)
        return jobs()

    with server.client() as http:
        assert http.get("/healthz").status_code == 200
        monkeypatch.setattr(catalog, "jobs", stuck)
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(http.get, "/v1/jobs") for _ in range(2)]  # both handler threads, stuck
            try:
                wedged = wait_until(lambda: (r := http.get("/healthz")).status_code == 503 and r, timeout=10,
                                    what="/healthz to fail with the handler pool wedged")
                assert wedged.json()["status"] == "wedged"
                # over wedged_after_s, reported to the millisecond: 0.5004 s reads 0.5
                assert wedged.json()["detail"]["handler_pool_waited_s"] >= 0.5
            finally:
                release.set()
            assert all(f.result().status_code == 200 for f in held)
        wait_until(lambda: http.get("/healthz").status_code == 200, timeout=10, what="/healthz to recover")


def test_sigterm_stops_serve_while_advice_is_in_flight(root: Path, tmp_path: Path) -> None:
    ckptd = CkptdProcess(root, tmp_path / "state", log_path=tmp_path / "ckptd.log",
                         env={"CKPTD_ADVICE_TIMEOUT_S": "3", "CKPTD_ADVICE_MAX_FAILURES": "10000000"})
    ckptd.start()
    try:
        ckptd.wait_ready(timeout=60)
        with ThreadPoolExecutor(1) as pool:
            def slow() -> httpx.Response:
                return httpx.get(f"{ckptd.url}/v1/jobs/llm/advice", params=SLOWER, timeout=120)

            computing = [pool.submit(slow)]

            def running() -> bool:  # a quick one is refused while the slow one computes
                if computing[-1].done():  # it lost the slot to a quick one, or timed out: again
                    computing.append(pool.submit(slow))
                resp = httpx.get(f"{ckptd.url}/v1/jobs/llm/advice", timeout=5,
                                 params={**COSTS, "mtbf_hours": 10, "min_failures": 10})
                return resp.status_code == 503 and "already running" in resp.json()["message"]

            wait_until(running, timeout=20, what="an advice computation under way")
            started = time.monotonic()
            assert ckptd.proc is not None
            ckptd.proc.terminate()
            ckptd.proc.wait(timeout=30)
            assert time.monotonic() - started < 15.0, ckptd.log()
    finally:
        ckptd.stop()
