"""The commit rule and the structural checks (trainer_client.core.format._steps) on real Orbax output."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.orbax_steps import training_metadata
from trainer_client.core._errors import ArrayIndexError
from trainer_client.core._storage import Entry, Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, COMMIT_MARKER, TMP_DIR_SUFFIX
from trainer_client.core.format._item_keys import item_kvstore_spec
from trainer_client.core.format._records import RecordPlace, record_paths, side_dir
from trainer_client.core.format._steps import (
    StepInspection,
    StepName,
    inspect_step,
    latest_committed,
    parse_step_name,
    read_saved_sharding,
    step_entries,
)
from trainer_client.core.protocol import MAX_STEP, StepState

# ---- parse_step_name -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("0", StepName(0, False)),
        ("120", StepName(120, False)),
        ("120.orbax-checkpoint-tmp", StepName(120, True)),
        ("120.orbax-checkpoint-tmp-1712345678901234", StepName(120, True)),
        ("7.orbax-checkpoint-tmp-3", StepName(7, True)),
        (str(MAX_STEP), StepName(MAX_STEP, False)),
        ("00000120", StepName(120, False)),  # step_format_fixed_length
        ("step_3", StepName(3, False, True)),  # Orbax's step_prefix; a bare Checkpointer user's own names
        ("checkpoint_3", StepName(3, False, True)),
        ("my_run_12", StepName(12, False, True)),
        ("checkpoint_3.orbax-checkpoint-tmp-17", StepName(3, True, True)),
    ],
)
def test_parse_step_name_accepts_steps(name: str, expected: StepName) -> None:
    assert parse_step_name(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "",
        "abc",
        "-1",
        "1.5",
        "+3",
        " 3",
        "3 ",
        "_3",
        ".ckptd_3",
        "step_3x",
        "3.orbax-checkpoint",
        "3orbax-checkpoint-tmp",
        "tmp.orbax-checkpoint-tmp",
        ".orbax-checkpoint-tmp",
        "3/4",
        str(MAX_STEP + 1),  # cannot be a step: no catalog (SQLite INTEGER) or request can name it
        "9" * 19,
        "1" * 20,
    ],
)
def test_parse_step_name_rejects_non_steps(name: str) -> None:
    assert parse_step_name(name) is None


# ---- real Orbax saves (in this process: tiny, 8 fake CPU devices) --------------------------------


def _orbax_save(job_dir: Path, steps: list[int], custom_metadata: dict[int, dict[str, Any]]) -> None:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    mgr = ocp.CheckpointManager(job_dir, options=ocp.CheckpointManagerOptions(max_to_keep=None))
    for step in steps:
        w = jax.device_put(jnp.ones((4, 8), jnp.float32) * step, NamedSharding(mesh, P(None, "data")))
        mgr.save(step, args=ocp.args.StandardSave({"params": {"w": w}, "step": jnp.int32(step)}),
                 custom_metadata=custom_metadata.get(step))
    mgr.wait_until_finished()
    mgr.close()


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job directory with steps 1 and 2 saved by plain Orbax; step 2 carries ckptd metadata."""
    job = tmp_path_factory.mktemp("layout") / "job"
    _orbax_save(job, [1, 2], {2: training_metadata(2)})
    return job


@pytest.fixture
def job(saved_job: Path, tmp_path: Path) -> Path:
    """A private copy of ``saved_job`` that a test may damage."""
    dst = tmp_path / "job"
    shutil.copytree(saved_job, dst)
    return dst


def _inspect(job: Path, name: str, **kwargs: Any) -> StepInspection:
    storage = Storage(str(job.parent))
    path = job / name
    entry = Entry(name, str(path), path.is_dir(), path.stat().st_mtime)
    inspection = inspect_step(storage, entry, **kwargs)
    assert inspection is not None
    return inspection


def _set_mtime(path: Path, when: float) -> None:
    for p in [path, *path.rglob("*")]:
        os.utime(p, (when, when))


def test_real_orbax_save_is_committed(job: Path) -> None:
    started = time.time()
    for name in ("1", "2"):
        assert (job / name / COMMIT_MARKER).is_file()  # Orbax (rename mode) writes the marker too
        ins = _inspect(job, name)
        assert ins.state is StepState.COMMITTED, ins.reason
        assert ins.reason is None
        assert ins.item_names == ("default",)
        assert ins.committed_at is not None and started - 600 < ins.committed_at <= time.time()
    plain = _inspect(job, "1")
    assert plain.training is None  # plain Orbax: no ckptd metadata
    with_meta = _inspect(job, "2")
    assert with_meta.training is not None
    assert with_meta.training.data_position == 128 and with_meta.training.mesh.shape == [4, 2]
    assert latest_committed(Storage(str(job)), str(job)) == with_meta


