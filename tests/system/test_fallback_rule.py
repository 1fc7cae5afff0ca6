"""What the client's storage-scan fallback accepts (docs/protocol.md, "What the fallback accepts"), pinned in one
place against ckptd's own answer over the same steps: a committed step that is not quarantined and passes quick
validation against its manifest, or — a step plain Orbax wrote, which ckptd adopts — has no manifest at all
and is structurally sound. An unfinished save, a quarantined step and a step whose files no longer match its
manifest are never taken. With ckptd down, the client's resume plans from that step (``source:
storage_scan``); ckptd, up, names the same step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.helpers import free_port
from tests.support.orbax_steps import write_orbax_steps
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._files import CKPTD_MANIFEST, COMMIT_MARKER, QUARANTINE_FILE, VERIFIED_FILE


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fallback") / "root"
    write_orbax_steps(root / "job", [1, 2, 3, 4, 5])
    Catalog(Storage(str(root)), ":memory:").rebuild()  # ckptd adopts them all: a manifest and a verified record each
    return root


def _steps(root: Path, *, unfinished: int | None = 5, quarantined: int | None = 4, damaged: int | None = 3,
           unadopted: int | None = 2) -> Path:
    job = root / "job"
    assert all((job / str(s) / CKPTD_MANIFEST).is_file() for s in range(1, 6))
    if unfinished:  # a finalized name without the marker: Orbax's own local reader would take it
        (job / str(unfinished) / COMMIT_MARKER).unlink()
    if quarantined:
        (job / str(quarantined) / QUARANTINE_FILE).write_text(json.dumps({"reason": "found bad by a ckptd"}))
    if damaged:  # one data file cut short after its manifest was written
        victim = max((job / str(damaged) / "default").rglob("d/*"), key=lambda f: f.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:-1])
    if unadopted:  # what plain Orbax leaves: committed, no manifest, no verdict
        (job / str(unadopted) / CKPTD_MANIFEST).unlink()
        (job / str(unadopted) / VERIFIED_FILE).unlink(missing_ok=True)
    return job


@pytest.fixture
def root(written: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "root"
    shutil.copytree(written, copy)
    return copy


def test_the_fallback_takes_the_newest_committed_sound_step_and_ckptd_names_the_same(root: Path) -> None:
    _steps(root)
    storage = Storage(str(root))
    found = latest_good_on_storage(storage, storage.join("job"))
    assert found is not None and found.step == 2  # 5 unfinished, 4 quarantined, 3 damaged; 2 has no manifest
    catalog = Catalog(storage, ":memory:")
    catalog.rebuild()
    served = catalog.confirmed_latest_good("job")
    assert served is not None and served.step == 2  # ckptd adopts the plain Orbax step and serves it


def test_a_step_with_a_manifest_that_no_longer_matches_is_not_taken_even_when_nothing_else_is(root: Path) -> None:
    _steps(root, unfinished=None, quarantined=None, damaged=5, unadopted=None)
    storage = Storage(str(root))
    found = latest_good_on_storage(storage, storage.join("job"))
    assert found is not None and found.step == 4
    assert latest_good_on_storage(storage, storage.join("job"), at_most=3).step == 3  # type: ignore[union-attr]


def test_with_ckptd_down_the_client_resumes_from_the_step_the_rule_accepts(root: Path) -> None:
    _steps(root)
    settings = ClientSettings(url=f"http://127.0.0.1:{free_port()}", timeout_s=0.2, resume_deadline_s=0.5,
                              report_events=False)
    with CkptdClient(settings, root=str(root)) as client:
        plan = client.resume("job", p.ResumeRequest(policy="pause", alive_devices=8, use_memory_tier=False))
    assert (plan.step, plan.source, plan.tier) == (2, "storage_scan", "storage")
    assert plan.path == str(root / "job" / "2")
