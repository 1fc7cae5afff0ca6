"""What a new user of the ``ckptd`` command tripped on: ``ckptd ls /etc`` listed ~70 "jobs", ``CKPTD_ROOT`` did not
count as the root, ``--help`` showed RST markup and module paths, ``ckptd plan ... | head`` ended in a
BrokenPipeError traceback. (``--devices -3`` naming the flag: tests/server/cli/test_cli_targets.py; the serving line:
tests/server/cli/test_serve_cli.py.)"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli._main import build_parser, main
from ckptd.events._events import EventStore
from tests.support.helpers import clean_env
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Job ``llm``: steps 10 and 20."""
    root = tmp_path_factory.mktemp("user") / "root"
    write_orbax_jobs({root / "llm": [10, 20]}, custom_metadata={s: training_metadata(s) for s in (10, 20)})
    return root


def _etc_like(tmp_path: Path) -> Path:
    """A directory of configuration directories, like /etc: none of them holds a step."""
    etc = tmp_path / "etc"
    for name in ("apt", "ssh", "cron.d", "X11", "default"):
        (etc / name).mkdir(parents=True)
        (etc / name / "config").write_text("x = 1\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    return etc


def test_ls_refuses_a_directory_that_is_no_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    etc = _etc_like(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["ls", str(etc)])
    assert info.value.code == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"ckptd: {etc} is not a checkpoint root: none of its 5 directories holds checkpoint steps (X11, apt, cron.d, "
        "default, ssh); a root holds JOB/STEP directories"]


def test_ls_lists_roots_that_hold_jobs_or_nothing_yet(root: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fresh").mkdir()  # a root nothing has been saved to yet: an empty table
    assert main(["ls", str(tmp_path / "fresh")]) == 0
    assert capsys.readouterr().out.split() == ["JOB", "STEPS", "LATEST", "LATEST-GOOD"]
    events_only = tmp_path / "events-only"  # a job that has reported events before its first save
    EventStore(Storage(str(events_only))).append("llm", [p.ElasticEvent(kind="start", time=1.7e9, run="r", id="0")])
    (events_only / "notes").mkdir()
    assert main(["ls", str(events_only)]) == 0
    assert "llm" in capsys.readouterr().out


def test_ckptd_root_is_the_default_root(root: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("CKPTD_ROOT", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["ls"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "ckptd: no ROOT given and CKPTD_ROOT is not set\n"
    with pytest.raises(SystemExit) as info:
        main(["show", "llm"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "ckptd: expected ROOT/JOB (or JOB with CKPTD_ROOT set), got 'llm'\n"

    monkeypatch.setenv("CKPTD_ROOT", str(root))
    assert main(["ls"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["llm", "2", "20", "20"]
    for argv in (["show", "llm"], ["plan", "llm", "--devices", "4"], ["validate", "llm"], ["gc", "llm", "--dry-run"]):
        assert main(argv) == 0, argv
        assert "20" in capsys.readouterr().out, argv
    assert main(["show", f"{root}/llm"]) == 0  # ROOT/JOB still names its own root
    capsys.readouterr()


def _helps() -> dict[str, str]:
    parser = build_parser()
    helps = {"ckptd": parser.format_help()}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps.update({f"ckptd {name}": command.format_help() for name, command in sub.choices.items()})
    return helps


def test_help_has_no_markup_and_no_module_paths() -> None:
    helps = _helps()
    assert len(helps) >= 10 and "usage: ckptd advise" in helps["ckptd advise"]
    for command, text in helps.items():
        assert "``" not in text and ":class:" not in text and ":func:" not in text, (command, text)
        modules = re.findall(r"\b(?:ckptd|trainer_client)(?:\.[A-Za-z_]+)+|\b[a-z_]+/[a-z_/]+\.py\b", text)
        assert not modules, (command, modules)


def test_every_command_has_a_description_and_every_option_says_what_it_does() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.description, f"ckptd {name} --help has no description"
        silent = [a.option_strings or [a.dest] for a in command._actions if not a.help]
        assert silent == [], f"ckptd {name}: {silent} have no help"
    plan = _helps()["ckptd plan"]
    for option in ("--devices", "--step", "--json", "--policy"):
        assert option in plan
    assert "--keep-last N" in _helps()["ckptd gc"] and "newest N good steps" in _helps()["ckptd gc"]


@pytest.mark.parametrize("argv", [["plan", "{root}/llm", "--devices", "4"], ["ls", "{root}"],
                                  ["show", "{root}/llm", "--json"]])
def test_a_reader_that_stops_reading_gets_no_traceback(root: Path, argv: list[str]) -> None:
    """``ckptd plan ... | head -1``: the reader is gone before the command writes (its end of the pipe is closed
    before the interpreter has even started), so every write meets a broken pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", *(a.format(root=root) for a in argv)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_gc_reports_a_step_retention_left_alone_as_left_not_deleted(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # on gs:// retention leaves a multi-host save written in place to its claim's cleanup (docs/multihost.md,
    # "Fenced writers"): the table must not say such a step was deleted
    from ckptd.cli import _maintenance

    monkeypatch.setattr(_maintenance, "collect", lambda storage, decisions, dry_run=False, **_kw: [])
    assert main(["gc", f"{root}/llm", "--keep-last", "1"]) == 0
    captured = capsys.readouterr()
    [row] = [line.split() for line in captured.out.splitlines() if line.split()[:1] == ["10"]]
    assert row[2] == "left" and "deleted" not in captured.out
    assert captured.err.strip() == "0 step(s) deleted"
    assert (root / "llm" / "10").is_dir()


def test_gc_reports_a_deletion_refused_on_gcs_with_its_reason(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # on gs:// a step changed since it was listed is kept (docs/gcs.md, "Fencing on gs://"): the table says so, and why
    from dataclasses import replace

    from ckptd.cli import _maintenance

    def refusing(storage: object, decisions: list[Any], dry_run: bool = False, *, refused: list[Any],
                 **_kw: object) -> list[Any]:
        refused += [replace(d, reasons=[*d.reasons, "saved again since"]) for d in decisions if d.action == "delete"]
        return []

    monkeypatch.setattr(_maintenance, "collect", refusing)
    assert main(["gc", f"{root}/llm", "--keep-last", "1"]) == 0
    captured = capsys.readouterr()
    [row] = [line for line in captured.out.splitlines() if line.split()[:1] == ["10"]]
    assert row.split()[2] == "refused" and row.endswith("; saved again since")
    assert captured.err.strip() == "0 step(s) deleted"
