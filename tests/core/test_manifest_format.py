"""The manifest read in one parse (orjson) and written with each array once; manifests of the previous format
still accepted; the memos of ``json_docs`` never hide a changed byte. Synthetic steps, no jax."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckptd.catalog._catalog import Catalog
from tests.support.orbax_steps import training_metadata
from trainer_client.core._storage import Entry, Storage
from trainer_client.core._validation import validate_step
from trainer_client.core.format import _json_docs as json_docs
from trainer_client.core.format._files import CHECKPOINT_METADATA, CKPTD_MANIFEST, COMMIT_MARKER, ITEM_METADATA
from trainer_client.core.format._manifest import (
    Manifest,
    build_manifest,
    list_files,
    parse_manifest,
    read_manifest,
    seal_manifest,
    write_manifest,
)
from trainer_client.core.format._steps import inspect_step
from trainer_client.core.protocol import ArraySpec, StepState, TrainingMetadata

ARRAYS = 300


def _arrays(n: int = ARRAYS, spec: str = "data") -> dict[str, dict[str, Any]]:
    return {f"params.layer{i:04d}": {"shape": [8, 16], "dtype": "float32", "partition_spec": [None, spec],
                                     "changed": False} for i in range(n)}


def _item_metadata(n: int = ARRAYS) -> bytes:
    tree = {f"('params', 'layer{i:04d}')": {"key_metadata": [{"key": "params", "key_type": 2}],
                                           "value_metadata": {"value_type": "jax.Array", "write_shape": [8, 8]}}
            for i in range(n)}
    return json.dumps({"tree_metadata": tree, "use_ocdbt": True}).encode()


def _step(job: Path, step: int, *, arrays: dict[str, dict[str, Any]] | None = None, manifest: bool = True) -> Path:
    """A committed step as trainer_client leaves it (Orbax's json rendering of its metadata, ckptd's manifest)."""
    path = job / str(step)
    (path / "default" / "d").mkdir(parents=True)
    custom = training_metadata(step, arrays=arrays if arrays is not None else _arrays())
    meta = {"item_handlers": {"default": "orbax.checkpoint.StandardCheckpointHandler"},
            "commit_timestamp_nsecs": 1_700_000_000_000_000_000 + step, "custom_metadata": custom}
    (path / CHECKPOINT_METADATA).write_text(json.dumps(meta))  # Orbax writes it with json, ", " and ": "
    (path / "default" / ITEM_METADATA).write_bytes(_item_metadata())
    (path / "default" / "d" / "chunk").write_bytes(b"\x01" * 1000)
    if manifest:
        storage = Storage(str(job.parent))
        training = TrainingMetadata.model_validate(custom["ckptd"])
        built = build_manifest(storage, str(path), step=step, writer="trainer_client", arrays=training.arrays,
                               training=training)
        write_manifest(storage, str(path), built)
    (path / COMMIT_MARKER).write_text("done")
    return path


def _old_format(path: Path) -> Manifest:
    """Rewrite the step's manifest as the previous code wrote it: every array twice, pydantic's indented JSON."""
    storage = Storage(str(path.parent.parent))
    manifest = read_manifest(storage, str(path))
    assert manifest is not None and manifest.training is not None
    old = manifest.model_copy(update={"arrays": dict(manifest.training.arrays), "checksum": ""})
    old = old.model_copy(update={"checksum": old.computed_checksum()})
    (path / CKPTD_MANIFEST).write_text(old.model_dump_json(indent=1))
    return old


def test_each_array_is_recorded_once_and_read_back_whole(tmp_path: Path) -> None:
    path = _step(tmp_path / "job", 5)
    raw = (path / CKPTD_MANIFEST).read_bytes()
    assert json.loads(raw)["arrays"] == {}
    manifest = read_manifest(Storage(str(tmp_path)), str(path))
    assert manifest is not None and manifest.training is not None
    assert len(manifest.training.arrays) == ARRAYS and manifest.arrays == {}
    slow = Manifest.model_validate_json(raw)  # the full pydantic parse gives the same manifest
    assert slow == manifest and slow.checksum == slow.model_copy(update={"checksum": ""}).computed_checksum()
    assert raw == manifest.model_dump_json().encode()  # written as pydantic renders it, checksum last
    assert validate_step(Storage(str(tmp_path)), str(path), "quick").ok


def test_a_manifest_written_by_the_previous_code_is_still_accepted(tmp_path: Path) -> None:
    path = _step(tmp_path / "job", 5)
    old = _old_format(path)
    assert len(old.arrays) == ARRAYS  # both copies, as before
    storage = Storage(str(tmp_path))
    assert read_manifest(storage, str(path)) == old
    assert validate_step(storage, str(path), "quick").ok
    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    assert cat.step("job", 5).state is StepState.VERIFIED  # type: ignore[union-attr]
    sealed = read_manifest(storage, str(path))
    assert sealed is not None and sealed.sealed is not None and sealed.arrays == old.arrays  # kept as it was
    assert validate_step(storage, str(path), "deep").ok


def test_any_changed_byte_of_a_manifest_is_caught(tmp_path: Path) -> None:
    path = _step(tmp_path / "job", 5)
    raw = (path / CKPTD_MANIFEST).read_bytes()
    at = raw.index(b"float32") + 1
    flipped = raw[:at] + b"X" + raw[at + 1:]
    with pytest.raises(ValueError, match="checksum"):
        parse_manifest(flipped)
    with pytest.raises(ValueError):
        parse_manifest(raw[: len(raw) // 2])  # cut short
    (path / CKPTD_MANIFEST).write_bytes(flipped)
    result = validate_step(Storage(str(tmp_path)), str(path), "quick")
    assert not result.ok and "manifest unreadable" in result.problems[0]


def test_a_malformed_array_entry_is_refused_after_steps_that_shared_their_arrays(tmp_path: Path) -> None:
    """Steps 1-3 share their per-array metadata byte for byte (parsed once: ``json_docs.loads_sharing``);
    step 4's manifest holds one malformed entry under a checksum that matches, step 5's training metadata
    one: still refused (quarantined, corrupt), their files kept."""
    import google_crc32c

    from trainer_client.core.format._checksum import crc32c_b64

    job = tmp_path / "job"
    for step in range(1, 6):
        _step(job, step)
    raw = (job / "4" / CKPTD_MANIFEST).read_bytes()
    body = raw[:raw.rindex(b',"checksum":')] + b"}"
    assert body.count(b'"shape":[8,16]') == ARRAYS
    at = body.rindex(b'"shape":[8,16]')
    body = body[:at] + b'"shape":"eight"' + body[at + len(b'"shape":[8,16]'):]
    checksum = crc32c_b64(google_crc32c.value(body))
    (job / "4" / CKPTD_MANIFEST).write_bytes(body[:-1] + b',"checksum":"' + checksum.encode() + b'"}')
    meta = (job / "5" / CHECKPOINT_METADATA).read_bytes()
    at = meta.rindex(b'"shape": [8, 16]')
    (job / "5" / CHECKPOINT_METADATA).write_bytes(meta[:at] + b'"shape": "eight"' + meta[at + 16:])
    cat = Catalog(Storage(str(tmp_path)), ":memory:")
    cat.rebuild()
    states = {info.step: info for info in cat.checkpoints("job")}
    assert [states[s].state for s in (1, 2, 3)] == [StepState.VERIFIED] * 3
    assert states[4].state is StepState.QUARANTINED and "manifest unreadable" in (states[4].reason or "")
    assert states[5].state is StepState.CORRUPT and "training metadata is invalid" in (states[5].reason or "")
    assert (job / "4" / CKPTD_MANIFEST).exists() and (job / "5" / "default" / "d" / "chunk").exists()


def test_a_sealed_manifest_is_written_as_pydantic_renders_it(tmp_path: Path) -> None:
    """The seal renders the arrays of a layout seen before once (``json_docs.rendered_arrays``): the bytes
    written are still pydantic's rendering of the whole manifest, checksum last."""
    job = tmp_path / "job"
    storage = Storage(str(tmp_path))
    for step in (1, 2):
        _step(job, step)
        manifest = read_manifest(storage, str(job / str(step)))
        assert manifest is not None and manifest.training is not None
        assert json_docs.rendered_arrays(manifest.training.arrays) is not None  # a layout validated before
        sealed = seal_manifest(storage, str(job / str(step)), manifest)
        assert (job / str(step) / CKPTD_MANIFEST).read_bytes() == sealed.model_dump_json().encode()
        assert read_manifest(storage, str(job / str(step))) == sealed
    other = {"params.other": ArraySpec(partition_spec=["data"])}
    assert json_docs.rendered_arrays(other) is None


