"""The restore from the memory tier as a pipeline: every shard checked before its array is built, a damaged
snapshot refused with no array handed back, host buffers (the snapshot's map) held until each transfer is
done, and on CPU no restored array sharing memory with the snapshot. Speed is the bench's
(bench/tier_restore.py), not these tests'."""

from __future__ import annotations

import gc
import shutil
import threading
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.trainer.runtime import test_direct_restore as direct_cases
from trainer_client.core._errors import StoredFormatError
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE
from trainer_client.core.format._snapshot import read_meta
from trainer_client.runtime.memory import _memory_restore
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.restore import _direct_restore
from trainer_client.runtime.restore._direct_restore import restore_direct
from trainer_client.runtime.restore._host_pipeline import stream_to_devices
from trainer_client.runtime.saving._checkpointing import leaf_name, training_metadata


def _mesh(n: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(n // 2, 2), ("replica", "data"))


def _state(mesh: Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    specs = {"w": P(None, "data"), "b": P("replica"), "m": P("replica", "data"), "r": P()}
    shapes = {"w": (16, 8), "b": (8,), "m": (8, 4), "r": (3,)}
    return {k: jax.device_put(rng.standard_normal(shapes[k]).astype(np.float32), NamedSharding(mesh, specs[k]))
            for k in specs}


def _save(tmp_path: Path) -> tuple[Path, dict[str, Any], Mesh]:
    mesh = _mesh()
    state = _state(mesh)
    meta = training_metadata(4, state, data_position=4, global_batch=8, mesh=mesh, slices=[0, 1, 2, 3])
    return MemoryTier(str(tmp_path), "job").save(4, state, meta, persist=False), state, mesh


def _target(state: dict[str, Any], mesh: Mesh | None = None) -> dict[str, Any]:
    def one(a: jax.Array) -> jax.ShapeDtypeStruct:
        sharding = a.sharding if mesh is None else NamedSharding(mesh, a.sharding.spec)  # type: ignore[attr-defined]
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return {k: one(v) for k, v in state.items()}


def _flip(path: Path, at: int) -> None:
    with open(path / SNAPSHOT_DATA_FILE, "r+b") as f:  # same size, one byte changed: only a checksum sees it
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("views", [False, True], ids=["cpu-copies", "accelerator-views"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_corrupted_byte_anywhere_is_refused_and_no_array_is_handed_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, views: bool) -> None:
    path, state, _ = _save(tmp_path)
    meta = read_meta(path)
    shards = [(name, k, s) for name in meta.leaf_names for k, s in enumerate(meta.arrays[name].shards)]
    name, k, shard = {"first": shards[0], "middle": shards[len(shards) // 2], "last": shards[-1]}[where]
    _flip(path, shard.offset + (shard.nbytes - 1 if where == "last" else shard.nbytes // 2))
    if views:  # the path of accelerators (transfers read the map), run on CPU devices
        monkeypatch.setattr(_memory_restore, "_on_cpu", lambda leaves: False)
    built: list[jax.Array] = []
    make = jax.make_array_from_callback

    def spy(*args: Any, **kwargs: Any) -> jax.Array:
        built.append(make(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    for mesh in (None, _mesh(4)):  # the saved layout, and a smaller mesh (regions assembled from shards)
        built.clear()
        with pytest.raises(StoredFormatError, match=rf"damaged: {name} shard {k}: XXH3"):
            restore_snapshot(path, _target(state, mesh), threads=3)
        assert all(array.is_deleted() for array in built)  # what was built before the damage was found, dropped
    assert len(built) < len(state)  # the damaged array itself was never built


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("mesh_size", [8, 4, 2])
def test_the_accelerator_path_restores_exactly_and_outlives_the_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh_size: int) -> None:
    path, state, _ = _save(tmp_path)
    monkeypatch.setattr(_memory_restore, "_on_cpu", lambda leaves: False)
    restored = restore_snapshot(path, _target(state, None if mesh_size == 8 else _mesh(mesh_size)), threads=2,
                                host_bytes=64)
    (path / SNAPSHOT_DATA_FILE).unlink()  # evicted: the map, where it is still viewed, keeps its pages
    gc.collect()
    for key, array in state.items():
        assert np.array_equal(np.asarray(restored[key]), np.asarray(array))


@pytest.mark.needs_devices(8)
def test_the_cpu_path_copies_every_shard_the_accelerator_path_views_the_map(tmp_path: Path) -> None:
    path, state, _ = _save(tmp_path)
    meta = read_meta(path)
    name = meta.leaf_names[0]
    shards = _memory_restore._Shards(path, meta, copy=False)
    assert shards.data is not None
    lo, hi = shards.data.ctypes.data, shards.data.ctypes.data + len(shards.data)
    views = shards.checked(name, meta.arrays[name])
    shards.close()
    assert all(lo <= v.ctypes.data < hi and not v.flags.writeable for v in views)  # read-only views of the map
    (path / SNAPSHOT_DATA_FILE).unlink()
    gc.collect()  # the map outlives the snapshot while a view of it (a transfer's source) lives
    assert [v.tobytes() for v in views] == [np.asarray(s.data).tobytes() for s in state[name].addressable_shards
                                            if s.replica_id == 0]
    path, state, _ = _save(tmp_path / "again")
    copies = _memory_restore._Shards(path, meta, copy=True)
    owned = copies.checked(name, meta.arrays[name])
    copies.close()
    assert all(v.flags.writeable and v.ctypes.data % 64 == 0 for v in owned)  # buffers of the restore's own
    # (that arrays restored on CPU keep their bytes whatever happens to the snapshot after: test_memory_tier.py)


class _Transfer:
    """A stand-in for a jax array whose transfer reads ``host`` until ``block_until_ready``."""

    def __init__(self, host: np.ndarray, log: list[str]) -> None:
        self.host = weakref.ref(host)
        self.log = log
        self.deleted = False

    def block_until_ready(self) -> _Transfer:
        if self.host() is None:
            self.log.append("freed before its transfer completed")
        return self

    def delete(self) -> None:
        self.deleted = True


def test_host_buffers_are_held_until_their_transfer_is_done_then_freed() -> None:
    log: list[str] = []
    sizes = [100, 300, 50, 200, 100, 250]
    live: dict[int, int] = {}
    peak = [0]
    lock = threading.Lock()

    def prepare(k: int) -> np.ndarray:
        host = np.zeros(sizes[k], np.uint8)
        with lock:
            live[k] = sizes[k]
            peak[0] = max(peak[0], sum(live.values()))
        weakref.finalize(host, lambda: live.pop(k, None))
        return host

    out = stream_to_devices(list(range(len(sizes))), sizes, prepare, lambda k, host: _Transfer(host, log),
                            threads=3, budget=400)
    assert log == [] and len(out) == len(sizes)
    gc.collect()
    assert all(t.host() is None for t in out) and not live  # every buffer gone once its transfer was done
    assert peak[0] <= 400  # never more host bytes at once than the budget


def test_a_failed_check_drops_what_was_built_and_raises_the_first_failure() -> None:
    log: list[str] = []
    built: list[_Transfer] = []

    def prepare(k: int) -> np.ndarray:
        if k in (3, 5):
            raise StoredFormatError(f"shard {k} damaged")
        return np.zeros(8, np.uint8)

    def build(k: int, host: np.ndarray) -> _Transfer:
        built.append(_Transfer(host, log))
        return built[-1]

    with pytest.raises(StoredFormatError, match="shard 3 damaged"):
        stream_to_devices(list(range(8)), [8] * 8, prepare, build, threads=1)
    assert log == [] and built and all(t.deleted for t in built) and len(built) <= 3


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("case", sorted(direct_cases.TARGETS))
def test_the_direct_readers_accelerator_path_reads_the_mapped_files_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    values = direct_cases._save(tmp_path / "job")
    monkeypatch.setattr(_direct_restore, "_on_cpu", lambda sharding: False)  # as on an accelerator
    mesh_shape, names, specs = direct_cases.TARGETS[case]
    target = direct_cases._target(direct_cases._mesh(mesh_shape, names), specs)
    out = restore_direct(tmp_path / "job" / "3" / "default", target, leaf_name, host_batch_bytes=64)
    shutil.rmtree(tmp_path / "job")  # the maps, where still viewed, keep their pages
    gc.collect()
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree_util.tree_leaves(target),
                                 strict=True):
        assert got.sharding == want.sharding
        assert np.array_equal(np.asarray(got), values[leaf_name(path).split(".")[-1]])
