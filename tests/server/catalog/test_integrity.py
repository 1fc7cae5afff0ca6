"""Integrity end to end: manifests, validation, quarantine, durability ordering, and Orbax's step-cache
failure — on real Orbax checkpoints written by trainer_client."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main as ckptd_main
from tests.support.golden import copy_root
from tests.support.helpers import wait_until
from trainer_client.checkpoint_io import _checkpointer as checkpointing
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._durability import Syncer, using_syncer
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage, validate_step
from trainer_client.core.format._files import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    VERIFIED_FILE,
)
from trainer_client.core.format._manifest import read_manifest, write_manifest
from trainer_client.core.protocol import ResumeRequest, StepState
from trainer_client.runtime.saving._checkpointing import Checkpointer

N_STEPS = 60


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))


def _state(mesh: Mesh, step: int) -> dict[str, jax.Array]:
    return {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8) + step, NamedSharding(mesh, P(None, "data"))),
        "b": jax.device_put(jnp.full((16,), float(step)), NamedSharding(mesh, P("replica"))),
    }


def _save(ck: Checkpointer, mesh: Mesh, step: int) -> None:
    ck.save(step, _state(mesh, step), data_position=step * 8, global_batch=8, mesh=mesh, slices=[0, 1, 2, 3])


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job of N_STEPS committed steps written by trainer_client, verified (and sealed) by a catalog."""
    root = tmp_path_factory.mktemp("golden")
    mesh = _mesh()
    ck = Checkpointer(str(root / "job"))
    for step in range(1, N_STEPS + 1):
        _save(ck, mesh, step)
    ck.close()
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()
    assert [c.state for c in cat.checkpoints("job")] == [StepState.VERIFIED] * N_STEPS
    cat.close()
    return root


@pytest.fixture
def root(golden: Path, tmp_path: Path) -> Path:
    return copy_root(golden, tmp_path)


def test_trainer_written_steps_carry_a_manifest_plain_orbax_can_ignore(root: Path) -> None:
    import orbax.checkpoint as ocp

    storage = Storage(str(root))
    manifest = read_manifest(storage, storage.join("job", "7"))
    assert manifest is not None and manifest.writer == "trainer_client" and manifest.step == 7
    assert manifest.training is not None and manifest.training.data_position == 56
    assert manifest.sealed is not None and set(manifest.sealed) == {CHECKPOINT_METADATA, COMMIT_MARKER}
    assert "default/_METADATA" in manifest.files and all(f.crc32c for f in manifest.files.values())
    restored = ocp.CheckpointManager(str(root / "job")).restore(7)
    assert float(np.asarray(restored["b"])[0]) == 7.0


def _corrupt(path: Path, kind: str, rng: random.Random) -> None:
    if kind == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    else:
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(data))


def test_every_corruption_is_detected_and_latest_good_falls_back(root: Path) -> None:
    rng = random.Random(20261130)
    storage = Storage(str(root))
    job = root / "job"
    trials = rng.sample(range(1, N_STEPS + 1), 50)
    assert N_STEPS in trials or trials.append(N_STEPS) is None  # the newest step is always hit
    seen_kinds: dict[str, int] = {}
    for step in trials:
        # every file of the checkpoint (ckptd's verified record is a verdict about it, not part of it:
        # a damaged one is ignored, see test_catalog)
        files = sorted(p for p in (job / str(step)).rglob("*")
                       if p.is_file() and p.stat().st_size > 0 and p.name != VERIFIED_FILE)
        target = rng.choice(files)
        kind = rng.choice(["flip", "truncate", "delete"])
        seen_kinds[kind] = seen_kinds.get(kind, 0) + 1
        _corrupt(target, kind, rng)
        step_path = storage.join("job", str(step))
        deep = validate_step(storage, step_path, "deep")
        assert not deep.ok, f"deep validation missed a {kind} of {target.relative_to(job)}"
        if kind in ("truncate", "delete"):
            quick = validate_step(storage, step_path, "quick")
            assert not quick.ok, f"quick validation missed a {kind} of {target.relative_to(job)}"
    assert set(seen_kinds) == {"flip", "truncate", "delete"}

    # The operator's deep validation quarantines every corrupted step (files kept) and exits 1 ...
    assert ckptd_main(["validate", "--deep", f"{root}/job"]) == 1
    quarantined = {int(p.parent.name) for p in job.glob(f"*/{QUARANTINE_FILE}")}
    still_committed = {s for s in trials if (job / str(s) / COMMIT_MARKER).exists()}
    assert quarantined == still_committed
    assert all((job / str(s)).is_dir() for s in trials), "a bad step was deleted"
    # ... and latest-good falls back to the newest untouched step, for ckptd and for the client's scan.
    newest_good = max(set(range(1, N_STEPS + 1)) - set(trials))
    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    good = cat.confirmed_latest_good("job")
    assert good is not None and good.step == newest_good
    fallback = latest_good_on_storage(storage, storage.join("job"))
    assert fallback is not None and fallback.step == newest_good
    assert ckptd_main(["validate", "--deep", f"{root}/job", str(newest_good)]) == 0


