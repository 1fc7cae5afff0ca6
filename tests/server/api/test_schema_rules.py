"""Requests the schema calls valid are answered, never refused as invalid: the rules between fields that an
OpenAPI schema cannot state are given a meaning instead (docs/protocol.md, "Resume" and "Advice").

Schemathesis' ``--checks all`` (``positive_data_acceptance`` among them) found two such refusals, both
``422``: a resume whose ``alive_devices`` is not the sum of the slices it lists, and advice given both
``mtbf_hours`` and ``failures_per_slice_day``. The same kind: a slice listed twice, ``min_slices`` over
``slices``, a failure rate and slice count that together put the job's MTBF outside its range, inputs asking
for more simulated failures than ``CKPTD_ADVICE_MAX_FAILURES``. Each now has a documented meaning, tested one
by one, then schemathesis runs every check on both operations, on a job that has a step, with ``422`` no
longer among the answers a valid request may get.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptd.advisor._advisor import advise
from ckptd.advisor._budget import WorkBudget
from ckptd.advisor._failures import PoissonFailures
from ckptd.advisor._sim_model import DAY, JobModel, Schedule
from ckptd.advisor._simulator import simulate
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.server import ServerHandle, app_over, start_server
from trainer_client.core import protocol as p

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "25"))  # per operation and generation mode, as test_hostile

COSTS: dict[str, Any] = dict(step_time_s=2.0, save_stall_s=5.0, persist_time_s=30.0, restore_time_s=60.0,
                             recovery_time_s=60.0, replace_time_s=600.0, slices=4, min_failures=100)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Job ``llm``: step 10 with ckptd training metadata on the mesh (replica=4, data=2), by plain Orbax."""
    root = tmp_path_factory.mktemp("schema-rules")
    write_orbax_jobs({root / "llm": [10]}, custom_metadata={10: training_metadata(10)})
    return root


