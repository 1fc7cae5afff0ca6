"""``ckptd serve`` refuses to start a server that cannot work, in one line and before "startup complete":
a local root that does not exist, a port already taken; it warns when it listens beyond loopback without a
token; its ``--help`` shows the defaults. Each is a real subprocess.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.helpers import clean_env, free_port, stop_process, wait_until
from tests.support.serve_cli import served
from trainer_client.core import protocol as p

pytestmark = pytest.mark.integration


def _serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``ckptd serve ARGS`` that is expected to exit by itself."""
    return subprocess.run([sys.executable, "-m", "ckptd", "serve", *args], env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def _listening(host: str = "127.0.0.1") -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as other:
        other.bind((host, 0))
        other.listen()
        yield int(other.getsockname()[1])


def test_a_missing_root_is_refused_unless_asked_to_create_it(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-root"
    done = _serve("--root", str(missing), "--port", str(free_port()), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"ckptd: the checkpoint root {str(missing)!r} does not exist: create it, or pass --create-root "
        "(CKPTD_CREATE_ROOT=true)"
    ]
    assert not missing.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    done = _serve("--root", str(a_file), "--port", str(free_port()), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2 and "is not a directory" in done.stderr and "Traceback" not in done.stderr

    port = free_port()
    log = tmp_path / "create.log"
    with served(["--root", str(missing), "--create-root", "--state-dir", str(tmp_path / "state")], port, clean_env(),
                log, route=p.ROUTE_READYZ, timeout=30):
        pass
    assert missing.is_dir()
    assert f"WARNING ckptd.serve: created the checkpoint root {missing}" in log.read_text()


def test_a_port_in_use_is_one_line_and_no_startup(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    with _listening() as port:
        done = _serve("--root", str(tmp_path / "root"), "--port", str(port), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"ckptd: cannot listen on 127.0.0.1:{port}: Address already in use"
    output = done.stdout + done.stderr
    assert "startup complete" not in output.lower() and "Traceback" not in output


def test_listening_beyond_loopback_without_a_token_is_warned_about(tmp_path: Path) -> None:
    """Checked on a port taken on loopback, so the server never actually listens on every interface."""
    (tmp_path / "root").mkdir()
    args = ("--root", str(tmp_path / "root"), "--state-dir", str(tmp_path / "state"))
    with _listening() as port:
        open_to_all = _serve(*args, "--host", "0.0.0.0", "--port", str(port))
        with_token = _serve(*args, "--host", "0.0.0.0", "--port", str(port), env={"CKPTD_TOKEN": "a-real-token-1"})
        loopback = _serve(*args, "--host", "127.0.0.1", "--port", str(port))
    assert open_to_all.returncode == with_token.returncode == loopback.returncode == 1  # the port was taken
    assert "WARNING ckptd.serve: NO TOKEN: listening on 0.0.0.0 without a bearer token" in open_to_all.stderr
    assert "NO TOKEN" not in with_token.stderr and "NO TOKEN" not in loopback.stderr


def test_help_shows_every_flag_with_its_default_and_variable() -> None:
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--help"], env=clean_env(), capture_output=True,
                          text=True, timeout=60, check=True)
    text = " ".join(done.stdout.split())
    for flag, variable, default in [("--root", "CKPTD_ROOT", "./checkpoints"), ("--host", "CKPTD_HOST", "127.0.0.1"),
                                    ("--port", "CKPTD_PORT", str(p.DEFAULT_PORT)),
                                    ("--shm-dir", "CKPTD_SHM_DIR", "unset"),
                                    ("--create-root", "CKPTD_CREATE_ROOT", "False")]:
        assert flag in text and f"env {variable}; default: {default})" in text, (flag, text)
    assert "env CKPTD_STATE_DIR)" in text and "~/.cache" in text
    assert "None (env" not in text, "a flag without a description"


def test_help_lists_every_setting_in_its_group() -> None:
    """Each group of ``ckptd.config.GROUPS`` has its heading, under which stand exactly its settings: a flag's help
    names its variable (``env CKPTD_...``), a setting only the environment sets has a line of its own
    (``CKPTD_... (default: ...)``). docs/operations.md, "Settings", groups them the same way
    (tests/system/test_public_api.py)."""
    from ckptd.config import GROUPS, env_names

    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--help"], env=clean_env(COLUMNS="100"),
                          capture_output=True, text=True, timeout=60, check=True)
    headings = {group.replace("_", " ") + ":": group for group in GROUPS}
    sections: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if line in headings:
            sections[headings[line]] = []
        elif sections:
            sections[list(sections)[-1]].append(line)
    assert list(sections) == list(GROUPS), "one heading per group, in their order"
    name = r"(?:CKPTD|JOB)_[A-Z_]*[A-Z]"
    for group, cls in GROUPS.items():
        text = " ".join(" ".join(sections[group]).split())
        listed = re.findall(rf"\(env ({name})[;)]", text) + re.findall(rf"({name})(?: or {name})* \(default:", text)
        assert sorted(listed) == sorted(env_names(field)[0] for field in cls.model_fields), group


def test_serve_logs_where_it_serves(tmp_path: Path) -> None:
    """Once it answers, ``ckptd serve`` logs the root, its URL (the port it bound: here 0 was asked for) and the pages
    a person opens there; each of them answers."""
    (tmp_path / "root").mkdir()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp_path / "root"), "--port",
                                 "0", "--state-dir", str(tmp_path / "state")], env=clean_env(), stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        def serving_line() -> str | None:
            assert proc.poll() is None, log.read_text()
            return next((line for line in log.read_text().splitlines() if "serving the checkpoint root" in line), None)

        line = wait_until(serving_line, timeout=60, what="ckptd serve to log where it serves")
        found = re.search(r"INFO ckptd.serve: serving the checkpoint root (\S+) at (http://127\.0\.0\.1:\d+): "
                          r"dashboard (\S+)/, API docs (\S+)/docs, metrics (\S+)/metrics$", line)
        assert found is not None, line
        assert found.group(1) == str(tmp_path / "root") and len(set(found.groups()[1:])) == 1, line
        url = found.group(2)
        for page in ("/", "/docs", "/metrics", p.ROUTE_HEALTHZ):
            assert httpx.get(url + page, timeout=10).status_code == 200, page
    finally:
        assert stop_process(proc, 15)
