"""Leaves that are not arrays (Python ints, floats, bools and strings, numpy scalars) survive every path of a
step: a direct save and restore (ckptd's reader and Orbax's), a memory snapshot (recorded as data) and a
restore from it, the persist by ckptd's worker, a plan and a restore from storage onto a smaller mesh. Plain
Orbax, in another process, reads a persisted step's values exactly as it reads a direct save's. A
snapshot's values are untrusted input: one that does not fit its type is refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.helpers import clean_env
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core.format._snapshot import SNAPSHOT_META_FILE, problems, read_meta
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, training_metadata

VALUES: dict[str, Any] = {"epoch": 3, "big": 2**40, "lr": 2.5e-4, "inf": -math.inf, "name": "run-é",
                          "done": True, "f32": np.float32(1.1), "i8": np.int8(-7), "flag": np.bool_(True)}

_PLAIN = r"""
import json, sys
import numpy as np
import orbax.checkpoint as ocp
out = {}
for path in sys.argv[1:]:
    values = ocp.StandardCheckpointer().restore(path)["values"]
    out[path] = {k: [type(v).__name__, str(np.asarray(v).dtype) if not isinstance(v, str) else "str", repr(v)]
                 for k, v in values.items()}
print(json.dumps(out))
"""


def _state(mesh: jax.sharding.Mesh, shift: int = 0) -> dict[str, Any]:
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) + shift, NamedSharding(mesh, P("replica", "data")))
    return {"w": w, "values": dict(VALUES, epoch=VALUES["epoch"] + shift), "nothing": None}


def _target(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Value leaves of the types wanted (their values are not used) and the array on ``mesh``."""
    return {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("replica", "data"))),
            "values": {k: type(v)() if not isinstance(v, np.generic) else type(v)(0) for k, v in VALUES.items()},
            "nothing": None}


def _assert_exact(restored: dict[str, Any], shift: int = 0) -> None:
    want = dict(VALUES, epoch=VALUES["epoch"] + shift)
    assert set(restored["values"]) == set(want)
    for key, value in want.items():
        got = restored["values"][key]
        assert type(got) is type(value), (key, type(got))
        assert got == value or (isinstance(value, float) and math.isnan(value) and math.isnan(got)), (key, got)
    assert np.array_equal(np.asarray(restored["w"]), np.arange(64, dtype=np.float32).reshape(8, 8) + shift)
    assert restored["nothing"] is None


@pytest.mark.needs_devices(8)
def test_values_survive_direct_memory_persist_and_a_restore_onto_fewer_devices(tmp_path: Path) -> None:
    from ckptd.persist._persist_worker import persist

    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    small = jax.make_mesh((2, 2), ("replica", "data"), devices=jax.devices()[:4])
    job = tmp_path / "root" / "job"
    state = _state(mesh)
    meta = training_metadata(10, state, data_position=0, global_batch=8, mesh=mesh, slices=[0])
    assert "values.name" not in meta.arrays and meta.arrays["values.epoch"].dtype == "int64"
    checkpointer = Checkpointer(str(job))
    try:
        checkpointer.save_with_metadata(10, state, meta)
    finally:
        checkpointer.close()
    for direct in (True, False):  # ckptd's reader with the values through Orbax, and Orbax alone
        _assert_exact(restore(str(job / "10"), _target(small), direct=direct))

    tier = MemoryTier(str(tmp_path / "shm"), "job", preallocate=False, max_snapshots=3)
    snapshot = tier.save(20, _state(mesh, 1), meta.model_copy(update={"step": 20}), persist=True)
    later = tier.save(30, _state(mesh, 2), meta.model_copy(update={"step": 30}), persist=True)  # same structure
    recorded = {tuple(k for _, k in e.path): e.value for e in read_meta(later).tree if e.kind == "value"}
    assert recorded[("values", "epoch")] is not None and recorded[("values", "epoch")].value == VALUES["epoch"] + 2
    assert recorded[("values", "f32")].dtype == "float32" and len(read_meta(later).leaf_names) == 1
    _assert_exact(restore_snapshot(snapshot, _target(small)), 1)
    _assert_exact(restore_snapshot(later, _target(small)), 2)

    persist(snapshot, str(job))
    plan = plan_for_step(Storage(str(tmp_path / "root")), str(job / "20"), p.ResumeRequest(alive_devices=4),
                         job="job", step=20)
    assert plan.mesh.shape == [2, 2] and "values.name" not in plan.arrays
    _assert_exact(restore(plan.path, _target(small)), 1)
    # an array target for a saved number gets an array, as Orbax gives it
    as_array = _target(small)
    as_array["values"]["epoch"] = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(small, P()))
    restored = restore(plan.path, as_array)
    assert isinstance(restored["values"]["epoch"], jax.Array) and int(restored["values"]["epoch"]) == 4
    assert int(restore_snapshot(snapshot, as_array)["values"]["epoch"]) == 4
    # and a value target for a saved 0-d array gets the value
    as_value = _target(small)
    as_value["w"] = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(small, P()))
    counted = {**_state(mesh), "count": jax.device_put(np.int32(7), NamedSharding(mesh, P()))}
    zero_d = tier.save(40, counted, meta.model_copy(update={"step": 40}), persist=False)
    restored = restore_snapshot(zero_d, {**as_value, "count": 0})
    assert type(restored["count"]) is int and restored["count"] == 7

    # plain Orbax, in another process, reads the persisted step's values as it reads the direct save's
    proc = subprocess.run([sys.executable, "-c", _PLAIN, str(job / "10" / "default"), str(job / "20" / "default")],
                          env=clean_env(), capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    direct_save, persisted = plain[str(job / "10" / "default")], plain[str(job / "20" / "default")]
    assert {k: v[:2] for k, v in direct_save.items()} == {k: v[:2] for k, v in persisted.items()}
    assert persisted["name"][2] == repr(VALUES["name"]) and persisted["lr"][2] == repr(VALUES["lr"])
    assert persisted["epoch"][2] == "4" and persisted["f32"][:2] == ["ndarray", "float32"]


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("value", [{"type": "int", "value": 300, "dtype": "int8"},
                                   {"type": "float", "value": "not a float"},
                                   {"type": "str", "value": 5},
                                   {"type": "int", "value": 1, "dtype": "object"}])
def test_a_snapshot_value_that_does_not_fit_its_type_is_refused(tmp_path: Path, value: dict[str, Any]) -> None:
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    state = _state(mesh)
    snapshot = MemoryTier(str(tmp_path / "shm"), "job", preallocate=False).save(
        5, state, training_metadata(5, state, data_position=0, global_batch=8, mesh=mesh, slices=[0]), persist=True)
    meta = json.loads((snapshot / SNAPSHOT_META_FILE).read_text())
    entry = next(e for e in meta["tree"] if e["kind"] == "value")
    entry["value"] = value
    (snapshot / SNAPSHOT_META_FILE).write_text(json.dumps(meta))
    assert any(SNAPSHOT_META_FILE in problem for problem in problems(snapshot))
