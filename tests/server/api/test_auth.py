"""Auth, through a real ``ckptd serve``: with a token (``CKPTD_TOKEN`` or ``CKPTD_TOKEN_FILE``) every ``/v1``
route needs ``Authorization: Bearer <token>``; the probes stay open; ``/metrics`` is open unless
``CKPTD_METRICS_REQUIRE_TOKEN``; trainer_client sends the token from its environment; and the token never
appears in an answer or in a log line, even at debug level.

The routes are taken from the server's own ``/openapi.json``, so a route added later is covered too.
"""

from __future__ import annotations

import inspect
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import ckptd.api._app
import ckptd.api._auth
from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import clean_env, wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._event_reporter import EventReporter
from trainer_client.config import ClientSettings, reset_client_settings
from trainer_client.core import protocol as p
from trainer_client.core.protocol import ResumeRequest
from trainer_client.errors import CkptdRequestError

pytestmark = pytest.mark.integration

TOKEN = "tok-3f9a7c21d8e64b0f95a2c7e1"  # distinctive, so a leak is found by a plain search
WRONG = [
    None,
    "",
    "Bearer",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Basic {TOKEN}",
    TOKEN,
    f"Bearer  {TOKEN}",
    f"Token {TOKEN}",
    f"Bearer {TOKEN.upper()}",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("auth") / "root"
    write_orbax_jobs({root / "meta": [10]}, custom_metadata={10: training_metadata(10)})
    return root


def _serve(root: Path, tmp: Path, name: str, env: dict[str, str]) -> CkptdProcess:
    server = CkptdProcess(
        root, tmp / f"{name}-state", log_path=tmp / f"{name}.log", env={"CKPTD_LOG_LEVEL": "debug", **env}
    )
    server.start()
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def env_server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CkptdProcess]:
    server = _serve(root, tmp_path_factory.mktemp("env"), "env", {"CKPTD_TOKEN": TOKEN})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def file_server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CkptdProcess]:
    tmp = tmp_path_factory.mktemp("file")
    token_file = tmp / "token"
    token_file.write_text(f"  {TOKEN}\n")  # as a Secret is often written: whitespace around it
    token_file.chmod(0o600)
    server = _serve(root, tmp, "file", {"CKPTD_TOKEN_FILE": str(token_file), "CKPTD_METRICS_REQUIRE_TOKEN": "true"})
    yield server
    server.stop()


def _v1_requests(url: str) -> list[tuple[str, str, Any]]:
    """(method, path, json body) for every /v1 operation of the server's own OpenAPI, on job ``meta``."""
    spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
    bodies = {p.ROUTE_RESUME: {"alive_devices": 8}, p.ROUTE_EVENTS: {"events": [{"kind": "start", "time": 1.0}]},
              p.ROUTE_PEER_FETCH: {"step": 10, "source": 1, "origin": 0, "count": 2}}
    out = []
    for path, item in spec["paths"].items():
        if not path.startswith(p.API_PREFIX):
            continue
        for method in item:
            body = bodies.get(path) if method == "post" else None
            out.append((method.upper(), path.replace("{job}", "meta"), body))
    return out


def _assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.status_code, response.text)
    assert p.ErrorBody.model_validate(response.json()).code is p.ErrorCode.UNAUTHORIZED
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert TOKEN not in response.text and TOKEN not in str(response.headers)


