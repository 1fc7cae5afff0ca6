"""The host-memory tier: snapshots in shared memory, persisted by ckptd even when the trainer dies, bounded
memory, plans that prefer a whole snapshot, and same-PID recovery from memory."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.elastic_mlp import TrainLog, init_state, make_train_fn, partition_specs
from tests.support.helpers import REPO, kernel_counts_page_faults, minor_faults
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_PERSISTED_FILE
from trainer_client.core.format._snapshot import problems, read_meta
from trainer_client.core.protocol import ResumeRequest
from trainer_client.errors import MemoryTierFull
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_spare import make_spare, snapshot_bytes
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.restore._direct_restore import restore_direct
from trainer_client.runtime.saving._checkpointing import Checkpointer, leaf_name, training_metadata
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault


def _mesh(n: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(n // 2, 2), ("replica", "data"))


def _shardings(mesh: Mesh) -> Any:
    specs = partition_specs(jax.eval_shape(init_state))
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _state(mesh: Mesh, seed: int = 0) -> Any:
    return jax.jit(lambda: init_state(seed), out_shardings=_shardings(mesh))()


def _meta(step: int, state: Any, mesh: Mesh) -> Any:
    return training_metadata(step, state, data_position=step * 48, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])


def _leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.needs_devices(8)
def test_a_snapshot_restores_exactly_onto_a_smaller_mesh(tmp_path: Path) -> None:
    mesh = _mesh()
    state = _state(mesh, seed=3)
    tier = MemoryTier(str(tmp_path), "job")
    path = tier.save(7, state, _meta(7, state, mesh), persist=False)
    assert problems(path) == [] and read_meta(path).step == 7
    assert tier.last_blocked_s is not None and tier.last_blocked_s < 5
    small = _mesh(6)
    target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    jax.eval_shape(init_state), _shardings(small))
    restored = restore_snapshot(path, target)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for a, b in zip(_leaves(state), _leaves(restored), strict=True):
        assert np.array_equal(a, b)
    assert all(leaf.sharding.mesh.devices.shape == (3, 2) for leaf in jax.tree_util.tree_leaves(restored))
    # a damaged snapshot is never taken for whole
    with open(path / SNAPSHOT_DATA_FILE, "r+b") as f:
        f.truncate(10)
    assert any("bytes" in p for p in problems(path))


def _snapshots(job: Path) -> list[str]:
    return sorted(p.name for p in job.iterdir() if p.is_dir())


@pytest.mark.needs_devices(8)
def test_the_next_snapshot_is_written_into_pages_allocated_ahead(tmp_path: Path) -> None:
    mesh = _mesh()
    state = _state(mesh, seed=1)
    tier = MemoryTier(str(tmp_path), "job", max_snapshots=2)
    first = tier.save(1, state, _meta(1, state, mesh), persist=False)
    tier.wait_spare()
    spare = tmp_path / "job" / f".spare-{os.getpid()}"
    assert spare.stat().st_size >= read_meta(first).nbytes and tier.last_spare_s is not None
    held = os.open(spare, os.O_RDONLY)  # keeps the inode alive, so its number cannot be reused meanwhile

    second_state = _state(mesh, seed=2)
    second = tier.save(2, second_state, _meta(2, second_state, mesh), persist=False)
    assert os.fstat(held).st_ino == (second / SNAPSHOT_DATA_FILE).stat().st_ino  # the spare became step 2's data
    assert os.fstat(held).st_nlink == 1
    os.close(held)
    assert problems(second) == []
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                    second_state)
    for a, b in zip(_leaves(second_state), _leaves(restore_snapshot(second, target)), strict=True):
        assert np.array_equal(a, b)
    # The spare for step 3 takes the place of step 1, which step 3 would have evicted: never more than
    # max_snapshots snapshots' worth of memory, and the newest snapshot is kept.
    tier.wait_spare()
    assert _snapshots(tmp_path / "job") == ["2"] and spare.stat().st_size >= read_meta(second).nbytes

    # a smaller state is written into the spare and the file cut to its size; a larger one gets a new file
    small = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("replica")))}
    third = tier.save(3, small, _meta(3, small, mesh), persist=False)
    assert problems(third) == [] and (third / SNAPSHOT_DATA_FILE).stat().st_size == read_meta(third).nbytes
    tier.wait_spare()
    assert spare.stat().st_size >= read_meta(third).nbytes
    held = os.open(spare, os.O_RDONLY)
    fourth = tier.save(4, state, _meta(4, state, mesh), persist=False)
    # too small: dropped (the spare's name no longer names it), a new file written
    assert problems(fourth) == [] and os.fstat(held).st_ino != (fourth / SNAPSHOT_DATA_FILE).stat().st_ino
    assert not spare.exists() or spare.stat().st_ino != os.fstat(held).st_ino
    os.close(held)
    tier.wait_spare()
    assert spare.stat().st_size >= read_meta(fourth).nbytes
    tier.close()
    assert not spare.exists()

    # the spare vanishing between the look and the use (ckptd dropping it as stale) costs only the head start
    tier._spare_bytes = lambda: 1 << 40  # type: ignore[method-assign]
    fifth = tier.save(5, state, _meta(5, state, mesh), persist=False)
    assert problems(fifth) == []

    # one snapshot at most: no room for a spare, ever
    single = MemoryTier(str(tmp_path), "single", max_snapshots=1)
    single.save(1, state, _meta(1, state, mesh), persist=False)
    single.wait_spare()
    assert not list((tmp_path / "single").glob(".spare-*"))


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A directory in shared memory (tmpfs: one page fault per page touched; a disk's large folios map more),
    where the kernel counts page faults (what these tests read)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    if not kernel_counts_page_faults():
        pytest.skip("this kernel does not count minor page faults (getrusage's ru_minflt stays 0, as in gVisor)")
    path = Path(tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_touched_spare_has_its_pages_faulted_in_and_an_allocated_one_not(shm_path: Path) -> None:
    tmp_path = shm_path
    nbytes = 16 << 20
    pages = nbytes // mmap.PAGESIZE
    before = minor_faults()
    make_spare(tmp_path / "allocated", nbytes, touched=False)
    allocated = minor_faults() - before
    before = minor_faults()
    make_spare(tmp_path / "touched", nbytes, touched=True)
    touched = minor_faults() - before
    assert touched >= pages and allocated < pages // 4, (touched, allocated)
    assert (tmp_path / "touched").stat().st_size == nbytes and not list(tmp_path.glob("*.part"))
    assert (tmp_path / "touched").read_bytes() == bytes(nbytes)


@pytest.mark.needs_devices(8)
def test_prepare_touches_the_first_saves_file_before_it_and_evicts_nothing(shm_path: Path) -> None:
    tmp_path = shm_path
    mesh = _mesh()
    state = {"w": jax.jit(lambda: jnp.ones((1024, 4096), jnp.float32),  # 16 MiB, by rows over the data axis
                          out_shardings=NamedSharding(mesh, P("data")))(), "step": 3}
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                      if isinstance(a, jax.Array) else a, state)
    nbytes = snapshot_bytes(abstract)
    assert nbytes == snapshot_bytes(state) >= 16 << 20  # one replica of each of the two halves, aligned
    assert snapshot_bytes({"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32)}) >= 16 << 20  # no sharding: whole
    earlier = MemoryTier(str(tmp_path), "job", max_snapshots=3)
    earlier.save(1, state, _meta(1, state, mesh), persist=False)
    earlier.close()

    tier = MemoryTier(str(tmp_path), "job", max_snapshots=3)
    before = minor_faults()
    tier.prepare(abstract)  # in the background
    tier.wait_spare()
    assert minor_faults() - before >= nbytes // mmap.PAGESIZE  # every page of the spare faulted in
    spare = tmp_path / "job" / f".spare-{os.getpid()}"
    assert spare.stat().st_size >= nbytes and _snapshots(tmp_path / "job") == ["1"]  # a resume may read step 1
    held = os.open(spare, os.O_RDONLY)
    first = tier.save(2, state, _meta(2, state, mesh), persist=False)
    assert os.fstat(held).st_ino == (first / SNAPSHOT_DATA_FILE).stat().st_ino  # the first save wrote into it
    os.close(held)
    assert problems(first) == []
    tier.prepare(abstract)  # the spare after the first save is there (or being made): nothing more
    tier.wait_spare()
    assert len(list((tmp_path / "job").glob(".spare-*"))) == 1
    tier.close()

    full = MemoryTier(str(tmp_path), "full", max_snapshots=1)  # no room for a spare: prepare makes none
    full.prepare(abstract)
    full.wait_spare()
    assert not list((tmp_path / "full").glob(".spare-*"))


def test_a_new_attempts_prepare_never_waits_for_a_spare_still_being_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare a save starts (its pages touched: seconds for gigabytes on the lent chip's sandbox) goes on beside
    the next attempt's restore: ``prepare`` returns at once, and the next save waits for it and writes into it."""
    import trainer_client.runtime.memory._memory_tier as memory_tier

    started, release = threading.Event(), threading.Event()
    real = memory_tier.make_spare

    def slow_spare(spare: Path, nbytes: int, *, touched: bool, gate: threading.Event | None = None) -> None:
        started.set()
        release.wait(timeout=60)
        real(spare, nbytes, touched=touched, gate=gate)

    monkeypatch.setattr(memory_tier, "make_spare", slow_spare)
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("replica", "data"))  # whatever devices the run has
    state = {"w": jax.device_put(jnp.ones((64, 256), jnp.float32), NamedSharding(mesh, P("data"))), "step": 3}
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                      if isinstance(a, jax.Array) else a, state)
    tier = MemoryTier(str(tmp_path), "job", max_snapshots=3)
    tier.save(1, state, _meta(1, state, mesh), persist=False)  # starts the next save's spare
    assert started.wait(timeout=30)
    tier.prepare(abstract)  # a new attempt, restoring step 1: not held up by the spare
    assert tier.making_spare()
    release.set()
    tier.wait_spare()
    spare = tmp_path / "job" / f".spare-{os.getpid()}"
    held = os.open(spare, os.O_RDONLY)
    second = tier.save(2, state, _meta(2, state, mesh), persist=False)
    assert os.fstat(held).st_ino == (second / SNAPSHOT_DATA_FILE).stat().st_ino  # the save wrote into it
    os.close(held)
    assert problems(second) == []
    tier.close()


