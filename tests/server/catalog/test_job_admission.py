"""Which directories of the root a limit on jobs keeps (``ckptd/catalog/_job_admission.py``): never decided by
names. A directory holding no step (an empty one, junk) never displaces a job that holds steps, however many
there are and however they sort; among jobs, the most recently changed are kept (a root with hundreds of old
runs is normal, and the run training now is the one that needs answers). Served by real servers over real
Orbax steps.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx

from tests.support.golden import copy_root, golden_fixture
from tests.support.helpers import wait_until
from tests.support.orbax_steps import write_orbax_jobs
from tests.support.server import StartServer
from trainer_client.core import protocol as p

# Written once by plain Orbax in another process: one job with steps 10 and 20.
golden_root = golden_fixture(lambda root: write_orbax_jobs({root / "train": [10, 20]}), name="golden_root")

_DAY = 86_400.0


def _age(path: Path, seconds: float) -> None:
    """Set ``path``'s times ``seconds`` in the past (what an old run's directory looks like)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def _latest_good(http: httpx.Client, job: str) -> tuple[int, dict[str, object]]:
    response = http.get(f"/v1/jobs/{job}/checkpoints/latest-good")
    return response.status_code, dict(response.json())


def test_256_empty_directories_do_not_displace_a_real_job(golden_root: Path, tmp_path: Path,
                                                          ckptd_server: StartServer) -> None:
    """256 empty directories that sort before the job and are newer than it (the default ``max_jobs`` is 256):
    a fresh ckptd serves the job; an empty directory is what the limit leaves out."""
    root = copy_root(golden_root, tmp_path)
    _age(root / "train", _DAY)
    for i in range(256):
        (root / f"aaa-{i:03d}").mkdir()
    server = ckptd_server(root)
    assert server.settings.storage.max_jobs == 256
    with server.client() as http:
        status, body = _latest_good(http, "train")
        assert status == 200, body
        assert body["step"] == 20
        jobs = [j["name"] for j in http.get("/v1/jobs").json()["jobs"]]
    assert "train" in jobs and len(jobs) == 256


def test_a_fresh_ckptd_over_many_old_runs_keeps_the_newest(golden_root: Path, tmp_path: Path,
                                                           ckptd_server: StartServer) -> None:
    """Twelve old runs (days old) and the run training now, whose name sorts last, over a limit of 8 jobs:
    the run training now is served; the oldest runs are what the limit leaves out, each said why."""
    root = copy_root(golden_root, tmp_path)
    for i in range(12):
        shutil.copytree(root / "train", root / f"run-{i:03d}")
        _age(root / f"run-{i:03d}", (20 - i) * _DAY)
    (root / "train").rename(root / "zz-now")
    server = ckptd_server(root, max_jobs=8)
    with server.client() as http:
        status, body = _latest_good(http, "zz-now")
        assert status == 200, body
        jobs = {j["name"] for j in http.get("/v1/jobs").json()["jobs"]}
        assert jobs == {"zz-now", *(f"run-{i:03d}" for i in range(5, 12))}
        refused = http.get("/v1/jobs/run-000/checkpoints/latest-good")
        assert refused.status_code == 404
        error = p.ErrorBody.model_validate(refused.json())
        assert error.code is p.ErrorCode.JOB_NOT_FOUND and "past the job limit" in error.message


def test_a_job_that_appears_when_empty_directories_fill_the_limit_is_served(golden_root: Path, tmp_path: Path,
                                                                            ckptd_server: StartServer) -> None:
    """A running ckptd whose limit (4) is taken by empty directories: a job whose steps appear afterwards is
    served at its first request (not "past the job limit" until some later scan), and an empty directory
    leaves the catalog in its place."""
    root = tmp_path / "root"
    for i in range(4):
        (root / f"empty-{i}").mkdir(parents=True)
    server = ckptd_server(root, max_jobs=4)
    with server.client() as http:
        wait_until(lambda: len(http.get("/v1/jobs").json()["jobs"]) == 4, timeout=15, what="4 jobs catalogued")
        shutil.copytree(golden_root / "train", root / "train")
        status, body = _latest_good(http, "train")
        assert status == 200, body
        assert body["step"] == 20
        jobs = {j["name"] for j in http.get("/v1/jobs").json()["jobs"]}
    assert "train" in jobs and len(jobs) == 4
