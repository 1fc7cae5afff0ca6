"""``python -m examples.demo --hosts 2`` as a user runs it (a subprocess): two trainer processes of one
jax.distributed job, each with its own ``ckptd serve`` and shared memory, one SIGKILLed mid-run, both restarted.
The report must show one agreed step, new PIDs, where each host restored from, a falling loss, the last step
committed and every step on storage deep-validated. The peer variant (``--lose-host-memory 1``: host 1's
part brought back from host 0's sidecar, host 0 from its memory, no storage read) is in ``make test`` (a short
run); the memory-only variant (``make test-all``), the storage variants (a host and its peer both wiped; a
wiped host without peer copies) and the bitwise comparison with a run without a kill are chaos-marked
(``make chaos``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import REPO, clean_env

SHORT = ["--steps", "40", "--checkpoint-period", "15", "--memory-period", "5", "--kill-after", "25",
         "--step-time-s", "0.02", "--heartbeat-s", "5"]


def _demo(out: Path, *extra: str, timeout_s: float = 540) -> dict[str, Any]:
    """Run the demo in a session of its own: on a timeout its sidecars and trainers go with it (SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-m", "examples.demo", "--hosts", "2", "--out", str(out), *extra],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
        proc.wait()
    assert proc.returncode == 0, stdout[-4000:] + stderr[-3000:]
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("report: "), last
    report: dict[str, Any] = json.loads(Path(last.removeprefix("report: ")).read_text())
    report["stdout"] = stdout
    return report


def _check(report: dict[str, Any], steps: int, tier: str | list[str]) -> None:
    assert report["job"] and Path(report["root"]).is_dir()
    assert report["final_step"] == steps
    assert report["final_loss"] < report["initial_loss"]
    hosts = report["hosts"]
    assert [h["process_index"] for h in hosts] == [0, 1]
    assert all(h["pid_after"] != h["pid_before"] for h in hosts), "restarted processes, as JobSet restarts them"
    assert {h["resume_step"] for h in hosts} == {report["agreed_step"]}, "one step for every host"
    for h, expected in zip(hosts, [tier] * len(hosts) if isinstance(tier, str) else tier, strict=True):
        assert h["restored_from"].startswith(f"{expected}: "), h
    assert report["last_step_committed"] == steps
    validated = report["validate_deep"]
    assert validated["exit_code"] == 0 and validated["steps"] and all(s["ok"] for s in validated["steps"])
    assert steps in [s["step"] for s in validated["steps"]]


# a long form: the short suite's peer run below has host 0 resume from its memory through the same agreement
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_hosts_resume_one_step_from_memory(tmp_path: Path) -> None:
    report = _check_run(tmp_path, "memory")
    # the memory save the trainers waited past for the kill (25)
    assert report["agreed_step"] == 25
    assert all(f"/{h['resume_step']}" in h["restored_from"] for h in report["hosts"])
    # the timeline names who made each host's plan: the processes, from memory (not a storage scan)
    planned = [line for line in report["stdout"].splitlines() if " plan_received " in line]
    assert len(planned) == 2 and all("from memory_agreement" in line for line in planned), planned


def _check_run(tmp_path: Path, tier: str | list[str], *extra: str) -> dict[str, Any]:
    report = _demo(tmp_path / "out", *SHORT, *extra)
    _check(report, 40, tier)
    return report


@pytest.mark.timeout(600)
def test_a_host_that_lost_its_memory_gets_its_part_from_its_peer(tmp_path: Path) -> None:
    report = _check_run(tmp_path, ["memory", "peer"], "--lose-host-memory", "1")
    assert report["agreed_step"] == 25, "the memory save the trainers waited past for the kill, not storage's 15"
    assert report["lost_host_memory"] == 1
    assert report["hosts"][1]["restored_from"].startswith("peer: host 0 ")
    lines = report["stdout"].splitlines()
    assert any("peer copy held" in line and "host 1's part" in line for line in lines)
    assert any("restored" in line and "from peer: host 0" in line for line in lines)
    planned = [line for line in lines if " plan_received " in line]
    assert len(planned) == 2 and all("from memory_agreement" in line for line in planned), planned


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_wiped_host_s_trainer_asks_its_sidecar_for_its_part_from_the_peer(tmp_path: Path) -> None:
    report = _check_run(tmp_path, ["memory", "peer"], "--lose-host-memory", "1", "--trainer-asks")
    assert report["agreed_step"] == 25
    assert report["hosts"][1]["restored_from"].startswith("peer: host 0 ")
    log = (Path(report["root"]).parent / "ckptd-1.log").read_text(errors="replace")
    assert "this host's part brought back from host 0" in log  # asked by the trainer: the refill is off


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("extra", "lost"), [(["0,1"], [0, 1]), (["1", "--no-peers"], 1)],
                         ids=["a host and its peer both wiped", "no peer copies"])
def test_a_wiped_host_whose_part_is_nowhere_sends_both_hosts_to_storage(tmp_path: Path, extra: list[str],
                                                                        lost: object) -> None:
    report = _check_run(tmp_path, "storage", "--lose-host-memory", *extra)
    assert report["agreed_step"] == 15, "the newest step on storage before the kill"
    assert report["lost_host_memory"] == lost


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_damaged_peer_copy_is_found_and_both_hosts_resume_from_storage(tmp_path: Path) -> None:
    report = _check_run(tmp_path, "storage", "--lose-host-memory", "1", "--corrupt-peer-copy")
    assert report["agreed_step"] == 15, "the newest step on storage before the kill"
    lines = report["stdout"].splitlines()
    assert any("peer copy damaged" in line for line in lines)
    assert not any("from peer" in line for line in lines), "the damaged copy is never restored"


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_with_a_kill_ends_bitwise_equal_to_one_without(tmp_path: Path) -> None:
    """Deterministic data (each sample from its index) and an exact restore: the final state of every host's
    shards (sha256 over their bytes) and the final loss are those of the same run without a failure."""
    killed = _demo(tmp_path / "killed", *SHORT)
    _check(killed, 40, "memory")
    clean = _demo(tmp_path / "clean", *SHORT, "--no-kill")
    assert clean["killed_host"] is None
    assert [h["state_sha256"] for h in killed["hosts"]] == [h["state_sha256"] for h in clean["hosts"]]
    assert all(h["state_sha256"] for h in clean["hosts"])
    assert killed["final_loss"] == clean["final_loss"]
