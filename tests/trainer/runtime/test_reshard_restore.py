"""Restores on the planned mesh are exact: 8->6, 8->4, 8->2, 8->7 and 4->8 fake devices, including arrays
whose first dimension the new axis size does not divide (the plan changes their spec and says so)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_client.core._resume_decision import resume_plan
from trainer_client.core._storage import Storage
from trainer_client.core.format._steps import latest_committed
from trainer_client.core.protocol import ResumeRequest
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, spec_from_json

pytestmark = pytest.mark.needs_devices(8)

SPECS = {
    "a": P("replica", "data"),  # (8, 6): 8 does not divide by 3 or 7
    "b": P("replica", None),  # (12, 4): divides by 2, 3, 4 but not 7 or 8
    "c": P("data"),  # (10,)
    "d": P(("replica", "data"), None),  # (16, 3): 16 over replica*data
    "e": P(None, "replica"),  # (5, 8): second dimension on replica
}
SHAPES = {"a": (8, 6), "b": (12, 4), "c": (10,), "d": (16, 3), "e": (5, 8)}


def _state(mesh: Mesh) -> dict[str, jax.Array]:
    out = {}
    for k, (name, shape) in enumerate(sorted(SHAPES.items())):
        value = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * (k + 1) + 0.5
        out[name] = jax.device_put(value, NamedSharding(mesh, SPECS[name]))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, np.ndarray]]]:
    out = {}
    for n_devices, shape in ((8, (4, 2)), (4, (2, 2))):
        root = tmp_path_factory.mktemp(f"saved{n_devices}")
        mesh = Mesh(np.array(jax.devices()[:n_devices]).reshape(shape), ("replica", "data"))
        state = _state(mesh)
        ck = Checkpointer(str(root / "job"))
        ck.save(5, state, data_position=5 * 16, global_batch=16, mesh=mesh, slices=[])
        ck.close()
        out[n_devices] = (root, {k: np.asarray(v) for k, v in state.items()})
    return out


@pytest.mark.parametrize(("before", "after", "mesh_shape"),
                         [(8, 6, [3, 2]), (8, 4, [2, 2]), (8, 2, [1, 2]), (8, 7, [3, 2]), (4, 8, [4, 2])])
def test_restore_on_the_planned_mesh_is_exact(
    saved: dict[int, tuple[Path, dict[str, np.ndarray]]], before: int, after: int, mesh_shape: list[int]
) -> None:
    root, values = saved[before]
    storage = Storage(str(root))
    found = latest_committed(storage, storage.join("job"))
    assert found is not None and found.training is not None
    plan = resume_plan(job="job", step=found.step, path=found.path, training=found.training,
                       saved_layout=(None, {}), request=ResumeRequest(policy="resize", alive_devices=after))
    assert plan.mesh.shape == mesh_shape and plan.idle_devices == after - np.prod(mesh_shape)
    mesh = Mesh(np.array(jax.devices()[: plan.mesh.size]).reshape(plan.mesh.shape), tuple(plan.mesh.axis_names))
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))

    target = {}
    for name, spec in plan.arrays.items():
        assert spec.shape == list(SHAPES[name]) and spec.dtype == "float32"
        target[name] = jax.ShapeDtypeStruct(tuple(spec.shape), jnp.float32,
                                            sharding=NamedSharding(mesh, spec_from_json(spec.partition_spec)))
    restored = restore(plan.path, target)

    for name, array in restored.items():
        assert np.array_equal(np.asarray(array), values[name]), name
        assert array.sharding.spec == spec_from_json(plan.arrays[name].partition_spec)
        assert array.sharding.mesh.devices.shape == tuple(mesh_shape)
    # Whatever no longer divides was changed, visibly; whatever still divides was kept.
    replica = sizes["replica"]
    assert plan.arrays["a"].changed == (8 % replica != 0)
    assert plan.arrays["b"].changed == (12 % replica != 0)
    assert plan.arrays["d"].changed == (16 % (replica * sizes["data"]) != 0)
    assert not plan.arrays["c"].changed
    changed = [n for n, s in plan.arrays.items() if s.changed]
    assert all(any(note.startswith(f"{n}:") for note in plan.notes) for n in changed)
    if (before, after) == (8, 6):
        assert changed == ["a", "d", "e"]  # first dims 8 and 16 over replica=3; 8 in dim 1 of "e"
        assert plan.arrays["d"].partition_spec == ["data", None]
