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
