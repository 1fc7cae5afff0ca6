"""Integrity and durability on ``gs://``, against a real GCS JSON API on 127.0.0.1 (fake-gcs-server).

Steps are written in this process (conftest gives it 8 fake CPU devices) straight to ``gs://``: by
trainer_client's Checkpointer (Orbax's commit-file mode: in place, ``commit_success.txt`` last) and by a
plain Orbax CheckpointManager. Each test works on its own server-side copy of those steps. Damage is
done through a separate gcsfs instance (``other_writer``: another process, as far as this process's
listing caches go); what GCS reports is read straight from its JSON API with httpx, not through gcsfs.

"Downloads nothing" is checked on the wire: every HTTP request gcsfs makes goes through
``GCSFileSystem._request``; a recorder wrapped around it sees every media download (``alt=media``) and
its size.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import google_crc32c
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main as ckptd_main
from tests.support.gcs_emulator import GcsEmulator
from tests.support.helpers import REPO, clean_env
from trainer_client.core import _validation as validation
from trainer_client.core._durability import Syncer, using_syncer
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage, validate_step
from trainer_client.core.format._array_index import decode_all_arrays
from trainer_client.core.format._files import (
    CHECKPOINT_METADATA,
    CKPTD_MANIFEST,
    COMMIT_MARKER,
    QUARANTINE_FILE,
    VERIFIED_FILE,
)
from trainer_client.core.format._manifest import Listed, list_files, read_manifest, read_verified_record
from trainer_client.core.protocol import StepState
from trainer_client.runtime.saving._checkpointing import Checkpointer

pytestmark = pytest.mark.integration


BASE = "integrity"
TRAINER_STEPS = (1, 2, 3, 4, 5, 6)  # saved by trainer_client's Checkpointer, verified and sealed
ORBAX_STEPS = (7, 8)  # saved by plain Orbax: no manifest until ckptd adopts them
METADATA_FILES = frozenset({CKPTD_MANIFEST, CHECKPOINT_METADATA})  # what quick validation may read


# ---- what GCS says, without gcsfs ---------------------------------------------------------------------


def _objects(gcs: GcsEmulator, prefix: str) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (name relative to it -> object resource), from the JSON API."""
    prefix = prefix.strip("/") + "/"
    out: dict[str, dict[str, Any]] = {}
    params: dict[str, str] = {"prefix": prefix}
    with httpx.Client(trust_env=False, timeout=10.0) as http:
        while True:
            page = http.get(f"{gcs.url}/storage/v1/b/{gcs.bucket}/o", params=params).json()
            for item in page.get("items", []):
                out[item["name"][len(prefix):]] = item
            if not page.get("nextPageToken"):
                return out
            params["pageToken"] = page["nextPageToken"]


def _download(gcs: GcsEmulator, name: str) -> bytes:
    with httpx.Client(trust_env=False, timeout=10.0) as http:
        r = http.get(f"{gcs.url}/download/storage/v1/b/{gcs.bucket}/o/{quote(name, safe='')}",
                     params={"alt": "media"})
        r.raise_for_status()
        return r.content


def _crc32c(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def _is_data(rel: str) -> bool:
    """An object holding array bytes (OCDBT data and manifests), not small JSON metadata."""
    return "/d/" in rel or rel.endswith("manifest.ocdbt")


# ---- the wire: every request gcsfs sends ---------------------------------------------------------------


@dataclass
class Wire:
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, url, response bytes)

    def downloads(self) -> dict[str, int]:
        """Object name (in the bucket, without it) -> bytes downloaded, over every media GET."""
        out: dict[str, int] = {}
        for method, url, size in self.requests:
            if method == "GET" and "alt=media" in url:
                name = unquote(url.split("/o/", 1)[1].split("?", 1)[0])
                out[name] = out.get(name, 0) + size
        return out

    def downloaded_under(self, prefix: str) -> dict[str, int]:
        prefix = prefix.rstrip("/") + "/"
        return {n[len(prefix):]: b for n, b in self.downloads().items() if n.startswith(prefix)}

    def listings(self) -> int:
        return sum(1 for m, url, _ in self.requests if m == "GET" and url.split("?")[0].endswith("/o"))


