"""Hostile input: the app's own OpenAPI fuzzed by schemathesis, then paths, names and bodies meant to break
out of the checkpoint root or to crash the server. Every answer is a 4xx with the one error body (never
a 5xx), every answer conforms to the declared schema, and nothing outside the root is read, written or
deleted.

"Outside the root" is watched two ways for the whole module: a Python audit hook records every file the
process opens, lists, creates, renames or deletes while the hostile requests run (the server runs in this
process), and the files of a sandbox around the root (a canary and a complete Orbax job *next to* the
root, the target of any ``..``) have their access and modification times checked at the end, which also
catches reads from C++ (tensorstore) that no Python hook sees.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.server import ServerHandle, start_server
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "25"))  # per operation and generation mode

# ---- watching the file system ----------------------------------------------------------------------

_WATCHED_EVENTS = {
    "open",
    "os.listdir",
    "os.scandir",
    "os.remove",
    "os.rename",
    "os.replace",
    "os.rmdir",
    "os.mkdir",
    "os.utime",
    "os.chmod",
    "os.chown",
    "os.link",
    "os.symlink",
    "os.truncate",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "sqlite3.connect",
}


class FileAccesses:
    """Paths touched by this process while ``recording()`` is active (an audit hook cannot be removed, so
    one is installed for the session and records only while asked to)."""

    _installed: FileAccesses | None = None

    def __init__(self) -> None:
        self.active = False
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    @classmethod
    def get(cls) -> FileAccesses:
        if cls._installed is None:
            cls._installed = cls()
            sys.addaudithook(cls._installed._hook)
        return cls._installed

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or event not in _WATCHED_EVENTS:
            return
        for arg in args[:2]:
            if isinstance(arg, bytes):
                arg = os.fsdecode(arg)
            if isinstance(arg, str) and arg.startswith("/"):
                with self._lock:
                    self.seen.append((event, arg))

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/`` (jobs ``plain``: steps 1, 2 by plain Orbax; ``meta``: step 10 with ckptd metadata), and next
    to it what no request may reach: ``secret_job/`` (a complete job), ``canary.txt``."""
    box = tmp_path_factory.mktemp("hostile")
    root = box / "root"
    write_orbax_jobs({root / "plain": [1, 2], root / "meta": [10]}, custom_metadata={10: training_metadata(10)})
    shutil.copytree(root / "plain", box / "secret_job")
    (box / "canary.txt").write_text("no request may read, write or delete this file\n")
    (box / "state").mkdir()
    return box


def _outside(box: Path) -> list[Path]:
    return [box / "canary.txt", *sorted((box / "secret_job").rglob("*"))]


