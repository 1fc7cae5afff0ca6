"""Orbax's retention options through ``trainer_client.CheckpointManager``: ``max_to_keep``, ``keep_period``,
``keep_time_interval``, ``best_fn`` and a ``preservation_policy`` (MaxText's ``LatestN(10)``) keep what plain
Orbax keeps, judged over good steps only, except that the newest good step and every step that is not good
(a bad step kept for inspection, a save without its commit marker) are never deleted (docs/adopt.md,
"Retention")."""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as pp

from tests.support.helpers import REPO, clean_env
from tests.support.orbax_steps import _MAXTEXT_WRITER, MAXTEXT_MESH_AXES, MAXTEXT_MESH_SHAPE
from trainer_client import CheckpointManager
from trainer_client.core.format._files import COMMIT_MARKER


@pytest.fixture(autouse=True)
def _no_ckptd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_URL", raising=False)


def _save_steps(manager: Any, steps: range, loss: Any = None) -> list[int]:
    for step in steps:
        metrics = None if loss is None else {"loss": loss(step)}
        manager.save(step, args=ocp.args.StandardSave({"w": np.full(2, float(step))}), metrics=metrics)
    manager.wait_until_finished()
    return list(manager.all_steps())


def _on_disk(job: Path) -> list[int]:
    return sorted(int(p.name) for p in job.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("options", [
    ocp.CheckpointManagerOptions(max_to_keep=3),
    ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=4),
    ocp.CheckpointManagerOptions(max_to_keep=2, keep_time_interval=datetime.timedelta(days=1)),
    ocp.CheckpointManagerOptions(preservation_policy=pp.LatestN(3)),
    ocp.CheckpointManagerOptions(preservation_policy=pp.AnyPreservationPolicy(
        [pp.LatestN(1), pp.EveryNSteps(interval_steps=3), pp.CustomSteps([1])])),
    ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
    ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"),
], ids=["max_to_keep", "keep_period", "keep_time_interval", "LatestN", "any-policy", "sync", "best_fn"])
def test_orbaxs_retention_keeps_what_plain_orbax_keeps(tmp_path: Path, options: Any) -> None:
    """The same loop under plain Orbax and the drop-in: the same steps remain, on disk and in ``all_steps()``
    (losses fall, so the best steps are the newest ones and the newest-good rule changes nothing here)."""
    plain_job, ours_job = tmp_path / "plain" / "checkpoints", tmp_path / "ours" / "checkpoints"

    def loss(step: int) -> float:
        return 1.0 / (step + 1)

    with ocp.CheckpointManager(plain_job, options=options) as plain:
        kept = _save_steps(plain, range(10), loss)
    with CheckpointManager(ours_job, options=options) as mgr:
        assert _save_steps(mgr, range(10), loss) == kept
    assert _on_disk(ours_job) == _on_disk(plain_job) == kept
    assert len(kept) < 10  # something was deleted: the options acted
    with CheckpointManager(ours_job, options=options) as again:  # a new process sees the same
        assert list(again.all_steps()) == kept


def test_best_fn_never_deletes_the_newest_good_step(tmp_path: Path) -> None:
    """Rising losses: Orbax's BestN(1) keeps only step 0 and deletes the newest step; ckptd keeps both, and
    ``best_step()`` is Orbax's answer over good steps."""
    options = ocp.CheckpointManagerOptions(max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(tmp_path / "plain", options=options) as plain:
        assert _save_steps(plain, range(5), lambda step: float(step)) == [0]
    with CheckpointManager(tmp_path / "run" / "checkpoints", options=options) as mgr:
        assert _save_steps(mgr, range(5), lambda step: float(step)) == [0, 4]
        assert mgr.best_step() == 0 and mgr.latest_step() == 4


def test_retention_never_deletes_a_bad_step_nor_counts_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Steps 3 and 4 lose their commit marker (saves cut short): they are not good, so they are neither deleted
    nor counted; ``max_to_keep=2`` keeps the two newest good steps, 1 and 2, and says what it deleted."""
    job = tmp_path / "run" / "checkpoints"
    with CheckpointManager(job) as mgr:
        _save_steps(mgr, range(5))
    for step in (3, 4):
        (job / str(step) / COMMIT_MARKER).unlink()
    with (caplog.at_level(logging.INFO, logger="trainer_client.runtime.orbax_compat._manager_retention"),
          CheckpointManager(job, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mgr):
        mgr.save(7, args=ocp.args.StandardSave({"w": np.full(2, 7.0)}))
        mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [2, 7]
    assert _on_disk(job) == [2, 3, 4, 7]
    said = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
    assert any("step 0" in m and "max_to_keep=2" in m for m in said), said


def test_a_policy_with_the_old_options_is_refused_as_orbax_refuses_it(tmp_path: Path) -> None:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, preservation_policy=pp.LatestN(2))
    with pytest.raises(ValueError, match="mutually exclusive"):
        ocp.CheckpointManager(tmp_path / "plain", options=options)
    with pytest.raises(ValueError, match=r"preservation_policy.*max_to_keep"):
        CheckpointManager(tmp_path / "run" / "checkpoints", options=options)


def test_maxtexts_manager_with_its_default_latest_n_runs_swapped_in(tmp_path: Path) -> None:
    """MaxText's ``create_orbax_checkpoint_manager`` passes ``LatestN(max_num_checkpoints_to_keep)``: with 2,
    its saves of steps 0..300 leave the newest two."""
    plain = "    mgr = ocp.CheckpointManager("
    ours = "    from trainer_client import CheckpointManager\n    mgr = CheckpointManager("
    swapped = _MAXTEXT_WRITER.replace(plain, ours)
    job = tmp_path / "llama" / "checkpoints"
    spec = {"jobs": {str(job): [0, 100, 200, 300]}, "grain": False, "period": 100, "keep": 2, "batch": 4,
            "mesh_axes": list(MAXTEXT_MESH_AXES), "mesh_shape": list(MAXTEXT_MESH_SHAPE)}
    done = subprocess.run([sys.executable, "-c", swapped, json.dumps(spec)], env=clean_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _on_disk(job) == [200, 300]
