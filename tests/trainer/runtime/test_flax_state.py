"""Flax training states through every path of a step, with real Flax: a linen ``TrainState`` (optax adam; its
``step`` a Python int, as ``apply_gradients`` leaves it outside jit) and an NNX model's and optimizer's
state (``nnx.state(model)``, ``nnx.state(nnx.Optimizer(...))``). Saved by ckptd (directly, and from memory
through its persist worker), or by plain Flax + Orbax in another process (a foreign step: listed, validated
quick and deep), each is planned onto 4 of 8 devices and restored exactly onto the plan's mesh, as the Flax
type it was (an NNX state merges back into a working model); a memory snapshot restores onto the smaller
mesh too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.cli._main import main as ckptd_main
from tests.support.orbax_steps import write_flax_steps
from trainer_client.checkpoint_io._state_tree import is_value, leaf_name
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, spec_from_json, training_metadata

HIDDEN = 16
KINDS = ["linen", "nnx"]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(4)(nn.relu(nn.Dense(HIDDEN)(x)))


class NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1, self.l2 = nnx.Linear(8, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.l1(x)))


def _spec(shape: tuple[int, ...]) -> P:
    return P(*["data" if d == HIDDEN else None for d in shape])


def _shard(tree: Any, mesh: Mesh) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x.shape))) if hasattr(x, "shape") else x, tree)


def _flax_state(kind: str, seed: int, mesh: Mesh) -> tuple[Any, Any]:
    """(state after one optimizer update on ``mesh``, what turns it back into a model: the NNX graph)."""
    if kind == "linen":
        model = Mlp()
        state = train_state.TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
                                              params=model.init(jax.random.key(seed), jnp.ones((1, 8)))["params"])
        state = _shard(state, mesh).apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, state.params))
        assert type(state.step) is int  # a value leaf, as Flax leaves it outside jit
        return state, None
    nnx_model = NnxMlp(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(nnx_model, optax.adam(1e-2), wrt=nnx.Param)
    optimizer.update(nnx_model, jax.tree_util.tree_map(jnp.ones_like, nnx.state(nnx_model, nnx.Param)))
    graph, _ = nnx.split(nnx_model)
    return _shard({"model": nnx.state(nnx_model), "optimizer": nnx.state(optimizer)}, mesh), graph


def _target(state: Any, plan: p.ResumePlan) -> Any:
    """``state``'s structure on the plan's mesh with the plan's specs (values kept: they ask for their type)."""
    mesh = Mesh(np.array(jax.devices()[: np.prod(plan.mesh.shape)]).reshape(plan.mesh.shape),
                tuple(plan.mesh.axis_names))

    def leaf(path: Any, x: Any) -> Any:
        if is_value(x):
            return x
        spec = spec_from_json(plan.arrays[leaf_name(path)].partition_spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(leaf, state)


def _plan(root: Path, job: str, step: int) -> p.ResumePlan:
    plan = plan_for_step(Storage(str(root)), str(root / job / str(step)), p.ResumeRequest(alive_devices=4),
                         job=job, step=step)
    assert plan.mesh.shape == [2, 2] and not any(spec.changed for spec in plan.arrays.values()), plan
    return plan


def _assert_exact(restored: Any, expected: Any, kind: str, graph: Any) -> None:
    assert type(restored) is type(expected)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(expected)
    pairs = zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree_util.tree_leaves(expected), strict=True)
    for (path, got), want in pairs:
        if is_value(want):
            assert type(got) is type(want) and got == want, leaf_name(path)
            continue
        assert got.sharding.mesh.devices.shape == (2, 2), leaf_name(path)
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want)), leaf_name(path)
    x = jnp.arange(16, dtype=jnp.float32).reshape(2, 8) / 10
    restored, expected = _on_host(restored), _on_host(expected)  # computed unsharded, on the host's copies
    if kind == "linen":
        assert restored.step == expected.step and restored.apply_fn is expected.apply_fn
        out = restored.apply_fn({"params": restored.params}, x)
        assert np.allclose(out, expected.apply_fn({"params": expected.params}, x))
    else:  # the restored state merges back into a model that computes what the saved one did
        out = nnx.merge(graph, restored["model"])(x)
        assert np.allclose(out, nnx.merge(graph, expected["model"])(x))


def _on_host(state: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("kind", KINDS)
def test_a_flax_state_saved_by_ckptd_restores_onto_fewer_devices(tmp_path: Path, kind: str) -> None:
    from ckptd.persist._persist_worker import persist

    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    root, job = tmp_path / "root", tmp_path / "root" / "job"
    direct, graph = _flax_state(kind, 10, mesh)
    meta = training_metadata(10, direct, data_position=0, global_batch=8, mesh=mesh, slices=[0])
    checkpointer = Checkpointer(str(job))
    try:
        checkpointer.save_with_metadata(10, direct, meta)
    finally:
        checkpointer.close()
    _assert_exact(restore(str(job / "10"), _target(direct, _plan(root, "job", 10))), direct, kind, graph)

    in_memory, _ = _flax_state(kind, 20, mesh)
    snapshot = MemoryTier(str(tmp_path / "shm"), "job", preallocate=False).save(
        20, in_memory, meta.model_copy(update={"step": 20}), persist=True)
    persist(snapshot, str(job))
    plan = _plan(root, "job", 20)
    _assert_exact(restore(plan.path, _target(in_memory, plan)), in_memory, kind, graph)
    _assert_exact(restore_snapshot(snapshot, _target(in_memory, plan)), in_memory, kind, graph)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("kind", KINDS)
def test_a_flax_step_written_by_plain_flax_is_listed_validated_planned_and_restored(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    write_flax_steps(root / "job", [3], kind, tmp_path / "values.npz")
    saved = np.load(tmp_path / "values.npz")
    assert ckptd_main(["show", str(root / "job"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["state"]) for c in listed] == [(3, "verified")]
    assert ckptd_main(["validate", str(root / "job"), "--deep", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bad"] == 0 and all(r["level"] == "deep" and r["ok"] for r in report["steps"]), report
    like, graph = _flax_state(kind, 3, jax.make_mesh((4, 2), ("replica", "data")))  # the same structure
    plan = _plan(root, "job", 3)
    restored = restore(plan.path, _target(like, plan))
    assert type(restored) is type(like)
    for path, got in jax.tree_util.tree_flatten_with_path(restored)[0]:
        want = saved[f"3/{leaf_name(path)}"]
        assert np.array_equal(np.asarray(got), want) and np.asarray(got).dtype == want.dtype, leaf_name(path)
    if kind == "nnx":
        assert nnx.merge(graph, _on_host(restored)["model"])(jnp.ones((1, 8))).shape == (1, 4)
