"""The trainer's settings are read once per process: ``client_settings()`` is the one reading every module takes
when it is given none (docs/operations.md, "Settings", trainer); only the composition roots build a reading."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.helpers import REPO
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import client_settings, reset_client_settings


def test_the_trainer_reads_its_settings_once_per_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``client_settings()`` is the one reading: the client's default and every module's (the run id of a step,
    the save route's timeout, the restore's host-memory cap) see the same object, whatever the environment says
    later; ``reset_client_settings()`` is for tests."""
    monkeypatch.setenv("CKPTD_RUN_ID", "run-a")
    first = client_settings()
    monkeypatch.setenv("CKPTD_RUN_ID", "run-b")
    assert client_settings() is first and first.run_id == "run-a"
    with CkptdClient(root=str(tmp_path)) as client:
        assert client.settings is first
    reset_client_settings()
    assert client_settings().run_id == "run-b"


def test_only_the_composition_roots_read_the_environment() -> None:
    """ckptd's settings are built by ``ckptd serve`` (and the API's schema generator, over fixed values), the
    commands' by their support module; the trainer's only by ``client_settings()``: no other module builds a
    reading of its own."""
    readers = {"ckptd": {"Settings", "CliSettings"}, "trainer_client": {"ClientSettings"}}
    built: dict[str, int] = {}
    for package, names in readers.items():
        for path in sorted((REPO / package).rglob("*.py")):
            calls = [node for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names]
            if calls:
                built[str(path.relative_to(REPO))] = len(calls)
    assert built == {"ckptd/api/_gen_docs.py": 1, "ckptd/cli/_serve.py": 1, "ckptd/cli/_support.py": 1,
                     "trainer_client/config.py": 1}
