"""A real ckptd (uvicorn, HTTP over TCP on 127.0.0.1) and the real CLI, over steps Orbax wrote elsewhere."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.cli._main import main as ckptd_main
from tests.support.golden import copy_root
from tests.support.helpers import clean_env, stop_process, wait_until
from tests.support.orbax_steps import model_parallel_metadata, write_orbax_jobs
from trainer_client.core import protocol as p
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._steps import parse_step_name

pytestmark = pytest.mark.integration

CKPTD = [sys.executable, "-m", "ckptd"]


@pytest.fixture(scope="module")
def golden_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train: steps 10 and 20 saved by plain Orbax in another process; empty: a job with no step;
    tp: step 7 whose ckptd metadata records a (data=2, model=4) mesh."""
    root = tmp_path_factory.mktemp("integration") / "root"
    write_orbax_jobs({root / "train": [10, 20], root / "tp": [7]}, custom_metadata={7: model_parallel_metadata(7)})
    (root / "empty").mkdir()
    return root


@pytest.fixture
def root(golden_root: Path, tmp_path: Path) -> Path:
    dst = copy_root(golden_root, tmp_path)
    return dst


def _error(resp: httpx.Response, code: p.ErrorCode) -> p.ErrorBody:
    assert resp.status_code == p.ERROR_STATUS[code], resp.text
    body = p.ErrorBody.model_validate(resp.json())
    assert body.code is code
    return body