def _age_atimes(paths: list[Path]) -> dict[Path, tuple[int, int]]:
    """Put every atime an hour before its mtime, so any read (relatime) moves it; remember both."""
    stamps = {}
    for path in paths:
        st = path.stat()
        os.utime(path, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
        st = path.stat()
        stamps[path] = (st.st_atime_ns, st.st_mtime_ns)
    return stamps


def _atime_moves_on_read(box: Path) -> bool:
    """Does this file system record reads at all (relatime does, noatime does not)?"""
    probe = box / "atime-probe"
    probe.write_text("x")
    before = _age_atimes([probe])[probe]
    probe.read_text()
    return probe.stat().st_atime_ns != before[0]


@pytest.fixture(scope="module")
def watched(sandbox: Path) -> Iterator[dict[str, Any]]:
    """Records file accesses for every test of this module; ``test_zz_*`` at the end checks them."""
    accesses = FileAccesses.get()
    state: dict[str, Any] = {
        "atime_works": _atime_moves_on_read(sandbox),
        "stamps": _age_atimes(_outside(sandbox)),
        "accesses": accesses,
    }
    with accesses.recording():
        yield state


# ---- the app and a live server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def asgi_app(sandbox: Path, watched: dict[str, Any]) -> Any:
    from tests.support.helpers import make_settings

    catalog = Catalog(Storage(str(sandbox / "root")), sandbox / "state" / "asgi.sqlite3")
    catalog.rebuild()
    return create_app(make_settings(sandbox / "root", sandbox / "state"), catalog, background=False)


@pytest.fixture(scope="module")
def live(sandbox: Path, watched: dict[str, Any]) -> Iterator[ServerHandle]:
    state = sandbox / "state" / "live"
    state.mkdir()
    handle = start_server(sandbox / "root", state)
    try:
        yield handle
    finally:
        handle.stop()


def assert_error_body(status: int, body: bytes, *, allowed: tuple[int, ...] = ()) -> p.ErrorBody:
    """A 4xx whose body is the one ErrorBody, its status the one its code maps to."""
    assert 400 <= status < 500, f"{status}: {body[:300]!r}"
    error = p.ErrorBody.model_validate_json(body)
    assert p.ERROR_STATUS[error.code] == status, error
    if allowed:
        assert status in allowed, (status, error)
    return error


# ---- schemathesis: every operation of the app's own OpenAPI, all checks, all phases -----------------

# Two operations have rules between fields that an OpenAPI schema cannot state (resume's slices and
# alive_devices; the advisor's failure rates, min_slices, the MTBF a rate and a slice count make, the work a
# simulation costs): each is given a meaning, so a request the schema calls valid is answered, never refused
# 422 (tests/server/api/test_schema_rules.py). Their answers to valid requests may still be the job's state (404,
# 409) or a busy server's (503).
SCHEMATHESIS_CONFIG = """
[[operations]]
include-path = "/v1/jobs/{job}/advice"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "429", "503"]

[[operations]]
include-path = "/v1/jobs/{job}/resume"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "429", "503"]
"""


def run_schemathesis(handle: ServerHandle, tmp: Path, *options: str) -> str:
    """``schemathesis run`` (its CLI, as CI would run it) against the live server with every check and every
    phase; its output. Fails the test on any failure it reports."""
    config = tmp / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
               f"{handle.url}/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
               "--continue-on-failure", "--suppress-health-check", "all", "--request-timeout", "30", *options]
    done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-12_000:]
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅\s+{phase}", output), f"the {phase} phase did not run and pass:\n{output[-4000:]}"
    generated = re.search(r"(\d+) generated", output)
    assert generated and int(generated.group(1)) >= 100, output[-4000:]
    return output


def test_schemathesis_all_checks_all_phases(live: ServerHandle, tmp_path: Path) -> None:
    """No 5xx, every response conforms to the schema (status, content type, headers, body), valid requests
    are not refused and invalid ones are, undeclared methods get 405 with the right Allow, and sequences of
    calls (the stateful phase) hold together. Deterministic, ``HOSTILE_EXAMPLES`` per operation."""
    run_schemathesis(live, tmp_path, "--max-examples", str(EXAMPLES), "--generation-deterministic")


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(1800)
def test_schemathesis_long(live: ServerHandle, tmp_path: Path) -> None:
    """The long form: random generation, 10 times the examples; the seed is in the output."""
    # --max-response-time: a resume for ~300,000 devices that fit nowhere tries ~150,000 meshes, ~11 s on a
    # loaded 2-core host (the planner's worst case); the short form keeps schemathesis' 10 s
    run_schemathesis(live, tmp_path, "--max-examples", str(10 * EXAMPLES), "--max-response-time", "30")


# ---- explicit hostile paths, over raw sockets (no client normalizes them) ---------------------------