def test_a_held_spare_touches_no_page_until_released_and_a_save_releases_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a restore runs the spare's page-touching waits (``hold_spare``, before each chunk); ``release_spare``
    (the first step done) lets it finish, and a save that needs the spare releases it rather than wait forever."""
    import trainer_client.runtime.memory._memory_spare as memory_spare

    monkeypatch.setattr(memory_spare, "_TOUCH_CHUNK", 64 << 10)  # many chunks: a pause between any two
    chunks: list[int] = []
    real_mmap = memory_spare.mmap.mmap

    def counting_mmap(fd: int, length: int, **kwargs: Any) -> Any:
        chunks.append(kwargs.get("offset", 0))
        return real_mmap(fd, length, **kwargs)

    monkeypatch.setattr(memory_spare.mmap, "mmap", counting_mmap)
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("replica", "data"))
    state = {"w": jax.device_put(jnp.ones((256, 1024), jnp.float32), NamedSharding(mesh, P("data")))}
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    tier = MemoryTier(str(tmp_path), "job", max_snapshots=3)
    tier.hold_spare()  # a restore is running
    tier.prepare(abstract)  # the first save's spare: allocated, its touching held at the first chunk
    time.sleep(0.5)
    assert tier.making_spare() and chunks == []
    tier.release_spare()  # the first step is done
    tier.wait_spare()
    assert not tier.making_spare() and len(chunks) == snapshot_bytes(abstract) // (64 << 10) + 1
    first = tier.save(1, state, _meta(1, state, mesh), persist=False)  # starts the next spare, touched too
    tier.hold_spare()
    second = tier.save(2, state, _meta(2, state, mesh), persist=False)  # waits for it: released, not stuck
    assert problems(first) == [] and problems(second) == []
    tier.close()


def test_what_dead_trainers_left_in_shared_memory_is_dropped(tmp_path: Path) -> None:
    from trainer_client.core.format._snapshot_dirs import drop_leftovers

    job = tmp_path / "job"
    job.mkdir()
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    dead_spare, dead_unfinished = job / f".spare-{gone}", job / f"7.tmp-{gone}"
    alive_spare, alive_unfinished = job / f".spare-{os.getppid()}", job / f"8.tmp-{os.getppid()}"
    for spare in (dead_spare, alive_spare):
        spare.write_bytes(b"x" * 10)
    for unfinished in (dead_unfinished, alive_unfinished):
        unfinished.mkdir()
        (unfinished / SNAPSHOT_DATA_FILE).write_bytes(b"y" * 10)
    (job / "6").mkdir()  # a finished snapshot is not a leftover, however old
    MemoryTier(str(tmp_path), "job")  # a new trainer cleans up after the one before it
    assert not dead_spare.exists() and not dead_unfinished.exists()
    assert alive_spare.exists() and alive_unfinished.exists() and (job / "6").exists()
    assert drop_leftovers(job, older_than_s=3600) == 0  # ckptd's view: fresh, so kept
    old = time.time() - 7200
    for path in (alive_spare, alive_unfinished, job / "6"):
        os.utime(path, (old, old))
    assert drop_leftovers(job, older_than_s=3600) == 2
    assert not alive_spare.exists() and not alive_unfinished.exists() and (job / "6").exists()


@pytest.mark.needs_devices(8)
def test_memory_is_bounded_with_a_clear_error(tmp_path: Path) -> None:
    mesh = _mesh()
    state = _state(mesh)
    tier = MemoryTier(str(tmp_path), "job", max_snapshots=2)
    tier.save(1, state, _meta(1, state, mesh), persist=False)
    tier.save(2, state, _meta(2, state, mesh), persist=True)
    tier.save(3, state, _meta(3, state, mesh), persist=True)  # evicts 1: it needs no persisting
    tier.wait_spare()
    assert _snapshots(tmp_path / "job") == ["2", "3"]
    assert not list((tmp_path / "job").glob(".spare-*"))  # no room for one: 2 and 3 wait for ckptd
    with pytest.raises(MemoryTierFull, match="wait to be persisted"):
        tier.save(4, state, _meta(4, state, mesh), persist=True)
    (tmp_path / "job" / "2" / SNAPSHOT_PERSISTED_FILE).write_text("{}")  # ckptd persisted it: now it may go
    tier.save(4, state, _meta(4, state, mesh), persist=True)
    assert _snapshots(tmp_path / "job") == ["3", "4"]
    huge = MemoryTier(str(tmp_path), "other", reserve_bytes=2**62)
    with pytest.raises(MemoryTierFull, match="does not fit"):
        huge.save(1, state, _meta(1, state, mesh), persist=False)
    assert not (tmp_path / "other" / "1").exists()


@pytest.mark.needs_devices(8)
def test_ckptd_never_evicts_the_newest_snapshot_in_place_of_older_ones_awaiting_persist(tmp_path: Path) -> None:
    """ckptd keeps fewer snapshots than the trainer (1 against 4 here) and the oldest waits to be persisted:
    the newest, memory-only one is the one a resume takes next (a regrow may be restoring it right now), so
    ckptd leaves it rather than evict it as the only evictable one (it did: a regrow's restore found its
    snapshot.json gone). (Two waiting would not do: the older would be superseded by the newer, and evictable:
    tests/server/memory_tier/test_persist_behind.py.)"""
    from ckptd.memory_tier._snapshots import SnapshotKeeper
    from trainer_client.core._storage import Storage

    mesh = _mesh()
    state = _state(mesh)
    tier = MemoryTier(str(tmp_path / "shm"), "job", max_snapshots=4, preallocate=False)
    for step, persist in ((1, True), (2, False)):
        tier.save(step, state, _meta(step, state, mesh), persist=persist)
    keeper = SnapshotKeeper(Storage(str(tmp_path / "root")), str(tmp_path / "shm"), max_snapshots=1)
    keeper.scan()  # not started: nothing gets persisted, so 1 may not go
    assert _snapshots(tmp_path / "shm" / "job") == ["1", "2"]
    tier.save(3, state, _meta(3, state, mesh), persist=False)
    keeper.scan()  # 2 is no longer the newest: it goes, 3 stays
    assert _snapshots(tmp_path / "shm" / "job") == ["1", "3"]


_TRAINER = r"""
import sys
import jax, numpy as np
from jax.sharding import Mesh
sys.path.insert(0, sys.argv[3])
from tests.trainer.runtime.test_memory_tier import _meta, _state
from trainer_client.runtime.memory._memory_tier import MemoryTier
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))
state = _state(mesh, seed=11)
MemoryTier(sys.argv[1], sys.argv[2]).save(10, state, _meta(10, state, mesh), persist=True)
print("SAVED", flush=True)
import time; time.sleep(120)
"""


@pytest.mark.needs_devices(8)
def test_ckptd_persists_a_snapshot_of_a_trainer_killed_right_after_save(
    tmp_path: Path, ckptd_server: Any
) -> None:
    shm, root = tmp_path / "shm", tmp_path / "root"
    (root / "job").mkdir(parents=True)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(shm), "job", str(REPO)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "SAVED", proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    server = ckptd_server(root, shm_dir=str(shm), refresh_interval_s=0.2)
    with CkptdClient(ClientSettings(url=server.url)) as client:
        deadline = time.monotonic() + 90
        good = None
        while time.monotonic() < deadline:
            good = client.latest_good("job")
            if good is not None:
                break
            time.sleep(0.2)
        assert good is not None and good.step == 10, "ckptd did not persist the dead trainer's snapshot"
        while time.monotonic() < deadline and not (shm / "job" / "10" / SNAPSHOT_PERSISTED_FILE).exists():
            time.sleep(0.1)  # the step commits a moment before the worker exits and ckptd marks it
        assert (shm / "job" / "10" / SNAPSHOT_PERSISTED_FILE).exists()
    # plain Orbax restores what ckptd persisted, bit for bit
    mesh = _mesh()
    expected = _state(mesh, seed=11)
    target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    jax.eval_shape(init_state), _shardings(mesh))
    restored = ocp.CheckpointManager(str(root / "job")).restore(10, args=ocp.args.StandardRestore(target))
    for a, b in zip(_leaves(expected), _leaves(restored), strict=True):
        assert np.array_equal(a, b)


def _mapped(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def leaf_sharding(state: Any, name: str) -> Any:
    """The sharding of the leaf of ``state`` Orbax names ``name``."""
    return next(leaf.sharding for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                if leaf_name(path) == name)


@pytest.mark.needs_devices(8)
def test_the_persist_worker_hands_orbax_the_saved_shards_without_a_copy(tmp_path: Path) -> None:
    import tensorstore as ts

    from ckptd.persist._persist_worker import persist, snapshot_arrays

    mesh = _mesh()
    state = _state(mesh, seed=5)
    path = MemoryTier(str(tmp_path / "shm"), "job").save(12, state, _meta(12, state, mesh), persist=True)
    meta = read_meta(path)
    arrays = snapshot_arrays(path)
    for name, array, leaf in zip(meta.leaf_names, arrays, _leaves(state), strict=True):
        # on the trainer's mesh, sharded as the trainer had it: one saved shard per distinct device shard
        assert array.sharding.mesh.axis_names == ("replica", "data") and array.sharding.mesh.devices.shape == (4, 2)
        assert array.sharding.spec == leaf_sharding(state, name).spec
        distinct = {tuple((s.start or 0, s.stop) for s in shard.index) for shard in array.addressable_shards}
        assert len(distinct) == len(meta.arrays[name].shards)
        assert np.array_equal(np.asarray(array), leaf)
    if Path("/proc/self/maps").exists():  # each device buffer is the snapshot's own memory
        ranges = _mapped(path / SNAPSHOT_DATA_FILE)
        assert all(any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in ranges)
                   for array in arrays for s in array.addressable_shards)
    del arrays
    # fewer devices than shards: coarser shards, the same values
    for array, leaf in zip(snapshot_arrays(path, jax.devices()[:3]), _leaves(state), strict=True):
        assert len(array.sharding.device_set) <= 3 and np.array_equal(np.asarray(array), leaf)
    # a real Orbax step: plain Orbax restores it bit for bit, chunked as the trainer's shards
    assert persist(path, str(tmp_path / "root" / "job")) == f"{tmp_path / 'root' / 'job'}/12"
    target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    jax.eval_shape(init_state), _shardings(mesh))
    restored = ocp.CheckpointManager(str(tmp_path / "root" / "job")).restore(12, args=ocp.args.StandardRestore(target))
    for a, b in zip(_leaves(state), _leaves(restored), strict=True):
        assert np.array_equal(a, b)
    # and ckptd's own storage restore reads the persisted step's chunks directly, onto another mesh too
    small = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   jax.eval_shape(init_state), _shardings(_mesh(6)))
    direct = restore_direct(tmp_path / "root" / "job" / "12" / "default", small, leaf_name)
    for a, b in zip(_leaves(state), _leaves(direct), strict=True):
        assert np.array_equal(a, b)
    name, leaf = next((n, x) for n, x in zip(meta.leaf_names, jax.tree_util.tree_leaves(state), strict=True)
                      if len(meta.arrays[n].shards) > 1)
    stored = ts.open({"driver": "zarr", "path": name, "kvstore": {
        "driver": "ocdbt", "base": f"file://{tmp_path / 'root' / 'job' / '12' / 'default'}"}}).result()
    assert tuple(stored.chunk_layout.read_chunk.shape) == leaf.sharding.shard_shape(leaf.shape)


@pytest.mark.needs_devices(8)
def test_a_restore_from_memory_never_shares_memory_with_the_snapshot(tmp_path: Path) -> None:
    mesh = _mesh()
    state = _state(mesh, seed=9)
    tier = MemoryTier(str(tmp_path), "job")
    path = tier.save(3, state, _meta(3, state, mesh), persist=False)
    before = (path / SNAPSHOT_DATA_FILE).read_bytes()
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = restore_snapshot(path, target)
    if Path("/proc/self/maps").exists():  # the restore's map of the snapshot is gone, and no buffer lies in one
        ranges = _mapped(path / SNAPSHOT_DATA_FILE)
        assert not [s for leaf in jax.tree_util.tree_leaves(restored) for s in leaf.addressable_shards
                    if any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in ranges)]
    # a step that donates the restored buffers never writes the snapshot
    bumped = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x + 1, t), donate_argnums=0)(restored)
    for a, b in zip(_leaves(state), _leaves(bumped), strict=True):
        assert np.array_equal(a + 1, b)
    assert (path / SNAPSHOT_DATA_FILE).read_bytes() == before
    # what ckptd does to the snapshot afterwards (its file rewritten in place, cut short, evicted) never
    # reaches arrays restored from it: they hold the bytes that were checked
    again = restore_snapshot(path, target)
    with open(path / SNAPSHOT_DATA_FILE, "r+b") as f:
        f.write(bytes(len(before)))
        f.flush()
        f.truncate(16)
    shutil.rmtree(path)
    for a, b in zip(_leaves(state), _leaves(again), strict=True):
        assert np.array_equal(a, b)


def _tiers(tmp_path: Path, ckptd_server: Any, *, stored: int, in_memory: int) -> tuple[CkptdClient, Path]:
    """Step ``stored`` on storage, step ``in_memory`` in the memory tier, a ckptd over both, and its client."""
    shm, root = tmp_path / "shm", tmp_path / "root"
    mesh = _mesh()
    state = _state(mesh)
    ck = Checkpointer(str(root / "job"))
    ck.save(stored, state, data_position=48 * stored, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])
    ck.close()
    MemoryTier(str(shm), "job").save(in_memory, state, _meta(in_memory, state, mesh), persist=False)
    server = ckptd_server(root, shm_dir=str(shm))
    return CkptdClient(ClientSettings(url=server.url, shm_dir=str(shm)), root=str(root)), shm


@pytest.mark.needs_devices(8)
def test_plans_prefer_a_whole_memory_snapshot(tmp_path: Path, ckptd_server: Any) -> None:
    client, shm = _tiers(tmp_path, ckptd_server, stored=10, in_memory=15)
    request = ResumeRequest(policy="resize", alive_devices=6)
    with client:
        plan = client.resume("job", request)
        assert (plan.tier, plan.step, plan.data_position, plan.mesh.shape) == ("memory", 15, 720, [3, 2])
        storage_only = client.resume("job", request.model_copy(update={"use_memory_tier": False}))
        assert (storage_only.tier, storage_only.step) == ("storage", 10)
        fallback = client.resume_from_storage("job", request)
        assert fallback.model_dump(exclude={"source"}) == plan.model_dump(exclude={"source"})
        with open(shm / "job" / "15" / SNAPSHOT_DATA_FILE, "r+b") as f:  # damaged: never used
            f.truncate(1)
        assert client.resume("job", request).tier == "storage"


@pytest.mark.needs_devices(8)
def test_at_equal_steps_ckptd_and_the_fallback_both_restore_from_memory(tmp_path: Path, ckptd_server: Any) -> None:
    """The one decision (docs/protocol.md, "Resume"): a step held both in memory and verified on storage is
    restored from memory, by ckptd and by the client's storage fallback alike, asked for or not."""
    client, _ = _tiers(tmp_path, ckptd_server, stored=10, in_memory=10)
    with client:
        deadline = time.monotonic() + 30
        while (good := client.latest_good("job")) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert good is not None and good.step == 10  # verified on storage: a real tie
        for request in (ResumeRequest(alive_devices=6), ResumeRequest(alive_devices=6, step=10)):
            plan = client.resume("job", request)
            assert (plan.source, plan.tier, plan.step) == ("ckptd", "memory", 10)
            fallback = client.resume_from_storage("job", request)
            assert fallback.source == "storage_scan"
            assert fallback.model_dump(exclude={"source"}) == plan.model_dump(exclude={"source"})


