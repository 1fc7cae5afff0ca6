"""A step ckptd's persist worker writes from a memory snapshot records the trainer's mesh and shardings in
Orbax's ``_sharding`` (not the worker's own grid of fake devices), so plain Orbax, restoring without a
target, lays the state out as the trainer had it; with a target it restores bit for bit onto another mesh.
The restores run in another interpreter with nothing but plain Orbax."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.elastic_mlp import init_state, partition_specs
from tests.support.helpers import clean_env
from trainer_client.core.format._files import DEFAULT_ITEM, SHARDING_FILE
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import leaf_name, spec_to_json, training_metadata

pytestmark = pytest.mark.needs_devices(8)

# Plain Orbax in its own interpreter: restore step 21 without a target, then onto a (3, 2) mesh of 6 devices.
_RESTORE = r"""
import json, sys
import jax, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

job, expected = sys.argv[1], np.load(sys.argv[2])
def name(path):
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
mgr = ocp.CheckpointManager(job)
plain = jax.tree_util.tree_flatten_with_path(mgr.restore(21))[0]
out = {"plain": {name(p): [list(x.sharding.mesh.axis_names), list(x.sharding.mesh.devices.shape),
                           [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec],
                           bool(np.array_equal(np.asarray(x), expected[name(p)]))] for p, x in plain}}
small = jax.make_mesh((3, 2), ("replica", "data"), devices=jax.devices()[:6])
target = jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(small, x.sharding.spec)),
    mgr.restore(21))
restored = jax.tree_util.tree_flatten_with_path(mgr.restore(21, args=ocp.args.StandardRestore(target)))[0]
out["target"] = {name(p): [x.sharding.mesh.devices.shape == (3, 2),
                           bool(np.array_equal(np.asarray(x), expected[name(p)]))] for p, x in restored}
print(json.dumps(out))
"""


def _state(mesh: Mesh) -> Any:
    specs = partition_specs(jax.eval_shape(init_state))
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(lambda: init_state(11), out_shardings=shardings)()


def test_a_persisted_step_records_the_trainers_mesh_for_plain_orbax(tmp_path: Path) -> None:
    from ckptd.persist._persist_worker import persist

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "data"))
    state = _state(mesh)
    leaves = {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    (tmp_path / "shm").mkdir(mode=0o700)
    meta = training_metadata(21, state, data_position=21 * 48, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])
    snapshot = MemoryTier(str(tmp_path / "shm"), "job").save(21, state, meta, persist=True)
    persist(snapshot, str(tmp_path / "root" / "job"))

    raw = json.loads((tmp_path / "root" / "job" / "21" / DEFAULT_ITEM / SHARDING_FILE).read_text())
    recorded = {base64.b64decode(key).decode(): json.loads(value) for key, value in raw.items()}
    assert set(recorded) == set(leaves)
    for name, leaf in leaves.items():
        sharding = recorded[name]
        assert sharding["sharding_type"] == "NamedSharding", (name, sharding)
        assert (sharding["axis_names"], sharding["shape"]) == (["replica", "data"], [4, 2]), (name, sharding)
        assert sharding["partition_spec"] == spec_to_json(leaf.sharding.spec), (name, sharding)

    np.savez(tmp_path / "expected.npz", **{name: np.asarray(leaf) for name, leaf in leaves.items()})
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE, str(tmp_path / "root" / "job"), str(tmp_path / "expected.npz")],
        env=clean_env(), capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(answer["plain"]) == set(leaves)
    for name, (axes, shape, spec, exact) in answer["plain"].items():  # without a target: the trainer's layout
        assert (axes, shape) == (["replica", "data"], [4, 2]), name
        assert spec == spec_to_json(leaves[name].sharding.spec), name
        assert exact, name
    assert answer["target"] == {name: [True, True] for name in leaves}  # onto (3, 2), bit for bit
