"""A step's verdict belongs to the content it was given to (docs/operations.md, "A step saved again under its
number"): a step deleted and written again under the same number, or whose directory is swapped for another, has
its verdict derived again before it is named. A good step written over a verified one is named with its own
training metadata (not quarantined against the old one's manifest), a bad one is never named, and a quarantined
step saved again correctly is offered once verified. Real catalog, real Orbax steps.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.golden import copy_root
from tests.support.helpers import wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.server import StartServer
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core._validation import read_quarantine
from trainer_client.core.format._files import CHECKPOINT_METADATA, CKPTD_MANIFEST, QUARANTINE_FILE, VERIFIED_FILE
from trainer_client.core.format._manifest import read_manifest
from trainer_client.core.protocol import StepState

STEPS = [10, 20, 30]
NEW_BATCH = 32  # the second save of step 30 records another global batch: data position 30 * 32, not 30 * 64
OLD_POSITION, NEW_POSITION = 30 * 64, 30 * NEW_BATCH


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``root``: job ``train`` with steps 10, 20, 30, verified once (records written); ``donor``: another save of
    step 30 (other training metadata), with the manifest its writer wrote and no verdict (a fresh save)."""
    root, donor = tmp_path_factory.mktemp("resaved-golden"), tmp_path_factory.mktemp("resaved-donor")
    write_orbax_jobs({root / "train": STEPS}, custom_metadata={s: training_metadata(s) for s in STEPS})
    write_orbax_jobs({donor / "train": [30]}, custom_metadata={30: training_metadata(30, global_batch=NEW_BATCH)})
    for where in (root, donor):
        first = Catalog(Storage(str(where)), ":memory:")
        first.rebuild()
        assert {c.state for c in first.checkpoints("train")} == {StepState.VERIFIED}
        first.close()
    (donor / "train" / "30" / VERIFIED_FILE).unlink()
    return root, donor / "train" / "30"


@pytest.fixture
def root(golden: tuple[Path, Path], tmp_path: Path) -> Path:
    path = copy_root(golden[0], tmp_path)
    os.utime(path / "train", (1_700_000_000, 1_700_000_000))  # listed long ago: a quick pass may trust it
    return path


@pytest.fixture
def donor(golden: tuple[Path, Path]) -> Path:
    return golden[1]


def _fresh_copy(source: Path, staging: Path, damage: str | None = None, *, plain: bool = False) -> Path:
    """A new save of ``source``'s content at ``staging`` (written now: new modification times), without any
    verdict of ckptd's (``plain``: no manifest either, as plain Orbax saves); ``damage``: ``truncate`` (a data file
    its manifest lists cut to half) or ``metadata`` (the data position in ``_CHECKPOINT_METADATA`` changed, same
    size: only the manifest's check tells)."""
    shutil.copytree(source, staging, copy_function=shutil.copy)
    for record in (VERIFIED_FILE, QUARANTINE_FILE, *((CKPTD_MANIFEST,) if plain else ())):
        (staging / record).unlink(missing_ok=True)
    if damage == "truncate":
        manifest = read_manifest(Storage(str(staging.parent)), str(staging))
        assert manifest is not None
        rel, entry = max(((r, e) for r, e in manifest.expected_files().items() if "/d/" in r),
                         key=lambda kv: kv[1].size)
        with open(staging / rel, "r+b") as f:
            f.truncate(entry.size // 2)
    elif damage == "metadata":
        meta = staging / CHECKPOINT_METADATA
        text = meta.read_text()
        forged = text.replace(f'"data_position": {OLD_POSITION}', f'"data_position": {OLD_POSITION + 1}')
        assert forged != text and len(forged) == len(text)
        meta.write_text(forged)
    return staging


def _resave(root: Path, source: Path, damage: str | None = None, *, plain: bool = False) -> None:
    """Step 30 deleted, then written again under its number (a new directory renamed into place, as Orbax does)."""
    staging = _fresh_copy(source, root.parent / "staging", damage, plain=plain)
    shutil.rmtree(root / "train" / "30")
    os.rename(staging, root / "train" / "30")


def _swap(root: Path, source: Path, damage: str | None = None) -> None:
    """Step 30's directory exchanged at once for a new one (``renameat2(RENAME_EXCHANGE)``), and the job directory's
    modification time put back: nothing in the job's listing says that step 30 changed."""
    job = root / "train"
    before = job.stat()
    staging = _fresh_copy(source, root.parent / "staging", damage)
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("no renameat2 in this C library")
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if libc.renameat2(at_cwd, bytes(staging), at_cwd, bytes(job / "30"), exchange) != 0:
        pytest.skip(f"renameat2(RENAME_EXCHANGE) refused here: {os.strerror(ctypes.get_errno())}")
    shutil.rmtree(staging)  # the old step 30, swapped out
    os.utime(job, ns=(before.st_atime_ns, before.st_mtime_ns))


def _catalog(root: Path) -> Catalog:
    cat = Catalog(Storage(str(root)), ":memory:", revalidate_after_s=3600.0)  # the last full check: seconds old
    cat.rebuild()
    for _ in range(2):  # named twice: its manifest is kept, the next answers look at its listing only
        named = cat.confirmed_latest_good("train")
        assert named is not None and named.step == 30
    return cat


def _quarantine_30(cat: Catalog, root: Path) -> None:
    """Step 30 found bad by ckptd (a data file truncated behind its back): quarantined, its files kept."""
    manifest = read_manifest(cat.storage, str(root / "train" / "30"))
    assert manifest is not None
    rel = next(r for r in manifest.expected_files() if "/d/" in r)
    with open(root / "train" / "30" / rel, "r+b") as f:
        f.truncate(1)
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 20
    assert cat.step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]