def test_a_step_that_lost_its_manifest_is_quarantined_never_adopted_again(root: Path) -> None:
    """A verified step whose manifest is deleted (its verified record still there) is damaged: adopting it as
    a plain Orbax step would seal whatever its files hold now, a corrupted chunk included."""
    step = root / "job" / str(N_STEPS)
    (step / CKPTD_MANIFEST).unlink()
    chunk = next((step / "default").rglob("d/*"))
    chunk.write_bytes(bytes(b ^ 0xFF for b in chunk.read_bytes()))  # and a chunk changed, same size
    storage = Storage(str(root))
    fallback = latest_good_on_storage(storage, storage.join("job"))
    assert fallback is not None and fallback.step == N_STEPS - 1
    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    assert cat.step("job", N_STEPS).state is StepState.QUARANTINED  # type: ignore[union-attr]
    assert "manifest missing" in (cat.step("job", N_STEPS).reason or "")  # type: ignore[union-attr]
    assert cat.confirmed_latest_good("job").step == N_STEPS - 1  # type: ignore[union-attr]
    assert not (step / CKPTD_MANIFEST).exists() and chunk.exists()  # nothing sealed, nothing deleted


def test_a_step_truncated_after_verification_is_never_named(root: Path) -> None:
    storage = Storage(str(root))
    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    assert cat.latest_good("job").step == N_STEPS  # type: ignore[union-attr]
    victim = next((root / "job" / str(N_STEPS) / "default").rglob("d/*"))
    victim.write_bytes(victim.read_bytes()[:-1])
    good = cat.confirmed_latest_good("job")  # the quick check at answer time catches it
    assert good is not None and good.step == N_STEPS - 1
    assert (root / "job" / str(N_STEPS) / QUARANTINE_FILE).exists()
    assert cat.step("job", N_STEPS).state is StepState.QUARANTINED  # type: ignore[union-attr]
    # every ckptd sees the quarantine after a restart, from storage alone
    fresh = Catalog(storage, ":memory:")
    fresh.rebuild()
    assert fresh.step("job", N_STEPS).state is StepState.QUARANTINED  # type: ignore[union-attr]
    assert fresh.latest_good("job").step == N_STEPS - 1  # type: ignore[union-attr]


