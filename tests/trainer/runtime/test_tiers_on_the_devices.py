"""Every tier saves and restores exactly on the devices this run has, whatever their number: on 8 fake CPU devices
in the suite, on one real chip under ``make test-device`` (where most runtime tests, built for 8 devices, skip).

Each restore comes after a training step that donates the state the tier copied, as a real step does: what the
tier holds must not be the buffers the step took. Exactness is checked against the state kept on the host before
the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, training_metadata

MemoryKind = Literal["auto", "pinned_host", "unpinned_host"]


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("data",))


def _state(mesh: Mesh, seed: int) -> dict[str, Any]:
    """A small training state: rows over every device, a replicated vector, a bf16 leaf and a step count."""
    rng = np.random.default_rng(seed)
    rows = 8 * len(mesh.devices.flat)
    return {"w": jax.device_put(rng.standard_normal((rows, 256)).astype(np.float32), NamedSharding(mesh, P("data"))),
            "b": jax.device_put(rng.standard_normal(256).astype(np.float32), NamedSharding(mesh, P())),
            "h": jax.device_put(jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16),
                                NamedSharding(mesh, P("data"))),
            "step": jax.device_put(np.int32(seed), NamedSharding(mesh, P()))}


def _train(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"] * 0.5 + 1, "b": state["b"] - 1, "h": state["h"] * 2, "step": state["step"] + 1}


_step = jax.jit(_train, donate_argnums=0)  # a training step: it takes the state's buffers


def _host(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in state.items()}


def _assert_equal(got: dict[str, Any], want: dict[str, np.ndarray], mesh: Mesh) -> None:
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
        assert got[name].sharding.is_equivalent_to(NamedSharding(mesh, P("data") if name in ("w", "h") else P()),
                                                   value.ndim)


def _target(state: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


@pytest.mark.parametrize("memory_kind", ["auto", "pinned_host", "unpinned_host"])
def test_replica_snapshots_of_a_donated_state_restore_exactly(memory_kind: MemoryKind) -> None:
    """Snapshots every step, the step donating the state each one copied; the held snapshot is the state of
    its step, bit for bit, on the mesh. The loop never waited for a copy: each due step took a snapshot or
    skipped one still in flight."""
    mesh = _mesh()
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if memory_kind != "auto" and memory_kind not in kinds:
        pytest.skip(f"this device has no {memory_kind} memory ({sorted(kinds)})")
    state = _state(mesh, seed=1)
    replicas = RunnerReplicas(ReplicaOptions(period=1, when_busy="skip", memory_kind=memory_kind),
                              {0: list(mesh.devices.flat)})
    kept: dict[int, dict[str, np.ndarray]] = {}
    try:
        replicas.prepare(state)
        for step in range(12):
            replicas.boundary(step)
            kept[step] = _host(state)
            if replicas.due(step):
                replicas.snapshot(step, state, step * 8, None)
            state = _step(state)
        assert replicas.tier is not None
        replicas.tier.wait()
        stats = replicas.stats()
        assert stats is not None and stats.snapshots >= 1 and stats.snapshots + stats.skips == 12
        held = replicas.held_step()
        assert held is not None
        restored = replicas.tier.restore(mesh)
        assert restored.step == held and restored.data_position == held * 8
        _assert_equal(restored.state, kept[held], mesh)
        _step(restored.state)  # the restored state trains (and is donated) like any other
    finally:
        replicas.close()


def test_a_shared_memory_snapshot_of_a_donated_state_restores_exactly(tmp_path: Path) -> None:
    mesh = _mesh()
    state = _state(mesh, seed=2)
    want = _host(state)
    tier = MemoryTier(str(tmp_path), "job", max_snapshots=2)
    try:
        meta = training_metadata(5, state, data_position=40, global_batch=8, mesh=mesh, slices=[0])
        path = tier.save(5, state, meta, persist=False)
        target = _target(state)
        _step(state)  # donates what the snapshot was written from
        _assert_equal(restore_snapshot(path, target), want, mesh)
    finally:
        tier.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reader", "orbax"])
def test_a_step_on_storage_restores_exactly_through_either_reader(tmp_path: Path, direct: bool) -> None:
    mesh = _mesh()
    state = _state(mesh, seed=3)
    want = _host(state)
    checkpointer = Checkpointer(str(tmp_path / "job"), async_save=False)
    checkpointer.save(7, state, data_position=56, global_batch=8, mesh=mesh, slices=[0])
    checkpointer.close()
    target = _target(state)
    _step(state)
    _assert_equal(restore(str(tmp_path / "job" / "7"), target, direct=direct), want, mesh)