@pytest.mark.needs_devices(8)
def test_the_runner_recovers_from_memory_and_persists_through_ckptd(tmp_path: Path, ckptd_server: Any) -> None:
    shm, root = tmp_path / "shm", tmp_path / "root"
    (root / "job").mkdir(parents=True)
    server = ckptd_server(root, shm_dir=str(shm), refresh_interval_s=0.2)
    config = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48,
                           checkpoint_period=10, elastic=ElasticOptions(policy="resize"),
                           memory_tier=MemoryTierOptions(shm_dir=str(shm), memory_period=5, max_snapshots=3,
                                                         replicas=ReplicaOptions(enabled=False)),  # shm's path
                           health=HealthOptions(poll_interval_s=0.05, scale_up_check_interval_s=0.0))
    client = CkptdClient(ClientSettings(url=server.url, shm_dir=str(shm)), root=str(root))
    runner = ElasticRunner(config, slices=SimulatedSlices(num_slices=4, faults=[SliceFault(2, 17, None)]),
                           client=client, checkpoint_dir=str(root / "job"))
    log = TrainLog()
    try:
        result = runner.run(make_train_fn(30, log))
    finally:
        runner.checkpointer.close()
        client.close()
    down = result.recoveries[0]
    assert (down.failed_at_step, down.restored_step, down.lost_steps) == (17, 15, 2)  # memory period bounds it
    assert any(e.kind == "restored" and "memory" in e.detail for e in result.events)
    assert [log.samples[s] for s in range(30)] == [(s * 48, (s + 1) * 48) for s in range(30)]
    # the persistent saves went to storage through ckptd's persister: the first (10) and the run's last (30); 20,
    # due while 10 was still being persisted (the worker's first start loads jax), is persisted too, or superseded
    # by 30 before its turn came and reported (docs/operations.md, "Persists that fall behind")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (root / "job" / "30" / "commit_success.txt").exists():
        time.sleep(0.2)
    for step in (10, 30):
        assert (root / "job" / str(step) / "commit_success.txt").exists()
    if not (root / "job" / "20" / "commit_success.txt").exists():
        events = [e for f in (root / "job" / ".ckptd" / "events").glob("*.json")
                  for e in json.loads(f.read_text())["events"]]
        assert any(e["kind"] == "persist_overtaken" and e["step"] == 20 and e["superseded_by"] == 30 for e in events)