def test_plain_orbax_steps_are_adopted(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    mesh = _mesh()
    mgr = ocp.CheckpointManager(str(tmp_path / "job"))
    mgr.save(3, args=ocp.args.StandardSave(_state(mesh, 3)))
    mgr.wait_until_finished()
    storage = Storage(str(tmp_path))
    assert read_manifest(storage, storage.join("job", "3")) is None
    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    info = cat.step("job", 3)
    assert info is not None and info.state is StepState.VERIFIED and "adopted" in (info.reason or "")
    manifest = read_manifest(storage, storage.join("job", "3"))
    assert manifest is not None and manifest.writer == "adopted" and manifest.sealed is not None
    assert validate_step(storage, storage.join("job", "3"), "deep").ok


class _Recorder(Syncer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []  # (kind, path, commit marker of that step present?)

    def _record(self, kind: str, path: str) -> None:
        step_dir = next((p for p in Path(path).parents if p.name.split(".")[0].isdigit()), Path(path))
        marker = (Path(path) if kind == "dir" and path.split("/")[-1].split(".")[0].isdigit() else step_dir)
        final = marker.parent / marker.name.split(".")[0]
        self.events.append((kind, path, (final / COMMIT_MARKER).exists()))

    def fsync_file(self, path: str) -> None:
        self._record("file", path)
        super().fsync_file(path)

    def fsync_dir(self, path: str) -> None:
        self._record("dir", path)
        super().fsync_dir(path)


def test_everything_is_fsynced_before_the_commit_and_before_ckptd_says_good(tmp_path: Path) -> None:
    recorder = _Recorder()
    mesh = _mesh()
    with using_syncer(recorder):
        ck = Checkpointer(str(tmp_path / "job"))
        _save(ck, mesh, 5)
        ck.close()
        writer_events = list(recorder.events)
        step = tmp_path / "job" / "5"
        synced_before_commit = {Path(p).name for kind, p, committed in writer_events if not committed}
        for f in step.rglob("*"):
            if f.is_file() and f.name not in (COMMIT_MARKER, CHECKPOINT_METADATA):
                assert f.name in synced_before_commit, f"{f.relative_to(step)} not fsynced before the commit"
        assert CHECKPOINT_METADATA in synced_before_commit and CKPTD_MANIFEST in synced_before_commit
        assert any(k == "dir" and not committed for k, _, committed in writer_events)

        recorder.events.clear()
        cat = Catalog(Storage(str(tmp_path)), ":memory:")
        cat.rebuild()
        settled = [p for _, p, _ in recorder.events]
        for needed in (step / COMMIT_MARKER, step / CHECKPOINT_METADATA, step / CKPTD_MANIFEST, step, step.parent):
            assert str(needed) in settled, f"{needed} not fsynced before the step was reported good"
        # the sealed manifest is fsynced (with the rest, at once) before it is renamed into place
        assert any(p.startswith(str(step / CKPTD_MANIFEST) + ".tmp-") for p in settled)
        assert cat.step("job", 5).state is StepState.VERIFIED  # type: ignore[union-attr]


class _FailingSyncer(Syncer):
    """fsync fails with EIO for everything under ``prefix``."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = str(prefix)

    def fsync_file(self, path: str) -> None:
        if path.startswith(self.prefix):
            raise OSError("EIO: simulated disk error")
        super().fsync_file(path)

    def fsync_dir(self, path: str) -> None:
        self.fsync_file(path)


def test_a_step_that_cannot_be_made_durable_is_not_reported_good(root: Path) -> None:
    storage = Storage(str(root))
    step_path = storage.join("job", str(N_STEPS))
    manifest = read_manifest(storage, step_path)
    assert manifest is not None
    write_manifest(storage, step_path, manifest.model_copy(update={"sealed": None, "sealed_at": None}))  # unsealed
    with using_syncer(_FailingSyncer(root / "job" / str(N_STEPS))):
        cat = Catalog(Storage(str(root)), ":memory:")
        cat.rebuild()
    info = cat.step("job", N_STEPS)
    assert info is not None and info.state is StepState.COMMITTED and "EIO" in (info.reason or "")
    assert not list((root / "job" / str(N_STEPS)).glob("*.tmp-*"))  # no sealed manifest left half-done
    assert cat.latest_good("job").step == N_STEPS - 1  # type: ignore[union-attr]


class _Failing(list[int]):
    """The steps whose manifest fails; ``raised``: those whose failure was raised already."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: list[int] = []


@pytest.fixture
def failing_manifest(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Failing]:
    """Make the async save of the steps listed fail in Orbax's background thread (as when a slice dies
    during finalization)."""
    failing = _Failing()
    real = checkpointing.build_manifest

    def build(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("step") in failing:
            failing.raised.append(kwargs["step"])
            raise OSError("simulated: slice lost while the save was finalizing")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "build_manifest", build)
    yield failing


def test_orbax_step_cache_keeps_a_failed_save_but_the_client_never_resumes_from_it(
    tmp_path: Path, ckptd_server: Any, failing_manifest: _Failing
) -> None:
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path / "job"))
    _save(ck, mesh, 10)
    ck.wait()
    failing_manifest.append(20)
    _save(ck, mesh, 20)
    # the background save has failed (waited for: on a loaded machine it may take longer than the 1 s slept here,
    # and the failure cleared below could then let it commit); nobody has called wait_until_finished
    wait_until(lambda: 20 in failing_manifest.raised, timeout=60, what="step 20's save to fail")
    assert (tmp_path / "job" / "20.orbax-checkpoint-tmp").exists()
    # The field failure: Orbax's in-memory cache still reports the failed save as the latest step.
    assert ck._manager.latest_step() == 20
    assert not ck._manager.should_save(20)

    server = ckptd_server(tmp_path)
    client = CkptdClient(ClientSettings(url=server.url), root=str(tmp_path))
    plan = client.resume("job", ResumeRequest(policy="resize", alive_devices=8))
    assert plan.step == 10 and plan.data_position == 80
    assert client.resume_from_storage("job", ResumeRequest(policy="resize", alive_devices=8)).step == 10

    ck.reset()  # the elastic event: the old manager (and its cache) is dropped, not trusted
    assert ck._manager.latest_step() == 10
    failing_manifest.clear()
    _save(ck, mesh, 20)  # not skipped: the step is written again and committed
    ck.close()
    server.stop()
    fresh = Catalog(Storage(str(tmp_path)), ":memory:")
    fresh.rebuild()
    assert fresh.latest_good("job").step == 20  # type: ignore[union-attr]
    client.close()