@pytest.mark.parametrize("replace", [_resave, _swap], ids=["deleted-and-written", "swapped"])
def test_a_good_step_saved_again_is_named_with_its_own_metadata(root: Path, donor: Path, replace: object) -> None:
    cat = _catalog(root)
    replace(root, donor)  # type: ignore[operator]
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 30 and named.state is StepState.VERIFIED, cat.step("train", 30)
    assert named.training is not None and named.training.data_position == NEW_POSITION  # the new save's
    assert cat.layout(named).training.data_position == NEW_POSITION  # type: ignore[union-attr]
    assert read_quarantine(cat.storage, str(root / "train" / "30")) is None  # never judged by the old manifest
    assert cat.confirmed_step("train", 30).training.data_position == NEW_POSITION  # type: ignore[union-attr]


def test_a_refresh_that_lists_the_job_takes_a_new_save_of_a_verified_step_without_naming_it(root: Path,
                                                                                             donor: Path) -> None:
    """The list converges too: a refresh lists the job (its directory changed), finds step 30's directory changed,
    and catalogues the new save's metadata; answers cached per catalog version are made again."""
    cat = _catalog(root)
    cat.refresh(quick=True)
    version = cat.version
    _resave(root, donor)
    cat.refresh(quick=True)
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.VERIFIED
    assert thirty.training is not None and thirty.training.data_position == NEW_POSITION
    assert cat.version > version


@pytest.mark.parametrize("damage", ["truncate", "metadata"])
@pytest.mark.parametrize("replace", [_resave, _swap], ids=["deleted-and-written", "swapped"])
def test_a_bad_step_saved_over_a_verified_one_is_never_named(root: Path, damage: str, replace: object) -> None:
    cat = _catalog(root)
    source = root.parent / "old-30"
    shutil.copytree(root / "train" / "30", source)  # the same save again (file names and sizes alike), damaged
    replace(root, source, damage)  # type: ignore[operator]
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 20
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.QUARANTINED
    assert ("bytes, manifest says" if damage == "truncate" else "training metadata differs") in (thirty.reason or "")
    assert read_quarantine(cat.storage, str(root / "train" / "30")) is not None
    assert (root / "train" / "30" / CHECKPOINT_METADATA).is_file()  # reported and kept, never deleted
    assert cat.confirmed_step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]


@pytest.mark.parametrize("quick", [False, True], ids=["full-pass", "quick-pass"])
def test_a_quarantined_step_saved_again_correctly_is_offered(root: Path, donor: Path, quick: bool) -> None:
    cat = _catalog(root)
    _quarantine_30(cat, root)
    cat.refresh(quick=quick)
    assert cat.step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]  # nothing changed yet
    _resave(root, donor)
    cat.refresh(quick=quick)  # the refresher's pass; the job directory's time changed, so quick lists it too
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.VERIFIED, thirty
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 30 and named.training.data_position == NEW_POSITION  # type: ignore[union-attr]
    assert read_quarantine(cat.storage, str(root / "train" / "30")) is None


def test_a_quarantined_step_swapped_for_a_good_one_is_offered_by_the_next_full_pass(root: Path, donor: Path) -> None:
    cat = _catalog(root)
    _quarantine_30(cat, root)
    cat.refresh()  # the job listed, its time trusted from now on
    _swap(root, donor)
    cat.refresh(quick=True)  # the job directory's time did not change: a quick pass does not list it
    cat.refresh()  # the full pass (every Refresher.full_every) looks at its quarantined steps again
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.VERIFIED, thirty
    assert cat.confirmed_latest_good("train").step == 30  # type: ignore[union-attr]


