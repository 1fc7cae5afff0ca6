"""ckptd over a unix domain socket (``ckptd serve --uds PATH``, trainers ``CKPTD_URL=unix:///PATH``): real servers
answer the trainer's client and event reporter there, the bearer token still applies, the socket's mode is the
access rule, and the server refuses, in one line, a path that is no socket, a live socket, an unsafe directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from ckptd.config import Settings
from tests.support.helpers import clean_env, stop_process
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.server import StartServer, answers_ready, serve_process, socket_dir
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._event_reporter import EventReporter
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._ckptd_url import SUN_PATH_BYTES, unix_url
from trainer_client.errors import CkptdRequestError

pytestmark = pytest.mark.integration

TOKEN = "uds-test-token-0123456789"
STEPS = (10, 20)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train: steps 10 and 20 saved by plain Orbax, with ckptd's training metadata."""
    root = tmp_path_factory.mktemp("uds") / "root"
    write_orbax_jobs({root / "train": list(STEPS)}, custom_metadata={s: training_metadata(s) for s in STEPS})
    return root


@pytest.fixture
def sockets() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptd serve ARGS`` that is expected to exit by itself."""
    return subprocess.run([sys.executable, "-m", "ckptd", "serve", *args], env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_trainer_client_is_answered_over_the_socket_and_the_token_still_applies(
    golden: Path, sockets: Path, tmp_path: Path
) -> None:
    path = sockets / "ckptd.sock"
    log = tmp_path / "ckptd.log"
    proc, url = serve_process(golden, log, "--state-dir", str(tmp_path / "state"), uds=path, CKPTD_TOKEN=TOKEN,
                              CKPTD_ADOPT_AFTER_S="0")
    try:
        assert url == f"unix://{path}"
        assert stat.S_ISSOCK(path.lstat().st_mode) and stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert f"serving the checkpoint root {golden} at unix://{path} (mode 0600): curl --unix-socket {path} " \
               "http://localhost/healthz" in log.read_text()
        # no root: no storage fallback, so every answer below is ckptd's, over the socket
        with CkptdClient(ClientSettings(url=url, token=TOKEN, timeout_s=5, resume_deadline_s=30)) as client:
            assert client.healthy()
            good = client.latest_good("train")
            assert good is not None and (good.step, good.path) == (20, str(golden / "train" / "20"))
            plan = client.resume("train", p.ResumeRequest(policy="resize", alive_devices=8))
            assert (plan.step, plan.path, plan.mesh.shape) == (20, str(golden / "train" / "20"), [4, 2])
        with CkptdClient(ClientSettings(url=url, timeout_s=5)) as anonymous:
            assert anonymous.healthy()  # the probes are open, as over TCP
            with pytest.raises(CkptdRequestError) as refused:
                anonymous.jobs()
            assert (refused.value.status, refused.value.code) == (401, "UNAUTHORIZED")
    finally:
        assert stop_process(proc, 15)
    assert not path.exists() and not path.is_symlink()  # the socket file goes with the server


def test_the_event_reporter_and_a_socket_for_the_group(ckptd_server: StartServer, sockets: Path,
                                                       tmp_path: Path) -> None:
    """``uds_mode`` 0660 lets the socket's group in; a missing directory is created, searchable by the group only."""
    (tmp_path / "job").mkdir()
    path = sockets / "run" / "ckptd.sock"
    server = ckptd_server(tmp_path, uds=str(path), uds_mode="0660")
    assert server.url == unix_url(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660 and stat.S_IMODE(path.parent.stat().st_mode) == 0o710
    reporter = EventReporter(ClientSettings(url=server.url, timeout_s=2.0), "job")
    try:
        for i in range(3):
            reporter.report("checkpoint_started", time=1000.0 + i, step=i, blocked_seconds=0.01)
        assert reporter.flush(30) is True
        assert (reporter.sent, reporter.dropped) == (3, 0)
    finally:
        reporter.close(1)
    with server.client() as http:
        assert [e["step"] for e in http.get("/v1/jobs/job/events").json()["events"]] == [0, 1, 2]


def test_a_live_socket_is_never_taken_and_a_stale_one_is_replaced(golden: Path, sockets: Path,
                                                                  tmp_path: Path) -> None:
    path = sockets / "ckptd.sock"
    args = ("--state-dir", str(tmp_path / "state"))
    first, url = serve_process(golden, tmp_path / "first.log", *args, uds=path)
    try:
        second = _serve("--root", str(golden), *args, "--uds", str(path))
        assert second.returncode == 1
        assert second.stderr.strip().splitlines() == [
            f"ckptd: cannot listen on the unix socket {path}: a server already listens on it (another ckptd?): "
            "stop it, or choose another path"]
        assert answers_ready(url)  # the first server still answers on its socket
        first.kill()  # dies without removing its socket file
        first.wait(timeout=30)
    finally:
        stop_process(first, 15)
    assert stat.S_ISSOCK(path.lstat().st_mode) and not answers_ready(url)  # stale: there, but nothing answers
    third, _ = serve_process(golden, tmp_path / "third.log", *args, uds=path)
    try:
        assert answers_ready(url)
    finally:
        assert stop_process(third, 15)


def test_what_is_at_the_path_or_around_it_can_refuse_the_start(sockets: Path, tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    args = ("--root", str(tmp_path / "root"), "--state-dir", str(tmp_path / "state"))

    def refusal(*more: str) -> str:
        done = _serve(*args, *more)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptd: "), done.stderr
        assert "startup complete" not in (done.stdout + done.stderr).lower()
        return f"{done.returncode}: {lines[0]}"

    a_file = sockets / "ckptd.sock"
    a_file.write_text("not ours")
    assert refusal("--uds", str(a_file)) == (
        f"1: ckptd: cannot listen on the unix socket {a_file}: it exists and is not a socket but a file: remove it, "
        "or choose another path")
    assert a_file.read_text() == "not ours"  # nothing deleted

    shared = sockets / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert refusal("--uds", str(shared / "ckptd.sock")) == (
        f"1: ckptd: cannot listen on the unix socket {shared / 'ckptd.sock'}: its directory {str(shared)!r} is "
        "writable by every user (mode 0777): anyone could put their own socket there; use a directory only this "
        "user (or its group) may write")
    assert os.listdir(shared) == []

    assert refusal("--uds", str(sockets / "ok.sock"), "--port", "9999") == (
        "2: ckptd: --uds replaces --host and --port: give the socket or the address, not both")
    too_long = sockets / ("s" * SUN_PATH_BYTES)
    assert refusal("--uds", str(too_long)).startswith(
        f"2: ckptd: invalid settings: Value error, CKPTD_UDS (--uds): the socket path is {len(str(too_long))} "
        "bytes, longer than a unix socket's path may be")
    assert refusal("--uds", str(sockets / "ok.sock"), "--uds-mode", "0666").startswith(
        "2: ckptd: invalid settings: Value error, CKPTD_UDS_MODE '0666' must be 0600")
    assert not (sockets / "ok.sock").exists()


def test_the_server_checks_its_socket_path_with_the_clients_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative ``--uds`` is made absolute (what trainers are given: ``unix:///...``); empty is unset."""
    monkeypatch.chdir("/")
    assert Settings(uds="run/ckptd.sock").serve.uds == "/run/ckptd.sock"
    assert Settings(uds="").serve.uds is None
    assert Settings(uds_mode="660").serve.socket_mode() == 0o660
    with pytest.raises(ValidationError, match=r"CKPTD_UDS \(--uds\): the socket path is \d+ bytes"):
        Settings(uds="/" + "s" * SUN_PATH_BYTES)
