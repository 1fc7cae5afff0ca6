"""The replica snapshot tier: the train state copied into the accelerator hosts' memory, restored from the
replicas that survive a slice loss (docs/concepts.md, "Three tiers").

``ReplicaTier.snapshot`` dispatches an on-device copy of the state (which the next step does not donate);
its worker copies that into host memory on the same shardings, split into the replicas along the replica axis
(``trainer_client.runtime.replicas._replica_leaves``). At most one copy is in flight: another is skipped and counted.
Only when all of the copy is done does the snapshot become the *held* one, with its step, data position,
iterator state and non-array leaves, all of one step; a copy that fails (a slice lost: ``DATA_LOSS``) is
dropped and the previous held snapshot stays, whole. ``restore`` rebuilds each array from the replicas on
the slices left and lays it out on the new mesh (shrunk, or the same shape on a hot spare); when some array
has no whole copy left it raises ``NoWholeReplica`` naming them, and the caller resumes from another tier.

Orbax 0.12.8 has this design as ``Snapshotter`` (its Pathways training module, under ``_src``, not public
API), and this tier follows it: the same pinned-host copy, pathwaysutils' split and concatenation by mesh
axis, one request at a time, typed keys as ``key_data``, pinned-to-pinned then to the devices on restore. It
is not used as is because what ckptd needs is what it lacks: it skips a busy request with a log line only
(no count), drops a failed copy with a log line only, keeps no data position or iterator state, cannot be
told which slices were lost (it only probes, and on CPU without ``InJaxFaults`` a lost slice's copies still
read), concatenates whatever replicas survive — so an array sharded along the replica axis comes back with
the wrong shape instead of an error — and neither accounts for host memory nor reports age or bytes.

Host memory: one copy of each host's share of the state, two while a copy is in flight (``required_bytes``);
the constructor and ``prepare`` refuse a budget that cannot hold that (``MemoryTierFull``; docs/deploy.md).
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from trainer_client.checkpoint_io._state_tree import leaf_name
from trainer_client.errors import NoWholeReplica
from trainer_client.runtime.replicas._replica_held import (
    Copy,
    Held,
    ReplicaStats,
    Restored,
    Snapshot,
    Value,
    copy_value,
    kind_of,
    let_go,
)
from trainer_client.runtime.replicas._replica_leaves import (
    PINNED,
    HeldArray,
    ReplicaAxis,
    check_budget,
    device_bytes,
    dispatch_to_host,
    hold_pinned,
    host_bytes,
    is_key,
    rebuild,
    required_bytes,
    stage,
    staging_room,
    target_sharding,
    to_device,
    touch_copies,
)
from trainer_client.runtime.replicas._replica_pacing import PaceMeter

_log = logging.getLogger(__name__)
PyTree = Any


class ReplicaTier:
    """Asynchronous snapshots of one process's train state in its hosts' pinned memory, one held at a time.

    ``replica_axis``: the mesh axis (name, or index in each mesh's axes) the replicas lie along — the
    data-parallel axis across slices. ``slice_to_devices``: which devices each slice has (a ``SliceProvider``'s
    map); without it a device's ``slice_index`` (Pathways), else slice 0. ``state`` (arrays or
    ``ShapeDtypeStruct``s): checked against ``budget_bytes`` (default: the host's free memory) at once.
    """

    def __init__(self, *, replica_axis: ReplicaAxis = 0,
                 slice_to_devices: Mapping[int, Sequence[jax.Device]] | None = None,
                 state: PyTree | None = None, budget_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic, memory_kind: str = PINNED,
                 staging: bool | None = None, meter: PaceMeter | None = None) -> None:
        self.replica_axis = replica_axis
        self.memory_kind = memory_kind  # where the next snapshot's copy goes (the runner's pacer may change it)
        self.staging = staging  # copy through an on-device copy: None decides at the first snapshot (room for it)
        self._staging_given = staging  # None: decided again for each attempt (``prepare``): a new mesh, new room
        self._staged_bytes: dict[int, int] = {}  # per device, the staged copy's bytes once staging was chosen
        self.staging_reason: str | None = None
        self.meter = meter  # told of each copy's start and end (the pacer's measurements)
        self.last_copy_s: float | None = None
        self._slice_of = ({d.id: k for k, devices in slice_to_devices.items() for d in devices}
                          if slice_to_devices is not None else None)
        self._clock = clock
        self.budget_bytes = budget_bytes
        if state is not None:
            check_budget(state, budget_bytes)
        self._reserve: list[jax.Array] = []  # prepare's throwaway copies, until the first dispatch
        self._lock = threading.Condition()
        self._held: Snapshot | None = None
        self._in_flight = False
        self._names: tuple[Any, list[str]] | None = None
        self.snapshots = self.skips = self.failures = 0
        self.last_error: BaseException | None = None
        self.last_dispatch_s: float | None = None
        self._queue: queue.Queue[Copy | None] = queue.Queue(maxsize=1)
        self._worker = threading.Thread(target=self._complete_copies, name="ckptd-replica-tier", daemon=True)
        self._worker.start()

    # ---- snapshots ------------------------------------------------------------------------------

    def prepare(self, state: PyTree) -> int:
        """Make the tier ready for an attempt's first snapshot of ``state`` (arrays, or ``ShapeDtypeStruct``s
        with shardings) and return the host bytes it needs: its footprint checked against the budget
        (``MemoryTierFull``); whether copies are staged on the device decided afresh (unless configured: a new
        mesh changes each device's share); when staged, the on-device copy compiled now rather than in the first
        snapshot's dispatch. When not staged (the step waits for each copy), two throwaway copies of the state's
        layout are made in host memory — the held snapshot and the next, in flight — which fault the pages in and
        are kept until the first snapshot's dispatch lets them go for its copy to take; nothing is reserved once
        a snapshot is held or in flight (its memory is in use already)."""
        need = check_budget(state, self.budget_bytes)
        if self._staging_given is None:
            self.staging = None
        if self._stages(state):  # the copy runs beside the loop: its first-time costs are not the loop's
            arrays = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
            if arrays:
                jax.block_until_ready(stage(arrays)[0])
            return need
        with self._lock:
            if self._held is not None or self._in_flight:
                return 0
        self._reserve = touch_copies(state, self.replica_axis, 2, self.memory_kind)
        return need

    def _stages(self, state: PyTree) -> bool:
        """Whether snapshots copy through an on-device copy: as configured, else decided once from the devices'
        room for one (``staging_room``)."""
        if self.staging is None:
            arrays = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array | jax.ShapeDtypeStruct)]
            self.staging, self.staging_reason = staging_room(arrays, self._staged_bytes)
            if self.staging:
                self._staged_bytes = device_bytes(arrays)
            _log.info("replica snapshots %s: %s", "staged on the device" if self.staging else "copied directly "
                      "(the step waits for each copy to read its buffers)", self.staging_reason)
        return self.staging

    @property
    def reserved_bytes(self) -> int:
        """Host bytes ``prepare`` holds for the first snapshot (0 once it has been dispatched)."""
        return sum(host_bytes(x) for x in self._reserve)

    def snapshot(self, step: int, state: PyTree, *, data_position: int, iterator_state: Any = None) -> bool:
        """Dispatch a copy of ``state`` (of ``step``; ``data_position`` and ``iterator_state`` at it) and
        return; False when a copy is still in flight (skipped, counted). A ``DATA_LOSS`` raised by the dispatch
        itself is raised on (the held snapshot stays)."""
        started = time.perf_counter()
        with self._lock:
            if self._in_flight:
                self.skips += 1
                return False
            self._in_flight = True
        self._reserve = []  # prepare's pages go back to the allocator, for this copy to take
        try:
            snap = self._dispatch(step, state, data_position, iterator_state)
        except BaseException as exc:
            self._finished(None, exc)
            raise
        self.last_dispatch_s = time.perf_counter() - started
        self._queue.put(snap)
        return True

    def _dispatch(self, step: int, state: PyTree, data_position: int, iterator_state: Any) -> Copy:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if self._names is None or self._names[0] != treedef:  # the leaves' names once per structure
            self._names = (treedef, [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]])
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
        values = [None if isinstance(x, jax.Array) else Value(copy.deepcopy(x)) for x in leaves]
        names = [n for n, x in zip(self._names[1], leaves, strict=True) if isinstance(x, jax.Array)]
        key_dtypes = [x.dtype if is_key(x) else None for x in arrays]
        staged = self._stages(state)
        kind = self.memory_kind
        started = self._clock()
        # staged: one jitted on-device copy, the host copy from it on the worker; direct: the host copy now
        if staged:
            sources, shardings = stage(arrays)
        else:
            sources = dispatch_to_host(arrays, kind)
            shardings = []
        if self.meter is not None:
            self.meter.copy_started(kind, started)
        return Copy(step, treedef, names, key_dtypes, sources, shardings, staged, kind, values, data_position,
                     copy.deepcopy(iterator_state), started)

    def _complete_copies(self) -> None:
        """The worker: copy each staged snapshot to the host, wait for it; hold it once all of it is done, or
        drop it (the staged device copies are freed either way)."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._complete(job)
            del job

    def _complete(self, job: Copy) -> None:
        """One snapshot's copy to the host, waited for and held. Its unsplit host arrays live only in this call:
        the held replicas share their buffers, and a failed attempt's clean-up deletes every live array the tier
        does not hold (``held_arrays``), which would take the replicas' buffers with them."""
        try:
            # leaf by leaf: each call allocates its host buffer holding the interpreter's lock, and the training
            # thread must be able to take that lock between them (one call for all 31 leaves of a 5.22 GB state
            # stalled a step on a TPU v5e by up to 0.8 s: docs/benchmarks.md, "Device profile")
            hosts = [dispatch_to_host([src], job.kind, [sharding])[0]
                     for src, sharding in zip(job.sources, job.shardings, strict=True)] if job.staged else job.sources
            job.sources = []  # the staged device copies go as soon as their host copies are done
            jax.block_until_ready(hosts)
            done = self._clock()
            self.last_copy_s = done - job.taken_at
            snap = self._hold(job, hosts)
            del hosts
        except Exception as exc:  # e.g. DATA_LOSS: a slice lost mid-copy; the held snapshot stays
            job.sources = []
            _log.log(logging.INFO if "DATA_LOSS" in str(exc) else logging.WARNING,  # a lost slice's: expected
                     "replica snapshot of step %d dropped, step %s still held: %s", job.step,
                     self._held.step if self._held is not None else None, exc)
            self._finished(None, exc, (job.kind, job.taken_at, self._clock()))
        else:
            self._finished(snap, None, (job.kind, job.taken_at, done))

    def _hold(self, job: Copy, hosts: list[jax.Array]) -> Snapshot:
        arrays = iter(hold_pinned(name, host, self.replica_axis, key)
                      for name, host, key in zip(job.names, hosts, job.key_dtypes, strict=True))
        held: list[HeldArray | Value] = [next(arrays) if v is None else v for v in job.values]
        nbytes = sum(leaf.nbytes for leaf in held if isinstance(leaf, HeldArray))
        return Snapshot(job.step, job.treedef, held, job.data_position, job.iterator_state, job.taken_at, nbytes)

    def _finished(self, snap: Snapshot | None, error: BaseException | None,
                  timing: tuple[str, float, float] | None = None) -> None:
        """A copy is over: ``snap`` held (the previous snapshot's memory goes back) or ``error`` counted; the
        meter told of ``timing`` (kind, dispatched, copied) before the tier is free for the next snapshot."""
        previous: Snapshot | None = None
        with self._lock:
            if snap is not None:
                previous, self._held = self._held, snap
                self.snapshots += 1
            if error is not None:
                self.failures += 1
                self.last_error = error
            if timing is not None and self.meter is not None:
                kind, started, done = timing
                self.meter.copy_done(kind, started, done, landed=error is None, settled=self._clock())
            self._in_flight = False
            self._lock.notify_all()
        let_go(previous)

    @property
    def busy(self) -> bool:
        """A copy is in flight."""
        with self._lock:
            return self._in_flight

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no copy is in flight; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._in_flight, timeout_s)

    def close(self) -> None:
        """Wait for the copy in flight, stop the worker and drop the held snapshot (its memory goes back)."""
        self.wait()
        self._queue.put(None)
        self._worker.join()
        self._reserve = []
        with self._lock:
            self._held = None

    # ---- what is held ---------------------------------------------------------------------------

    def _slices(self, device_ids: Collection[int]) -> frozenset[int]:
        if self._slice_of is not None:
            return frozenset(self._slice_of[d] for d in device_ids if d in self._slice_of)
        by_id = {d.id: d for d in jax.devices()}
        return frozenset(int(getattr(by_id[d], "slice_index", 0)) for d in device_ids if d in by_id)

    def held(self) -> Held | None:
        """The step held whole and the slices its replicas live on; None before the first copy completes."""
        with self._lock:
            snap = self._held
        if snap is None:
            return None
        arrays = snap.arrays
        every = self._slices({d for leaf in arrays for ids in leaf.device_ids for d in ids})
        return Held(snap.step, every, self._replica_groups(arrays))

    def _replica_groups(self, arrays: list[HeldArray]) -> tuple[frozenset[int], ...]:
        """Each replica of the whole state and the slices it needs: replica ``r`` is every array's ``r``-th
        copy along the replica axis; an array held whole or split along the axis needs all of its devices in
        every replica."""
        count = max((len(leaf.replicas) for leaf in arrays if leaf.axis is not None and not leaf.split),
                    default=1)
        groups: list[set[int]] = [set() for _ in range(count)]
        for leaf in arrays:
            per_replica = leaf.axis is not None and not leaf.split and len(leaf.replicas) == count
            for r, group in enumerate(groups):
                ids = leaf.device_ids[r] if per_replica else frozenset().union(*leaf.device_ids)
                group.update(ids)
        return tuple(self._slices(group) for group in groups)

    def held_arrays(self) -> list[jax.Array]:
        """The host arrays of the held snapshot, and ``prepare``'s until the first snapshot (what a failed
        attempt's clean-up must leave alone)."""
        with self._lock:
            snap = self._held
        return [r for leaf in snap.arrays for r in leaf.replicas] + self._reserve if snap is not None else \
            list(self._reserve)

    def stats(self) -> ReplicaStats:
        with self._lock:
            snap = self._held
            return ReplicaStats(held_step=snap.step if snap else None, snapshots=self.snapshots, skips=self.skips,
                                failures=self.failures, bytes_held=snap.nbytes if snap else 0,
                                age_s=self._clock() - snap.taken_at if snap else None,
                                last_dispatch_s=self.last_dispatch_s,
                                memory_kind=kind_of(snap) if snap else None, staged=self.staging,
                                last_copy_s=self.last_copy_s)

    # ---- restore --------------------------------------------------------------------------------

    def restore(self, target: Any, *, lost_slices: Collection[int] = (),
                alive_devices: Collection[jax.Device] | None = None) -> Restored:
        """The held step rebuilt from the replicas on live slices, laid out on ``target``: a ``Mesh`` (each
        array keeps its partition spec; the mesh has the same axis names) or a tree like the state whose
        array leaves are ``Sharding``s, arrays or ``ShapeDtypeStruct``s. A replica is live when none of its
        devices is on ``lost_slices``, all are in ``alive_devices`` (when given), and it reads back.
        ``NoWholeReplica`` when some array has no whole copy left. Afterwards the tier holds the restored
        state on its new layout."""
        self.wait()  # a copy in flight completes (held) or fails (dropped) first
        with self._lock:
            snap = self._held
        if snap is None:
            raise NoWholeReplica("the replica snapshot tier holds no snapshot yet: nothing to restore from")
        lost = self._device_ids_of(lost_slices)
        alive = None if alive_devices is None else frozenset(d.id for d in alive_devices)

        def usable(ids: frozenset[int]) -> bool:
            return not (ids & lost) and (alive is None or ids <= alive)

        wants = [target] * len(snap.leaves) if isinstance(target, jax.sharding.Mesh) else \
            snap.treedef.flatten_up_to(target)
        hosts: list[tuple[HeldArray, Any, jax.Array] | None] = []
        missing: list[str] = []
        for leaf, want in zip(snap.leaves, wants, strict=True):
            if not isinstance(leaf, HeldArray):
                hosts.append(None)
                continue
            sharding = target_sharding(leaf, want)
            host = rebuild(leaf, sharding, usable)
            if host is None:
                missing.append(leaf.name)
            hosts.append(None if host is None else (leaf, sharding, host))
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise NoWholeReplica(
                f"no whole replica of {len(missing)} array(s) of step {snap.step} survives (lost slices "
                f"{sorted(lost_slices)}): {shown}. Each array must be replicated along the replica axis and at "
                "least one replica's slice must be alive; resume from the shared-memory tier or storage.",
                tuple(missing))
        out = [copy_value(leaf) if entry is None else to_device(entry[2], entry[0], entry[1])
               for leaf, entry in zip(snap.leaves, hosts, strict=True)]
        jax.block_until_ready([jax.random.key_data(x) if is_key(x) else x for x in out if isinstance(x, jax.Array)])
        self._hold_restored(snap, hosts)
        return Restored(snap.step, jax.tree_util.tree_unflatten(snap.treedef, out), snap.data_position,
                        copy.deepcopy(snap.iterator_state))

    def _device_ids_of(self, slices: Collection[int]) -> frozenset[int]:
        if not slices:
            return frozenset()
        return frozenset(d.id for d in jax.devices() if self._slices({d.id}) & set(slices))

    def _hold_restored(self, snap: Snapshot, hosts: list[tuple[HeldArray, Any, jax.Array] | None]) -> None:
        """Hold the restored step on its new layout: the rebuilt host arrays themselves, split again (the
        restored device arrays are copies of them, so a step that donates those leaves these alone)."""
        leaves: list[HeldArray | Value] = []
        for leaf, entry in zip(snap.leaves, hosts, strict=True):
            if entry is None:
                leaves.append(leaf)
                continue
            before, _, host = entry
            leaves.append(hold_pinned(before.name, host, self.replica_axis, before.key_dtype))
        nbytes = sum(leaf.nbytes for leaf in leaves if isinstance(leaf, HeldArray))
        with self._lock:
            self._held = Snapshot(snap.step, snap.treedef, leaves, snap.data_position, snap.iterator_state,
                                   snap.taken_at, nbytes)


__all__ = ["Held", "ReplicaStats", "ReplicaTier", "Restored", "check_budget", "required_bytes"]
