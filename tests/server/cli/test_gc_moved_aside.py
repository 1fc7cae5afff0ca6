"""``ckptd gc`` and the steps a save moved aside (docs/operations.md, "Steps moved aside"): the evidence of a
quarantined step or of a save cut short, kept under ``<step>.ckptd-aside-<UTC time>``. Retention never deletes
one; ``gc`` lists each, with what it was and when it was moved, and deletes one only when told to with
``--delete-aside-older-than`` and it was moved longer ago than that, never in a read-only job. The steps are real
Orbax steps, moved aside by the drop-in manager's own mover (``trainer_client/runtime/saving/_step_aside.py``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from ckptd.catalog._integrity import quarantine
from ckptd.cli._main import build_parser
from ckptd.cli._main import main as ckptd_main
from tests.support.golden import copy_root, golden_fixture
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import COMMIT_MARKER, TMP_DIR_SUFFIX
from trainer_client.runtime.saving._step_aside import clear_for_save

STEPS = [10, 20, 30]
DAY = 86400.0

golden_root = golden_fixture(
    lambda root: write_orbax_jobs({root / "train": STEPS}, custom_metadata={s: training_metadata(s) for s in STEPS}),
    name="golden_root")


@pytest.fixture
def root(golden_root: Path, tmp_path: Path) -> Path:
    """``train``: steps 10, 20; step 30 quarantined and moved aside ten days ago by a new save of 30, which has not
    landed yet; a save of 40 cut short two hours ago (its tmp directory) and moved aside now by a new save of 40."""
    root = copy_root(golden_root, tmp_path)
    storage = Storage(str(root))
    quarantine(storage, str(root / "train" / "30"), "quick validation failed: a file truncated", ["a file truncated"])
    assert clear_for_save(storage, "train", 30, good=lambda: [10, 20], save_timeout_s=3600, mover=True,
                          now=time.time() - 10 * DAY)
    cut_short = root / "train" / f"40{TMP_DIR_SUFFIX}"
    shutil.copytree(root / "train" / "20", cut_short)
    (cut_short / COMMIT_MARKER).unlink()
    then = time.time() - 2 * 3600
    for path in [cut_short, *cut_short.rglob("*")]:
        os.utime(path, (then, then))
    assert clear_for_save(storage, "train", 40, good=lambda: [10, 20], save_timeout_s=3600, mover=True)
    return root


def _asides(root: Path) -> dict[int, Path]:
    return {int(p.name.split(".")[0]): p for p in (root / "train").iterdir() if ".ckptd-aside-" in p.name}


def _gc(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert ckptd_main(["gc", f"{root}/train", "--keep-last", "1", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_gc_lists_moved_aside_steps_and_keeps_them(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    asides = _asides(root)
    assert sorted(asides) == [30, 40]
    rows = {Path(str(d["path"])).name: d for d in _gc(root, capsys)}
    assert rows["10"]["action"] == "delete" and not (root / "train" / "10").exists()  # retention as before
    for step, path in asides.items():
        row = rows[path.name]
        assert (row["step"], row["state"], row["action"]) == (step, "moved_aside", "keep"), row
        assert "--delete-aside-older-than" in " ".join(row["reasons"])  # type: ignore[arg-type]
        assert path.is_dir()
    assert rows[asides[30].name]["was"] == "quarantined: quick validation failed: a file truncated"
    assert rows[asides[40].name]["was"] == "uncommitted"
    assert 9.9 * DAY < float(rows[asides[30].name]["age_s"]) < 10.1 * DAY  # type: ignore[arg-type]
    # the table says the same
    assert ckptd_main(["gc", f"{root}/train"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "moved_aside" in lines["30"] and "keep" in lines["30"] and asides[30].name in lines["30"]


def test_gc_deletes_moved_aside_steps_only_when_told_and_only_the_old_ones(root: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    asides = _asides(root)
    rows = {Path(str(d["path"])).name: d for d in _gc(root, capsys, "--delete-aside-older-than", "7d", "--dry-run")}
    assert rows[asides[30].name]["action"] == "delete" and rows[asides[40].name]["action"] == "keep"
    assert all(path.is_dir() for path in asides.values())  # a dry run
    assert ckptd_main(["gc", f"{root}/train", "--delete-aside-older-than", "7d", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "would delete" in captured.out and "1 moved-aside step(s) would delete" in captured.err

    rows = {Path(str(d["path"])).name: d for d in _gc(root, capsys, "--delete-aside-older-than", "7d")}
    assert rows[asides[30].name]["action"] == "delete" and not asides[30].exists()
    assert rows[asides[40].name]["action"] == "keep" and asides[40].is_dir()
    assert "less than 7d ago" in " ".join(rows[asides[40].name]["reasons"])  # type: ignore[arg-type]
    assert sorted(p.name for p in (root / "train").iterdir() if p.name.isdigit()) == ["20"]  # the steps: as before


def test_gc_deletes_no_moved_aside_step_of_a_read_only_job(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    asides = _asides(root)
    rows = _gc(root, capsys, "--read-only", "--delete-aside-older-than", "0s")
    assert {d["action"] for d in rows} == {"keep"}
    assert all(path.is_dir() for path in asides.values())


def test_gc_help_says_what_it_does_with_moved_aside_steps() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["gc"].format_help().split())
    assert "moved aside" in text and "--delete-aside-older-than" in text and "never deleted" in text