@pytest.mark.parametrize("server_fixture", ["env_server", "file_server"])
def test_every_v1_route_needs_the_token(server_fixture: str, request: pytest.FixtureRequest) -> None:
    server: CkptdProcess = request.getfixturevalue(server_fixture)
    routes = _v1_requests(server.url)
    assert {(m, path) for m, path, _ in routes} >= {
        ("GET", p.ROUTE_JOBS),
        ("GET", "/v1/jobs/meta/checkpoints"),
        ("GET", "/v1/jobs/meta/checkpoints/latest-good"),
        ("POST", "/v1/jobs/meta/resume"),
    }
    routes.append(("GET", "/v1/no-such-route", None))  # even what does not exist says nothing without the token
    with httpx.Client(base_url=server.url, timeout=30) as http:
        # once its plain-Orbax steps are adopted (before that a good request is 503 NOT_READY: not yet, not "none")
        wait_until(lambda: http.get("/v1/jobs/meta/checkpoints/latest-good",
                                    headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200,
                   timeout=30, what="meta's steps adopted")
        for method, path, body in routes:
            for header in WRONG:
                headers = {} if header is None else {"Authorization": header}
                _assert_unauthorized(http.request(method, path, json=body, headers=headers))
            good = http.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
            assert good.status_code != 401 and good.status_code < 500, (method, path, good.text)
            assert TOKEN not in good.text
            lower = http.request(method, path, json=body, headers={"Authorization": f"bearer {TOKEN}"})
            assert lower.status_code == good.status_code  # the scheme is case-insensitive (RFC 7235)


def test_probes_stay_open_and_metrics_is_configurable(env_server: CkptdProcess, file_server: CkptdProcess) -> None:
    for server in (env_server, file_server):
        for path in (p.ROUTE_HEALTHZ, p.ROUTE_READYZ, "/openapi.json", "/docs"):
            assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200, path
    assert httpx.get(f"{env_server.url}/metrics", timeout=10).status_code == 200  # default: open for scrapers
    _assert_unauthorized(httpx.get(f"{file_server.url}/metrics", timeout=10))  # CKPTD_METRICS_REQUIRE_TOKEN
    ok = httpx.get(f"{file_server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and "ckptd_" in ok.text
    schema = httpx.get(f"{file_server.url}/openapi.json", timeout=10).json()
    assert "401" in schema["paths"][p.ROUTE_METRICS]["get"]["responses"]
    assert "401" in schema["paths"][p.ROUTE_RESUME]["post"]["responses"]


def test_trainer_client_sends_the_token_from_its_environment(
    env_server: CkptdProcess, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_URL", env_server.url)
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    reset_client_settings()
    with CkptdClient(root=str(root)) as client:  # ClientSettings() from the environment
        assert client.latest_good("meta").step == 10  # type: ignore[union-attr]
        plan = client.resume("meta", ResumeRequest(alive_devices=8))
        assert plan.step == 10 and plan.source == "ckptd"  # ckptd answered: not the storage fallback
        assert TOKEN not in repr(client.settings) and TOKEN not in str(client.settings)
    reporter = EventReporter(ClientSettings(), "meta")
    reporter.report("start", time=1_700_000_000.0, detail="auth test")
    assert reporter.close(10.0)
    events = httpx.get(
        f"{env_server.url}/v1/jobs/meta/events", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ).json()["events"]
    assert any(e.get("detail") == "auth test" for e in events)

    monkeypatch.setenv("CKPTD_TOKEN", "not-the-token")
    reset_client_settings()  # the environment is read once a process: as a new process would read it
    with CkptdClient(root=str(root)) as client, pytest.raises(CkptdRequestError) as refused:
        client.resume("meta", ResumeRequest(alive_devices=8))  # refused: raised, not bypassed via storage
    assert refused.value.code == p.ErrorCode.UNAUTHORIZED.value and TOKEN not in str(refused.value)


def test_constant_time_comparison_is_kept() -> None:
    source = inspect.getsource(ckptd.api._auth.BearerAuth)  # what app.py installs with the auth group's token
    assert "hmac.compare_digest(" in source and "BearerAuth, token=auth.token" in inspect.getsource(ckptd.api._app)


def test_token_never_in_logs(
    env_server: CkptdProcess, file_server: CkptdProcess, root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The debug logs of both servers (uvicorn and ckptd) and of this process (client, httpx) after requests
    with good, wrong and missing tokens, failures included; and a server at uvicorn's ``trace`` level."""
    trace = _serve(root, tmp_path, "trace", {"CKPTD_TOKEN": TOKEN, "CKPTD_LOG_LEVEL": "trace"})
    try:
        with caplog.at_level(logging.DEBUG):
            for server in (env_server, file_server, trace):
                with httpx.Client(base_url=server.url, timeout=30) as http:
                    for header in [*WRONG, f"Bearer {TOKEN}"]:
                        headers = {} if header is None else {"Authorization": header}
                        for method, path, body in _v1_requests(server.url):
                            http.request(method, path, json=body, headers=headers)
                        http.post("/v1/jobs/meta/resume", content=b"{not json", headers=headers)
                        http.post("/v1/jobs/meta/resume", json={"alive_devices": TOKEN}, headers=headers)
                for token in (TOKEN, "wrong"):
                    with CkptdClient(ClientSettings(url=server.url, token=token, timeout_s=2), root=str(root)) as c:
                        try:
                            c.resume("meta", ResumeRequest(alive_devices=8))
                        except CkptdRequestError as exc:
                            logging.getLogger("test").warning("refused: %s", exc)
    finally:
        trace.stop()
    logs = {
        name: server.log_path.read_text(errors="replace")
        for name, server in (("env", env_server), ("file", file_server), ("trace", trace))
    }
    assert logs["env"].strip(), "the server logged nothing: the check would be vacuous"
    assert "ASGI" in logs["trace"], "the trace server did not log at trace level"
    for name, text in logs.items():
        assert TOKEN not in text, f"the token is in the {name} server's log"
    assert caplog.records and TOKEN not in caplog.text


def test_a_bad_token_file_stops_the_server_without_printing_a_token(tmp_path: Path, root: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = {
        "missing": {"CKPTD_TOKEN_FILE": str(tmp_path / "nope")},
        "empty": {"CKPTD_TOKEN_FILE": str(empty)},
        "both": {"CKPTD_TOKEN_FILE": str(empty), "CKPTD_TOKEN": TOKEN},
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--port", "0"],
            env=clean_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in cases.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (name, err)
        assert err.startswith("ckptd: invalid settings:"), (name, err)
        assert TOKEN not in err + out


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", "is empty"), ("   ", "is empty"), (f" {TOKEN} ", "spaces or line breaks around it"),
     ("tök€n-3f9a7c21d8e64b0f", "printable ASCII"), ("two words", "printable ASCII"),
     ("REPLACE-WITH-openssl-rand-hex-32", "placeholder of deploy/k8s/secret.example.yaml")],
    ids=["empty", "blank", "padded", "non-ascii", "space", "placeholder"],
)
def test_a_token_that_cannot_work_stops_the_server(root: Path, tmp_path: Path, value: str, expected: str) -> None:
    """``CKPTD_TOKEN=""`` used to serve without auth; a non-ASCII token made every request 401 (the header was
    decoded as latin-1, the token encoded as UTF-8). Each is now a settings error at startup, as a token file."""
    token_file = tmp_path / "token"
    token_file.write_text(value, encoding="utf-8")
    for env in ({"CKPTD_TOKEN": value}, {"CKPTD_TOKEN_FILE": str(token_file)}):
        if "CKPTD_TOKEN_FILE" in env and value.strip() != value and value.strip():
            continue  # a file's surrounding whitespace is stripped (a Secret often ends in a newline)
        done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--port", "0"],
                              env=clean_env(**env), capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, (env, done.stderr)
        assert done.stderr.startswith("ckptd: invalid settings:") and expected in done.stderr, done.stderr
        if value.strip():
            assert value.strip() not in done.stderr + done.stdout, "the token was printed"


def test_the_header_is_compared_as_bytes(env_server: CkptdProcess) -> None:
    """Bytes no client should send (non-ASCII, latin-1 or UTF-8) are a 401, never an error; a token of every
    printable ASCII character a generator may use is accepted as sent."""
    host, port = env_server.url.removeprefix("http://").split(":")
    for given in (TOKEN.encode() + "é".encode(), TOKEN.encode() + "é".encode("latin-1"), b"\xff" * 8):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + given + b"\r\n\r\n")
            assert s.recv(65536).split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized"
    from ckptd.config import token_problem

    assert token_problem("a~b+c/d=e_f-g.h!$%&'*") is None
