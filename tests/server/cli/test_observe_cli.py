"""``ckptd events`` and ``ckptd goodput``: straight from storage, no server; ``--json`` is what the HTTP
routes answer; exit 0 only with an answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.advisor._goodput import compute_goodput
from ckptd.cli._main import main
from ckptd.events._events import EventStore
from tests.support.helpers import clean_env
from trainer_client.core._storage import Storage
from trainer_client.core.protocol import ElasticEvent, EventList, Goodput

T0 = 1_700_000_000.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "quiet").mkdir()
    events = [
        ElasticEvent(kind="start", time=T0, run="r", id="1"),
        ElasticEvent(kind="initialized", time=T0 + 1, step=0, run="r", id="2"),
        ElasticEvent(kind="first_step_done", time=T0 + 2, step=1, run="r", id="3"),
        ElasticEvent(kind="failure_detected", time=T0 + 10, step=9, run="r", id="4", detail="DATA_LOSS: slice 1"),
        ElasticEvent(kind="slices_ready", time=T0 + 12, run="r", id="5"),
        ElasticEvent(kind="restored", time=T0 + 13, step=5, run="r", id="6"),
        ElasticEvent(kind="first_step_done", time=T0 + 15, step=6, run="r", id="7"),
        ElasticEvent(kind="recovered", time=T0 + 15, step=6, run="r", id="8", recovery_seconds=5.0, lost_steps=4,
                     mesh_before=[4, 2], mesh_after=[3, 2]),
        ElasticEvent(kind="finished", time=T0 + 20, step=10, run="r", id="9"),
    ]
    store = EventStore(Storage(str(tmp_path)))
    store.append("llm", events[:4])
    store.append("llm", events[3:])  # a resent event: shown once
    return tmp_path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_events_lists_what_the_api_serves(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "events", f"{root}/llm", "--json")
    listed = EventList.model_validate_json(out)
    assert code == 0 and listed.job == "llm"
    assert [e.id for e in listed.events] == [str(i) for i in range(1, 10)]
    assert listed.events == EventStore(Storage(str(root))).load("llm")

    code, out, err = _run(capsys, "events", f"{root}/llm", "--kind", "recovered", "--kind", "failure_detected")
    assert code == 0 and "2 event(s)" in err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["TIME", "KIND", "STEP", "RECOVERY"]
    assert "failure_detected" in lines[1] and "DATA_LOSS: slice 1" in lines[1]
    assert "recovered" in lines[2] and "5.00s" in lines[2] and "4x2->3x2" in lines[2]
    code, out, _ = _run(capsys, "events", f"{root}/llm", "--since", str(T0 + 14), "--limit", "1", "--json")
    assert [e["kind"] for e in json.loads(out)["events"]] == ["finished"]


@pytest.mark.parametrize(("job", "message"), [("quiet", "0 event(s)"), ("nope", "no job 'nope'"),
                                              (".ckptd", "no job '.ckptd'")])
def test_events_exit_1_without_an_answer(root: Path, capsys: pytest.CaptureFixture[str], job: str,
                                         message: str) -> None:
    code, _, err = _run(capsys, "events", f"{root}/{job}")
    assert code == 1 and message in err


def test_goodput_is_the_routes_answer_and_reads_at_a_glance(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "goodput", f"{root}/llm", "--json")
    result = Goodput.model_validate_json(out)
    assert code == 0
    assert result == compute_goodput("llm", EventStore(Storage(str(root))).load("llm"))
    assert result.recoveries == 1 and result.lost_steps == 4 and result.step_time_s is None
    code, out, _ = _run(capsys, "goodput", f"{root}/llm", "--step-time", "0.5")
    assert code == 0
    first, *rows = out.splitlines()
    # 20 s: startup 1 + (1 - 0.5), waiting 2, restore 1, recompile 2 - 0.5, lost 4 x 0.5 = 8 s -> 12 s productive
    assert first == ("job llm: goodput 60.0% over 20.0 s (1 run(s), 1 recovery, 4 lost step(s); "
                     "step time 0.5 s from given)")
    table = {r[:20].strip(): r[20:].split() for r in rows[1:] if not r.startswith("note")}
    assert table["productive"] == ["12.00", "60.0%"] and table["waiting for slices"] == ["2.00", "10.0%"]
    assert table["lost steps"] == ["2.00", "10.0%"] and table["job down"] == ["0.00", "0.0%"]
    assert _run(capsys, "goodput", f"{root}/quiet")[0] == 1
    with pytest.raises(SystemExit):
        main(["goodput", f"{root}/llm", "--step-time", "0"])


def test_the_installed_command_runs_them(root: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ckptd", "goodput", f"{root}/llm", "--json", "--step-time", "0.5"],
                         capture_output=True, text=True, env=clean_env(), timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert Goodput.model_validate_json(out.stdout).goodput == pytest.approx(0.6)
    assert "reading events" not in out.stderr  # no progress bar when stderr is not a terminal


@pytest.mark.parametrize("when", [1e18, 1e300])  # past any date, finite (POST events takes each; not inf)
def test_events_prints_a_time_past_any_date_as_its_number(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          when: float) -> None:
    EventStore(Storage(str(tmp_path))).append("llm", [ElasticEvent(kind="start", time=T0, run="r", id="1"),
                                                      ElasticEvent(kind="finished", time=when, run="r", id="2")])
    code, out, _ = _run(capsys, "events", f"{tmp_path}/llm")
    assert code == 0
    assert f"{when:.6g}" in out.splitlines()[2] and "finished" in out.splitlines()[2]