def test_tmp_copy_is_writing_then_abandoned(job: Path) -> None:
    tmp = job / f"3{TMP_DIR_SUFFIX}-1712345678"
    shutil.copytree(job / "2", tmp)
    assert (tmp / COMMIT_MARKER).exists()  # the marker alone does not commit a tmp directory
    ins = _inspect(job, tmp.name, save_timeout_s=60)
    assert (ins.step, ins.state) == (3, StepState.WRITING)
    assert ins.reason is not None and "tmp" in ins.reason
    assert ins.training is None and ins.committed_at is None

    _set_mtime(tmp, time.time() - 120)
    assert _inspect(job, tmp.name, save_timeout_s=60).state is StepState.ABANDONED
    assert _inspect(job, tmp.name, save_timeout_s=600).state is StepState.WRITING

    # One fresh file inside makes it a save in progress again.
    (tmp / "late-shard").write_bytes(b"x")
    assert _inspect(job, tmp.name, save_timeout_s=60).state is StepState.WRITING

    latest = latest_committed(Storage(str(job)), str(job))
    assert latest is not None and latest.step == 2


def test_step_without_commit_marker_is_not_committed_but_orbax_default_mode_takes_it(job: Path) -> None:
    # A commit-file save cut short: the step directory has its final name and all its files
    # but the finalizing commit_success.txt was never written.
    shutil.copytree(job / "2", job / "3")
    (job / "3" / COMMIT_MARKER).unlink()

    ins = _inspect(job, "3", save_timeout_s=60)
    assert ins.state is StepState.WRITING
    assert ins.reason is not None and COMMIT_MARKER in ins.reason
    _set_mtime(job / "3", time.time() - 120)
    assert _inspect(job, "3", save_timeout_s=60).state is StepState.ABANDONED

    latest = latest_committed(Storage(str(job)), str(job))
    assert latest is not None and latest.step == 2

    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path.atomicity import CommitFileTemporaryPath

    # Plain Orbax in its default (rename) mode for a local directory accepts the partial step ...
    mgr = ocp.CheckpointManager(job, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        assert mgr.latest_step() == 3
        assert 3 in mgr.all_steps()
    finally:
        mgr.close()
    # ... while Orbax's commit-file reader agrees with ckptd's rule.
    mgr = ocp.CheckpointManager(
        job,
        options=ocp.CheckpointManagerOptions(read_only=True, temporary_path_class=CommitFileTemporaryPath),
    )
    try:
        assert mgr.latest_step() == 2
    finally:
        mgr.close()


def _garble(text: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(text)

    return write


def _garble_bytes(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(data)

    return write


def _remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("relpath", "damage", "reason"),
    [
        (CHECKPOINT_METADATA, _remove, "_CHECKPOINT_METADATA missing"),
        (CHECKPOINT_METADATA, _garble('{"item_handlers": '), "_CHECKPOINT_METADATA is not JSON"),
        (CHECKPOINT_METADATA, _garble_bytes(b"\xff\xfe\x00garbage"), "_CHECKPOINT_METADATA is not JSON"),
        (CHECKPOINT_METADATA, _garble("[1, 2, 3]"), "_CHECKPOINT_METADATA is not a JSON object"),
        ("default/_METADATA", _remove, "default/_METADATA missing"),
        ("default/_METADATA", _garble("{tree_metadata"), "default/_METADATA is not JSON"),
        ("default/_METADATA", _garble("null"), "default/_METADATA is not a JSON object"),
    ],
)
def test_damaged_metadata_is_corrupt_with_a_reason(
    job: Path, relpath: str, damage: Callable[[Path], None], reason: str
) -> None:
    damage(job / "2" / relpath)
    ins = _inspect(job, "2")
    assert ins.state is StepState.CORRUPT
    assert ins.reason is not None and ins.reason.startswith(reason)
    assert ins.training is None
    latest = latest_committed(Storage(str(job)), str(job))
    assert latest is not None and latest.step == 1  # a corrupt step is skipped, never served


def test_invalid_ckptd_training_metadata_is_corrupt(job: Path) -> None:
    meta_path = job / "2" / CHECKPOINT_METADATA
    meta = json.loads(meta_path.read_text())
    meta["custom_metadata"]["ckptd"]["data_position"] = "not a number"
    meta_path.write_text(json.dumps(meta))
    ins = _inspect(job, "2")
    assert ins.state is StepState.CORRUPT
    assert ins.reason is not None and "training metadata is invalid" in ins.reason


def test_unrelated_custom_metadata_is_ignored(job: Path) -> None:
    meta_path = job / "1" / CHECKPOINT_METADATA
    meta = json.loads(meta_path.read_text())
    meta["custom_metadata"] = {"someone_else": {"x": 1}}
    meta_path.write_text(json.dumps(meta))
    ins = _inspect(job, "1")
    assert ins.state is StepState.COMMITTED and ins.training is None


def test_read_saved_sharding_of_a_real_save(job: Path) -> None:
    storage = Storage(str(job))
    mesh, arrays = read_saved_sharding(storage, str(job / "1"))
    assert mesh is not None
    assert mesh.axis_names == ["replica", "data"]
    assert mesh.shape == [4, 2]
    # "step" is a single-device array: no NamedSharding, so no entry.
    assert set(arrays) == {"params.w"}
    assert arrays["params.w"].partition_spec == [None, "data"]


def test_read_saved_sharding_without_a_usable_file(job: Path) -> None:
    storage = Storage(str(job))
    sharding = job / "1" / "default" / "_sharding"
    sharding.write_text("{not json")
    assert read_saved_sharding(storage, str(job / "1")) == (None, {})
    sharding.unlink()
    assert read_saved_sharding(storage, str(job / "1")) == (None, {})


def test_step_entries_newest_first_and_ignores_non_steps(job: Path) -> None:
    shutil.copytree(job / "2", job / f"2{TMP_DIR_SUFFIX}-99")
    shutil.copytree(job / "2", job / f"5{TMP_DIR_SUFFIX}")
    (job / "7").write_text("a file named like a step")
    (job / "notes").mkdir()
    (job / ("9" * 25)).mkdir()
    (job / str(MAX_STEP + 1)).mkdir()
    names = [entry.name for _, entry in step_entries(Storage(str(job)), str(job))]
    assert names == [f"5{TMP_DIR_SUFFIX}", "2", f"2{TMP_DIR_SUFFIX}-99", "1"]


def test_latest_committed_at_most_and_empty(job: Path, tmp_path: Path) -> None:
    storage = Storage(str(job))
    at_most = latest_committed(storage, str(job), at_most=1)
    assert at_most is not None and at_most.step == 1
    assert latest_committed(storage, str(job), at_most=0) is None
    assert latest_committed(Storage(str(tmp_path)), str(tmp_path / "nothing-here")) is None


# ---- where the records and the root item of a step are -----------------------------------------------


def test_side_records_and_the_root_item_are_addressed_alike_on_disk_and_gcs() -> None:
    assert side_dir("/data/ckpt/llama/300/") == "/data/ckpt/.ckptd/llama/300"
    assert side_dir("gs://b/ckpt/llama/checkpoint_300") == "gs://b/ckpt/.ckptd/llama/checkpoint_300"
    assert record_paths("/r/j/5", "x.json") == ("/r/.ckptd/j/5/x.json", "/r/j/5/x.json")
    assert RecordPlace("/r/j/5").write_path("x.json") == "/r/j/5/x.json"
    assert RecordPlace("/r/j/5", read_only=True).write_path("x.json") == "/r/.ckptd/j/5/x.json"
    assert item_kvstore_spec("gs://b/ckpt/job/100", "") == {"driver": "gcs", "bucket": "b", "path": "ckpt/job/100/"}
    assert item_kvstore_spec("gs://b/ckpt/job/100", "items")["path"] == "ckpt/job/100/items/"
    assert item_kvstore_spec("/r/job/100/", "") == {"driver": "file", "path": "/r/job/100/"}
    assert item_kvstore_spec("/r/job/100", "default") == {"driver": "file", "path": "/r/job/100/default/"}
    for bad in ("..", ".", "a/b", "/"):
        with pytest.raises(ArrayIndexError):
            item_kvstore_spec("/r/job/100", bad)