@contextmanager
def wire(storage: Storage) -> Iterator[Wire]:
    """Record every HTTP request of ``storage``'s gcsfs instance (shared by every Storage of this process)."""
    fs: Any = storage.fs
    real = fs._request
    recorded = Wire()

    async def recording(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        out = await real(method, path, *args, **kwargs)
        recorded.requests.append((str(method).upper(), str(fs._format_path(path, args)), len(out[3])))
        return out

    fs._request = recording
    try:
        yield recorded
    finally:
        del fs._request


# ---- writing steps once, copying them per test -----------------------------------------------------


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))


def _trainer_state(mesh: Mesh, step: int) -> dict[str, jax.Array]:
    return {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64) * 0.5 + step, NamedSharding(mesh, P(None, "data"))),
        "b": jax.device_put(jnp.full((16,), float(step)), NamedSharding(mesh, P("replica"))),
    }


def _save(ck: Checkpointer, mesh: Mesh, step: int) -> None:
    ck.save(step, _trainer_state(mesh, step), data_position=step * 8, global_batch=8, mesh=mesh,
            slices=[0, 1, 2, 3])


@dataclass(frozen=True)
class Golden:
    gcs: GcsEmulator
    before_seal: dict[int, dict[str, dict[str, Any]]]  # trainer steps as the Checkpointer left them