def test_a_manifest_orjson_cannot_render_is_checked_the_pydantic_way(tmp_path: Path) -> None:
    """A file size beyond 64 bits: orjson refuses it, the pydantic rendering (the definition) still checks."""
    path = _step(tmp_path / "job", 5)
    storage = Storage(str(tmp_path))
    manifest = read_manifest(storage, str(path))
    assert manifest is not None
    huge = manifest.model_copy(update={"files": {**manifest.files, "big": manifest.files["default/d/chunk"]
                                                 .model_copy(update={"size": 2**70})}})
    written = write_manifest(storage, str(path), huge)
    assert read_manifest(storage, str(path)) == written
    (path / CKPTD_MANIFEST).write_bytes((path / CKPTD_MANIFEST).read_bytes().replace(b"1180591620717411303424",
                                                                                   b"1180591620717411303425"))
    with pytest.raises(ValueError, match="checksum"):
        read_manifest(storage, str(path))


def test_training_metadata_that_differs_from_the_manifest_is_caught(tmp_path: Path) -> None:
    job = tmp_path / "job"
    path = _step(job, 5)
    meta = json.loads((path / CHECKPOINT_METADATA).read_text())
    meta["custom_metadata"]["ckptd"]["arrays"]["params.layer0007"]["partition_spec"] = ["data", None]
    (path / CHECKPOINT_METADATA).write_text(json.dumps(meta))
    inspection = inspect_step(Storage(str(tmp_path)), Entry("5", str(path), True, None))
    assert inspection is not None and inspection.state is StepState.COMMITTED
    result = validate_step(Storage(str(tmp_path)), str(path), "quick", recorded_training=inspection.training)
    assert result.problems == [f"{CHECKPOINT_METADATA}: training metadata differs from the manifest"]
    assert validate_step(Storage(str(tmp_path)), str(path), "quick").problems == result.problems  # read itself


