"""What an operator trips on at the command line: a root taken for a job and back, a
malformed ``--slices``, ``None`` in a listing, a timeline drowned in ``checkpoint_started``. Each is one
clear line and exit 2 (a usage error), or a readable table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.cli._main import main
from ckptd.events._events import EventStore
from tests.support.helpers import clean_env
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import TMP_DIR_SUFFIX

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llm``: steps 10 and 20 (plain Orbax, ckptd metadata) and a run's events with 3 saves; ``empty``: one
    save being written (no step done yet); ``7``: a job named like a step, holding step 5."""
    root = tmp_path_factory.mktemp("cli") / "root"
    write_orbax_jobs({root / "llm": [10, 20], root / "7": [5]},
                     custom_metadata={10: training_metadata(10), 20: training_metadata(20)})
    (root / "empty" / f"3{TMP_DIR_SUFFIX}").mkdir(parents=True)
    events = [p.ElasticEvent(kind="start", time=T0, run="r", id="0")]
    events += [p.ElasticEvent(kind="checkpoint_started", time=T0 + i, step=10 * i, run="r", id=f"s{i}",
                              blocked_seconds=0.01) for i in (1, 2, 3)]
    events += [p.ElasticEvent(kind="failure_detected", time=T0 + 4, step=30, run="r", id="f", detail="slice 1"),
               p.ElasticEvent(kind="finished", time=T0 + 9, step=40, run="r", id="end")]
    EventStore(Storage(str(root))).append("llm", events)
    return root


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``ckptd argv``: it must exit 2 with a message and no traceback; the message."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err
    return err


def test_ls_of_a_job_says_it_is_a_job(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, "ls", f"{root}/llm")
    assert "is a job, not a checkpoint root" in err and "steps 10, 20" in err
    assert f"ckptd show {root}/llm" in err and f"ckptd ls {root}" in err


@pytest.mark.parametrize("command", ["show", "validate", "gc", "plan", "events", "advise"])
def test_a_root_given_for_a_job_says_it_is_a_root(root: Path, capsys: pytest.CaptureFixture[str],
                                                  command: str) -> None:
    extra = ["--devices", "8"] if command == "plan" else []
    err = _usage_error(capsys, command, str(root), *extra)
    assert "is a checkpoint root, not a job" in err and "llm" in err and f"ckptd ls {root}" in err


def test_a_step_given_for_a_job_says_it_is_a_step(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, "show", f"{root}/llm/20")
    assert "is a step directory, not a job" in err and f"ckptd show {root}/llm" in err


def test_ls_lists_jobs_with_numeric_names_and_dashes_for_nothing(root: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(root)]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["llm"] == ["2", "20", "20"]
    assert rows["7"] == ["1", "5", "5"]  # a job named like a step is still a job
    assert rows["empty"] == ["1", "3", "-"]  # no good step: '-', not 'None'
    assert main(["show", f"{root}/7"]) == 0  # and shows as one


@pytest.mark.parametrize(("slices", "why"), [("foo", "not INDEX:DEVICES"), ("0:2,1", "not INDEX:DEVICES"),
                                             ("0:-1", "not INDEX:DEVICES"), ("a:b", "not INDEX:DEVICES")])
def test_plan_with_malformed_slices_is_a_usage_error(root: Path, capsys: pytest.CaptureFixture[str], slices: str,
                                                     why: str) -> None:
    assert why in _usage_error(capsys, "plan", f"{root}/llm", "--devices", "8", "--slices", slices)


def test_plan_with_an_invalid_request_says_so_in_one_line(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{root}/llm", "--devices", "-1"]) == 2  # was a pydantic traceback
    err = capsys.readouterr().err
    assert err == "ckptd: plan: --devices: Input should be greater than or equal to 0\n"  # the flag, not the field
    # slices that do not hold --devices: planned for --devices, naming no slice (docs/protocol.md, Resume)
    assert main(["plan", f"{root}/llm", "--devices", "8", "--slices", "0:2,1:2"]) == 0
    assert "alive_devices=8 but the slices listed hold 4 devices" in capsys.readouterr().out
    assert main(["plan", f"{root}/llm", "--devices", "4", "--slices", "0:2,1:2"]) == 0


def test_the_installed_command_prints_no_traceback(root: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ckptd", "plan", f"{root}/llm", "--devices", "8", "--slices", "foo"],
                         capture_output=True, text=True, env=clean_env(), timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--slices" in out.stderr


def test_events_leaves_the_saves_out_unless_asked(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", f"{root}/llm"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint_started" not in out and "failure_detected" in out and "finished" in out
    assert "3 event(s); 3 checkpoint_started hidden (--all shows them)" in err
    assert main(["events", f"{root}/llm", "--all"]) == 0
    out, err = capsys.readouterr()
    assert out.count("checkpoint_started") == 3 and "6 event(s)" in err and "hidden" not in err
    assert main(["events", f"{root}/llm", "--kind", "checkpoint_started", "--limit", "2"]) == 0
    out, _ = capsys.readouterr()
    assert out.count("checkpoint_started") == 2
    assert main(["events", f"{root}/llm", "--json"]) == 0  # what the API serves: every event
    assert p.EventList.model_validate_json(capsys.readouterr().out).events[1].kind == "checkpoint_started"
