"""Every field of Orbax's ``CheckpointManagerOptions`` is either honoured (handed to Orbax's own manager) or
refused with a clear error before anything is written, never ignored (docs/adopt.md, "Options refused")."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.path import atomicity

from trainer_client import CheckpointManager
from trainer_client.core.format._files import CKPTD_MANIFEST
from trainer_client.runtime.orbax_compat._checkpoint_manager import HONOURED, REFUSED


@pytest.fixture(autouse=True)
def _no_ckptd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_URL", raising=False)


def test_every_field_of_orbaxs_options_is_judged() -> None:
    fields = {f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)}
    assert fields - HONOURED - set(REFUSED) == set(), "an Orbax option neither honoured nor refused"
    assert HONOURED.isdisjoint(REFUSED)


class _OwnTmp(atomicity.AtomicRenameTemporaryPath):
    """A temporary path class of the user's own."""


@pytest.mark.parametrize("options, named", [
    (ocp.CheckpointManagerOptions(step_format_fixed_length=8), "step_format_fixed_length"),
    (ocp.CheckpointManagerOptions(temporary_path_class=_OwnTmp), "temporary_path_class"),
    (ocp.CheckpointManagerOptions(multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None)),
     r"multiprocessing_options=MultiprocessingOptions\(primary_host"),
    (ocp.CheckpointManagerOptions(multiprocessing_options=ocp.options.MultiprocessingOptions(
        active_processes={1, 2})), r"multiprocessing_options=MultiprocessingOptions\(active_processes"),
    (ocp.CheckpointManagerOptions(atomicity_options=ocp.options.AtomicityOptions(allow_legacy_atomic_rename=True)),
     r"atomicity_options=AtomicityOptions\(allow_legacy_atomic_rename"),
])
def test_a_value_ckptd_cannot_honour_is_refused_before_anything_is_written(
        tmp_path: Path, options: Any, named: str) -> None:
    with pytest.raises(ValueError, match=rf"CheckpointManagerOptions\({named}.*is not supported: "):
        CheckpointManager(tmp_path / "checkpoints", options=options)
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("options", [
    ocp.CheckpointManagerOptions(temporary_path_class=atomicity.CommitFileTemporaryPath),
    ocp.CheckpointManagerOptions(atomicity_options=ocp.options.AtomicityOptions(
        mode=ocp.options.AtomicityMode.COMMIT_FILE)),
    ocp.CheckpointManagerOptions(best_mode="min", keep_checkpoints_without_metrics=False, save_on_steps=[3],
                                 prevent_write_metrics=True, lightweight_initialize=True),
], ids=["commit-file-class", "commit-file-mode", "orbax-own"])
def test_the_values_ckptd_honours_are_orbaxs_own(tmp_path: Path, options: Any) -> None:
    """Orbax's own settings act as in Orbax; the step is good either way (committed, manifested)."""
    job = tmp_path / "checkpoints"
    with CheckpointManager(job, options=options, item_names=("state",)) as mgr:
        for step in range(4):
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.full(2, float(step))})))
        mgr.wait_until_finished()
        saved = list(mgr.all_steps())
        with ocp.CheckpointManager(job, options=options, item_names=("state",)) as plain:
            assert saved == list(plain.all_steps()) == [0, 1, 2, 3]  # every step committed
        got = mgr.restore(None, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert float(got.state["w"][0]) == saved[-1]
    assert (job / str(saved[-1]) / CKPTD_MANIFEST).is_file()
