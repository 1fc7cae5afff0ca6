"""The shared-memory directory is private (docs/operations.md, "Security"): nothing read from it is
unpickled, nothing there is followed through a link, a directory others may write is refused, and a
snapshot whose bytes changed is neither persisted nor restored."""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.memory_tier._snapshots import SnapshotKeeper
from ckptd.persist._persist_worker import persist
from trainer_client.core._errors import StoredFormatError, UnsafePathError
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE, SNAPSHOT_PERSISTED_FILE, SNAPSHOT_SPARE_PREFIX
from trainer_client.core.format._snapshot import problems, read_meta
from trainer_client.core.format._snapshot_dirs import mark_persisted, newest_whole
from trainer_client.core.format._tree_paths import TreeEntry, rebuild
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _state(mesh: Mesh) -> Any:
    """A real optimizer state: optax's chain holds an empty named tuple, adam's NamedTuples hold arrays."""
    row = NamedSharding(mesh, P("data", None))
    params = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), row),
              "layers": [{"b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))},
                         {"b": jax.device_put(jnp.full(8, 2.0), NamedSharding(mesh, P("data")))}]}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)
    return {"params": params, "opt": opt, "nothing": None, "empty": {}}


def _save(shm: Path, step: int = 5, *, persist: bool = True) -> tuple[Path, Any]:
    mesh = _mesh()
    state = _state(mesh)
    meta = training_metadata(step, state, data_position=step, global_batch=8, mesh=mesh, slices=[0])
    return MemoryTier(str(shm), "job", preallocate=False).save(step, state, meta, persist=persist), state


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.needs_devices(8)
def test_a_snapshot_is_private_and_holds_no_pickle(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    path, _ = _save(shm)
    assert _mode(shm) == _mode(shm / "job") == _mode(path) == 0o700
    assert all(_mode(f) == 0o600 for f in path.iterdir()), {f.name: oct(_mode(f)) for f in path.iterdir()}
    assert not [f for f in path.iterdir() if f.suffix == ".pickle"]


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {_Boom.marker}",))

    marker = ""


@pytest.mark.needs_devices(8)
def test_the_persist_worker_never_unpickles_what_it_finds(tmp_path: Path) -> None:
    path, state = _save(tmp_path / "shm")
    _Boom.marker = str(tmp_path / "pwned")
    (path / "treedef.pickle").write_bytes(pickle.dumps(_Boom()))  # what the old format read back
    (path / "treedef.pickle").chmod(0o600)
    url = persist(path, str(tmp_path / "root" / "job"))
    assert not (tmp_path / "pwned").exists()
    # the step is the one the trainer would have saved itself: same tree metadata, same values
    direct = Checkpointer(str(tmp_path / "direct"))
    direct.save_with_metadata(5, state, read_meta(path).training)
    direct.wait()
    direct.close()

    def tree_metadata(step_dir: str) -> Any:  # the tree Orbax recorded (chunk shapes may differ)
        tree = json.loads(Path(step_dir, "default", "_METADATA").read_text())["tree_metadata"]
        return {k: (v["key_metadata"], v["value_metadata"]["value_type"]) for k, v in tree.items()}

    assert tree_metadata(url) == tree_metadata(str(tmp_path / "direct" / "5"))
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = ocp.CheckpointManager(str(tmp_path / "root" / "job")).restore(
        5, args=ocp.args.StandardRestore(target))
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("entries", [
    [{"path": [["dict", "a"]]}, {"path": [["dict", "a"], ["dict", "b"]]}],  # a leaf and a container
    [{"path": [["dict", "a"]]}, {"path": [["seq", "0"]]}],  # a dict and a sequence at once
    [{"path": [["seq", "0"]]}, {"path": [["seq", "2"]]}],  # a sequence with a hole
    [{"path": [["dict", "a"]]}, {"path": [["dict", "a"]]}],  # one path twice
])
def test_a_forged_tree_description_is_a_format_error(entries: list[dict[str, Any]]) -> None:
    tree = [TreeEntry.model_validate(e) for e in entries]
    with pytest.raises(StoredFormatError):
        rebuild(tree, [np.zeros(1)] * len(tree))


@pytest.mark.needs_devices(8)
def test_a_directory_others_may_write_is_refused_by_trainer_ckptd_and_resume(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    _save(shm)
    shm.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by its group or by others"):
        _save(shm, 6)
    assert newest_whole(str(shm), "job") is None  # what resume names: nothing from a directory others write
    keeper = SnapshotKeeper(Storage(str(tmp_path / "root")), str(shm))
    keeper.scan()
    assert keeper.jobs() == [] and "writable" in (keeper.stats.last_error or "")
    shm.chmod(0o700)
    (shm / "job").chmod(0o757)
    assert newest_whole(str(shm), "job") is None
    (shm / "job").chmod(0o700)
    assert newest_whole(str(shm), "job") is not None


@pytest.mark.needs_devices(8)
def test_a_directory_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmp_path / "shm"
    _save(shm)
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(shm).st_uid + 1)  # as seen by another user
    with pytest.raises(UnsafePathError, match="belongs to uid"):
        MemoryTier(str(shm), "job")
    assert newest_whole(str(shm), "job") is None


@pytest.mark.needs_devices(8)
def test_links_are_never_followed(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    path, _ = _save(shm)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # ckptd marking a snapshot persisted replaces a planted link, never writes through it
    (path / SNAPSHOT_PERSISTED_FILE).symlink_to(victim)
    mark_persisted(path, "file:///x/5")
    assert victim.read_text() == "precious" and not (path / SNAPSHOT_PERSISTED_FILE).is_symlink()
    # the trainer's spare file: a planted link at its temporary name is not zero-filled through
    tier = MemoryTier(str(shm), "job", preallocate=True)
    (shm / "job" / f"{SNAPSHOT_SPARE_PREFIX}{os.getpid()}.part").symlink_to(victim)
    tier._prepare_spare(1 << 20, path, True)  # touched: every page written, the strongest case
    assert victim.read_text() == "precious"
    tier.close()
    # a step directory that is a link, and a data file that is a link, are not snapshots
    elsewhere = tmp_path / "elsewhere"
    os.rename(path, elsewhere)
    (shm / "job" / "5").symlink_to(elsewhere)
    assert newest_whole(str(shm), "job") is None
    (shm / "job" / "5").unlink()
    os.rename(elsewhere, path)
    (path / SNAPSHOT_DATA_FILE).rename(tmp_path / "data")
    (path / SNAPSHOT_DATA_FILE).symlink_to(tmp_path / "data")
    assert any("data.bin" in p for p in problems(path))


@pytest.mark.needs_devices(8)
def test_a_snapshot_whose_bytes_changed_is_neither_persisted_nor_restored(tmp_path: Path) -> None:
    path, state = _save(tmp_path / "shm")
    meta = read_meta(path)
    shard = meta.arrays[meta.leaf_names[-1]].shards[0]
    with open(path / SNAPSHOT_DATA_FILE, "r+b") as f:  # same size, one byte flipped: only a checksum sees it
        f.seek(shard.offset)
        byte = f.read(1)
        f.seek(shard.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert problems(path) == []
    with pytest.raises(StoredFormatError, match="damaged"):
        persist(path, str(tmp_path / "root" / "job"))
    assert not (tmp_path / "root" / "job" / "5").exists()
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    with pytest.raises(StoredFormatError, match="damaged"):
        restore_snapshot(path, target)