def test_a_quarantined_step_left_alone_stays_quarantined_and_is_not_read_again(root: Path) -> None:
    """The look is cheap: a quarantined step unchanged is not inspected again, however many passes."""
    cat = _catalog(root)
    _quarantine_30(cat, root)
    reason = cat.step("train", 30).reason  # type: ignore[union-attr]
    version = cat.version
    for quick in (False, True, False):
        cat.refresh(quick=quick)
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.QUARANTINED and thirty.reason == reason
    assert cat.version == version  # no row changed
    record = json.loads((root / "train" / "30" / QUARANTINE_FILE).read_text())
    assert record["reason"] == reason


def _plan(http: httpx.Client) -> p.ResumePlan:
    response = http.post("/v1/jobs/train/resume", json={"alive_devices": 8})
    assert response.status_code == 200, response.text
    return p.ResumePlan.model_validate(response.json())


def test_a_served_job_resumes_only_from_what_each_save_of_step_30_holds(root: Path, donor: Path,
                                                                       ckptd_server: StartServer) -> None:
    """Through a real ckptd (its refresher running): step 30 saved again with a forged data position is never
    planned from; saved again correctly, it is planned from with the new save's data position."""
    server = ckptd_server(root, revalidate_after_s=3600.0)
    with server.client() as http:
        assert _plan(http).step == 30 and _plan(http).data_position == OLD_POSITION
        source = root.parent / "old-30"
        shutil.copytree(root / "train" / "30", source)
        _resave(root, source, "metadata")
        plan = _plan(http)
        assert plan.step == 20 and plan.data_position == 20 * 64
        assert http.get("/v1/jobs/train/checkpoints/latest-good").json()["step"] == 20
        _resave(root, donor)  # the quarantined step 30 saved again, correctly

        def offered() -> int | None:
            answer = http.get("/v1/jobs/train/checkpoints/latest-good").json()
            return answer["step"] if answer.get("step") == 30 else None

        wait_until(offered, timeout=30, what="step 30 offered again after its new save")
        plan = _plan(http)
        assert plan.step == 30 and plan.data_position == NEW_POSITION


# ---- a job watched read-only: its records on the side prefix, where a new save does not reach ---------------------


@pytest.fixture
def plain_root(root: Path) -> Path:
    """``root`` as plain Orbax left it, no file of ckptd's in its steps: what a read-only ckptd adopts."""
    for record in root.glob("train/*/ckptd_*"):
        record.unlink()
    return root


def _read_only(root: Path) -> Catalog:
    cat = Catalog(Storage(str(root)), ":memory:", revalidate_after_s=3600.0, read_only=True)
    cat.rebuild()
    assert cat.confirmed_latest_good("train").step == 30  # type: ignore[union-attr]
    assert (root / ".ckptd" / "train" / "30" / CKPTD_MANIFEST).is_file()  # adopted: its records on the side
    return cat


def _offered_with_the_new_save(cat: Catalog, root: Path) -> None:
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 30 and named.training.data_position == NEW_POSITION  # type: ignore[union-attr]
    assert not (root / ".ckptd" / "train" / "30" / QUARANTINE_FILE).exists()
    [earlier] = (root / ".ckptd" / "train").glob("30.ckptd-aside-*")  # the old save's records: kept, aside
    assert (earlier / CKPTD_MANIFEST).is_file()
    fresh = Catalog(Storage(str(root)), ":memory:", read_only=True)  # a restart says the same
    fresh.rebuild()
    assert fresh.confirmed_latest_good("train").training.data_position == NEW_POSITION  # type: ignore[union-attr]
    assert not list(root.glob("train/*/ckptd_*"))  # nothing written into the job


def test_a_good_step_of_a_read_only_job_saved_again_is_judged_by_its_own_files(plain_root: Path,
                                                                             donor: Path) -> None:
    cat = _read_only(plain_root)
    _resave(plain_root, donor, plain=True)
    _offered_with_the_new_save(cat, plain_root)


def test_a_quarantined_step_of_a_read_only_job_saved_again_correctly_is_offered(plain_root: Path,
                                                                               donor: Path) -> None:
    cat = _read_only(plain_root)
    _quarantine_30(cat, plain_root)
    record = json.loads((plain_root / ".ckptd" / "train" / "30" / QUARANTINE_FILE).read_text())
    assert record["metadata_crc32c"]  # which save it is about
    cat.refresh()
    assert cat.step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]  # the same save: kept
    _resave(plain_root, donor, plain=True)
    cat.refresh()
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.VERIFIED, thirty
    _offered_with_the_new_save(cat, plain_root)
