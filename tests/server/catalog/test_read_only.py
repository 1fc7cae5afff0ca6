"""Read-only adoption: a root (or some jobs) ckptd may not write into. Its manifests, verified and quarantine
records go to ``<root>/.ckptd/<job>/<step>/``; nothing under ``<root>/<job>/`` changes (the tree's bytes,
names and modes are hashed before and after, over catalog builds, quarantines, deep validation and gc); and
every read — list, latest-good, resume plans, validate, the client's storage fallback — answers as a ckptd in
normal mode over a copy of the same root does. The steps are written by plain Orbax in another process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptd._sidecar import retention_policy
from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._retention import prune
from ckptd.cli._main import main as ckptd_main
from tests.support.helpers import make_settings, wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._files import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    QUARANTINE_FILE,
    TMP_DIR_SUFFIX,
    VERIFIED_FILE,
)
from trainer_client.core.format._records import SIDE_DIR

JOBS = ("llama", "mlp")
EVENTS = {"events": [{"kind": "start", "time": 1.0, "step": 0, "id": "h:1:a:1"},
                     {"kind": "restored", "time": 2.0, "step": 300, "id": "h:1:a:2"}]}
REQUEST = {"alive_devices": 6, "slices": [{"index": 0, "devices": 2}, {"index": 1, "devices": 2},
                                          {"index": 3, "devices": 2}]}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llama``: steps 100, 200, 300 by plain Orbax, a step 350 whose metadata is damaged, a save of 400 still
    in its tmp directory; ``mlp``: steps 10, 20 with ckptd's training metadata."""
    root = tmp_path_factory.mktemp("orbax") / "root"
    write_orbax_jobs({root / "llama": [100, 200, 300], root / "mlp": [10, 20]},
                     custom_metadata={10: training_metadata(10), 20: training_metadata(20)})
    shutil.copytree(root / "llama" / "300", root / "llama" / "350")
    (root / "llama" / "350" / CHECKPOINT_METADATA).write_text("{oops")
    shutil.copytree(root / "llama" / "300", root / "llama" / f"400{TMP_DIR_SUFFIX}-1")
    return root


def _lock(path: Path) -> None:
    """Make every directory and file under ``path`` (``path`` included) read-only."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            os.chmod(Path(dirpath) / name, 0o444)
    for dirpath, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        os.chmod(dirpath, 0o555)


def _unlock(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(Path(dirpath) / name, 0o644)


def tree_hash(path: Path) -> str:
    """Every entry under ``path``: its relative name, type, mode, size, modification time and bytes."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(path)):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            full = Path(dirpath) / name
            info = full.lstat()
            digest.update(f"{full.relative_to(path)}|{stat.S_IFMT(info.st_mode)}|{info.st_mode:o}|"
                          f"{info.st_size}|{info.st_mtime_ns}\n".encode())
            if full.is_file():
                digest.update(full.read_bytes())
    return digest.hexdigest()


