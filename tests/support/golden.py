"""Golden roots: a checkpoint root written once per test module, copied for each test.

Real Orbax steps take seconds to write, so a module writes its root once (``golden_fixture``) and each test
works on a copy of its own (``copy_root``), which it may damage, extend or serve. ``copy2`` keeps the files'
modification times, so ckptd's verified records (whose fingerprints hold them) stay valid in the copy.
``add_odd_steps`` adds the directories a catalog must classify without trusting: a step still being written,
a corrupt one, one without its commit marker.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainer_client.core.format._files import CHECKPOINT_METADATA, COMMIT_MARKER, TMP_DIR_SUFFIX


def golden_fixture(write: Callable[[Path], object], *, name: str) -> Any:
    """A module-scoped fixture called ``name``: a fresh directory ``write`` fills once, its path."""

    @pytest.fixture(scope="module", name=name)
    def _golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
        root = tmp_path_factory.mktemp(name)
        write(root)
        return root

    return _golden


def copy_root(golden: Path, tmp_path: Path, name: str = "root") -> Path:
    """This test's own copy of ``golden`` (modification times kept), at ``tmp_path / name``."""
    dst = tmp_path / name
    shutil.copytree(golden, dst)
    return dst


def add_odd_steps(job: Path, source: int, *, writing: str | None = None, corrupt: int | None = None,
                  uncommitted: int | None = None) -> None:
    """Copies of the committed step ``source`` of ``job``: ``writing`` a tmp directory (``<name>`` +
    Orbax's tmp suffix, as given), ``corrupt`` a step whose metadata does not parse, ``uncommitted`` a
    finalized name without ``commit_success.txt``."""
    if writing is not None:
        shutil.copytree(job / str(source), job / writing)
    if corrupt is not None:
        shutil.copytree(job / str(source), job / str(corrupt))
        (job / str(corrupt) / CHECKPOINT_METADATA).write_text("{garbled")
    if uncommitted is not None:
        shutil.copytree(job / str(source), job / str(uncommitted))
        (job / str(uncommitted) / COMMIT_MARKER).unlink()


def tmp_step(step: int, suffix: str = "") -> str:
    """The directory name of ``step`` while Orbax writes it locally (``suffix``: Orbax's ``-<n>`` variant)."""
    return f"{step}{TMP_DIR_SUFFIX}{suffix}"


__all__ = ["add_odd_steps", "copy_root", "golden_fixture", "tmp_step"]