def raw_request(
    handle: ServerHandle, target: str, *, method: str = "GET", body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request with ``target`` exactly as given; (status, headers, body)."""
    host, port = handle.url.removeprefix("http://").split(":")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    if parsed.get("transfer-encoding", parsed.get("Transfer-Encoding", "")).lower() == "chunked":
        payload = _dechunk(payload)
    return int(status_line.split()[1]), {k.lower(): v for k, v in parsed.items()}, payload


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


JOB_SEGMENTS = [
    "..",
    ".",
    "...",
    "../secret_job",
    "..%2Fsecret_job",
    "%2e%2e",
    "%2E%2E%2Fsecret_job",
    "%2e%2e%2f%2e%2e",
    "%252e%252e",
    "..%5Csecret_job",
    "..\\secret_job",
    "%2Fetc%2Fpasswd",
    "%2F",
    "%00",
    "plain%00",
    "plain%00.txt",
    "%C0%AE%C0%AE",
    "%E2%80%AE",
    "~",
    "$HOME",
    "secret_job",
    "plain%2F..%2F..%2Fsecret_job",
    ".hidden",
    "a" * 129,
    "b" * 5000,
    "c" * 12000,
    "plain%0d%0aX-Injected:%201",
    "plain;rm",
    "*",
    "%3F",
]
SUFFIXES = [
    ("GET", "checkpoints"),
    ("GET", "checkpoints/latest-good"),
    ("POST", "resume"),
    ("GET", "events"),
    ("POST", "events"),
    ("GET", "goodput"),
    ("GET", "advice?step_time_s=1"),
]


@pytest.mark.parametrize("segment", JOB_SEGMENTS, ids=lambda s: s[:24])
def test_hostile_job_names_never_leave_the_root(live: ServerHandle, segment: str) -> None:
    for method, suffix in SUFFIXES:
        body = b'{"alive_devices": 8}' if suffix == "resume" else b'{"events": [{"kind": "start", "time": 1.0}]}'
        status, headers, payload = raw_request(
            live, f"/v1/jobs/{segment}/{suffix}", method=method, body=body if method == "POST" else b""
        )
        assert "x-injected" not in headers
        if status == 200:
            # Events may come before a job's first step: they are stored under the root, by a valid name, and
            # from then on that job (root/<name>, holding no step) exists; the one outside is never seen.
            assert p.is_valid_job_name(segment), payload
            assert (Path(live.settings.storage.root) / segment / ".ckptd" / "events").is_dir()
            assert b'"step"' not in payload and b"/secret_job/" not in payload, payload
            continue
        # a name that is not one: 400; one that splits the path: no route; a name not under the root: 404
        # (and once root/<name> exists, the advisor's 422 for the inputs it lacks)
        error = assert_error_body(status, payload, allowed=(400, 404, 422))
        assert "secret_job" not in error.message or error.code in (
            p.ErrorCode.INVALID_JOB_NAME,
            p.ErrorCode.JOB_NOT_FOUND,
        )


RAW_TARGETS = [
    "/v1/jobs/../../secret_job/checkpoints",
    "/v1/../../../etc/passwd",
    "/v1/jobs//checkpoints",
    "//v1/jobs/plain/checkpoints",
    "/v1/jobs/plain/checkpoints/../../../../secret_job/checkpoints",
    "/v1/jobs/%2e%2e/%2e%2e/secret_job/checkpoints",
    "/v1/jobs/plain/checkpoints%2F..%2F..",
    "/v1/jobs/plain/checkpoints/latest-good/..",
    "/v1/jobs/plain/../meta/checkpoints",
]


@pytest.mark.parametrize("target", RAW_TARGETS)
def test_raw_traversal_targets(live: ServerHandle, target: str) -> None:
    status, _, payload = raw_request(live, target)
    if status == 200:  # only a path that stays under the root may answer, and only with its own job
        listing = json.loads(payload)
        assert listing["job"] in ("plain", "meta"), listing
        assert all("/root/" in c["path"] and "secret_job" not in c["path"] for c in listing["checkpoints"])
    else:
        assert_error_body(status, payload, allowed=(400, 404, 405))


def test_steps_that_are_not_steps(live: ServerHandle) -> None:
    for step in [
        "../1",
        "1/../2",
        "-1",
        "1.5",
        "1e3",
        "NaN",
        "null",
        "true",
        '"1"',
        "[1]",
        "{}",
        str(2**63),
        str(-(2**63)),
        "0x10",
        "1" * 400,
    ]:
        body = f'{{"alive_devices": 8, "step": {step if not step.startswith(("..", "1/")) else json.dumps(step)}}}'
        status, _, payload = raw_request(live, "/v1/jobs/meta/resume", method="POST", body=body.encode())
        if status == 200:  # only a real, verified step (or, for null, the latest good one)
            assert json.loads(payload)["step"] == (10 if step == "null" else int(float(step)))
        else:
            assert_error_body(status, payload, allowed=(404, 409, 422))


BAD_BODIES = [
    b"{oops",
    b'{"alive_devices": 8',
    b"\xff\xfe{}",
    b'\xef\xbb\xbf{"alive_devices": 8}',
    b"[" * 50_000,
    b'{"a":' * 50_000,
    b'"' + b"x" * 100_000 + b'"',
    json.dumps({"alive_devices": [8] * 10_000}).encode(),
    b'{"alive_devices": 8, "slices": '
    + json.dumps([{"index": i, "devices": 0} for i in range(100_001)]).encode()
    + b"}",
    b'{"alive_devices": 1e999999}',
    b'{"alive_devices": -0.0}',
    b'{"alive_devices": 8, "__proto__": {}}',
    b'{"alive_devices": 8, "alive_devices": "8"}',
    b"\x00\x00\x00",
    b'{"alive_devices": 8}' + b" " * 1000 + b"x",
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=lambda b: repr(b[:20]))
def test_bodies_that_are_not_requests(live: ServerHandle, body: bytes) -> None:
    for target in ("/v1/jobs/meta/resume", "/v1/jobs/meta/events"):
        status, _, payload = raw_request(live, target, method="POST", body=body)
        if status == 200 and target.endswith("resume"):
            continue  # "-0.0" is the integer 0... and 0 devices is a 409; a duplicate key keeps the last
        assert_error_body(status, payload, allowed=(409, 413, 422))


NESTED = [b"[" * depth + b"]" * depth for depth in (500, 700, 990)] + [
    b'{"alive_devices": 8, "slices": ' + b"[" * 600 + b"]" * 600 + b"}",
    b'{"events": [{"kind": "start", "time": 1, "detail": ' + b'{"a":' * 600 + b"1" + b"}" * 600 + b"}]}",
]


def test_deeply_nested_json_is_a_4xx_with_one_short_log_line(asgi_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    """JSON nested 500-990 deep used to end in a RecursionError: a 500 and ~180 KB of traceback in the log."""
    from fastapi.testclient import TestClient

    with TestClient(asgi_app, raise_server_exceptions=True) as client, caplog.at_level(logging.DEBUG):
        for body in NESTED:
            for target in ("/v1/jobs/meta/resume", "/v1/jobs/meta/events"):
                response = client.post(target, content=body, headers={"content-type": "application/json"})
                error = assert_error_body(response.status_code, response.content, allowed=(422,))
                assert error.code is p.ErrorCode.INVALID_REQUEST
    assert all(len(record.getMessage()) < 500 and not record.exc_info for record in caplog.records)
    assert sum(len(record.getMessage()) for record in caplog.records) < 20_000


def test_huge_bodies_get_413_before_they_are_read(live: ServerHandle) -> None:
    limit = live.settings.limits.max_body_bytes
    host, port = live.url.removeprefix("http://").split(":")
    # Declared too large: answered at once, the body never sent.
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            (
                f"POST /v1/jobs/meta/resume HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10 * limit}\r\n\r\n"
            ).encode()
            + b"{"
        )
        answer = s.recv(65536)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"413", answer[:300]
    error = assert_error_body(413, payload)
    assert error.code is p.ErrorCode.PAYLOAD_TOO_LARGE and error.detail == {"max_body_bytes": limit}
    # Streamed without a length (chunked, a little over the limit): cut off once past it.
    assert _chunked_post(host, int(port), "/v1/jobs/meta/events", limit + (64 << 10)) == 413

    with httpx.Client(base_url=live.url, timeout=60) as http:
        # just under the limit is read and judged on its content
        near = http.post(
            "/v1/jobs/meta/resume",
            content=b" " * (limit - 100) + b'{"alive_devices": 8}',
            headers={"content-type": "application/json"},
        )
        assert near.status_code == 200, near.text
        # and the server is fine afterwards
        assert http.get("/healthz").status_code == 200


def _chunked_post(host: str, port: int, target: str, size: int) -> int:
    """POST ``size`` bytes as a chunked body over a raw socket; the status of the answer. The server may
    answer and close before the body is all sent: the rest is then not sent, and the answer still read."""
    piece = b"0," * (32 << 10)
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(
            f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        sent = 0
        try:
            while sent < size:
                s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sent += len(piece)
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-body, as it should be
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split()[1])


def test_wrong_types_and_queries(live: ServerHandle) -> None:
    cases = [
        ("GET", "/v1/jobs/meta/events?since=yesterday"),
        ("GET", "/v1/jobs/meta/events?limit=0"),
        ("GET", f"/v1/jobs/meta/events?limit={10**30}"),
        ("GET", "/v1/jobs/meta/goodput?step_time_s=-1"),
        ("GET", "/v1/jobs/meta/advice?step_time_s=abc"),
        ("GET", "/v1/jobs/meta/advice?mtbf_hours=nan"),
        ("GET", "/v1/jobs/meta/advice?slices=1e999"),
        ("DELETE", "/v1/jobs/meta/checkpoints"),
        ("PUT", "/v1/jobs/meta/resume"),
        ("PATCH", "/v1/jobs"),
        ("GET", "/v1/jobs/meta/resume"),
        ("GET", "/v2/jobs"),
        ("GET", "/v1/jobs/meta/checkpoints/11"),
    ]
    for method, target in cases:
        status, _, payload = raw_request(live, target, method=method)
        assert_error_body(status, payload, allowed=(404, 405, 422))
    for body in (
        b'{"events": "start"}',
        b'{"events": []}',
        b'{"events": [{"kind": "start"}]}',
        b'{"events": [{"kind": "../../x", "time": 1}]}',
        b'{"events": [{"kind": "start", "time": -1}]}',
        b'{"events": [{"kind": "start", "time": 1, "detail": "' + b"d" * 5000 + b'"}]}',
    ):
        status, _, payload = raw_request(live, "/v1/jobs/meta/events", method="POST", body=body)
        assert_error_body(status, payload, allowed=(422,))


# ---- and at the end: nothing outside the root was touched ------------------------------------------


def test_zz_nothing_outside_the_root_was_read_written_or_deleted(sandbox: Path, watched: dict[str, Any]) -> None:
    root = os.path.realpath(sandbox / "root")
    state = os.path.realpath(sandbox / "state")
    box = os.path.realpath(sandbox)
    accesses: FileAccesses = watched["accesses"]
    assert accesses.seen, "the audit hook recorded nothing: the check would be vacuous"
    escaped = []
    for event, path in accesses.seen:
        real = os.path.realpath(path)
        inside_box = real == box or real.startswith(box + os.sep)
        allowed = real in (root, state) or real.startswith((root + os.sep, state + os.sep))
        if inside_box and not allowed:
            escaped.append((event, path))
    assert not escaped, f"touched outside the root: {escaped[:20]}"
    # nothing next to the root changed or was read (C++ readers included)
    for path, (atime, mtime) in watched["stamps"].items():
        assert path.exists(), f"{path} was deleted"
        st = path.stat()
        assert st.st_mtime_ns == mtime, f"{path} was modified"
        if watched["atime_works"]:
            assert st.st_atime_ns == atime, f"{path} was read"
    # and the root itself still holds exactly what it held, plus event files of valid job names
    assert sorted(p.name for p in (sandbox / "secret_job").iterdir()) == ["1", "2"]