def _raw_get(url: str, target: str) -> tuple[int, Any]:
    """GET with the request target sent byte for byte (no client-side path normalization)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


# ---- the server in a thread ------------------------------------------------------------------------


def test_latest_good_and_resume_over_http(ckptd_server: Any, golden_root: Path) -> None:
    server = ckptd_server(golden_root)
    with server.client() as c:
        jobs = p.JobList.model_validate(c.get("/v1/jobs").json()).jobs
        assert [(j.name, j.latest_good_step) for j in jobs] == [("empty", None), ("tp", 7), ("train", 20)]

        info = p.CheckpointInfo.model_validate(c.get("/v1/jobs/train/checkpoints/latest-good").json())
        assert (info.step, info.state, info.path) == (20, p.StepState.VERIFIED,
                                                       str(golden_root / "train" / "20"))
        _error(c.get("/v1/jobs/empty/checkpoints/latest-good"), p.ErrorCode.NO_GOOD_CHECKPOINT)
        _error(c.get("/v1/jobs/nope/checkpoints/latest-good"), p.ErrorCode.JOB_NOT_FOUND)

        resp = c.post("/v1/jobs/train/resume", json={"policy": "resize", "alive_devices": 6})
        assert resp.status_code == 200, resp.text
        plan = p.ResumePlan.model_validate(resp.json())
        assert (plan.step, plan.path) == (20, str(golden_root / "train" / "20"))
        assert plan.mesh == p.MeshSpec(axis_names=["replica", "data"], shape=[3, 2])
        assert plan.arrays["params.w"].partition_spec == [None, "data"]

        _error(c.post("/v1/jobs/train/resume", json={"policy": "pause", "alive_devices": 6}),
               p.ErrorCode.NOT_ENOUGH_DEVICES)
        older = p.ResumePlan.model_validate(
            c.post("/v1/jobs/train/resume", json={"alive_devices": 8, "step": 10}).json())
        assert (older.step, older.mesh.shape) == (10, [4, 2])

        assert "ckptd_latest_good_step" in c.get("/metrics").text

    # Paths a browser or a proxy would never send, straight to uvicorn.
    for target, status, code in [
        ("/v1/jobs/../checkpoints", 400, "INVALID_JOB_NAME"),  # uvicorn does not normalize dot segments
        ("/v1/jobs/%2E%2E/checkpoints", 400, "INVALID_JOB_NAME"),
        ("/v1/jobs/%00/checkpoints/latest-good", 400, "INVALID_JOB_NAME"),
        ("/v1/jobs/a%2Fb/checkpoints", 404, "ROUTE_NOT_FOUND"),
        ("/v1/jobs/" + "z" * 4000 + "/checkpoints", 400, "INVALID_JOB_NAME"),
    ]:
        got_status, body = _raw_get(server.url, target)
        assert (got_status, body["code"]) == (status, code), target
        assert body["message"]


def test_new_steps_and_jobs_appear_without_restart(
    ckptd_server: Any, root: Path
) -> None:
    server = ckptd_server(root)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            write_orbax_jobs({root / "train": [30], root / "late": [1]})
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    served: set[int] = set()
    with server.client() as c:
        # While Orbax writes in the other process, every answer is a finalized step.
        while writer.is_alive():
            resp = c.get("/v1/jobs/train/checkpoints/latest-good")
            assert resp.status_code == 200
            info = p.CheckpointInfo.model_validate(resp.json())
            name = parse_step_name(Path(info.path).name)
            assert name is not None and not name.is_tmp
            assert (Path(info.path) / COMMIT_MARKER).is_file()
            served.add(info.step)
            time.sleep(0.02)
        writer.join()
        assert not errors, errors
        assert served <= {20, 30}

        def latest_is_30() -> bool:
            return bool(c.get("/v1/jobs/train/checkpoints/latest-good").json().get("step") == 30)

        wait_until(latest_is_30, timeout=10, what="step 30 served without a restart")

        def late_job() -> bool:
            jobs = p.JobList.model_validate(c.get("/v1/jobs").json()).jobs
            return any(j.name == "late" and j.latest_good_step == 1 for j in jobs)

        wait_until(late_job, timeout=10, what="job 'late' listed")


def test_server_with_token(ckptd_server: Any, golden_root: Path) -> None:
    server = ckptd_server(golden_root, token="tok-123")
    with server.client() as c:
        assert c.get("/healthz").status_code == 200
        body = _error(c.get("/v1/jobs"), p.ErrorCode.UNAUTHORIZED)
        assert "tok-123" not in body.message
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer tok-123"}).status_code == 200


# ---- the real command line -------------------------------------------------------------------------


def test_cli_serve(golden_root: Path, tmp_path: Path, tcp_port: int) -> None:
    env = clean_env(CKPTD_STATE_DIR=str(tmp_path / "state"), CKPTD_REFRESH_INTERVAL_S="0.2",
                         CKPTD_TOKEN="cli-token", CKPTD_LOG_LEVEL="info", CKPTD_KEEP_ALIVE_S="6.5")
    proc = subprocess.Popen(
        [*CKPTD, "serve", "--root", str(golden_root), "--host", "127.0.0.1", "--port", str(tcp_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{tcp_port}"
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"ckptd serve exited with {proc.returncode}: {proc.communicate()[1][-2000:]}")
            try:
                return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=30, interval=0.1, what="ckptd serve: GET /readyz -> 200")
        assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401  # CKPTD_TOKEN took effect
        auth = {"Authorization": "Bearer cli-token"}
        # Plain-Orbax steps are adopted once their files have been still for CKPTD_ADOPT_AFTER_S (default 2 s):
        # a fresh root may answer NO_GOOD_CHECKPOINT for that long, never a step not yet checksummed.
        answers: list[httpx.Response] = []

        def resumed() -> bool:
            answers.append(httpx.post(f"{url}/v1/jobs/train/resume", json={"alive_devices": 6}, headers=auth,
                                      timeout=5))
            assert answers[-1].status_code in (200, 404), answers[-1].text
            return answers[-1].status_code == 200

        wait_until(resumed, timeout=30, interval=0.2, what="resume -> 200 once the plain-Orbax steps are adopted")
        plan = p.ResumePlan.model_validate(answers[-1].json())
        assert (plan.step, plan.mesh.shape) == (20, [3, 2])
        assert (tmp_path / "state" / "catalog.sqlite3").exists()  # CKPTD_STATE_DIR took effect
        # CKPTD_KEEP_ALIVE_S took effect: a connection is kept between requests, and closed once idle 7 s (6.5
        # rounded up to whole seconds), past uvicorn's own default of 5 s. Timed from before the last request, so
        # from before the server's idle timer started: a timer never fires early, so the bound holds however slow
        # the machine (the default would close at 5 s, under it); the close itself must come within the
        # socket's 60 s.
        conn = http.client.HTTPConnection("127.0.0.1", tcp_port, timeout=5)
        for _ in range(2):
            before_last = time.monotonic()
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
        assert conn.sock is not None
        conn.sock.settimeout(60)
        assert conn.sock.recv(1) == b""  # blocks until the server closes the idle connection
        assert time.monotonic() - before_last >= 6.9
        conn.close()
    finally:
        stop_process(proc, 15)
    stderr = proc.stderr.read() if proc.stderr else ""
    # uvicorn shuts down gracefully on SIGTERM (lifespan included), then re-raises the signal.
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert "Application shutdown complete" in stderr, stderr


def _ckptd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CKPTD, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_cli_ls_show_plan(golden_root: Path, tmp_path: Path) -> None:
    env = clean_env(TMPDIR=str(tmp_path))
    ls = _ckptd("ls", str(golden_root), env=env)
    assert ls.returncode == 0, ls.stderr
    rows = {line.split()[0]: line.split()[1:] for line in ls.stdout.splitlines()[1:]}
    assert rows == {"empty": ["0", "-", "-"], "tp": ["1", "7", "7"], "train": ["2", "20", "20"]}  # "-": no step

    show = _ckptd("show", f"{golden_root}/train", env=env)
    assert show.returncode == 0, show.stderr
    assert "latest-good: 20" in show.stderr
    assert [line.split()[:2] for line in show.stdout.splitlines()[1:]] == [["10", "verified"],
                                                                           ["20", "verified"]]

    empty = _ckptd("show", f"{golden_root}/empty", env=env)
    assert empty.returncode == 1
    assert "latest-good: none" in empty.stderr

    plan = _ckptd("plan", f"{golden_root}/train", "--devices", "6", "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    parsed = p.ResumePlan.model_validate_json(plan.stdout)
    assert parsed.mesh.shape == [3, 2] and parsed.mesh.axis_names == ["replica", "data"]
    assert (parsed.step, parsed.path) == (20, str(golden_root / "train" / "20"))

    assert list(tmp_path.iterdir()) == []  # the one-shot commands leave no files behind


def test_cli_exit_codes(golden_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In process (same code as the console script, without paying a new interpreter each time).
    assert ckptd_main(["ls", "--json", str(golden_root)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [j["name"] for j in listed] == ["empty", "tp", "train"]

    assert ckptd_main(["show", "--json", f"{golden_root}/train"]) == 0
    shown = [p.CheckpointInfo.model_validate(c) for c in json.loads(capsys.readouterr().out)]
    assert [(c.step, c.state) for c in shown] == [(10, p.StepState.VERIFIED), (20, p.StepState.VERIFIED)]

    assert ckptd_main(["show", f"{golden_root}/nope"]) == 1
    assert "no job 'nope'" in capsys.readouterr().err

    assert ckptd_main(["plan", f"{golden_root}/train", "--devices", "8", "--step", "10", "--json"]) == 0
    assert p.ResumePlan.model_validate_json(capsys.readouterr().out).step == 10

    assert ckptd_main(["plan", f"{golden_root}/train", "--devices", "6", "--policy", "pause"]) == 1
    assert "NOT_ENOUGH_DEVICES" in capsys.readouterr().err
    assert ckptd_main(["plan", f"{golden_root}/tp", "--devices", "3"]) == 1
    assert "NO_VALID_MESH" in capsys.readouterr().err
    assert ckptd_main(["plan", f"{golden_root}/train", "--devices", "8", "--step", "15"]) == 1
    assert ckptd_main(["plan", f"{golden_root}/empty", "--devices", "8"]) == 1

    assert ckptd_main(["plan", f"{golden_root}/train", "--devices", "6", "--slices", "0:2,1:2,3:2"]) == 0
    text = capsys.readouterr().out
    assert "(replica=3, data=2)" in text and "params.w" in text

    assert ckptd_main(["ls", str(tmp_path / "missing")]) == 1  # one line: "... does not exist"
    assert capsys.readouterr().err == f"ckptd: {tmp_path / 'missing'} does not exist\n"
    with pytest.raises(SystemExit) as exc:
        ckptd_main(["show", "no-slash"])  # no CKPTD_ROOT here: a usage error
    assert exc.value.code == 2