@pytest.fixture(scope="module")
def golden(gcs_emulator: GcsEmulator) -> Golden:
    gcs = gcs_emulator
    mesh = _mesh()
    ck = Checkpointer(gcs.gs(BASE, "golden", "job"))  # no atomicity given: commit-file mode on gs://
    for step in TRAINER_STEPS:
        _save(ck, mesh, step)
    ck.close()
    before = {s: _objects(gcs, f"{BASE}/golden/job/{s}") for s in TRAINER_STEPS}

    rng = np.random.default_rng(0)
    mgr = ocp.CheckpointManager(gcs.gs(BASE, "orbax", "job"), options=ocp.CheckpointManagerOptions(max_to_keep=None))
    for step in ORBAX_STEPS:
        big = rng.standard_normal((256, 256), dtype=np.float32)
        state = {"big": jax.device_put(jnp.asarray(big), NamedSharding(mesh, P("replica", "data"))),
                 "step": jnp.int32(step)}
        mgr.save(step, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    mgr.close()

    cat = Catalog(Storage(gcs.gs(BASE, "golden")), ":memory:")  # verifies and seals the trainer's steps
    try:
        cat.rebuild()
        assert {c.step: c.state for c in cat.checkpoints("job")} == dict.fromkeys(TRAINER_STEPS, StepState.VERIFIED)
    finally:
        cat.close()
    return Golden(gcs, before)


def _clone(golden: Golden, name: str, *, trainer: tuple[int, ...] = TRAINER_STEPS,
           orbax: tuple[int, ...] = ()) -> tuple[Storage, str]:
    """Server-side copies of golden steps into ``gs://bucket/integrity/<name>/job``: (root storage, job url)."""
    gcs = golden.gcs
    writer = gcs.other_writer()
    for source, steps in (("golden", trainer), ("orbax", orbax)):
        for step in steps:
            for rel in _objects(gcs, f"{BASE}/{source}/job/{step}"):
                writer.copy(f"{gcs.bucket}/{BASE}/{source}/job/{step}/{rel}",
                            f"{gcs.bucket}/{BASE}/{name}/job/{step}/{rel}")
    return Storage(gcs.gs(BASE, name)), gcs.gs(BASE, name, "job")


def _data_object(gcs: GcsEmulator, step_prefix: str) -> str:
    """The largest array-data object of a step (relative name)."""
    objects = _objects(gcs, step_prefix)
    return max((r for r in objects if r.startswith("default/ocdbt.process_") and "/d/" in r),
               key=lambda r: (int(objects[r]["size"]), r))


def _flip(gcs: GcsEmulator, path: str, rng: random.Random) -> None:
    """Rewrite the object at ``bucket``-relative ``path`` with one byte changed: same size, new CRC32C."""
    writer = gcs.other_writer()
    data = bytearray(writer.cat(f"{gcs.bucket}/{path}"))
    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    writer.pipe(f"{gcs.bucket}/{path}", bytes(data))


def _states(catalog: Catalog, job: str = "job") -> dict[int, StepState]:
    return {c.step: c.state for c in catalog.checkpoints(job)}


# ---- 1. manifests on gs:// carry GCS's own CRC32Cs; verification, sealing, adoption --------------------


def test_checkpointer_manifests_match_object_crc32c_and_are_sealed(golden: Golden) -> None:
    gcs = golden.gcs
    storage = Storage(gcs.gs(BASE, "golden"))
    for step in TRAINER_STEPS:
        # As the Checkpointer left it: the manifest was written in place before the commit marker ...
        first = golden.before_seal[step]
        assert CKPTD_MANIFEST in first and COMMIT_MARKER in first and QUARANTINE_FILE not in first
        assert int(first[CKPTD_MANIFEST]["generation"]) < int(first[COMMIT_MARKER]["generation"])
        # ... and once the catalog sealed it it lists every object of the step with GCS's own size and CRC32C.
        manifest = read_manifest(storage, storage.join("job", str(step)))
        assert manifest is not None and manifest.writer == "trainer_client" and manifest.step == step
        assert manifest.training is not None and manifest.training.data_position == step * 8
        assert manifest.sealed is not None and set(manifest.sealed) == {CHECKPOINT_METADATA, COMMIT_MARKER}
        objects = _objects(gcs, f"{BASE}/golden/job/{step}")
        expected = manifest.expected_files()
        assert set(expected) == set(objects) - {CKPTD_MANIFEST, VERIFIED_FILE}  # ckptd's own files
        record = read_verified_record(storage, storage.join("job", str(step)))
        assert record is not None and record.manifest_checksum == manifest.checksum
        assert set(record.fingerprints) == {CHECKPOINT_METADATA, COMMIT_MARKER, CKPTD_MANIFEST}
        assert any(_is_data(rel) for rel in expected)
        for rel, entry in expected.items():
            assert (entry.size, entry.crc32c) == (int(objects[rel]["size"]), objects[rel]["crc32c"]), rel
    # GCS's CRC32C is the CRC32C of the bytes (so comparing with it means something)
    objects = _objects(gcs, f"{BASE}/golden/job/1")
    for rel, obj in objects.items():
        assert _crc32c(_download(gcs, f"{BASE}/golden/job/1/{rel}")) == obj["crc32c"], rel


def test_the_manifest_is_unsealed_until_ckptd_verifies_the_step(golden: Golden) -> None:
    """The first version of each manifest (written by the trainer before the commit) had no seal."""
    gcs = golden.gcs
    mesh = _mesh()
    ck = Checkpointer(gcs.gs(BASE, "unsealed", "job"))
    _save(ck, mesh, 9)
    ck.close()
    storage = Storage(gcs.gs(BASE, "unsealed"))
    first = read_manifest(storage, storage.join("job", "9"))
    assert first is not None and first.sealed is None
    objects = _objects(gcs, f"{BASE}/unsealed/job/9")
    assert int(objects[CKPTD_MANIFEST]["generation"]) < int(objects[COMMIT_MARKER]["generation"])
    assert set(first.files) == set(objects) - {CKPTD_MANIFEST, CHECKPOINT_METADATA, COMMIT_MARKER}
    cat = Catalog(storage, ":memory:")
    try:
        cat.rebuild()
        assert _states(cat) == {9: StepState.VERIFIED}
    finally:
        cat.close()
    sealed = read_manifest(storage, storage.join("job", "9"))
    assert sealed is not None and sealed.sealed is not None and sealed.files == first.files
    after = _objects(gcs, f"{BASE}/unsealed/job/9")
    for name in (CHECKPOINT_METADATA, COMMIT_MARKER):
        assert sealed.sealed[name].crc32c == after[name]["crc32c"]


def test_plain_orbax_steps_on_gcs_are_adopted_without_downloading_arrays(golden: Golden) -> None:
    gcs = golden.gcs
    storage, _ = _clone(golden, "adopt", trainer=(), orbax=ORBAX_STEPS)
    for step in ORBAX_STEPS:
        assert read_manifest(storage, storage.join("job", str(step))) is None
    cat = Catalog(storage, ":memory:")
    try:
        with wire(storage) as w:
            cat.rebuild()
        for step in ORBAX_STEPS:
            info = cat.step("job", step)
            assert info is not None and info.state is StepState.VERIFIED and "adopted" in (info.reason or "")
            downloaded = w.downloaded_under(f"{BASE}/adopt/job/{step}")
            assert downloaded and not [r for r in downloaded if _is_data(r)], downloaded
            manifest = read_manifest(storage, storage.join("job", str(step)))
            assert manifest is not None and manifest.writer == "adopted" and manifest.sealed is not None
            objects = _objects(gcs, f"{BASE}/adopt/job/{step}")
            assert set(manifest.expected_files()) == set(objects) - {CKPTD_MANIFEST, VERIFIED_FILE}
            for rel, entry in manifest.expected_files().items():
                assert (entry.size, entry.crc32c) == (int(objects[rel]["size"]), objects[rel]["crc32c"]), rel
        assert w.listings() > 0
        assert cat.confirmed_latest_good("job").step == ORBAX_STEPS[-1]  # type: ignore[union-attr]
    finally:
        cat.close()


# ---- 2. quick validation: deletion, truncation, same-size flip — without downloading data -------------


def test_quick_validation_catches_damage_from_the_listing_alone(golden: Golden) -> None:
    gcs = golden.gcs
    rng = random.Random(4)
    storage, _ = _clone(golden, "quick")
    job = f"{BASE}/quick/job"
    writer = gcs.other_writer()
    damaged: dict[int, tuple[str, str]] = {}  # step -> (file, expected problem)

    rel = _data_object(gcs, f"{job}/2")
    writer.rm(f"{gcs.bucket}/{job}/2/{rel}")
    damaged[2] = (rel, f"{rel}: missing")

    rel = _data_object(gcs, f"{job}/3")
    size = int(_objects(gcs, f"{job}/3")[rel]["size"])
    writer.pipe(f"{gcs.bucket}/{job}/3/{rel}", writer.cat(f"{gcs.bucket}/{job}/3/{rel}")[: size - 7])
    damaged[3] = (rel, f"{rel}: {size - 7} bytes, manifest says {size}")

    for step, rel in ((4, _data_object(gcs, f"{job}/4")), (5, "default/_sharding"), (6, COMMIT_MARKER)):
        before = _objects(gcs, f"{job}/{step}")[rel]
        _flip(gcs, f"{job}/{step}/{rel}", rng)
        after = _objects(gcs, f"{job}/{step}")[rel]
        assert after["size"] == before["size"] and after["crc32c"] != before["crc32c"]
        damaged[step] = (rel, f"{rel}: object CRC32C {after['crc32c']}, manifest says {before['crc32c']}")

    for step in TRAINER_STEPS:
        step_path = storage.join("job", str(step))
        with wire(storage) as w:
            result = validate_step(storage, step_path, "quick")
        if step in damaged:
            assert result.problems == [damaged[step][1]], (step, result.problems)
        else:
            assert result.ok, result.problems
        # Nothing but the manifest and the step's metadata crossed the wire: no array data, and not the
        # damaged object.
        downloaded = w.downloaded_under(f"{job}/{step}")
        assert set(downloaded) <= METADATA_FILES, downloaded
        assert sum(w.downloads().values()) == sum(downloaded.values()) < 8192
        assert w.listings() >= 1 and result.bytes_read == 0

    # the client's fallback scan and a catalog apply the same check at first sight
    assert latest_good_on_storage(storage, storage.join("job")).step == 1  # type: ignore[union-attr]
    cat = Catalog(storage, ":memory:")
    try:
        cat.rebuild()
        assert _states(cat) == {1: StepState.VERIFIED, **dict.fromkeys(damaged, StepState.QUARANTINED)}
    finally:
        cat.close()


# ---- 3. deep validation, `ckptd validate --deep`, quarantine objects, latest-good fallback ------------


def _without_object_crcs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listings as a store without object checksums gives them: only deep validation can see a flip."""
    real = validation.list_files

    def sizes_only(storage: Storage, step_path: str) -> dict[str, Listed]:
        return {rel: Listed(f.size, None) for rel, f in real(storage, step_path).items()}

    monkeypatch.setattr(validation, "list_files", sizes_only)


def test_deep_validation_reads_every_object_back(golden: Golden, monkeypatch: pytest.MonkeyPatch) -> None:
    gcs = golden.gcs
    storage, _ = _clone(golden, "deep", trainer=(5, 6))
    job = f"{BASE}/deep/job"
    good = storage.join("job", "5")
    with wire(storage) as w:
        result = validate_step(storage, good, "deep", decode_arrays=decode_all_arrays)
    assert result.ok, result.problems
    assert result.manifest is not None
    expected = result.manifest.expected_files()
    assert result.bytes_read == sum(f.size for f in expected.values())
    downloaded = w.downloaded_under(f"{job}/5")
    assert set(expected) <= set(downloaded), set(expected) - set(downloaded)
    assert all(downloaded[rel] >= f.size for rel, f in expected.items())

    # A same-size flip, checked by reading back alone (object CRCs hidden from the listing)
    rel = _data_object(gcs, f"{job}/6")
    _flip(gcs, f"{job}/6/{rel}", random.Random(6))
    _without_object_crcs(monkeypatch)
    assert validate_step(storage, storage.join("job", "6"), "quick").ok  # sizes alone cannot see it
    deep = validate_step(storage, storage.join("job", "6"), "deep")
    assert len(deep.problems) == 1 and deep.problems[0].startswith(f"{rel}: CRC32C "), deep.problems


def test_validate_deep_cli_quarantines_and_latest_good_falls_back(
    golden: Golden
) -> None:
    gcs = golden.gcs
    rng = random.Random(3)
    storage, job_url = _clone(golden, "cli", orbax=ORBAX_STEPS)
    job = f"{BASE}/cli/job"
    for step in (4, 6):  # same-size flips in array data of trainer-written steps
        _flip(gcs, f"{job}/{step}/{_data_object(gcs, f'{job}/{step}')}", rng)
    # Step 8 (plain Orbax) lost half an array file before any ckptd saw it: its adopted manifest
    # records the object as it is, so only decoding the arrays can tell.
    writer = gcs.other_writer()
    rel = _data_object(gcs, f"{job}/8")
    data = writer.cat(f"{gcs.bucket}/{job}/8/{rel}")
    writer.pipe(f"{gcs.bucket}/{job}/8/{rel}", data[: len(data) // 2])

    # A running ckptd (its catalog and gcsfs listing caches live on) sees the flips at first sight.
    server = Catalog(storage, ":memory:")
    try:
        server.rebuild()
        assert _states(server) == {1: StepState.VERIFIED, 2: StepState.VERIFIED, 3: StepState.VERIFIED,
                                   4: StepState.QUARANTINED, 5: StepState.VERIFIED, 6: StepState.QUARANTINED,
                                   7: StepState.VERIFIED, 8: StepState.VERIFIED}
        assert server.confirmed_latest_good("job").step == 8  # type: ignore[union-attr]
        snapshot = _objects(gcs, job)
        assert {r for r in snapshot if r.endswith(QUARANTINE_FILE)} == {f"4/{QUARANTINE_FILE}", f"6/{QUARANTINE_FILE}"}

        # The operator runs `ckptd validate --deep` in another process.
        proc = subprocess.run([sys.executable, "-m", "ckptd", "validate", "--deep", "--json", job_url],
                              env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 1, proc.stderr[-4000:]
        report = json.loads(proc.stdout)
        rows = {r["step"]: r for r in report["steps"]}
        assert {s for s, r in rows.items() if not r["ok"]} == {4, 6, 8}
        assert all(r["level"] == "deep" for r in rows.values())
        assert any("cannot decode" in p for p in rows[8]["problems"]), rows[8]
        for step in (1, 2, 3, 5, 7):
            manifest = read_manifest(storage, storage.join("job", str(step)))
            assert manifest is not None
            assert rows[step]["bytes_read"] == sum(f.size for f in manifest.expected_files().values())

        # Quarantine records are objects in the steps; nothing else was touched, nothing deleted.
        after = _objects(gcs, job)
        assert set(after) - set(snapshot) == {f"8/{QUARANTINE_FILE}"}
        assert all(after[r]["generation"] == o["generation"] for r, o in snapshot.items())
        record = json.loads(_download(gcs, f"{job}/8/{QUARANTINE_FILE}"))
        assert "deep validation failed" in record["reason"] and record["path"] == f"{job_url}/8"
        record = json.loads(_download(gcs, f"{job}/6/{QUARANTINE_FILE}"))
        assert "object CRC32C" in record["reason"]

        # The running ckptd never names step 8 again, though quick validation still passes it (its
        # cached listing of step 8 predates the record: the answer must not come from that cache).
        assert server.confirmed_latest_good("job").step == 7  # type: ignore[union-attr]
        assert server.step("job", 8).state is StepState.QUARANTINED  # type: ignore[union-attr]
        assert validate_step(storage, storage.join("job", "8"), "quick").ok
    finally:
        server.close()

    fresh = Catalog(storage, ":memory:")
    try:
        fresh.rebuild()
        assert {s for s, st in _states(fresh).items() if st is StepState.QUARANTINED} == {4, 6, 8}
        assert fresh.confirmed_latest_good("job").step == 7  # type: ignore[union-attr]
        assert fresh.confirmed_latest_good("job", at_most=6).step == 5  # type: ignore[union-attr]
    finally:
        fresh.close()
    job_path = storage.join("job")
    assert latest_good_on_storage(storage, job_path).step == 7  # type: ignore[union-attr]
    assert latest_good_on_storage(storage, job_path, at_most=6).step == 5  # type: ignore[union-attr]
    assert latest_good_on_storage(storage, job_path, at_most=4).step == 3  # type: ignore[union-attr]


# ---- 4. retention on gs:// ---------------------------------------------------------------------------


def test_gc_on_gcs_deletes_only_what_retention_allows(golden: Golden, capsys: pytest.CaptureFixture[str]) -> None:
    gcs = golden.gcs
    storage, job_url = _clone(golden, "gc")
    job = f"{BASE}/gc/job"
    _flip(gcs, f"{job}/6/{_data_object(gcs, f'{job}/6')}", random.Random(5))  # newest step: quarantined
    gcs.other_writer().rm(f"{gcs.bucket}/{job}/3/{COMMIT_MARKER}")  # a save in progress: kept

    assert ckptd_main(["gc", job_url, "--keep-last", "2", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out
    before = _objects(gcs, job)
    assert {r.split("/")[0] for r in before} == {str(s) for s in TRAINER_STEPS}, "dry run deleted"
    assert f"6/{QUARANTINE_FILE}" in before

    assert ckptd_main(["gc", job_url, "--keep-last", "2", "--json"]) == 0
    decisions = {d["step"]: d for d in json.loads(capsys.readouterr().out)}
    assert {s: d["action"] for s, d in decisions.items()} == {1: "delete", 2: "delete", 3: "keep", 4: "keep",
                                                              5: "keep", 6: "keep"}
    assert "newest good step" in decisions[5]["reasons"] and decisions[6]["state"] == "quarantined"
    after = _objects(gcs, job)
    assert set(after) == {r for r in before if r.split("/")[0] not in ("1", "2")}
    assert all(after[r]["generation"] == before[r]["generation"] for r in after)  # the rest untouched
    cat = Catalog(storage, ":memory:")
    try:
        cat.rebuild()
        assert _states(cat) == {3: StepState.WRITING, 4: StepState.VERIFIED, 5: StepState.VERIFIED,
                                6: StepState.QUARANTINED}
        assert cat.confirmed_latest_good("job").step == 5  # type: ignore[union-attr]
    finally:
        cat.close()


# ---- 5. durability: no fsync on gs://, nothing local touched ----------------------------------------


class _Refuse(Syncer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def fsync_file(self, path: str) -> None:
        self.calls.append(path)
        raise AssertionError(f"fsync of {path} on a gs:// root")

    def fsync_dir(self, path: str) -> None:
        self.fsync_file(path)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_durability_paths_skip_fsync_on_gcs(
    golden: Golden, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gcs = golden.gcs
    # A decoy: gcsfs paths ("bucket/prefix/...") are relative paths; had anything handed one to the local
    # file system from here, it would have found these and fsynced or rewritten them.
    step_rel = Path(gcs.bucket, BASE, "durable", "job", "10")
    for rel in (COMMIT_MARKER, CHECKPOINT_METADATA, CKPTD_MANIFEST):
        (tmp_path / step_rel / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / step_rel / rel).write_text("decoy")
    tree = _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    os_fsyncs: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        os_fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)

    refuse = _Refuse()
    with using_syncer(refuse):
        ck = Checkpointer(gcs.gs(BASE, "durable", "job"))
        _save(ck, _mesh(), 10)
        ck.close()
        storage = Storage(gcs.gs(BASE, "durable"))
        cat = Catalog(storage, ":memory:")
        try:
            cat.rebuild()  # settle: adopt/seal/validate, then the durability step (local disks only)
            assert _states(cat) == {10: StepState.VERIFIED}, cat.checkpoints("job")
            assert cat.confirmed_latest_good("job").step == 10  # type: ignore[union-attr]
        finally:
            cat.close()
    assert refuse.calls == [] and os_fsyncs == []
    assert _tree(tmp_path) == tree
    manifest = read_manifest(storage, storage.join("job", "10"))
    assert manifest is not None and manifest.sealed is not None
    assert set(list_files(storage, storage.join("job", "10"))) == set(_objects(gcs, f"{BASE}/durable/job/10"))
