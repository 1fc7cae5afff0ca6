"""A step written by release 0.1.0 (tests/fixtures/release_0_1_0, by tests/fixtures/write_release_step.py) restores
unchanged with today's code: planned, restored onto another mesh (arrays and a value leaf), its data position and
its data iterator's state, deep-validated against its manifest, and restored by plain Orbax (whose handler lookup
reads the module path that release recorded for the item ``iter``). A step written today names its handlers by
stable identifiers: no module path of ckptd's packages in its metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_client.checkpoint_io._iterator_state import ITER_HANDLER_TYPESTR, LEGACY_ITER_HANDLER_TYPESTRS
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import validate_step
from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore
from trainer_client.runtime.saving._data_iterator import planned_state

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "release_0_1_0"
W = np.arange(8, dtype=np.float32).reshape(4, 2)
B = np.array([0.5, -1.5], dtype=np.float32)


def _root(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "root")
    return tmp_path / "root"


def _plain_restore(step: Path) -> ocp.args.Composite:
    """Every item of ``step`` by plain Orbax, with no args: each item's handler is looked up in Orbax's registry
    by the name the step records for it."""
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        return checkpointer.restore(step)
    finally:
        checkpointer.close()


@pytest.mark.needs_devices(4)
def test_the_release_step_is_planned_and_restored_onto_another_mesh(tmp_path: Path) -> None:
    root = _root(tmp_path)
    storage = Storage(str(root))
    step = str(root / "job" / "7")
    plan = plan_for_step(storage, step, p.ResumeRequest(alive_devices=4), job="job", step=7)
    assert (plan.step, plan.data_position, plan.global_batch) == (7, 56, 8)
    assert plan.arrays["params.w"].shape == [4, 2] and plan.arrays["params.w"].partition_spec == ["data", None]
    mesh = jax.make_mesh((4,), ("data",))
    target = {"params": {"w": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=NamedSharding(mesh, P("data"))),
                         "b": jax.ShapeDtypeStruct((2,), np.float32, sharding=NamedSharding(mesh, P()))},
              "epoch": 0}
    for direct in (True, False):  # ckptd's own chunk reader, and Orbax's
        state = restore(plan.path, target, direct=direct)
        np.testing.assert_array_equal(np.asarray(state["params"]["w"]), W)
        np.testing.assert_array_equal(np.asarray(state["params"]["b"]), B)
        assert state["epoch"] == 3 and type(state["epoch"]) is int
        assert state["params"]["w"].sharding == target["params"]["w"].sharding
    assert planned_state(plan) == DataIteratorRecord(process_index=0, process_count=1,
                                                     state={"next_index": 56, "seed": 11})
    assert validate_step(storage, step, "deep").ok


@pytest.mark.needs_devices(4)
def test_plain_orbax_restores_the_release_step_by_its_recorded_handlers(tmp_path: Path) -> None:
    root = _root(tmp_path)
    recorded = json.loads((root / "job" / "7" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]["iter"]
    assert recorded in LEGACY_ITER_HANDLER_TYPESTRS  # what release 0.1.0 wrote
    restored = _plain_restore(root / "job" / "7")
    assert restored["iter"] == DataIteratorRecord(process_index=0, process_count=1,
                                                  state={"next_index": 56, "seed": 11})
    np.testing.assert_array_equal(np.asarray(restored["default"]["params"]["w"]), W)


def test_a_step_written_today_names_stable_identifiers_and_restores_alike(tmp_path: Path) -> None:
    mesh = jax.make_mesh((min(2, jax.device_count()),), ("data",))  # sharded where there are 2 devices (one chip: 1)
    state = {"w": jax.device_put(W, NamedSharding(mesh, P("data")))}
    checkpointer = Checkpointer(str(tmp_path / "job"), async_save=False)
    try:
        checkpointer.save(3, state, data_position=6, global_batch=2, mesh=mesh, slices=[0],
                          data_iterator=DataIteratorRecord(process_index=0, process_count=1, state={"i": 6}))
    finally:
        checkpointer.close()
    step = tmp_path / "job" / "3"
    handlers = json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers["iter"] == ITER_HANDLER_TYPESTR
    named = [str(f.relative_to(step)) for f in step.rglob("*") if f.is_file() and b"trainer_client." in f.read_bytes()]
    assert named == [], f"module paths of ckptd's packages on disk: {named}"
    restored = _plain_restore(step)
    assert restored["iter"].state == {"i": 6}
    np.testing.assert_array_equal(np.asarray(restored["default"]["w"]), W)
