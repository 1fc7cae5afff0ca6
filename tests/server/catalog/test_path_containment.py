"""Nothing is read or written through a link that leads out of a local checkpoint root.

``root/evil -> outside/jobcopy`` once made ckptd adopt the copied steps (manifests and verified records
written outside) and store events there. Links are made for real here (``os.symlink``); the tree outside
the root is compared, file by file, before and after everything ckptd does with the root.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._job_admission import LINK_OUT_REASON
from ckptd.memory_tier._snapshots import SnapshotKeeper
from tests.support.golden import copy_root, golden_fixture
from tests.support.helpers import make_settings
from tests.support.orbax_steps import write_orbax_jobs
from trainer_client.core import protocol as p
from trainer_client.core._errors import UnsafePathError
from trainer_client.core._storage import Storage
from trainer_client.core._whole_files import write_json_file
from trainer_client.core.format._files import EVENTS_DIR

TOKEN = "s3cret"
_EVENT = {"events": [{"kind": "start", "time": 1.0}]}


# Plain Orbax steps (no ckptd file yet: ckptd adopts them, writing manifests): alpha 1, 2, 3; beta 5.
golden = golden_fixture(lambda root: write_orbax_jobs({root / "alpha": [1, 2, 3], root / "beta": [5]}), name="golden")


@pytest.fixture
def layout(golden: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``root`` (a copy of the golden root) and ``outside`` (next to it), holding the links' targets."""
    root, outside = copy_root(golden, tmp_path), tmp_path / "outside"
    outside.mkdir()
    shutil.copytree(golden / "alpha", outside / "jobcopy")
    shutil.copytree(golden / "alpha" / "3", outside / "stepcopy")
    (outside / "ckptd" / "events").mkdir(parents=True)
    (outside / "ckptd" / "events" / "00000000000000001-1-000001-abcd.json").write_text(json.dumps(
        {"format": "ckptd-events/1", "job": "x", "events": [{"kind": "planted", "time": 1.0, "received_at": 1.0}]}))
    return root, outside


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory below ``path``: (size, mtime in ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), path)] = (st.st_size, st.st_mtime_ns)
    return out


def _app(root: Path, tmp_path: Path, **overrides: Any) -> Any:
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    return create_app(make_settings(root, tmp_path / "state", **overrides), catalog, background=False)


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_job_directory_linked_out_of_the_root_is_refused_and_nothing_goes_through_it(
    layout: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, token: str | None
) -> None:
    root, outside = layout
    os.symlink(outside / "jobcopy", root / "evil")
    before = tree(outside)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    with caplog.at_level(logging.WARNING), TestClient(_app(root, tmp_path, token=token)) as client:
        app: Any = client.app
        assert [j["name"] for j in client.get("/v1/jobs", headers=auth).json()["jobs"]] == ["alpha", "beta"]
        assert app.state.catalog.refused == {"evil": LINK_OUT_REASON}
        for method, route, body in [
            ("GET", "/v1/jobs/evil/checkpoints", None), ("GET", "/v1/jobs/evil/checkpoints/latest-good", None),
            ("POST", "/v1/jobs/evil/resume", {"alive_devices": 8}), ("GET", "/v1/jobs/evil/events", None),
            ("GET", "/v1/jobs/evil/goodput", None), ("POST", "/v1/jobs/evil/events", _EVENT),
        ]:
            resp = client.request(method, route, json=body, headers=auth)
            assert resp.status_code == 404, (route, resp.text)
            error = p.ErrorBody.model_validate(resp.json())
            assert error.code is p.ErrorCode.JOB_NOT_FOUND and "link" in error.message
            assert str(outside) not in resp.text  # where the link leads stays in the server's log
        app.state.catalog.refresh()
        app.state.tracker.poll(goodput=True)
        assert client.get("/metrics").status_code == 200
    assert tree(outside) == before  # no manifest, verified record or event file written there
    assert not (outside / "jobcopy" / EVENTS_DIR).exists()
    assert any("evil" in r.getMessage() and "outside" in r.getMessage() for r in caplog.records)


def test_step_directories_linked_out_of_their_job_are_ignored(layout: tuple[Path, Path], tmp_path: Path) -> None:
    root, outside = layout
    os.symlink(outside / "stepcopy", root / "alpha" / "300")  # out of the root
    os.symlink(root / "beta" / "5", root / "alpha" / "301")  # inside the root, out of the job
    before = tree(outside)
    with TestClient(_app(root, tmp_path)) as client:
        steps = [c["step"] for c in client.get("/v1/jobs/alpha/checkpoints").json()["checkpoints"]]
        assert steps == [1, 2, 3]
        assert client.get("/v1/jobs/alpha/checkpoints/latest-good").json()["step"] == 3
        storage: Storage = client.app.state.catalog.storage  # type: ignore[attr-defined]
        assert set(storage.links_refused(str(root / "alpha"))) == {"300", "301"}
    assert tree(outside) == before


def test_an_events_directory_linked_out_of_the_root_is_neither_written_nor_read(
    layout: tuple[Path, Path], tmp_path: Path
) -> None:
    root, outside = layout
    os.symlink(outside / "ckptd", root / "alpha" / ".ckptd")
    before = tree(outside)
    with TestClient(_app(root, tmp_path)) as client:
        resp = client.post("/v1/jobs/alpha/events", json=_EVENT)
        assert resp.status_code == 404 and "link" in resp.json()["message"], resp.text
        assert client.get("/v1/jobs/alpha/events").json()["events"] == []  # the planted file is not served
    assert tree(outside) == before


def test_storage_reads_and_writes_stop_at_links_out_of_the_root(layout: tuple[Path, Path]) -> None:
    root, outside = layout
    (outside / "secret.json").write_text('{"secret": true}')
    os.symlink(outside / "secret.json", root / "alpha" / "leak.json")
    os.symlink(root / "beta", root / "alias")  # a link inside the root: fine
    storage = Storage(str(root))
    with pytest.raises(FileNotFoundError):
        storage.read_json(str(root / "alpha" / "leak.json"))
    assert "leak.json" not in {e.name for e in storage.list_dir(str(root / "alpha"))}
    with pytest.raises(UnsafePathError):
        write_json_file(storage, str(root / "alpha" / "leak.json"), "{}")
    os.symlink(outside / "jobcopy", root / "evil")
    with pytest.raises(UnsafePathError):
        write_json_file(storage, str(root / "evil" / "new.json"), "{}")
    assert not (outside / "jobcopy" / "new.json").exists()
    assert (outside / "secret.json").read_text() == '{"secret": true}'
    assert storage.inside(str(root / "alias" / "5")) and not storage.inside(str(root / "evil"))
    write_json_file(storage, str(root / "alias" / "note.json"), "{}")  # through a link that stays inside
    assert (root / "beta" / "note.json").exists()


def test_a_memory_snapshot_is_not_persisted_through_a_linked_job(layout: tuple[Path, Path], tmp_path: Path) -> None:
    root, outside = layout
    os.symlink(outside / "jobcopy", root / "evil")
    keeper = SnapshotKeeper(Storage(str(root)), str(tmp_path / "shm"))
    assert keeper.persist("evil", tmp_path / "shm" / "evil" / "40") is None  # refused before any worker starts
    assert keeper.stats.failed == 1 and "link" in (keeper.stats.last_error or "")
    assert not (outside / "jobcopy" / "40").exists()
