"""A save of ``trainer_client.CheckpointManager`` never destroys a step that holds evidence: a quarantined step,
or an uncommitted one, whose number a new save takes is moved aside first (kept under a name Orbax never takes
for a step, with its quarantine record, said in a log line, listed by ``ckptd ls``/``ckptd show``); an
uncommitted step younger than the save timeout may still be written by another writer and is refused, not moved
(docs/adopt.md, "A save over a bad step"). On a local disk and on gs:// (the GCS emulator)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from ckptd.cli._main import main as ckptd_main
from tests.support.gcs_emulator import GcsEmulator
from tests.support.helpers import wait_until
from tests.support.server import StartServer
from trainer_client import CheckpointManager, CkptdClient, ClientSettings
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import COMMIT_MARKER, QUARANTINE_FILE
from trainer_client.core.format._manifest import quarantine_record

ASIDE = ".ckptd-aside-"


@pytest.fixture(autouse=True)
def _no_ckptd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_URL", raising=False)


def _save(mgr: CheckpointManager, steps: tuple[int, ...]) -> None:
    for step in steps:
        assert mgr.save(step, args=ocp.args.StandardSave({"w": np.full(4, float(step))}))
    mgr.wait_until_finished()


def _restored(mgr: CheckpointManager, step: int) -> float:
    return float(mgr.restore(step, args=ocp.args.StandardRestore())["w"][0])


def _truncate_data(step_dir: Path) -> None:
    data = max((p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: p.stat().st_size)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)


def _cut_short(job: Path, source: int, name: str, *, age_s: float) -> Path:
    """``job/name``: a copy of step ``source`` without its commit marker (a save cut short), last written
    ``age_s`` seconds ago."""
    target = job / name
    shutil.copytree(job / str(source), target)
    (target / COMMIT_MARKER).unlink()
    when = time.time() - age_s
    for path in [target, *target.rglob("*")]:
        os.utime(path, (when, when))
    return target


def _asides(job: Path) -> list[str]:
    return sorted(p.name for p in job.iterdir() if ASIDE in p.name)


def test_a_quarantined_and_an_abandoned_step_are_moved_aside_before_a_save_takes_their_numbers(
    tmp_path: Path, ckptd_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    job = root / "checkpoints"
    with CheckpointManager(job) as mgr:
        _save(mgr, (10, 20, 30))
    _truncate_data(job / "30")  # ckptd quarantines it
    _cut_short(job, 20, "40.orbax-checkpoint-tmp", age_s=7200)  # a crash's leftover, older than the save timeout
    server = ckptd_server(root)

    def states() -> dict[int, str] | None:
        with server.client() as http:  # TCP or, where there is none, a unix socket
            listed = http.get("/v1/jobs/checkpoints/checkpoints").json().get("checkpoints", [])
        found = {c["step"]: c["state"] for c in listed}
        return found if found.get(30) == "quarantined" else None

    assert wait_until(states, timeout=60, what="step 30 quarantined")[40] == "abandoned"
    assert (job / "30" / QUARANTINE_FILE).is_file()
    client = CkptdClient(ClientSettings(url=server.url), root=str(root))
    with (caplog.at_level(logging.WARNING, logger="trainer_client.runtime.saving._step_aside"),
          CheckpointManager(str(job), ckptd=client) as mgr):
        assert list(mgr.all_steps()) == [10, 20]
        _save(mgr, (30, 40))  # the resumed loop saves 30 and 40 again
        assert list(mgr.all_steps()) == [10, 20, 30, 40] and mgr.latest_step() == 40  # right after the saves
        assert _restored(mgr, 30) == 30.0 and _restored(mgr, 40) == 40.0
    asides = _asides(job)
    assert [name.split(".")[0] for name in asides] == ["30", "40"]
    assert (job / asides[0] / QUARANTINE_FILE).is_file()  # the evidence, with its record
    assert not (job / asides[1] / COMMIT_MARKER).exists()
    said = [r.getMessage() for r in caplog.records]
    assert any("step 30" in m and "quarantined" in m and asides[0] in m for m in said), said
    assert any("step 40" in m and "uncommitted" in m and asides[1] in m for m in said), said
    # plain Orbax never takes a moved-aside step for a step, nor cleans it up as a temporary one
    with ocp.CheckpointManager(job, options=ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)) as plain:
        assert list(plain.all_steps()) == [10, 20, 30, 40]
    assert _asides(job) == asides
    # ckptd lists them as moved aside
    ls_err, ls_json, show_out = io.StringIO(), io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(ls_err):
        assert ckptd_main(["ls", str(root)]) == 0
    with contextlib.redirect_stdout(ls_json):
        assert ckptd_main(["ls", "--json", str(root)]) == 0
    with contextlib.redirect_stdout(show_out):
        assert ckptd_main(["show", str(job)]) == 0
    shown = show_out.getvalue()
    assert "checkpoints: 2 step(s) moved aside" in ls_err.getvalue(), ls_err.getvalue()
    assert [j["moved_aside"] for j in json.loads(ls_json.getvalue())] == [2]
    assert f"moved aside: {asides[0]}" in shown and "quarantined" in shown, shown
    assert f"moved aside: {asides[1]}" in shown and "uncommitted" in shown, shown


def test_ckptds_verdict_on_the_step_moved_aside_does_not_count_for_the_new_one(tmp_path: Path) -> None:
    """ckptd still says 30 is quarantined (it has not looked again since): the step saved anew is named good,
    judged from storage, right after the save."""
    job = tmp_path / "run" / "checkpoints"
    with CheckpointManager(job) as mgr:
        _save(mgr, (10, 30))
    (job / "30" / QUARANTINE_FILE).write_text(quarantine_record(str(job / "30"), "test", ["bad"]))

    def ckptd(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/latest-good"):
            return httpx.Response(200, json={"step": 10, "state": "verified", "path": str(job / "10")})
        return httpx.Response(200, json={"job": "checkpoints", "checkpoints": [
            {"step": 10, "state": "verified", "path": str(job / "10")},
            {"step": 30, "state": "quarantined", "path": str(job / "30")}]})

    client = CkptdClient(ClientSettings(url="http://ckptd"), transport=httpx.MockTransport(ckptd))
    with CheckpointManager(str(job), ckptd=client) as mgr:
        assert list(mgr.all_steps()) == [10]
        _save(mgr, (30,))
        assert list(mgr.all_steps()) == [10, 30] and mgr.latest_step() == 30


def test_an_uncommitted_step_younger_than_the_save_timeout_is_refused_not_moved(tmp_path: Path) -> None:
    """Another writer may still be saving it: the save raises, naming the step and the way out; nothing moves.
    Told a save timeout of 0 (no other writer), the same save moves it aside."""
    job = tmp_path / "run" / "checkpoints"
    with CheckpointManager(job) as mgr:
        _save(mgr, (10,))
    _cut_short(job, 10, "20.orbax-checkpoint-tmp", age_s=0)
    with CheckpointManager(job) as mgr:
        with pytest.raises(StepAlreadyExistsError, match=r"step 20: .*may still be writing it.*save_timeout_s"):
            mgr.save(20, args=ocp.args.StandardSave({"w": np.full(4, 20.0)}))
        assert list(mgr.all_steps()) == [10]
    assert (job / "20.orbax-checkpoint-tmp").is_dir() and _asides(job) == []
    with CheckpointManager(job, save_timeout_s=0) as mgr:
        _save(mgr, (20,))
        assert list(mgr.all_steps()) == [10, 20]
    assert [name.split(".")[0] for name in _asides(job)] == ["20"]


@pytest.mark.integration
def test_on_gcs_a_quarantined_step_is_copied_aside_then_deleted(gcs_emulator: GcsEmulator) -> None:
    """gs:// has no rename: the step is copied under the moved-aside name, every object checked, then deleted
    (its commit marker first), before Orbax writes the step again in place."""
    job = gcs_emulator.gs("aside", "run", "checkpoints")
    with CheckpointManager(job) as mgr:
        _save(mgr, (10, 20))
    storage = Storage(job)
    step_20 = storage.join("20")
    storage.fs.pipe(f"{step_20}/{QUARANTINE_FILE}", quarantine_record(job + "/20", "test", ["bad"]).encode())
    storage.invalidate()
    with CheckpointManager(job) as mgr:
        assert list(mgr.all_steps()) == [10]
        _save(mgr, (20,))
        assert list(mgr.all_steps()) == [10, 20] and _restored(mgr, 20) == 20.0
    storage.invalidate()
    asides = [e.name for e in storage.list_dir(storage.join()) if ASIDE in e.name]
    assert len(asides) == 1 and asides[0].startswith("20.")
    aside = storage.join(asides[0])
    assert storage.exists(f"{aside}/{QUARANTINE_FILE}") and storage.exists(f"{aside}/{COMMIT_MARKER}")
    assert not storage.exists(f"{step_20}/{QUARANTINE_FILE}")
