"""A step saved again under its number on ``gs://`` (fake-gcs-server; docs/operations.md, "A step saved again under
its number"): an object store has no directory times, so a verified step is looked at before it is named and a
quarantined one at each full pass. Steps written by plain Orbax in another process, uploaded; the new saves are
written by another gcsfs instance (another process, as far as the catalog's listing caches go)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.gcs_emulator import GcsEmulator
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, QUARANTINE_FILE
from trainer_client.core.format._records import SIDE_DIR
from trainer_client.core.protocol import StepState

pytestmark = pytest.mark.integration

STEPS = [10, 20, 30]
OLD_POSITION, NEW_POSITION = 30 * 64, 30 * 32


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/train``: steps 10, 20, 30 by plain Orbax; ``donor/train/30``: another save of 30 (another batch)."""
    base = tmp_path_factory.mktemp("gcs-resaved")
    write_orbax_jobs({base / "root" / "train": STEPS}, custom_metadata={s: training_metadata(s) for s in STEPS})
    write_orbax_jobs({base / "donor" / "train": [30]}, custom_metadata={30: training_metadata(30, global_batch=32)})
    return base


def _upload(gcs: GcsEmulator, local: Path, name: str) -> Storage:
    storage = Storage(gcs.gs(name))
    storage.fs.put(str(local / "root") + "/", gcs.gs(name) + "/", recursive=True)
    return storage


def _resave(gcs: GcsEmulator, storage: Storage, source: Path) -> None:
    """Step 30 deleted and saved again, by another writer."""
    writer = gcs.other_writer()
    target = storage.join("train", "30")
    writer.rm(target, recursive=True)
    writer.put(str(source) + "/", target + "/", recursive=True)


def _quarantine_30(gcs: GcsEmulator, cat: Catalog, storage: Storage) -> None:
    """A data object of step 30 cut short behind ckptd's back: found before 30 is named, quarantined."""
    writer = gcs.other_writer()
    data = max((p for p in writer.find(storage.join("train", "30")) if "/d/" in p), key=lambda p: writer.size(p))
    writer.pipe(data, writer.cat(data)[:1])
    assert cat.confirmed_latest_good("train").step == 20  # type: ignore[union-attr]
    assert cat.step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]


@pytest.mark.parametrize("read_only", [False, True], ids=["records-in-the-step", "read-only"])
def test_a_quarantined_step_saved_again_on_gcs_is_offered_by_the_next_full_pass(
        gcs_emulator: GcsEmulator, local: Path, read_only: bool) -> None:
    storage = _upload(gcs_emulator, local, f"resaved-quarantined-{read_only}")
    cat = Catalog(storage, ":memory:", revalidate_after_s=3600.0, read_only=read_only)
    cat.rebuild()
    assert cat.confirmed_latest_good("train").step == 30  # type: ignore[union-attr]
    _quarantine_30(gcs_emulator, cat, storage)
    side_record = storage.join(SIDE_DIR, "train", "30", QUARANTINE_FILE)
    assert storage.exists(side_record) is read_only
    _resave(gcs_emulator, storage, local / "donor" / "train" / "30")
    cat.refresh(quick=True)  # quick: settled steps are not listed on an object store
    assert cat.step("train", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]
    cat.refresh()  # a full pass lists each quarantined step
    thirty = cat.step("train", 30)
    assert thirty is not None and thirty.state is StepState.VERIFIED, thirty
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 30 and named.training.data_position == NEW_POSITION  # type: ignore[union-attr]
    storage.invalidate()
    assert not storage.exists(side_record)
    if read_only:  # the old save's records: kept, aside
        assert [e.name for e in storage.list_dir(storage.join(SIDE_DIR, "train")) if ".ckptd-aside-" in e.name]


def test_a_verified_step_saved_again_on_gcs_is_judged_before_it_is_named(gcs_emulator: GcsEmulator, local: Path,
                                                                         tmp_path: Path) -> None:
    storage = _upload(gcs_emulator, local, "resaved-verified")
    cat = Catalog(storage, ":memory:", revalidate_after_s=3600.0)
    cat.rebuild()
    for _ in range(2):
        assert cat.confirmed_latest_good("train").step == 30  # type: ignore[union-attr]
    forged = tmp_path / "30"  # the same save again, its data position changed in its metadata (same size)
    storage.fs.get(storage.join("train", "30") + "/", str(forged) + "/", recursive=True)
    meta = forged / CHECKPOINT_METADATA
    text = meta.read_text()
    meta.write_text(text.replace(f'"data_position": {OLD_POSITION}', f'"data_position": {OLD_POSITION + 1}'))
    assert meta.read_text() != text
    _resave(gcs_emulator, storage, forged)
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 20
    assert "training metadata differs" in (cat.step("train", 30).reason or "")  # type: ignore[union-attr]
    shutil.rmtree(forged)
    _resave(gcs_emulator, storage, local / "donor" / "train" / "30")
    cat.refresh()
    named = cat.confirmed_latest_good("train")
    assert named is not None and named.step == 30 and named.training.data_position == NEW_POSITION  # type: ignore[union-attr]
