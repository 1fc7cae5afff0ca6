"""trainer_client.CheckpointManager told the global batch: every save records ckptd's training metadata, and a
save the host-memory tier can hold goes there, persisted by a real ckptd as a good Orbax step plain Orbax
restores; what the tier cannot hold (another item, a full tier) goes to storage through Orbax (docs/adopt.md,
"Training metadata and the memory tier")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from tests.support.grain_data import dataset
from tests.support.server import StartServer
from trainer_client import CheckpointManager, CkptdClient, ClientSettings
from trainer_client.core._storage import Storage
from trainer_client.core._validation import validate_step
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._steps import read_training
from trainer_client.runtime.orbax_compat._manager_saves import MemorySave, TrainingInfo, memory_save

BATCH = 32


@pytest.fixture(autouse=True)
def _no_ckptd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CKPTD_URL", "CKPTD_SHM_DIR", "CKPTD_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _state(step: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8) + step, NamedSharding(mesh, PartitionSpec("data", "model")))
    b = jax.device_put(jnp.full((4,), step, jnp.int32), NamedSharding(mesh, PartitionSpec()))
    return {"w": w, "b": b, "count": step}


def _target() -> dict[str, Any]:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                  if isinstance(a, jax.Array) else a, _state(0))


def _custom(job: Path, step: int) -> dict[str, Any]:
    return dict(json.loads((job / str(step) / "_CHECKPOINT_METADATA").read_text())["custom_metadata"])


@pytest.mark.needs_devices(8)
def test_saves_go_through_the_memory_tier_and_ckptd_persists_good_orbax_steps(
    tmp_path: Path, ckptd_server: StartServer
) -> None:
    root, shm = tmp_path / "run", tmp_path / "shm"
    root.mkdir()
    server = ckptd_server(root, shm_dir=str(shm), refresh_interval_s=0.2)
    client = CkptdClient(ClientSettings(url=server.url, shm_dir=str(shm), run_id="run-7"), root=str(root))
    job = root / "checkpoints"
    iterator = iter(dataset(batch=4))
    options = ocp.CheckpointManagerOptions(save_interval_steps=2)
    with CheckpointManager(job, options=options, item_names=("state", "iter"), ckptd=client,
                           global_batch=BATCH) as mgr:
        for step in range(6):
            next(iterator)
            saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(step)),
                                                           iter=grain.checkpoint.CheckpointSave(iterator)))
            assert saved == (step % 2 == 0)
            if saved:  # the loop paid the device-to-host copy: the step is a snapshot, Orbax's view counts it
                assert (shm / "checkpoints" / str(step)).is_dir()
                assert not mgr.should_save(step)
                mgr.wait_until_finished()  # until ckptd has committed it on storage (the tier holds two)
                assert mgr.latest_step() == step
        assert list(mgr.all_steps()) == [0, 2, 4] and mgr.latest_step() == 4
        got = mgr.restore(None, args=ocp.args.Composite(state=ocp.args.StandardRestore(_target())))
        fresh = iter(dataset(batch=4))  # Grain's own handler reads the iterator's state ckptd wrote
        mgr.restore(4, args=ocp.args.Composite(state=ocp.args.StandardRestore(_target()),
                                               iter=grain.checkpoint.CheckpointRestore(fresh)))
        assert fresh.get_state() == {"next_index": 5}
        with pytest.raises(StepAlreadyExistsError):  # as Orbax refuses a step it has saved
            mgr.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(4))), force=True)
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(64.0).reshape(8, 8) + 4)
    storage = Storage(str(job))
    for step in (0, 2, 4):
        assert validate_step(storage, storage.join(str(step))).ok
        training, _ = read_training(storage, storage.join(str(step)))
        assert training is not None
        assert (training.step, training.data_position, training.global_batch) == (step, step * BATCH, BATCH)
        assert (training.mesh.axis_names, training.mesh.shape, training.run_id) == (["data", "model"], [4, 2], "run-7")
        assert training.arrays["w"].partition_spec == ["data", "model"]
        # Grain's item: the iterator's state after step + 1 batches, as Grain's handler writes it
        written = json.loads((job / str(step) / "iter" / "process_0-of-1.json").read_text())
        assert written["next_index"] == step + 1
    # plain Orbax restores what ckptd persisted
    with ocp.CheckpointManager(job, item_names=("state",)) as plain:
        assert list(plain.all_steps()) == [0, 2, 4]
        restored = plain.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(_target())))
    np.testing.assert_array_equal(np.asarray(restored.state["b"]), np.full(4, 2))
    assert int(restored.state["count"]) == 2
    with server.client() as http:
        events = http.get("/v1/jobs/checkpoints/events").json()["events"]
    saves = [e for e in events if e["kind"] == "checkpoint_started"]
    assert [(e["step"], e["tier"]) for e in saves] == [(0, "memory+persist"), (2, "memory+persist"),
                                                      (4, "memory+persist")]
    assert all(e["blocked_seconds"] >= 0 for e in saves)


@pytest.mark.needs_devices(8)
def test_training_metadata_is_recorded_with_storage_saves(tmp_path: Path) -> None:
    """No tier configured: the save goes to Orbax with ckptd's metadata in its custom metadata and manifest, at
    the data position the loop gives; the loop's own custom metadata stays."""
    job = tmp_path / "checkpoints"
    with CheckpointManager(job, global_batch=BATCH, data_position=lambda step: (step + 1) * BATCH) as mgr:
        assert mgr.save(3, args=ocp.args.StandardSave(_state(3)), custom_metadata={"mine": 1})
        mgr.wait_until_finished()
    custom = _custom(job, 3)
    assert custom["mine"] == 1 and custom["ckptd"]["data_position"] == 4 * BATCH
    storage = Storage(str(job))
    result = validate_step(storage, storage.join("3"))
    assert result.ok and result.manifest is not None and result.manifest.training is not None
    assert result.manifest.training.data_position == 4 * BATCH


