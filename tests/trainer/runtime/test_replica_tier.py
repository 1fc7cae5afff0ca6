"""The replica snapshot tier: copies of the state in host memory, restored from the replicas a slice loss spares.

8 fake CPU devices; a mesh of 2 replicas (one per simulated slice) x 4; ``InJaxFaults`` makes a lost slice's
arrays — the pinned copies on it too — raise ``DATA_LOSS`` as on Pathways.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.helpers import kernel_counts_page_faults
from trainer_client.errors import CkptdError, MemoryTierFull, NoWholeReplica
from trainer_client.runtime.replicas import _replica_tier
from trainer_client.runtime.replicas._replica_held import Snapshot, let_go
from trainer_client.runtime.replicas._replica_leaves import device_bytes, staging_room
from trainer_client.runtime.replicas._replica_tier import ReplicaTier, required_bytes
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slices import SimulatedSlices

AXES = ("replica", "model")


def _mesh(devices: list[jax.Device], replicas: int) -> Mesh:
    return Mesh(np.array(devices).reshape(replicas, -1), AXES)


def _state(mesh: Mesh, *, w_spec: P | None = None, seed: int = 3) -> dict[str, Any]:
    w_spec = P(None, "model") if w_spec is None else w_spec

    def put(x: Any, spec: P) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {"w": put(jnp.arange(32, dtype=jnp.float32).reshape(4, 8) * seed, w_spec),
            "b": put(jnp.arange(8, dtype=jnp.int32) + seed, P("model")),
            "rng": put(jax.random.key(seed), P()),
            "epoch": seed, "name": "run"}


def _spec(x: jax.Array) -> P:
    assert isinstance(x.sharding, NamedSharding)
    return x.sharding.spec


def _host(state: dict[str, Any]) -> dict[str, Any]:
    """Plain values to compare with: arrays as numpy, keys as their key data."""
    return {k: np.asarray(jax.random.key_data(v)) if k == "rng" else np.asarray(v) if isinstance(v, jax.Array)
            else v for k, v in state.items()}


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert jax.dtypes.issubdtype(got["rng"].dtype, jax.dtypes.prng_key)  # a typed key again
    host = _host(got)
    assert host.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(host[k], v, err_msg=k)


@pytest.fixture
def slices() -> SimulatedSlices:
    return SimulatedSlices(num_slices=2)


@pytest.fixture
def tier(slices: SimulatedSlices) -> Iterator[ReplicaTier]:
    t = ReplicaTier(replica_axis="replica", slice_to_devices=slices.slice_to_devices)
    yield t
    t.close()


@pytest.mark.needs_devices(8)
def test_restore_after_losing_one_of_two_slices_is_exact(slices: SimulatedSlices, tier: ReplicaTier) -> None:
    devices = jax.devices()
    state = _state(_mesh(devices, 2))
    want = _host(state)
    assert tier.snapshot(5, state, data_position=50) and tier.wait(10)
    assert tier.held() == (5, frozenset({0, 1}), (frozenset({0}), frozenset({1})))
    with InJaxFaults(slices) as faults:
        slices.take_down(1, None)  # everything on slice 1 is gone, its pinned copies too
        with pytest.raises(jax.errors.JaxRuntimeError):
            jax.block_until_ready(state["w"])
        shrunk = _mesh(devices[:4], 1)
        out = tier.restore(shrunk, lost_slices={1})
        assert faults.raised  # the lost replica was tried and refused, not read
    assert (out.step, out.data_position) == (5, 50)
    _assert_equal(out.state, want)
    assert out.state["w"].sharding == NamedSharding(shrunk, P(None, "model"))
    assert tier.held() == (5, frozenset({0}), (frozenset({0}),))  # the tier now holds the restored step on the new mesh


@pytest.mark.needs_devices(8)
def test_restore_onto_a_hot_spare_keeps_the_shape() -> None:
    slices = SimulatedSlices(num_slices=4)  # slices of 2 devices: the job on 0 and 1, 2 and 3 spares
    by_slice = slices.slice_to_devices
    tier = ReplicaTier(replica_axis=0, slice_to_devices=by_slice)
    try:
        state = _state(_mesh([*by_slice[0], *by_slice[1]], 2))
        want = _host(state)
        assert tier.snapshot(9, state, data_position=90) and tier.wait(10)
        assert tier.held() == (9, frozenset({0, 1}), (frozenset({0}), frozenset({1})))
        spare_mesh = _mesh([*by_slice[0], *by_slice[2]], 2)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            spare_mesh, _spec(x))) if isinstance(x, jax.Array) else x, state)
        out = tier.restore(target, alive_devices=[*by_slice[0], *by_slice[2], *by_slice[3]])
        _assert_equal(out.state, want)
        assert out.state["b"].sharding.mesh == spare_mesh
        assert tier.held() == (9, frozenset({0, 2}), (frozenset({0}), frozenset({2})))
    finally:
        tier.close()


@pytest.mark.needs_devices(8)
def test_keys_iterator_state_and_values_come_back_with_their_step(tier: ReplicaTier) -> None:
    mesh = _mesh(jax.devices(), 2)
    first = _state(mesh, seed=1)
    iterator = {"position": 10, "shard": [0, 1]}
    assert tier.snapshot(1, first, data_position=10, iterator_state=iterator) and tier.wait(10)
    iterator["position"] = 99  # the caller's object moves on: the held copy does not
    second = _state(mesh, seed=2)
    assert tier.snapshot(2, second, data_position=20, iterator_state={"position": 20}) and tier.wait(10)
    out = tier.restore(mesh, lost_slices={0})
    assert (out.step, out.data_position, out.iterator_state) == (2, 20, {"position": 20})
    _assert_equal(out.state, _host(second))
    assert not np.array_equal(np.asarray(jax.random.key_data(out.state["rng"])),
                              np.asarray(jax.random.key_data(first["rng"])))


@pytest.mark.needs_devices(8)
def test_a_busy_tier_skips_and_counts(tier: ReplicaTier, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _mesh(jax.devices(), 2)
    gate = threading.Event()
    real = jax.block_until_ready

    def held_back(x: Any) -> Any:
        if threading.current_thread().name == "ckptd-replica-tier":
            assert gate.wait(10)
        return real(x)

    monkeypatch.setattr(_replica_tier.jax, "block_until_ready", held_back)
    assert tier.snapshot(1, _state(mesh, seed=1), data_position=1)
    assert not tier.snapshot(2, _state(mesh, seed=2), data_position=2)  # the copy of 1 is in flight
    assert not tier.snapshot(3, _state(mesh, seed=3), data_position=3)
    assert tier.held() is None  # nothing is held before its whole copy is done
    assert tier.stats().skips == 2
    gate.set()
    assert tier.wait(10)
    stats = tier.stats()
    assert (stats.held_step, stats.snapshots, stats.skips, stats.failures) == (1, 1, 2, 0)
    assert stats.bytes_held == required_bytes(_state(mesh), in_flight=False) > 0
    assert stats.age_s is not None and stats.age_s >= 0
    assert tier.snapshot(4, _state(mesh, seed=4), data_position=4)  # free again


@pytest.mark.parametrize("op, inside, staging", [
    ("block", "ReplicaTier._complete_copies", True),
    ("to_device", "ReplicaTier._complete_copies", True),  # staged: the copy to the host is the worker's
    ("block", "ReplicaTier._complete_copies", False),
    ("to_device", "ReplicaTier.snapshot", False),  # direct: the copy to the host is dispatched by the loop
])
@pytest.mark.needs_devices(8)
def test_a_failure_during_the_copy_leaves_the_previous_snapshot_whole(
        slices: SimulatedSlices, tier: ReplicaTier, op: Any, inside: str, staging: bool) -> None:
    tier.staging = staging
    mesh = _mesh(jax.devices(), 2)
    first = _state(mesh, seed=1)
    want = _host(first)
    assert tier.snapshot(1, first, data_position=10, iterator_state={"position": 10}) and tier.wait(10)
    with InJaxFaults(slices) as faults:
        faults.fail_during(op, 1, down_for_s=None, inside=inside)
        try:
            tier.snapshot(2, _state(mesh, seed=2), data_position=20, iterator_state={"position": 20})
        except jax.errors.JaxRuntimeError:
            assert inside == "ReplicaTier.snapshot"  # the dispatch itself failed: raised on to the caller
        assert tier.wait(10)
        assert [f.op for f in faults.fired] == [op]
        assert tier.stats().failures == 1 and tier.held()[:2] == (1, frozenset({0, 1}))
        out = tier.restore(_mesh(jax.devices()[:4], 1), lost_slices={1})
    assert (out.step, out.data_position, out.iterator_state) == (1, 10, {"position": 10})
    _assert_equal(out.state, want)


@pytest.mark.needs_devices(8)
def test_state_sharded_across_the_slices_has_no_whole_replica(tier: ReplicaTier) -> None:
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh, w_spec=P("replica", "model"))  # half of w on each slice
    want = _host(state)
    assert tier.snapshot(3, state, data_position=30) and tier.wait(10)
    held = tier.held()
    # b and rng have a copy per slice, but w's halves are on both: every replica needs both slices
    assert held is not None and held.replicas == (frozenset({0, 1}), frozenset({0, 1}))
    with pytest.raises(NoWholeReplica) as lost_one:
        tier.restore(_mesh(jax.devices()[:4], 1), lost_slices={1})
    assert lost_one.value.arrays == ("w",) and "w" in str(lost_one.value)
    assert isinstance(lost_one.value, CkptdError)
    with pytest.raises(NoWholeReplica) as lost_both:  # more slices lost than replicas
        tier.restore(_mesh(jax.devices()[:4], 1), lost_slices={0, 1})
    assert set(lost_both.value.arrays) == {"w", "b", "rng"}
    out = tier.restore(mesh)  # nothing lost: the parts make it whole again, and stay held
    _assert_equal(out.state, want)
    _assert_equal(tier.restore(mesh).state, want)


@pytest.mark.needs_devices(8)
def test_donated_buffers_do_not_corrupt_the_snapshot(tier: ReplicaTier) -> None:
    mesh = _mesh(jax.devices(), 2)

    @jax.jit
    def train_step(s: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {"w": s["w"] * 2 + 1, "b": s["b"] + 1}

    step_fn = jax.jit(train_step, donate_argnums=0)
    full = _state(mesh)
    state = {"w": full["w"], "b": full["b"]}
    for step in range(4):
        want = {k: np.asarray(v) for k, v in state.items()}
        assert tier.snapshot(step, state, data_position=step)
        old = state
        state = step_fn(state)  # donates the buffers the copy was taken from, maybe while it is in flight
        assert old["w"].is_deleted()
        assert tier.wait(10)
        out = tier.restore(mesh)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(out.state[k]), v)
        state = step_fn(out.state)  # the restored arrays donated too: the held copy stays
        again = tier.restore(mesh)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(again.state[k]), v)


@pytest.mark.needs_devices(8)
def test_host_memory_is_accounted_and_checked_against_the_budget() -> None:
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh)
    # every device holds its shard: w 4x2 float32, b 2 int32 per device; the key (8 bytes) on every device
    one = 8 * (4 * 2 * 4) + 8 * (2 * 4) + 8 * 8
    assert required_bytes(state, in_flight=False) == one
    assert required_bytes(state) == 2 * one
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    assert required_bytes(abstract) == 2 * one
    with pytest.raises(MemoryTierFull, match=r"needs .* MiB"):
        ReplicaTier(replica_axis="replica", state=abstract, budget_bytes=2 * one - 1)
    ReplicaTier(replica_axis="replica", state=abstract, budget_bytes=2 * one).close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim_heap() -> None:
    """Give the memory earlier tests freed back to the kernel, so that new buffers must fault their pages in
    (else they reuse resident heap and the resident size does not move)."""
    if not kernel_counts_page_faults():
        pytest.skip("this kernel's resident size does not follow the pages touched (gVisor)")
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("no glibc malloc_trim: the resident size cannot tell new pages from reused ones")


@pytest.mark.parametrize("form", ["arrays", "abstract"])
@pytest.mark.needs_devices(8)
def test_prepare_faults_in_two_copies_and_lets_them_go_at_the_first_snapshot(form: str) -> None:
    mesh = _mesh(jax.devices(), 2)
    big = jax.jit(lambda: jnp.ones((512, 4096), jnp.float32),  # 8 MiB, a quarter on each device of a replica
                  out_shardings=NamedSharding(mesh, P(None, "model")))()
    state = {"w": big, "rng": jax.device_put(jax.random.key(1), NamedSharding(mesh, P())), "step": 4}
    given = state if form == "arrays" else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state)
    one = required_bytes(state, in_flight=False)  # both replicas of w: 16 MiB, and the key on every device
    tier = ReplicaTier(replica_axis="replica", staging=False)
    try:
        _trim_heap()
        before = _resident_bytes()
        assert tier.prepare(given) == 2 * one
        grown = _resident_bytes() - before
        assert grown >= 0.9 * 2 * 16 * 2**20, grown  # both copies of w written, not only reserved
        assert tier.reserved_bytes >= 2 * 16 * 2**20
        assert all(x.sharding.memory_kind == "pinned_host" and not x.is_deleted() for x in tier._reserve)
        assert tier.snapshot(1, state, data_position=0) and tier.wait(10)
        assert tier.reserved_bytes == 0  # the first copy took their place
        assert tier.prepare(given) == 0 and tier.reserved_bytes == 0  # a snapshot is held: nothing reserved
        np.testing.assert_array_equal(np.asarray(tier.restore(mesh).state["w"]), np.asarray(big))
    finally:
        tier.close()


@pytest.mark.needs_devices(8)
def test_prepare_refuses_a_budget_too_small_before_touching_anything() -> None:
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh)
    need = required_bytes(state)
    tier = ReplicaTier(replica_axis="replica", budget_bytes=need - 1, staging=False)
    try:
        with pytest.raises(MemoryTierFull, match=r"needs .* MiB of host memory .* budget is"):
            tier.prepare(state)
        assert tier.reserved_bytes == 0
    finally:
        tier.close()
    roomy = ReplicaTier(replica_axis="replica", budget_bytes=need, staging=False)
    assert roomy.prepare(state) == need and roomy.reserved_bytes == need
    roomy.close()
    assert roomy.reserved_bytes == 0


@pytest.mark.needs_devices(8)
def test_prepares_copies_are_left_alone_by_a_failed_attempts_clean_up_until_the_first_snapshot() -> None:
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh)
    tier = ReplicaTier(replica_axis="replica", staging=False)
    try:
        tier.prepare(state)
        kept = tier.held_arrays()
        assert kept and {id(x) for x in kept} == {id(x) for x in tier._reserve}
        assert tier.snapshot(1, state, data_position=0) and tier.wait(10)
        held = tier.held_arrays()
        assert held and not {id(x) for x in held} & {id(x) for x in kept}  # the reserve is gone: only the snapshot
    finally:
        tier.close()



@pytest.mark.needs_devices(8)
def test_a_staged_tier_reserves_nothing_and_copies_from_an_on_device_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged (room on the devices): ``prepare`` checks the budget and touches nothing (the copies run beside
    the loop); a snapshot copies to the host from an on-device copy of the state, never from the state's own
    buffers, so a step that donates them right after the dispatch changes nothing held."""
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh, seed=3)
    want = _host(state)
    tier = ReplicaTier(replica_axis="replica", staging=True)
    read: list[set[int]] = []
    real = _replica_tier.dispatch_to_host

    def recording(arrays: Any, kind: str, shardings: Any = None) -> Any:
        read.append({id(x) for x in arrays})
        return real(arrays, kind, shardings)

    monkeypatch.setattr(_replica_tier, "dispatch_to_host", recording)
    try:
        assert tier.prepare(state) == required_bytes(state) and tier.reserved_bytes == 0
        assert tier.snapshot(1, state, data_position=10)
        donate = jax.jit(lambda w, b: (w + 1, b + 1), donate_argnums=(0, 1))
        ids = {id(x) for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)}
        # the step donates the state while its snapshot's copy may still be in flight
        state["w"], state["b"] = donate(state["w"], state["b"])
        assert tier.wait(30) and tier.stats().staged is True
        assert read and not read[0] & ids  # the host copy read other buffers than the state's
        assert tier.stats().memory_kind == "pinned_host"
        _assert_equal(tier.restore(mesh).state, want)
    finally:
        tier.close()