@pytest.mark.needs_devices(8)
def test_a_save_costs_the_loop_the_copy_whether_or_not_ckptd_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_client.runtime.saving._saver import Saver

    class CkptdAway:
        ok = False

    mesh = _mesh()
    state = _state(mesh)
    checkpointer = Checkpointer(str(tmp_path / "root" / "job"))
    try:
        # ckptd not answering: the snapshot waits in shared memory for it (only the device-to-host copy)
        with_memory = Saver(checkpointer, MemoryTier(str(tmp_path / "shm"), "job", preallocate=False), CkptdAway())
        assert with_memory.save(10, state, _meta(10, state, mesh), persist=True) == "memory+persist"
        assert read_meta(tmp_path / "shm" / "job" / "10").persist and not (tmp_path / "root" / "job" / "10").exists()
        # storage only: a periodic save never waits for the previous save still being written
        direct = Saver(checkpointer, None, None)
        monkeypatch.setattr(checkpointer, "is_saving", lambda: True)
        assert direct.save(20, state, _meta(20, state, mesh), persist=True, if_busy="skip") == "skipped"
        assert 20 not in direct.saved_steps and direct.last_blocked_s == 0.0
        assert direct.save(20, state, _meta(20, state, mesh), persist=True, if_busy="wait") == "storage"
        checkpointer.wait()
        assert (tmp_path / "root" / "job" / "20").is_dir()
    finally:
        checkpointer.close()


@pytest.mark.parametrize("pid", [2**31, 2**63, 10**30])
def test_a_leftover_named_by_a_number_no_pid_is_dropped_not_an_overflow(tmp_path: Path, pid: int) -> None:
    from trainer_client.core.format._snapshot_dirs import drop_leftovers

    job = tmp_path / "job"
    job.mkdir()
    (job / f".spare-{pid}").write_bytes(b"x")
    (job / f"7.tmp-{pid}").mkdir()
    MemoryTier(str(tmp_path), "job")  # the trainer's start: no process has that pid
    assert sorted(p.name for p in job.iterdir()) == []
    (job / f"7.tmp-{pid}").mkdir()
    assert drop_leftovers(job) == 1