@pytest.mark.needs_devices(8)
def test_without_the_global_batch_no_metadata_is_made_up(tmp_path: Path) -> None:
    job = tmp_path / "checkpoints"
    with CheckpointManager(job) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(_state(1)))
    assert "ckptd" not in _custom(job, 1)
    with pytest.raises(ValueError, match="data_position= needs global_batch="):
        CheckpointManager(job, data_position=lambda step: step)


@pytest.mark.needs_devices(8)
def test_what_the_tier_cannot_hold_goes_to_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON item beside the state, and a state of numpy arrays (no mesh: no metadata either), go to storage;
    a state the tier holds goes to shared memory (no ckptd runs here: it waits there)."""
    shm, job = tmp_path / "shm", tmp_path / "checkpoints"
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    with CheckpointManager(job, item_names=("state", "extra"), global_batch=BATCH, persist_timeout_s=0.5) as mgr:
        assert mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1)),
                                                   extra=ocp.args.JsonSave({"lr": 0.1})))
        assert mgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(3)})))
        assert mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(3))))
        assert (shm / "checkpoints" / "3").is_dir() and not (job / "3").exists()
        with pytest.raises(TimeoutError, match=r"steps \[3\]"):
            mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [1, 2] and mgr.latest_step() == mgr.best_step() == 2
    for step in (1, 2):
        assert (job / str(step) / COMMIT_MARKER).is_file() and not (shm / "checkpoints" / str(step)).exists()
    assert _custom(job, 1)["ckptd"]["global_batch"] == BATCH and "ckptd" not in _custom(job, 2)


@pytest.mark.needs_devices(8)
def test_a_full_tier_sends_the_save_to_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ckptd persists the snapshots: after the tier's two, the next save goes to Orbax."""
    shm, job = tmp_path / "shm", tmp_path / "checkpoints"
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    with CheckpointManager(job, global_batch=BATCH, persist_timeout_s=0.2) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, args=ocp.args.StandardSave(_state(step)))
        with pytest.raises(TimeoutError):
            mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [3] and not mgr.should_save(2)
    assert sorted(p.name for p in (shm / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    assert _custom(job, 3)["ckptd"]["step"] == 3


@pytest.mark.needs_devices(8)
def test_which_save_arguments_the_tier_holds() -> None:
    state = _state(1)
    chunked = ocp.args.PyTreeSave(state, save_args=jax.tree_util.tree_map(
        lambda _: ocp.SaveArgs(chunk_byte_size=1 << 20), state))  # MaxText's: a layout choice, the values kept
    held = memory_save(ocp.args.Composite(items=chunked), default_item=False)
    assert isinstance(held, MemorySave) and held.item == "items" and held.data_iterator is None
    unnamed = memory_save(ocp.args.StandardSave(state), default_item=True)
    assert isinstance(unnamed, MemorySave) and unnamed.item == "default"
    casting = ocp.args.PyTreeSave(state, save_args=jax.tree_util.tree_map(
        lambda _: ocp.SaveArgs(dtype=jnp.float16), state))
    refused = {
        "cast": ocp.args.Composite(items=casting),
        "no array item": ocp.args.Composite(extra=ocp.args.JsonSave({"a": 1})),
        "two array items": ocp.args.Composite(a=ocp.args.StandardSave(state), b=ocp.args.StandardSave(state)),
        "iter is no iterator": ocp.args.Composite(a=ocp.args.StandardSave(state), iter=ocp.args.JsonSave({})),
        "unnamed, items named": ocp.args.StandardSave(state),
        "numpy": ocp.args.Composite(a=ocp.args.StandardSave({"w": np.ones(2)})),
    }
    for why, args in refused.items():
        assert isinstance(memory_save(args, default_item=False), str), why


def test_the_data_position_is_an_index() -> None:
    assert TrainingInfo(8).position(3) == 24
    assert TrainingInfo(8, lambda step: np.int64(step + 1) * 8).position(3) == 32
    for bad in (lambda step: 1.5, lambda step: -1, lambda step: True):
        with pytest.raises(ValueError, match="global index of the next sample"):
            TrainingInfo(8, cast(Any, bad)).position(3)
    with pytest.raises(ValueError):
        TrainingInfo(0)