@pytest.mark.needs_devices(8)
def test_a_replaced_snapshot_is_let_go_array_by_array_unless_a_reader_still_has_it(tier: ReplicaTier) -> None:
    mesh = _mesh(jax.devices(), 2)
    assert tier.snapshot(1, _state(mesh, seed=1), data_position=1) and tier.wait(10)
    first = tier._held
    assert first is not None and first.leaves
    reader = first  # as ``held`` or ``stats`` would have it, taken before the next snapshot replaced it
    assert tier.snapshot(2, _state(mesh, seed=2), data_position=2) and tier.wait(10)
    assert tier.held()[0] == 2 and reader.leaves  # a reader's snapshot is left whole
    alone = tier._held
    del reader, first
    assert tier.snapshot(3, _state(mesh, seed=3), data_position=3) and tier.wait(10)
    assert alone is not None and alone.leaves  # still ours here: whole
    kept = alone.leaves
    del alone
    snap = Snapshot(9, None, list(kept), 0, None, 0.0, 0)
    let_go(snap)
    assert snap.leaves == []  # nothing else held it: emptied array by array


@pytest.mark.needs_devices(8)
def test_staging_needs_room_beside_the_peak_and_counts_its_own_copy_once() -> None:
    """A device's room for a staged copy: its limit less the peak so far less 5%; the tier's own earlier staged
    copy, part of that peak, is not counted twice (after a recovery the tier decides again)."""
    mesh = _mesh(jax.devices(), 2)
    state = _state(mesh)
    arrays = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    per_device = device_bytes(arrays)
    size = max(per_device.values())
    limit = 100 * size

    def stats(peak: int) -> Any:
        return lambda _: {"bytes_limit": limit, "peak_bytes_in_use": peak}

    fits, why = staging_room(arrays, stats_of=stats(limit * 95 // 100 - size))
    assert fits and "fits" in why
    fits, why = staging_room(arrays, stats_of=stats(limit * 95 // 100 - size + 1))
    assert not fits and "does not fit" in why
    # the same peak, reached with this tier's own staged copy beside the step: room still
    fits, _ = staging_room(arrays, per_device, stats_of=stats(limit * 95 // 100))
    assert fits
    assert staging_room(arrays, stats_of=lambda _: None) == (True, "no device memory statistics: host memory")
