"""A real ``ckptd serve`` over a root where a local attacker planted claims and part records of multi-host saves
(docs/multihost.md, section 5) and, for a ``--read-only`` sidecar, a memory snapshot to persist: the sidecar
keeps answering a healthy job and the probes, writes nothing outside the root (a sentinel directory beside
it stays empty) and, read-only, not a byte, name, mode or time under any job; the forged records are
reported and left where they are; SIGTERM ends it well within Kubernetes' default grace of 30 s.

Each forged record is one the sidecar once acted on: a part record whose item climbs out of the root (the
commit wrote ``_METADATA`` and ``commit_success.txt`` there), a claim of 2e7 processes (a core busy for ~25
min a pass, every job's commits held up, SIGTERM past 30 s), a claim made at ``1e300`` (never abandoned); a
read-only sidecar persisted a snapshot into ``<root>/<job>/`` and committed forged parts there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.forged_records import forge_claim, forge_part, tree_state, write_snapshot
from tests.support.orbax_steps import write_orbax_jobs
from tests.support.server import serve_process
from trainer_client.core.format._files import JOB_LOCK

GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
STOPPED_WITHIN_S = 10.0  # what the sidecar is held to: a third of it

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # an empty file's


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("forged-golden") / "root"
    write_orbax_jobs({root / "healthy": [1, 2]})
    return root


def _plant(root: Path, sentinel: Path) -> None:
    """Job ``forged``: a save whose parts aim at ``sentinel`` (an existing directory beside the root); job
    ``greedy``: a claim of 2e7 processes, one made at 1e300, one of the most processes allowed with no part;
    job ``odd``: a claim whose name is no number."""
    where = root / "forged" / ".ckptd" / "staging" / "9.ab-9"
    forge_claim(root, "forged", 9)
    for k in (0, 1):
        forge_part(root, "forged", 9, k, item=os.path.relpath(sentinel, where),  # ../../../../../sentinel
                   files=[{"path": f"{os.path.relpath(sentinel, where)}/f{k}", "size": 1, "crc32c": "AAAAAA=="}])
    forge_claim(root, "greedy", 10, process_count=20_000_000)
    forge_claim(root, "greedy", 11, created_at=1e300)
    forge_claim(root, "greedy", 12, process_count=65536)
    forge_claim(root, "odd", 1)
    (root / "odd" / ".ckptd" / "claims" / "\u00b2.json").write_text("{}")  # str.isdigit() takes it for a number


FORGED_JOBS = ("forged", "greedy", "odd")


def _serve(root: Path, tmp: Path, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = tmp / "ckptd.log"
    proc, url = serve_process(root, log, "--state-dir", str(tmp / "state"), *args, CKPTD_REFRESH_INTERVAL_S="0.2",
                              CKPTD_GC_INTERVAL_S="0.5", CKPTD_SAVE_TIMEOUT_S="1", CKPTD_ADOPT_AFTER_S="0",
                              CKPTD_LOG_LEVEL="info", **env)
    return proc, url, log


def _keeps_answering(url: str, seconds: float) -> None:
    """For ``seconds``: the probes and the healthy job's latest-good answer, each within 2 s."""
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
            good = client.get("/v1/jobs/healthy/checkpoints/latest-good")
            assert good.status_code == 200 and good.json()["step"] == 2, good.text
            time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], log: Path) -> float:
    """SIGTERM, and the seconds until the process is gone (SIGKILL past the grace, failing the test)."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"ckptd still running {GRACE_S:.0f}s after SIGTERM:\n{log.read_text()[-3000:]}")
    took = time.monotonic() - started
    print(f"stopped {took:.2f}s after SIGTERM")
    return took


def test_forged_claims_and_parts_write_nothing_outside_the_root_and_stall_nothing(
        golden: Path, tmp_path: Path) -> None:
    root, sentinel = tmp_path / "root", tmp_path / "sentinel"
    shutil.copytree(golden, root)
    sentinel.mkdir()
    _plant(root, sentinel)
    planted = {job: tree_state(root / job) for job in FORGED_JOBS}
    proc, url, log = _serve(root, tmp_path)
    try:
        _keeps_answering(url, 4.0)  # ~20 commit passes, ~8 retention passes
    finally:
        took = _stop(proc, log)
    text = log.read_text()
    assert list(sentinel.iterdir()) == [], text[-3000:]
    assert "committed step" not in text
    # the forged records are reported and skipped: never acted on, never deleted ...
    after = {job: tree_state(root / job) for job in FORGED_JOBS}
    assert after["forged"] == planted["forged"]  # an abandoned save whose parts are forged: kept for inspection
    records = {k: v for k, v in planted["greedy"].items() if v[3] and k != ".ckptd/claims/12.json"}  # files
    # the job's lock (an empty file the commit and cleanup flock: docs/multihost.md, section 5) is all that is added
    assert after["greedy"].get(JOB_LOCK, (0, 0, 0, EMPTY_SHA256))[3] == EMPTY_SHA256
    assert {k: v for k, v in after["greedy"].items() if v[3] and k != JOB_LOCK} == records
    for record in ("forged/.ckptd/staging/9.ab-9/ckptd_parts/process_0.json", "greedy/.ckptd/claims/10.json",
                   "greedy/.ckptd/claims/11.json"):
        assert f"ignoring {root}/{record}, forged or damaged" in text, record
    assert f"ignoring {root}/forged/.ckptd/staging/9.ab-9, forged or damaged: an abandoned save" in text
    # ... while well-formed claims within the bounds are what they say: abandoned saves, cleaned by retention
    assert "deleted abandoned save ab-12 of step 12 of greedy (parts missing: 0-65535)" in text
    assert not (root / "greedy" / ".ckptd" / "claims" / "12.json").exists()
    assert [p.name for p in (root / "odd" / ".ckptd" / "claims").iterdir()] == ["\u00b2.json"]
    assert took < STOPPED_WITHIN_S, f"SIGTERM took {took:.1f}s"


def test_a_read_only_sidecar_changes_no_byte_under_any_job(golden: Path, tmp_path: Path) -> None:
    root, shm = tmp_path / "root", tmp_path / "shm"
    shutil.copytree(golden, root)
    snapshot = write_snapshot(shm, "healthy", 1000)
    forge_claim(root, "forged", 9)
    for k in (0, 1):  # well-formed: in normal mode the leader would commit them as <root>/forged/9
        forge_part(root, "forged", 9, k)
    (root / "healthy" / "3.orbax-checkpoint-tmp-1").mkdir()  # an abandoned save: retention's, in normal mode
    os.utime(root / "healthy" / "3.orbax-checkpoint-tmp-1", (1.0, 1.0))
    before = {job: tree_state(root / job) for job in ("healthy", "forged")}
    proc, url, log = _serve(root, tmp_path, "--read-only", "--shm-dir", str(shm), CKPTD_KEEP_LAST="1")
    try:
        _keeps_answering(url, 4.0)
    finally:
        took = _stop(proc, log)
    text = log.read_text()
    assert {job: tree_state(root / job) for job in ("healthy", "forged")} == before, text[-3000:]
    assert not (root / "healthy" / "1000").exists() and not (root / "forged" / "9").exists()
    assert snapshot.is_dir() and not (snapshot / "persisted.json").exists()  # kept in memory, not persisted
    assert f"not persisting snapshot {snapshot}: {root}/healthy/1000: job 'healthy' is watched read-only" in text
    assert (root / ".ckptd" / "healthy" / "2" / "ckptd_verified.json").is_file()  # its records: on the side
    assert took < STOPPED_WITHIN_S, f"SIGTERM took {took:.1f}s"