@pytest.fixture(scope="module")
def client(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(app_over(root, tmp_path_factory.mktemp("state"), advice_max_failures=20_000)) as c:
        yield c


def _resume(client: TestClient, **body: Any) -> p.ResumePlan:
    response = client.post("/v1/jobs/llm/resume", json=body)
    assert response.status_code == 200, response.text
    return p.ResumePlan.model_validate(response.json())


def _advice(client: TestClient, **query: Any) -> p.Advice:
    response = client.get("/v1/jobs/llm/advice", params={**COSTS, **query})
    assert response.status_code == 200, response.text
    return p.Advice.model_validate(response.json())


# ---- resume -------------------------------------------------------------------------------------------


def test_slices_that_do_not_hold_alive_devices_are_planned_for_alive_devices_naming_no_slice(
    client: TestClient,
) -> None:
    agreeing = _resume(client, alive_devices=6, slices=[{"index": i, "devices": 2} for i in range(3)])
    assert agreeing.mesh.size == 6 and agreeing.slices_used == [0, 1, 2]
    plan = _resume(client, alive_devices=6, slices=[{"index": 0, "devices": 2}])  # was 422 INVALID_REQUEST
    assert plan.mesh == agreeing.mesh and plan.arrays == agreeing.arrays  # the plan for 6 devices
    assert plan.slices_used == [] and plan.idle_slices == []
    assert [note for note in plan.notes if note not in agreeing.notes] == [
        "alive_devices=6 but the slices listed hold 2 devices: planned for alive_devices, naming no slice"]


def test_a_slice_listed_twice_is_its_entries_added_up(client: TestClient) -> None:
    plan = _resume(client, alive_devices=6, slices=[{"index": 0, "devices": 2}, {"index": 1, "devices": 2},
                                                    {"index": 0, "devices": 2}])  # was 422: listed twice
    assert plan.slices_used == [0, 1] and plan.mesh.size == 6
    assert plan.notes[0] == "a slice is listed more than once: its entries were added up"


# ---- advice -------------------------------------------------------------------------------------------


def test_with_both_failure_rates_the_mtbf_sets_the_rate(client: TestClient) -> None:
    advice = _advice(client, mtbf_hours=10, failures_per_slice_day=5)  # was 422: "not both"
    assert advice.mtbf_hours == 10 and advice.inputs["mtbf_hours"].source == "given"
    rate = advice.inputs["failures_per_slice_day"]
    assert rate.source == "derived" and rate.value == pytest.approx(24 / (10 * 4))
    assert "the 5 given is not used: mtbf_hours, given too, sets the failure rate" in rate.note


def test_min_slices_over_the_job_s_slices_is_all_of_them(client: TestClient) -> None:
    advice = _advice(client, mtbf_hours=10, min_slices=9)  # was 422: "exceeds slices"
    minimum = advice.inputs["min_slices"]
    assert minimum.value == 4 and minimum.source == "derived" and "a resized job never shrinks" in minimum.note


def test_an_mtbf_out_of_range_from_a_rate_and_slices_is_advised_at_the_bound(client: TestClient) -> None:
    # each in range, together a job failing every 0.9 ms (was 422); and one failing every 2.7 million years
    fast = _advice(client, failures_per_slice_day=10_000, slices=10_000, horizon_days=0.01)
    assert fast.mtbf_hours == p.MIN_MTBF_HOURS and "advised at the bound" in fast.inputs["mtbf_hours"].note
    slow = _advice(client, failures_per_slice_day=1e-6, slices=1)
    assert slow.mtbf_hours == p.MAX_MTBF_HOURS and "advised at the bound" in slow.inputs["mtbf_hours"].note


def test_more_simulation_than_the_budget_is_a_shorter_horizon_said_in_the_answer(client: TestClient) -> None:
    """A one-minute MTBF over ten years (millions of failures per point): simulated within
    ``CKPTD_ADVICE_MAX_FAILURES`` (20,000 here), on a horizon cut to fit, where it was refused (422)."""
    advice = _advice(client, mtbf_hours=1 / 60, horizon_days=3650)
    assert advice.simulated_days < 1
    assert any(line.startswith("Simulated ") and "CKPTD_ADVICE_MAX_FAILURES" in line for line in advice.reasoning)
    runs = 3 * (13 + 13 + 1) + 1
    assert all(a.failures_simulated <= 2 * 20_000 / runs for a in advice.policies)
    # without a budget (ckptd advise on a terminal) the horizon asked is simulated
    unbounded = advise(p.AdviceQuery(**{**COSTS, "mtbf_hours": 1, "horizon_days": 5}))
    assert unbounded.simulated_days == pytest.approx(5)


def test_a_run_past_twice_its_share_of_failures_ends_there() -> None:
    budget = WorkBudget(max_failures=100)
    assert budget.share(1) == 100
    job = JobModel(slices=4, save_stall=1, persist_time=10, restore_time=60, recovery_time=60, replace_time=600,
                   detect_time=60)
    failures = PoissonFailures.from_mtbf(600.0, 4, seed=0)  # 10 min: ~14,400 failures in 100 days
    result = simulate(job, "resize", Schedule(300.0), horizon=100 * DAY, failures=failures, seed=0, budget=budget)
    assert budget.failures == 200 and budget.cut_short == 1 and result.wall < 100 * DAY


_NO_STALL = r"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the old sweep wanted all the memory there was
from ckptd.advisor._advisor import advise
from ckptd.advisor._budget import WorkBudget
from trainer_client.core import protocol as p
advice = advise(p.AdviceQuery(step_time_s=1e-4, save_stall_s=0, persist_time_s=86_400, restore_time_s=0,
                              recovery_time_s=0, replace_time_s=0, slices=1, mtbf_hours=1, min_failures=10,
                              horizon_days=1e-3), budget=WorkBudget(20_000, 10.0))
print(advice.recommended)
"""


def test_saves_that_cost_nothing_are_advised_without_a_sweep_as_large_as_memory() -> None:
    """Found by the schemathesis run below (with no save stall and a step of 0.1 ms): a persist of a day makes a
    persistent multiple of ~10^9 saves, and the sweep built a set of every number up to four times that (a
    ``MemoryError`` under a 2 GiB limit; on a host without one the kernel killed the process)."""
    done = subprocess.run([sys.executable, "-c", _NO_STALL], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() in ("pause", "resize", "spare"), done.stderr[-3000:]


# ---- schemathesis, every check, on both operations ----------------------------------------------------

POSITIVE_CONFIG = """
[[operations]]
include-path-regex = "^/v1/jobs/\\\\{job\\\\}/(resume|advice)$"
parameters = { "job" = "llm" }
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "429", "503"]
"""


@pytest.fixture(scope="module")
def live(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(root, tmp_path_factory.mktemp("live"), advice_max_failures=20_000)
    try:
        yield handle
    finally:
        handle.stop()


def _positive(live: ServerHandle, tmp: Path, *options: str) -> str:
    """``schemathesis run --checks all`` on resume and advice for the job ``llm``; its output. Fails the test on
    any failure it reports."""
    config = tmp / "schemathesis.toml"
    config.write_text(POSITIVE_CONFIG)
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
               f"{live.url}/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing",
               "--include-path-regex", "^/v1/jobs/\\{job\\}/(resume|advice)$", "--continue-on-failure",
               "--suppress-health-check", "all", "--request-timeout", "30", *options]
    done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-12_000:]
    generated = re.search(r"(\d+) generated", output)
    assert generated and int(generated.group(1)) >= 50, output[-4000:]
    return output


def test_schemathesis_finds_no_valid_request_refused(live: ServerHandle, tmp_path: Path) -> None:
    """``--checks all`` with ``positive_data_acceptance`` holding ``422`` for a failure, on resume and advice
    (a job that exists, so requests reach the planner and the advisor): deterministic, ``HOSTILE_EXAMPLES``
    examples (650 cases; on the old code it found the two refusals of the issue)."""
    _positive(live, tmp_path, "--generation-deterministic", "--max-examples", str(EXAMPLES))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_schemathesis_finds_no_valid_request_refused_long(live: ServerHandle, tmp_path: Path) -> None:
    """The long form: random generation, 10 times the examples; the seed is in the output."""
    _positive(live, tmp_path, "--max-examples", str(10 * EXAMPLES))
