"""On a real accelerator (``make test-device``): the host memory kinds the replica tier copies into are there, and a
copy into each comes back exactly, even when the step that follows donates the arrays it was taken from.

On CPU the host memory kinds are the device's own memory, so these say nothing there: they skip.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

pytestmark = pytest.mark.device

HOST_KINDS = ("pinned_host", "unpinned_host")


@pytest.fixture
def device() -> jax.Device:
    if jax.default_backend() == "cpu":
        pytest.skip("means something on an accelerator only: on CPU the host memory kinds are the device's memory")
    return jax.devices()[0]


def test_the_device_offers_both_host_memory_kinds(device: jax.Device) -> None:
    kinds = {memory.kind for memory in device.addressable_memories()}
    assert set(HOST_KINDS) <= kinds, kinds
    assert device.default_memory().kind not in HOST_KINDS


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_a_host_copy_survives_a_step_that_donates_its_source(device: jax.Device, kind: str) -> None:
    values = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    state = jax.device_put(values, SingleDeviceSharding(device))
    copy = jax.device_put(state, SingleDeviceSharding(device, memory_kind=kind))  # dispatched, not waited for
    step = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
    after = step(state)  # donates the buffer the copy reads
    assert state.is_deleted()
    assert copy.sharding.memory_kind == kind
    np.testing.assert_array_equal(np.asarray(copy), values)
    np.testing.assert_array_equal(np.asarray(after), values * 2 + 1)
    back = jax.device_put(copy, SingleDeviceSharding(device))
    assert back.sharding.memory_kind == device.default_memory().kind
    np.testing.assert_array_equal(np.asarray(back), values)


def test_a_snapshot_s_copy_runs_beside_donating_steps(device: jax.Device) -> None:
    """The replica tier's promise on an accelerator: the snapshot call returns once its copy is dispatched (from an
    on-device copy, so the next step may donate the state), and donating steps run while the copy to the host is in
    flight; the held snapshot is the state of its step, exactly. 256 MiB: the copy to the host takes far longer than
    an on-device step on any accelerator (its link is slower than its memory), so the copy is still in flight."""
    from trainer_client.runtime.replicas._options import ReplicaOptions
    from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas

    sharding = SingleDeviceSharding(device)
    state = {"w": jax.device_put(np.arange(64 << 20, dtype=np.float32).reshape(8192, 8192), sharding)}
    step = jax.jit(lambda s: {"w": s["w"] + 1}, donate_argnums=0)
    state = step(state)  # compiled before the snapshot
    want = np.asarray(state["w"])
    replicas = RunnerReplicas(ReplicaOptions(period=1, when_busy="skip", memory_kind="unpinned_host", staging=True),
                              {0: [device]})
    try:
        replicas.prepare(state)
        assert replicas.snapshot(1, state, 1, None)
        tier = replicas.tier
        assert tier is not None and tier.busy
        stepped = 0
        while tier.busy and stepped < 1000:
            state = step(state)
            jax.block_until_ready(state)
            stepped += 1
        assert stepped >= 1 and tier.wait(timeout_s=120)
        stats = replicas.stats()
        assert stats is not None and stats.staged and replicas.held_step() == 1
        np.testing.assert_array_equal(np.asarray(tier.restore({"w": sharding}).state["w"]), want)
    finally:
        replicas.close()
