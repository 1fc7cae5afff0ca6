"""The persist path's work beside the write (docs/benchmarks.md, ``persist_throughput_ratio_vs_disk_limit``):
a save's ``verify`` gates its commit (the persist worker checks the snapshot's bytes there, beside Orbax's
write), and ``ClosedFileSums`` checksums OCDBT data files as their writer closes them, trusting a sum only
for the file it read, unchanged since."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_client.core._written_crc import ClosedFileSums
from trainer_client.core.format._checksum import file_crc32c
from trainer_client.core.format._files import CKPTD_MANIFEST, TMP_DIR_SUFFIX
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata


def _state() -> dict[str, jax.Array]:
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    return {"w": jax.device_put(jnp.arange(64.0 * 8).reshape(64, 8), NamedSharding(mesh, P("data")))}


def _save(ck: Checkpointer, step: int, **kwargs: object) -> None:
    state = _state()
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    meta = training_metadata(step, state, data_position=step, global_batch=8, mesh=mesh, slices=[0])
    ck.save_with_metadata(step, state, meta, **kwargs)  # type: ignore[arg-type]


def test_a_save_whose_verify_raises_is_never_committed(tmp_path: Path) -> None:
    calls: list[bool] = []

    def verify() -> None:
        # every file of the step is written by now, and nothing is committed yet
        assert (tmp_path / f"3{TMP_DIR_SUFFIX}").is_dir() and not (tmp_path / "3").exists()
        calls.append(True)
        raise ValueError("damaged")

    ck = Checkpointer(str(tmp_path))
    _save(ck, 3, verify=verify)
    with pytest.raises(Exception, match="damaged"):
        ck.wait()
    with contextlib.suppress(Exception):
        ck.close()
    assert calls == [True]
    assert not (tmp_path / "3").exists()
    # the next save is not affected by the last one's verify
    ck2 = Checkpointer(str(tmp_path))
    _save(ck2, 4, verify=lambda: None)
    ck2.wait()
    ck2.close()
    assert (tmp_path / "4" / CKPTD_MANIFEST).is_file()


def test_a_synchronous_save_verifies_before_writing(tmp_path: Path) -> None:
    ck = Checkpointer(str(tmp_path), async_save=False)

    def verify() -> None:
        raise ValueError("damaged")

    with pytest.raises(ValueError, match="damaged"):
        _save(ck, 3, verify=verify)
    assert not any(tmp_path.glob("3*"))


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_closed_data_files_are_summed_as_read_back(tmp_path: Path) -> None:
    data_dir = tmp_path / "1.tmp" / "item" / "ocdbt.process_0" / "d"
    data_dir.mkdir(parents=True)
    sums = ClosedFileSums(str(tmp_path))
    if not sums.watching:
        pytest.skip("no inotify on this platform: nothing is summed early, the manifest reads every file")
    rng = np.random.default_rng(0)
    payloads = {f"f{i}": rng.bytes(100_000 + i) for i in range(4)}
    for name, data in payloads.items():
        _write(data_dir / name, data)
    _write(data_dir.parent / "manifest.ocdbt", b"metadata: rewritten and renamed, never trusted early")
    with open(data_dir / "f3", "ab") as f:  # reopened and written: its sum holds only if taken after this
        f.write(b"changed after its close")
    os.rename(tmp_path / "1.tmp", tmp_path / "1")  # the commit renames directories, not the files
    entries = sums.entries(str(tmp_path / "1"))
    sums.shutdown()
    for name in ("f0", "f1", "f2"):
        rel = f"item/ocdbt.process_0/d/{name}"
        assert entries[rel] == file_crc32c(str(tmp_path / "1" / rel)) == (len(payloads[name]), entries[rel][1])
    f3 = "item/ocdbt.process_0/d/f3"
    assert f3 not in entries or entries[f3] == file_crc32c(str(tmp_path / "1" / f3))
    assert "item/ocdbt.process_0/manifest.ocdbt" not in entries


def test_an_orbax_save_is_summed_as_the_manifest_would_read_it(tmp_path: Path) -> None:
    """A real save: every data file summed early has the CRC32C the manifest's own pass reads back."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    state = {f"w{i}": jax.device_put(jnp.full((512, 512), float(i)), NamedSharding(mesh, P("data")))
             for i in range(8)}  # 8 MiB: OCDBT data files of ~1 MiB, closed one after another
    ck = Checkpointer(str(tmp_path))
    sums = ClosedFileSums(str(tmp_path))
    if not sums.watching:
        pytest.skip("no inotify on this platform")
    ck.save(1, state, data_position=1, global_batch=8, mesh=mesh, slices=[0])
    ck.wait()
    ck.close()
    entries = sums.entries(str(tmp_path / "1"))
    sums.shutdown()
    assert entries
    for rel, entry in entries.items():
        assert "/d/" in rel
        assert entry == file_crc32c(str(tmp_path / "1" / rel))


