"""``examples/maxtext_style.py`` in its short form: a decoder LM with MaxText's settings under the elastic runner
loses a slice, trains on 3 slices, grows back, and reads exactly the batches an uninterrupted Grain iterator
gives, restored from the replica tier (MaxText's ``elastic_backup_kind: snapshot``) or from the checkpoint
(``checkpoint``); its checkpoints are MaxText's layout (``<run>/checkpoints/<step>/items`` + ``iter``), and
MaxText's way of restoring them (a CheckpointManager with the items ``items`` and ``iter``, Grain's handler for
``iter``; plain Orbax and Grain in another process) gets the state and the iterator's next batch back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.maxtext_style import MaxTextConfig, elastic_config, replica_options
from tests.support.helpers import clean_env
from trainer_client import MemoryTierOptions, ReplicaOptions

_MAXTEXT_RESTORE = r"""
import json, sys
import numpy as np
import orbax.checkpoint as ocp
from grain import checkpoint as grain_checkpoint, python as grain_python
from examples.maxtext_style import MaxTextConfig, data_pipeline

checkpoint_dir, step = sys.argv[1], int(sys.argv[2])
cfg = MaxTextConfig()
mgr = ocp.CheckpointManager(checkpoint_dir, item_names=("items", "iter"),
                            item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True),
                                           "iter": grain_python.PyGrainCheckpointHandler()})
iterator = iter(data_pipeline(cfg))
restored = mgr.restore(step, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(),
                                                      iter=grain_checkpoint.CheckpointRestore(iterator)))
reference = iter(data_pipeline(cfg))
for _ in range(step):
    next(reference)
embedding = restored["items"]["params"]["params"]["token_embedder"]["embedding"]
print(json.dumps({"step": int(np.asarray(restored["items"]["step"])), "embedding": list(np.asarray(embedding).shape),
                  "next_batch_exact": bool(np.array_equal(next(iterator), next(reference)))}))
"""


@pytest.mark.parametrize(("backup_kind", "restored", "tier"), [
    ("snapshot", 12, "replicas"),  # MaxText's default: the replica tier, one step lost
    # the step saved to storage, read from ckptd's shared memory (a long form: the shared-memory path of the
    # runner is covered by tests/trainer/runtime/test_memory_tier.py in the short suite)
    pytest.param("checkpoint", 10, "memory: ", marks=pytest.mark.slow),
])
def test_the_maxtext_style_example_resumes_grain_exactly_and_maxtext_restores_its_steps(
        tmp_path: Path, backup_kind: str, restored: int, tier: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "examples.maxtext_style", "--base-output-directory", str(out),
                           "--steps", "30", "--fail-at", "13", "--back-at", "22", "--elastic-backup-kind", backup_kind],
                          env=clean_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the timeline: an event of a step names it, one of no step (a wait for slices, the start) names none
    timeline = [line for line in proc.stdout.splitlines() if line.startswith("  [")]
    assert "step None" not in proc.stdout, timeline
    assert any(" restored " in line and f" step   {restored} " in line for line in timeline), timeline
    assert any(" waiting_for_slices " in line and " step " not in line for line in timeline), timeline
    report = json.loads((out / "report.json").read_text())
    assert report["grain_resumed_exactly"] and report["final_loss"] < report["first_loss"]
    assert [(r["kind"], r["failed_at_step"], r["restored_step"], r["mesh_after"]) for r in report["recoveries"]] == [
        ("slice_down", 13, restored, [3, 2]), ("scale_up", 23, 23, [4, 2])]  # slice 2 back at step 22, seen at 23
    assert report["recoveries"][0]["restored_from"].startswith(tier), report["recoveries"]
    checkpoints = out / "maxtext-style" / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [10, 20, 30]
    assert {"items", "iter"} <= {p.name for p in (checkpoints / "30").iterdir()}
    restore = subprocess.run([sys.executable, "-c", _MAXTEXT_RESTORE, str(checkpoints), "30"], env=clean_env(),
                             capture_output=True, text=True, timeout=300, check=False)
    assert restore.returncode == 0, restore.stderr[-3000:]
    restored = json.loads(restore.stdout.strip().splitlines()[-1])
    assert restored == {"step": 30, "embedding": [128, 32], "next_batch_exact": True}


def test_maxtexts_elastic_backup_kind_maps_onto_the_replica_tier() -> None:
    """``snapshot`` (MaxText's default): the replica tier, paced, along ``data`` (a replica per slice);
    ``checkpoint``, or elastic training off: no replica tier; any other kind refused as MaxText refuses it."""
    assert elastic_config(MaxTextConfig()).memory_tier.replicas == ReplicaOptions(
        enabled=True, period=None, replica_axis="data")
    assert not replica_options(MaxTextConfig(elastic_backup_kind="checkpoint")).enabled
    assert not elastic_config(MaxTextConfig(elastic_enabled=False)).memory_tier.replicas.enabled
    given = MemoryTierOptions(shm_dir="/dev/shm/x", replicas=ReplicaOptions(period=5, host_budget_bytes=1 << 30))
    tier = elastic_config(MaxTextConfig(), memory_tier=given).memory_tier
    assert (tier.shm_dir, tier.replicas) == ("/dev/shm/x", ReplicaOptions(
        enabled=True, period=5, replica_axis="data", host_budget_bytes=1 << 30))  # what MaxText has no flag for: kept
    with pytest.raises(ValueError, match="elastic_backup_kind must be one of"):
        replica_options(MaxTextConfig(elastic_backup_kind="emergency"))
