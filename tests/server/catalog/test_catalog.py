"""The catalog (ckptd.catalog._catalog): a cache of storage, rebuilt at start and kept fresh by refreshes."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ckptd._sidecar import commit_pass
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._integrity import settle
from ckptd.catalog._refresher import Refresher
from tests.support.golden import add_odd_steps, copy_root, golden_fixture
from tests.support.helpers import wait_until
from tests.support.orbax_steps import write_orbax_jobs
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, COMMIT_MARKER, TMP_DIR_SUFFIX
from trainer_client.core.format._steps import inspect_step, step_entries
from trainer_client.core.protocol import MAX_STEP, CheckpointInfo, JobInfo, StepState, is_valid_job_name

TMP4 = f"4{TMP_DIR_SUFFIX}-1712345678"

# A copied step keeps no ckptd files: it must look like a fresh step to the catalog, which adopts it.
_CKPTD_FILES = shutil.ignore_patterns("ckptd_*")


# Written once by plain Orbax in another process: alpha steps 1, 2, 3 and beta step 5.
golden_root = golden_fixture(lambda root: write_orbax_jobs({root / "alpha": [1, 2, 3], root / "beta": [5]}),
                             name="golden_root")


@pytest.fixture
def root(golden_root: Path, tmp_path: Path) -> Path:
    """A private copy of the golden root with every kind of step and a few things that are not steps.

    alpha: 1, 2, 3 committed; 4 a tmp directory (writing); 5 corrupt (garbled metadata);
    6 finalized name without commit_success.txt (writing). beta: 5 committed.
    """
    dst = copy_root(golden_root, tmp_path)
    alpha = dst / "alpha"
    add_odd_steps(alpha, 3, writing=TMP4, corrupt=5, uncommitted=6)
    (alpha / "notes.txt").write_text("not a step")
    (alpha / "tmp").mkdir()
    (alpha / "8").write_text("a file named like a step")
    (alpha / str(MAX_STEP + 1)).mkdir()  # too large to be a step: must not break the catalog
    (dst / ".hidden").mkdir()
    shutil.copytree(alpha / "1", dst / ".hidden" / "1")
    (dst / "not a job").mkdir()
    (dst / "README").write_text("a file at the root")
    return dst


@pytest.fixture
def catalog(root: Path, tmp_path: Path) -> Iterator[Catalog]:
    cat = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    yield cat
    cat.close()


def _states(cat: Catalog, job: str) -> dict[str, tuple[int, StepState]]:
    return {Path(c.path).name: (c.step, c.state) for c in cat.checkpoints(job)}


def _direct_scan(storage: Storage) -> dict[str, list[CheckpointInfo]]:
    """What storage holds, by the same rules, without any catalog."""
    out: dict[str, list[CheckpointInfo]] = {}
    for job in storage.list_dir(storage.root):
        if not job.is_dir or not is_valid_job_name(job.name):
            continue
        infos = []
        for _, entry in sorted(step_entries(storage, job.path), key=lambda pe: (pe[0].step, pe[1].name)):
            ins = inspect_step(storage, entry)
            assert ins is not None
            if ins.state is StepState.COMMITTED:  # what the catalog does with a committed step
                settled = settle(storage, ins)
                ins = replace(ins, state=settled.state, reason=settled.reason)
            infos.append(ins.to_info(storage))
        out[job.name] = infos
    return out


def _snapshot(cat: Catalog) -> tuple[list[JobInfo], dict[str, list[CheckpointInfo]]]:
    jobs = cat.jobs()
    return jobs, {j.name: cat.checkpoints(j.name) for j in jobs}


def test_rebuild_from_storage(catalog: Catalog, root: Path) -> None:
    assert not catalog.ready.is_set()
    catalog.rebuild()
    assert catalog.ready.is_set()
    assert catalog.last_refresh is not None and catalog.last_error is None

    jobs = {j.name: j for j in catalog.jobs()}
    assert set(jobs) == {"alpha", "beta"}  # ".hidden" and "not a job" are not job names
    assert jobs["alpha"] == JobInfo(name="alpha", path=str(root / "alpha"), steps=6, latest_step=6,
                                    latest_good_step=3)
    assert jobs["beta"].latest_good_step == 5 and jobs["beta"].steps == 1

    assert _states(catalog, "alpha") == {
        "1": (1, StepState.VERIFIED),
        "2": (2, StepState.VERIFIED),
        "3": (3, StepState.VERIFIED),
        TMP4: (4, StepState.WRITING),
        "5": (5, StepState.CORRUPT),
        "6": (6, StepState.WRITING),
    }
    corrupt = catalog.step("alpha", 5)
    assert corrupt is not None and corrupt.reason is not None and CHECKPOINT_METADATA in corrupt.reason
    assert catalog.has_job("alpha") and not catalog.has_job(".hidden") and not catalog.has_job("nope")


def test_latest_good_skips_corrupt_and_writing(catalog: Catalog, root: Path) -> None:
    catalog.rebuild()
    good = catalog.latest_good("alpha")
    assert good is not None
    assert (good.step, good.state, good.path) == (3, StepState.VERIFIED, str(root / "alpha" / "3"))
    assert good.committed_at is not None
    at_most = catalog.latest_good("alpha", at_most=2)
    assert at_most is not None and at_most.step == 2
    assert catalog.latest_good("alpha", at_most=0) is None
    assert catalog.latest_good("no-such-job") is None
    step4 = catalog.step("alpha", 4)
    assert step4 is not None and step4.state is StepState.WRITING
    assert catalog.step("alpha", 99) is None


def test_step_prefers_the_committed_directory(catalog: Catalog, root: Path) -> None:
    # A retried save: a stale tmp directory of step 3 next to the committed 3.
    shutil.copytree(root / "alpha" / "3", root / "alpha" / f"3{TMP_DIR_SUFFIX}-1")
    catalog.rebuild()
    step3 = catalog.step("alpha", 3)
    assert step3 is not None and step3.state is StepState.VERIFIED
    assert step3.path == str(root / "alpha" / "3")


def test_refresh_sees_new_vanished_and_finalized_steps(catalog: Catalog, root: Path) -> None:
    catalog.rebuild()
    alpha = root / "alpha"

    shutil.copytree(alpha / "3", alpha / "7", ignore=_CKPTD_FILES)  # a new committed step
    shutil.rmtree(alpha / "2")  # a step deleted by retention
    (alpha / TMP4).rename(alpha / "4")  # rename mode: the tmp directory is finalized
    (alpha / "6" / COMMIT_MARKER).write_text("ok")  # commit-file mode: the marker lands last
    shutil.copytree(root / "beta", root / "gamma")  # a new job
    shutil.rmtree(root / "beta")  # a job that went away

    catalog.refresh()

    assert [j.name for j in catalog.jobs()] == ["alpha", "gamma"]
    assert _states(catalog, "alpha") == {
        "1": (1, StepState.VERIFIED),
        "3": (3, StepState.VERIFIED),
        "4": (4, StepState.VERIFIED),
        "5": (5, StepState.CORRUPT),
        "6": (6, StepState.VERIFIED),
        "7": (7, StepState.VERIFIED),
    }
    good = catalog.latest_good("alpha")
    assert good is not None and good.step == 7
    assert catalog.checkpoints("beta") == []
    gamma = catalog.latest_good("gamma")
    assert gamma is not None and gamma.path == str(root / "gamma" / "5")

    shutil.rmtree(alpha / "7")
    catalog.refresh_job("alpha")  # one job only: what a resume request does
    good = catalog.latest_good("alpha")
    assert good is not None and good.step == 6


def test_a_corrupt_step_is_looked_at_again_but_a_committed_one_is_not(catalog: Catalog, root: Path) -> None:
    catalog.rebuild()
    catalog.refresh()  # the first listing after a step's verdict notes its directory's time
    alpha = root / "alpha"
    # A tool copying a step in may show the marker before the metadata: corrupt, then whole.
    shutil.copy2(alpha / "3" / CHECKPOINT_METADATA, alpha / "5" / CHECKPOINT_METADATA)
    # A settled step is not read again by refreshes while its directory stays as it was: a file rewritten in place
    # is found before the step is named (its identity: ckptd/catalog/_identity.py), or by a rebuild.
    (alpha / "1" / CHECKPOINT_METADATA).write_text("{garbled")
    catalog.refresh()
    assert _states(catalog, "alpha")["5"] == (5, StepState.VERIFIED)
    assert _states(catalog, "alpha")["1"] == (1, StepState.VERIFIED)
    assert catalog.confirmed_step("alpha", 1).state is StepState.CORRUPT  # type: ignore[union-attr]
    catalog.rebuild()
    assert _states(catalog, "alpha")["1"] == (1, StepState.CORRUPT)


def test_tmp_directory_is_abandoned_after_the_save_timeout(root: Path, tmp_path: Path) -> None:
    old = time.time() - 600
    for p in [root / "alpha" / TMP4, *(root / "alpha" / TMP4).iterdir()]:
        os.utime(p, (old, old))
    cat = Catalog(Storage(str(root)), tmp_path / "c.sqlite3", save_timeout_s=60)
    try:
        cat.rebuild()
        step4 = cat.step("alpha", 4)
        assert step4 is not None and step4.state is StepState.ABANDONED
        assert cat.latest_good("alpha") is not None
    finally:
        cat.close()


def test_fresh_start_equals_storage(root: Path, tmp_path: Path) -> None:
    storage = Storage(str(root))
    db = tmp_path / "state" / "catalog.sqlite3"
    db.parent.mkdir()
    cat = Catalog(storage, db)
    cat.rebuild()
    # Storage changes under a running catalog, seen by incremental refreshes.
    alpha = root / "alpha"
    (alpha / TMP4).rename(alpha / "4")
    cat.refresh()
    shutil.copytree(alpha / "3", alpha / "9", ignore=_CKPTD_FILES)
    shutil.rmtree(alpha / "1")
    cat.refresh()
    incremental = _snapshot(cat)
    cat.close()

    # Kill ckptd, drop its cache, start again: the rebuilt catalog is exactly what storage holds.
    for f in db.parent.iterdir():
        f.unlink()
    fresh = Catalog(Storage(str(root)), db)
    try:
        fresh.rebuild()
        assert _snapshot(fresh) == incremental
        assert _snapshot(fresh)[1] == _direct_scan(storage)
    finally:
        fresh.close()


def test_rebuild_forgets_a_stale_cache(root: Path, tmp_path: Path) -> None:
    db = tmp_path / "catalog.sqlite3"
    first = Catalog(Storage(str(root)), db)
    first.rebuild()
    assert _states(first, "alpha")["3"] == (3, StepState.VERIFIED)
    first.close()

    # While ckptd is down: step 3 is replaced by a broken copy, step 2 disappears.
    alpha = root / "alpha"
    meta = json.loads((alpha / "3" / CHECKPOINT_METADATA).read_text())
    (alpha / "3" / CHECKPOINT_METADATA).write_text(json.dumps(meta["item_handlers"])[:-5])
    shutil.rmtree(alpha / "2")

    second = Catalog(Storage(str(root)), db)  # same cache file, still holding the old rows
    try:
        second.rebuild()
        states = _states(second, "alpha")
        assert states["3"] == (3, StepState.CORRUPT)
        assert "2" not in states
        good = second.latest_good("alpha")
        assert good is not None and good.step == 1
        assert _snapshot(second)[1] == _direct_scan(Storage(str(root)))
    finally:
        second.close()


def test_refresher_thread_builds_then_follows_storage(
    catalog: Catalog, root: Path
) -> None:
    refresher = Refresher(catalog, 0.05)
    refresher.start()
    try:
        wait_until(catalog.ready.is_set, timeout=10, what="first rebuild")
        good = catalog.latest_good("alpha")
        assert good is not None and good.step == 3

        # copied beside, then renamed into place: the refresher never sees half a step
        shutil.copytree(root / "alpha" / "3", root / "incoming-11", ignore=_CKPTD_FILES)
        (root / "incoming-11").rename(root / "alpha" / "11")

        def latest() -> int | None:
            info = catalog.latest_good("alpha")
            return info.step if info and info.step == 11 else None

        assert wait_until(latest, timeout=10, what="step 11 in the catalog") == 11
    finally:
        refresher.stop()
    assert not refresher._thread.is_alive()


def test_a_committed_step_that_loses_its_marker_is_never_served(tmp_path: Path) -> None:
    """Rewritten in place (commit-file mode) between two refreshes: the answer checks storage first."""
    import shutil as _shutil

    from ckptd.catalog._catalog import Catalog as _Catalog
    from trainer_client.core._storage import Storage as _Storage

    job = tmp_path / "root" / "job"
    for step in (1, 2):
        d = job / str(step) / "default"
        d.mkdir(parents=True)
        (d / "_METADATA").write_text("{}")
        (job / str(step) / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"default": "x"}}')
        (job / str(step) / "commit_success.txt").write_text("ok")
    cat = _Catalog(_Storage(str(tmp_path / "root")), tmp_path / "c.sqlite3")
    cat.rebuild()
    assert cat.latest_good("job").step == 2  # type: ignore[union-attr]
    (job / "2" / "commit_success.txt").unlink()  # a new save of step 2 has started in place
    good = cat.confirmed_latest_good("job")
    assert good is not None and good.step == 1
    assert cat.step("job", 2).state.value == "writing"  # type: ignore[union-attr]
    assert cat.confirmed_step("job", 2).state.value == "writing"  # type: ignore[union-attr]
    _shutil.rmtree(job / "2")
    assert cat.confirmed_latest_good("job").step == 1  # type: ignore[union-attr]


def test_a_step_still_being_copied_in_is_adopted_only_once_it_settles(root: Path, tmp_path: Path) -> None:
    storage = Storage(str(root))
    cat = Catalog(storage, tmp_path / "c.sqlite3", adopt_after_s=1.0)
    try:
        shutil.copytree(root / "alpha" / "3", root / "alpha" / "12", ignore=_CKPTD_FILES)  # lands now
        cat.rebuild()
        fresh = cat.step("alpha", 12)
        assert fresh is not None and fresh.state is StepState.COMMITTED and "adopting" in (fresh.reason or "")
        good = cat.latest_good("alpha")
        assert good is None or good.step != 12
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and cat.step("alpha", 12).state is not StepState.VERIFIED:  # type: ignore[union-attr]
            time.sleep(0.2)
            cat.refresh_job("alpha")
        assert cat.step("alpha", 12).state is StepState.VERIFIED  # type: ignore[union-attr]
    finally:
        cat.close()


def test_a_quick_refresh_sees_renames_and_finishing_saves_without_listing(root: Path, tmp_path: Path) -> None:
    storage = Storage(str(root))
    cat = Catalog(storage, tmp_path / "q.sqlite3")
    try:
        cat.rebuild()
        alpha = root / "alpha"
        # a rename into the job directory changes its mtime: the quick refresh lists again
        shutil.copytree(alpha / "3", root / "incoming", ignore=_CKPTD_FILES)
        (root / "incoming").rename(alpha / "20")
        cat.refresh_job("alpha", quick=True)
        assert cat.step("alpha", 20).state is StepState.VERIFIED  # type: ignore[union-attr]
        # a save finishing in place (commit-file mode) does not touch the job directory: the quick refresh
        # looks again at the steps not yet settled
        shutil.copytree(alpha / "3", alpha / "21", ignore=_CKPTD_FILES)
        (alpha / "21" / COMMIT_MARKER).rename(root / "marker")
        cat.refresh_job("alpha")
        assert cat.step("alpha", 21).state is StepState.WRITING  # type: ignore[union-attr]
        (root / "marker").rename(alpha / "21" / COMMIT_MARKER)
        cat.refresh_job("alpha", quick=True)
        assert cat.step("alpha", 21).state is StepState.VERIFIED  # type: ignore[union-attr]
    finally:
        cat.close()


def test_the_commit_pass_waits_the_configured_save_timeout_before_redoing_another_s_commit(
    root: Path, tmp_path: Path
) -> None:
    # docs/multihost.md, "Fenced writers": a commit or cleanup another sidecar decided is redone only once its
    # fate record is older than the save timeout; CKPTD_SAVE_TIMEOUT_S, not the 1 h default
    cat = Catalog(Storage(str(root)), tmp_path / "timeout.sqlite3", save_timeout_s=42.0)
    try:
        assert commit_pass(cat, 0.05).parts.redo_after_s == 42.0  # as the composition root builds it
    finally:
        cat.close()