def test_a_file_changed_after_its_sum_is_not_trusted(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    sums = ClosedFileSums(str(tmp_path))
    if not sums.watching:
        pytest.skip("no inotify on this platform")
    _write(data_dir / "a", b"x" * 50_000)
    _write(data_dir / "b", b"y" * 50_000)
    sums.close()  # no more events: b's rewrite below is seen only by its changed size and times
    sums_before = sums.entries(str(tmp_path))
    _write(data_dir / "b", b"z" * 60_000)
    after = sums.entries(str(tmp_path))
    sums.shutdown()
    assert sums_before["d/a"] == file_crc32c(str(data_dir / "a"))
    assert after["d/a"] == sums_before["d/a"]
    assert "d/b" not in after


def test_the_checkpointers_manifest_takes_the_early_sums_and_stays_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Checkpointer save on a local disk hands the data files summed as they were closed to the manifest
    (not read again), and every CRC32C in the committed manifest is that of the bytes on disk."""
    import trainer_client.checkpoint_io._checkpointer as checkpointing
    from trainer_client.core._storage import Storage
    from trainer_client.core.format._manifest import build_manifest, read_manifest

    probe = ClosedFileSums(str(tmp_path))
    watching = probe.watching
    probe.shutdown()
    if not watching:
        pytest.skip("no inotify on this platform")
    given: list[dict[str, tuple[int, str]] | None] = []

    def spy(*args: object, **kwargs: object) -> object:
        given.append(kwargs.get("known"))  # type: ignore[arg-type]
        return build_manifest(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpointing, "build_manifest", spy)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    state = {f"w{i}": jax.device_put(jnp.full((512, 512), float(i)), NamedSharding(mesh, P("data")))
             for i in range(8)}
    ck = Checkpointer(str(tmp_path / "job"))
    for step_number in (1, 2):  # the second save: the job's directory already holds a step
        ck.save(step_number, state, data_position=1, global_batch=8, mesh=mesh, slices=[0])
        ck.wait()
    ck.close()
    assert len(given) == 2 and all(given), "the manifest got no early sums"
    step = tmp_path / "job" / "2"
    manifest = read_manifest(Storage(str(tmp_path / "job")), str(step))
    assert manifest is not None
    assert given[1] is not None
    assert set(given[1]) <= set(manifest.files) and all("/d/" in rel for rel in given[1])
    for rel, entry in manifest.files.items():
        assert (entry.size, entry.crc32c) == file_crc32c(str(step / rel)), rel
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptd-crc")], "left running"


def test_a_watch_of_new_directories_only_leaves_the_old_ones_alone(tmp_path: Path) -> None:
    """What a save watches in a job's directory: the directory and what is created in it from then on, not a
    watch and a descriptor for every directory of every earlier step."""
    for k in range(50):
        (tmp_path / str(k) / "d").mkdir(parents=True)
    sums = ClosedFileSums(str(tmp_path), existing_dirs=False)
    if not sums.watching:
        sums.shutdown()
        pytest.skip("no inotify on this platform")
    try:
        assert len(sums._dirs) == 1  # the job's directory alone
        (tmp_path / "new" / "d").mkdir(parents=True)
        deadline = time.monotonic() + 30
        while len(sums._dirs) < 3 and time.monotonic() < deadline:  # new and new/d, once seen
            time.sleep(0.01)
        _write(tmp_path / "new" / "d" / "a", b"x" * 50_000)
        entries = sums.entries(str(tmp_path / "new"))
    finally:
        sums.shutdown()
    assert entries == {"d/a": file_crc32c(str(tmp_path / "new" / "d" / "a"))}