def test_gc_keeps_the_newest_good_step_and_bad_ones(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = root / "job"
    (job / "55" / COMMIT_MARKER).unlink()  # now unfinished: a save in progress, kept
    bad = next((job / "58" / "default").rglob("d/*"))
    bad.write_bytes(bad.read_bytes()[:-3])
    assert ckptd_main(["gc", f"{root}/job", "--keep-last", "3", "--keep-every", "20", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete" in out
    assert sorted(int(p.name) for p in job.iterdir()) == list(range(1, N_STEPS + 1)), "dry run deleted"
    assert ckptd_main(["gc", f"{root}/job", "--keep-last", "3", "--keep-every", "20"]) == 0
    left = sorted(int(p.name) for p in job.iterdir())
    # kept: every 20th, the last 3 good (60, 59, 57), the unfinished 55 and the quarantined 58
    assert left == [20, 40, 55, 57, 58, 59, 60]
    assert (job / "58" / QUARANTINE_FILE).exists()


def test_gc_cleans_abandoned_saves_only_after_the_timeout(root: Path) -> None:
    from ckptd.catalog._retention import RetentionPolicy, collect, decide

    job = root / "job"
    shutil.copytree(job / "3", job / "61.orbax-checkpoint-tmp")
    shutil.copytree(job / "3", job / "62.orbax-checkpoint-tmp")
    old = time.time() - 7200
    for p in [job / "61.orbax-checkpoint-tmp", *(job / "61.orbax-checkpoint-tmp").rglob("*")]:
        os.utime(p, (old, old))
    storage = Storage(str(root))
    cat = Catalog(storage, ":memory:", save_timeout_s=3600)
    cat.rebuild()
    decisions = {d.path.rsplit("/", 1)[-1]: d for d in decide(cat.checkpoints("job"), RetentionPolicy())}
    assert decisions["61.orbax-checkpoint-tmp"].action == "delete"
    assert decisions["62.orbax-checkpoint-tmp"].action == "keep"
    assert all(d.action == "keep" for name, d in decisions.items() if name.isdigit())  # no rule: keep good
    collect(storage, decisions.values())
    assert not (job / "61.orbax-checkpoint-tmp").exists() and (job / "62.orbax-checkpoint-tmp").exists()


def test_the_server_applies_retention_in_the_background(root: Path, ckptd_server: Any) -> None:
    server = ckptd_server(root, keep_last=2, keep_every=25, gc_interval_s=0.1)
    job = root / "job"
    deadline = time.monotonic() + 30
    def steps() -> list[int]:
        return sorted(int(p.name) for p in job.iterdir() if p.name.isdigit())

    while len(steps()) > 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert steps() == [25, 50, 59, 60]
    with CkptdClient(ClientSettings(url=server.url)) as client:
        good = client.latest_good("job")
        assert good is not None and good.step == 60


def test_saving_a_step_that_is_already_on_storage_keeps_it_and_does_not_stop_training(tmp_path: Path) -> None:
    mesh = _mesh()
    first = Checkpointer(str(tmp_path / "job"))
    _save(first, mesh, 10)
    first.close()
    before = read_manifest(Storage(str(tmp_path)), str(tmp_path / "job" / "10"))
    again = Checkpointer(str(tmp_path / "job"))  # after an elastic event took the job back to step 5
    again.save(10, _state(mesh, 99), data_position=1, global_batch=8, mesh=mesh, slices=[0])
    again.close()
    assert 10 not in again.saved_steps
    after = read_manifest(Storage(str(tmp_path)), str(tmp_path / "job" / "10"))
    assert before is not None and after is not None and after.files == before.files  # never overwritten