@pytest.fixture()
def roots(written: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(a root ckptd may write into, the same root whose job directories are read-only)."""
    normal, read_only = tmp_path / "normal" / "root", tmp_path / "ro" / "root"
    shutil.copytree(written, normal)
    shutil.copytree(written, read_only)
    for job in JOBS:
        _lock(read_only / job)
    yield normal, read_only
    for job in JOBS:
        _unlock(read_only / job)


def _hashes(root: Path) -> dict[str, str]:
    return {job: tree_hash(root / job) for job in JOBS}


def _relative(value: object, root: Path) -> object:
    """An answer with the root's path taken out (the two roots differ only there)."""
    return json.loads(json.dumps(value).replace(str(root), "ROOT"))


def test_a_read_only_root_is_catalogued_and_planned_as_a_writable_one_and_left_untouched(
    roots: tuple[Path, Path], tmp_path: Path
) -> None:
    normal, read_only = roots
    before = _hashes(read_only)
    answers = {}
    for root, ro in ((normal, False), (read_only, True)):
        settings = make_settings(root, tmp_path / f"state-{ro}", read_only=ro, adopt_after_s=0.0)
        catalog = Catalog(Storage(str(root)), tmp_path / f"catalog-{ro}.sqlite3", read_only=settings.storage.read_only)
        catalog.rebuild()
        with TestClient(create_app(settings, catalog, background=False)) as server:
            got = {
                "jobs": server.get(p.ROUTE_JOBS).json(),
                **{f"list {job}": server.get(p.ROUTE_CHECKPOINTS.format(job=job)).json() for job in JOBS},
                **{f"good {job}": server.get(p.ROUTE_LATEST_GOOD.format(job=job)).json() for job in JOBS},
                **{f"plan {job}": server.post(p.ROUTE_RESUME.format(job=job), json=REQUEST).json() for job in JOBS},
                "events posted": server.post(p.ROUTE_EVENTS.format(job="llama"), json=EVENTS).json(),
            }
            listed = server.get(p.ROUTE_EVENTS.format(job="llama")).json()["events"]
            got["events"] = [[e["kind"], e["step"]] for e in listed]
        answers[ro] = _relative(got, root)
    assert answers[True] == answers[False]
    assert answers[True]["events"] == [["start", 0], ["restored", 300]]
    assert len(list((read_only / SIDE_DIR / ".events" / "llama").iterdir())) == 1  # a read-only job's events
    states = {c["step"]: c["state"] for c in answers[True]["list llama"]["checkpoints"]}
    assert states == {100: "verified", 200: "verified", 300: "verified", 350: "corrupt", 400: "writing"}
    assert answers[True]["plan llama"]["step"] == 300 and answers[True]["plan mlp"]["data_position"] == 20 * 64
    assert _hashes(read_only) == before  # not a byte, name, mode or time changed under the jobs
    side = read_only / SIDE_DIR
    for job, steps in (("llama", (100, 200, 300)), ("mlp", (10, 20))):
        for step in steps:  # the records ckptd keeps of each step, on the side
            assert {f.name for f in (side / job / str(step)).iterdir()} == {CKPTD_MANIFEST, VERIFIED_FILE}
            assert (normal / job / str(step) / VERIFIED_FILE).is_file()  # in the step, in normal mode
    # a new start reads the verdicts back from the side records (no re-adoption), and still writes nothing
    again = Catalog(Storage(str(read_only)), tmp_path / "again.sqlite3", read_only=True)
    again.rebuild()
    adopted = "adopted: manifest written by ckptd"
    assert [(c.step, c.state.value, c.reason) for c in again.checkpoints("llama")][:3] == [
        (100, "verified", adopted), (200, "verified", adopted), (300, "verified", adopted)]
    assert _hashes(read_only) == before


def test_quarantine_is_a_record_on_the_side_and_every_reader_honours_it(
    roots: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    normal, read_only = roots
    for root, ro in ((normal, False), (read_only, True)):
        Catalog(Storage(str(root)), ":memory:", read_only=ro).rebuild()  # adopted: manifests with good sums
    # the owner of the checkpoints damages step 300 in both roots (after ckptd adopted it)
    for root in (normal, read_only):
        _unlock(root / "llama" / "300")
        data = sorted((root / "llama" / "300" / "default").rglob("d/*"), key=lambda f: f.stat().st_size)[-1]
        data.write_bytes(data.read_bytes()[:-1])
        if root == read_only:
            _lock(root / "llama" / "300")
    before = _hashes(read_only)
    reports = {}
    for root, ro in ((normal, False), (read_only, True)):
        code = ckptd_main(["validate", f"{root}/llama", "--deep", "--json", *(["--read-only"] if ro else [])])
        reports[ro] = (code, _relative(json.loads(capsys.readouterr().out), root))
    assert reports[True] == reports[False]
    code, report = reports[True]
    assert code == 1 and {r["step"]: r["state"] for r in report["steps"]} == {
        100: "verified", 200: "verified", 300: "quarantined", 350: "quarantined"}
    assert _hashes(read_only) == before
    for step in (300, 350):  # quarantined by a record on the side, the step as it was
        record = json.loads((read_only / SIDE_DIR / "llama" / str(step) / QUARANTINE_FILE).read_text())
        assert record["path"] == str(read_only / "llama" / str(step)) and record["problems"]
        assert not (read_only / "llama" / str(step) / QUARANTINE_FILE).exists()
        assert (normal / "llama" / str(step) / QUARANTINE_FILE).is_file()
    # readers that know nothing of the mode see the side record: the client's fallback, a normal-mode
    # ckptd (which writes nothing for a step it finds quarantined), the CLI without --read-only
    for root in (normal, read_only):
        found = latest_good_on_storage(Storage(str(root)), str(root / "llama"))
        assert found is not None and found.step == 200
        fresh = Catalog(Storage(str(root)), ":memory:")
        fresh.rebuild()
        assert fresh.latest_good("llama").step == 200  # type: ignore[union-attr]
        assert {c.step: c.state.value for c in fresh.checkpoints("llama")}[300] == "quarantined"
    assert _hashes(read_only) == before
    plans = [plan_for_step(Storage(str(root)), str(root / "llama" / "200"), p.ResumeRequest.model_validate(REQUEST),
                           job="llama", step=200).model_dump_json().replace(str(root), "ROOT")
             for root in (normal, read_only)]
    assert plans[0] == plans[1]


def test_retention_deletes_nothing_in_a_read_only_job(
    roots: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, read_only = roots
    before = _hashes(read_only)
    assert ckptd_main(["gc", f"{read_only}/llama", "--keep-last", "1", "--read-only", "--json"]) == 0
    decisions = json.loads(capsys.readouterr().out)
    assert {d["action"] for d in decisions} == {"keep"} and len(decisions) == 5
    assert all(d["reasons"] == ["read-only job: ckptd deletes nothing here"] for d in decisions)
    assert _hashes(read_only) == before
    # the server's retention skips read-only jobs (CKPTD_READ_ONLY_JOBS names them) and prunes the others
    settings = make_settings(read_only, tmp_path / "state", read_only_jobs="llama", keep_last=1)
    _unlock(read_only / "mlp")  # mlp is not read-only here: ckptd may write and delete there
    catalog = Catalog(Storage(str(read_only)), tmp_path / "c.sqlite3",
                      read_only_jobs=settings.storage.read_only_job_names())
    catalog.rebuild()
    deleted = prune(catalog, retention_policy(settings.retention))
    assert [(d.path.rsplit("/", 2)[-2], d.step) for d in deleted] == [("mlp", 10)]
    assert tree_hash(read_only / "llama") == before["llama"]
    assert (read_only / "mlp" / "20" / VERIFIED_FILE).is_file() and not (read_only / SIDE_DIR / "mlp").exists()


def test_read_only_jobs_setting_is_parsed_and_checked(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, tmp_path, read_only_jobs=" llama, mlp ,")
    assert settings.storage.read_only_job_names() == frozenset({"llama", "mlp"}) and not settings.storage.read_only
    with pytest.raises(ValueError, match="invalid job names"):
        make_settings(tmp_path, tmp_path, read_only_jobs="ok,../etc")


def test_a_real_server_in_read_only_mode_and_the_client_s_fallback_give_one_plan(
    roots: tuple[Path, Path], ckptd_server: Any
) -> None:
    """``CKPTD_READ_ONLY`` in a real uvicorn server (its refresher and retention running, a keep-last rule
    set): the trainer's client gets the plan from it, then the same plan from storage once it is gone; the
    read-only jobs never change."""
    _, read_only = roots
    before = _hashes(read_only)
    server = ckptd_server(read_only, read_only=True, keep_last=1, gc_interval_s=0.2)
    request = p.ResumeRequest.model_validate(REQUEST)
    settings = ClientSettings(url=server.url, resume_deadline_s=1.0, timeout_s=0.5)
    with CkptdClient(settings, root=str(read_only)) as client:
        served = client.resume("llama", request)
        # Five more refresh passes over the read-only root, each followed by a retention pass (both every 0.2 s):
        # counted however long a loaded machine takes (a 1 s sleep could have seen none).
        catalog = server.server.config.app.state.catalog
        seen = {catalog.last_refresh}

        def passes() -> bool:
            seen.add(catalog.last_refresh)
            return len(seen) > 5

        wait_until(passes, timeout=60, interval=0.01, what="five more refresh and retention passes")
        server.stop()
        fallback = client.resume("llama", request)
    assert served.source == "ckptd" and fallback.source == "storage_scan" and served.step == 300
    assert served.model_copy(update={"source": "storage_scan"}) == fallback
    assert _hashes(read_only) == before