def test_item_metadata_seen_before_does_not_hide_a_broken_one(tmp_path: Path) -> None:
    job = tmp_path / "job"
    storage = Storage(str(tmp_path))
    good, broken, listed = _step(job, 1), _step(job, 2), _step(job, 3)
    assert inspect_step(storage, Entry("1", str(good), True, None)).state is StepState.COMMITTED  # type: ignore[union-attr]
    whole = (broken / "default" / ITEM_METADATA).read_bytes()
    (broken / "default" / ITEM_METADATA).write_bytes(whole[:-1])  # its last byte lost
    found = inspect_step(storage, Entry("2", str(broken), True, None))
    assert found is not None and found.state is StepState.CORRUPT and "not JSON" in (found.reason or "")
    (listed / "default" / ITEM_METADATA).write_bytes(b"[1, 2]")
    found = inspect_step(storage, Entry("3", str(listed), True, None))
    assert found is not None and found.state is StepState.CORRUPT and "not a JSON object" in (found.reason or "")


def test_arrays_validated_once_per_layout_and_never_trusted_when_they_differ() -> None:
    first = json_docs.parse_training(training_metadata(1, arrays=_arrays())["ckptd"])
    again = json_docs.parse_training(training_metadata(2, arrays=_arrays())["ckptd"])
    assert again.arrays == first.arrays and again.step == 2
    assert again == TrainingMetadata.model_validate(training_metadata(2, arrays=_arrays())["ckptd"])
    bad = _arrays()
    bad["params.layer0003"]["shape"] = "eight"
    with pytest.raises(ValidationError):
        json_docs.parse_training(training_metadata(3, arrays=bad)["ckptd"])
    resharded = json_docs.parse_training(training_metadata(4, arrays=_arrays(spec="model"))["ckptd"])
    assert resharded.arrays["params.layer0000"].partition_spec == [None, "model"]


def test_documents_orjson_refuses_are_read_as_json_reads_them() -> None:
    assert json_docs.loads(b'{"metrics": {"loss": NaN}, "big": 123456789012345678901234567890}')["big"] == (
        123456789012345678901234567890)
    with pytest.raises(ValueError):
        json_docs.loads(b'{"cut": ')
    with pytest.raises(ValueError):
        json_docs.loads(b"\xff\xfe")


def test_local_listing_matches_fsspec(tmp_path: Path) -> None:
    """The local listing (one scandir a directory) gives what fsspec's listing gave: links listed with their
    target's size, a link to a directory (even a loop) listed, not walked into; a dangling link, size 0."""
    path = _step(tmp_path / "job", 5)
    (path / "default" / "link").symlink_to(path / "default" / "d")
    (path / "default" / "d" / "loop").symlink_to(path / "default")
    (path / "default" / "d" / "to_chunk").symlink_to(path / "default" / "d" / "chunk")
    (path / "default" / "dangling").symlink_to(path / "nowhere")
    storage = Storage(str(tmp_path))
    fast = list_files(storage, str(path))
    assert fast["default/d/chunk"].size == fast["default/d/to_chunk"].size == 1000
    assert fast["default/dangling"].size == 0 and "default/link/chunk" not in fast
    found = storage.fs.find(str(path), detail=True)
    base = str(path) + "/"
    assert {k[len(base):]: int(v["size"] or 0) for k, v in found.items() if v["type"] != "directory"} == {
        k: v.size for k, v in fast.items()}
    assert list_files(storage, str(tmp_path / "job" / "404")) == {}
