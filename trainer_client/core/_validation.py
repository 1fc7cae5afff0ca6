"""Checking a committed step against its manifest: quick (names and sizes, GCS checksums) or deep (every
byte read back and checksummed, every array chunk decoded). Read-only.

Quick validation downloads nothing: it lists the step and compares each file's size with the manifest,
and on GCS also the CRC32C the object store keeps. It catches every missing or truncated file. Deep
validation reads every file back and checks its CRC32C (including ``_CHECKPOINT_METADATA`` and the commit
marker once the manifest is sealed), so it catches any flipped byte, and then decodes every array with tensorstore.

Used by ckptd's catalog for new steps (quick), by ``ckptd validate [--deep]``, and by the client's
fallback scan, so all of them reject the same steps. What ckptd's first sight of a step checks (quick, plus
the commit rule and the structure of ``steps.py``) is in docs/operations.md, "First sight". No jax here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from trainer_client.core._errors import StorageError
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import CHECKPOINT_METADATA, QUARANTINE_FILE, VERIFIED_FILE
from trainer_client.core.format._json_docs import loads, loads_sharing, parse_training
from trainer_client.core.format._manifest import (
    Listed,
    Manifest,
    file_entry,
    list_files,
    parse_manifest,
    read_manifest,
)
from trainer_client.core.format._parts import part_problems
from trainer_client.core.format._records import read_record
from trainer_client.core.format._steps import (
    CUSTOM_METADATA_KEY,
    TRAINING_ARRAYS,
    StepInspection,
    inspect_step,
    parse_step_name,
    step_entries,
)
from trainer_client.core.format._stored_extents import stored_contradictions
from trainer_client.core.protocol import StepState, TrainingMetadata

Level = Literal["quick", "deep"]


@dataclass
class ValidationResult:
    """What a validation of one step found; ``ok`` when ``problems`` is empty."""

    path: str
    level: Level
    manifest: Manifest | None
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_read: int = 0
    listed: dict[str, Listed] | None = field(default=None, repr=False)  # the step's files, as listed for the check

    @property
    def ok(self) -> bool:
        return not self.problems


def read_quarantine(storage: Storage, step_path: str) -> dict[str, object] | None:
    """The quarantine record of a step (any ckptd wrote it, in the step or on the side prefix of a read-only
    job: ``format/_records.py``), or None."""
    found = read_record(storage, step_path, QUARANTINE_FILE)
    return None if found is None else parse_quarantine(found[1])


def parse_quarantine(raw: bytes) -> dict[str, object]:
    """A quarantine record from its bytes (one that does not parse still quarantines)."""
    try:
        record = loads(raw)
    except ValueError:
        return {"reason": "quarantine record unreadable"}
    return record if isinstance(record, dict) else {"reason": "quarantine record unreadable"}


def _check_training(
    storage: Storage, step_path: str, manifest: Manifest, problems: list[str], recorded_training: object
) -> None:
    if manifest.training is None:
        return
    if isinstance(recorded_training, TrainingMetadata):  # read from the step a moment ago by the caller
        if recorded_training != manifest.training:
            problems.append(f"{CHECKPOINT_METADATA}: training metadata differs from the manifest")
        return
    try:
        meta = loads_sharing(storage.read_bytes(join_path(step_path, CHECKPOINT_METADATA)), TRAINING_ARRAYS)
        recorded = meta.get("custom_metadata", {}).get(CUSTOM_METADATA_KEY)
    except (FileNotFoundError, ValueError, AttributeError):
        problems.append(f"{CHECKPOINT_METADATA} unreadable")
        return
    try:
        same = parse_training(recorded) == manifest.training
    except ValidationError:
        same = False
    if not same:
        problems.append(f"{CHECKPOINT_METADATA}: training metadata differs from the manifest")


def validate_step(
    storage: Storage,
    step_path: str,
    level: Level = "quick",
    *,
    progress: Callable[[int], None] | None = None,
    decode_arrays: Callable[[str], list[str]] | None = None,
    recorded_training: TrainingMetadata | None = None,
    manifest: Manifest | None = None,
    manifest_bytes: bytes | None = None,
) -> ValidationResult:
    """Check a committed step against its manifest (and seal). ``progress(n_bytes)`` is called as deep
    validation reads; ``decode_arrays(step_url)`` returns problems found decoding the arrays (it gets the
    step's URL, ``gs://...`` on GCS: tensorstore would take a bare ``bucket/...`` path for a local one).
    ``recorded_training``: the training metadata the caller just parsed from the step's
    ``_CHECKPOINT_METADATA``, so it is not read and parsed again (megabytes for a large model);
    ``manifest``: the step's manifest as the caller read it before (unchanged since), likewise;
    ``manifest_bytes``: its bytes as the caller just read them (``b""``: it has none), so they are not read
    again (``ckptd.catalog._integrity`` reads a step's records on GCS concurrently)."""
    step_path = step_path.rstrip("/")
    result = ValidationResult(step_path, level, None)
    problems = result.problems
    try:
        if manifest is None and manifest_bytes is not None:
            manifest = parse_manifest(manifest_bytes) if manifest_bytes else None
        else:
            manifest = manifest or read_manifest(storage, step_path)
    except (ValueError, ValidationError) as exc:
        problems.append(f"manifest unreadable: {str(exc).splitlines()[0][:200]}")
        return result
    if manifest is None:
        # A step some ckptd verified against a manifest (its verified record is there) has lost it: damaged,
        # never adopted again as if plain Orbax had written it (adoption would seal whatever is there now).
        lost = read_record(storage, step_path, VERIFIED_FILE) is not None
        problems.append(f"manifest missing: {VERIFIED_FILE} says a ckptd verified this step against one"
                        if lost else "no manifest")
        return result
    result.manifest = manifest
    parsed = parse_step_name(step_path.rsplit("/", 1)[-1])
    if parsed is not None and parsed.step != manifest.step:
        problems.append(f"manifest is for step {manifest.step}, not {parsed.step}: a copied or moved directory")
    expected = manifest.expected_files()
    try:
        present = result.listed = list_files(storage, step_path)
    except StorageError as exc:
        problems.append(f"cannot list the step: {exc}")
        return result
    problems.extend(listing_problems(manifest, present))
    result.files_checked += len(expected)
    _check_training(storage, step_path, manifest, problems, recorded_training)
    if level == "deep" and not problems:
        for rel, entry in sorted(expected.items()):
            actual = file_entry(storage, join_path(step_path, rel))
            result.bytes_read += actual.size
            if progress is not None:
                progress(actual.size)
            if actual.crc32c != entry.crc32c:
                problems.append(f"{rel}: CRC32C {actual.crc32c}, manifest says {entry.crc32c}")
        if not problems and decode_arrays is not None:
            problems.extend(decode_arrays(storage.url_of(step_path)))
    return result


def listing_problems(manifest: Manifest, present: dict[str, Listed]) -> list[str]:
    """What a listing of the step (``list_files``) shows against its manifest: each file it names missing, of
    another size, or (on an object store) of another CRC32C."""
    problems = []
    for rel, entry in sorted(manifest.expected_files().items()):
        listed = present.get(rel)
        if listed is None:
            problems.append(f"{rel}: missing")
        elif listed.size != entry.size:
            problems.append(f"{rel}: {listed.size} bytes, manifest says {entry.size}")
        elif listed.crc32c is not None and listed.crc32c != entry.crc32c:
            problems.append(f"{rel}: object CRC32C {listed.crc32c}, manifest says {entry.crc32c}")
    return problems


def extent_problems(storage: Storage, step_path: str, manifest: Manifest) -> list[str]:
    """``listing_problems`` of the step as listed now: one listing (a ``scandir`` per directory on a local disk,
    a recursive listing on an object store), nothing read. What ckptd checks before it names a step it verified
    against ``manifest`` (docs/concepts.md, "Good")."""
    try:
        return listing_problems(manifest, list_files(storage, step_path.rstrip("/")))
    except StorageError as exc:
        return [f"cannot list the step: {exc}"]


def latest_good_on_storage(
    storage: Storage, job_path: str, *, at_most: int | None = None
) -> StepInspection | None:
    """The client's fallback answer to "latest good": the newest committed step that is not quarantined
    and passes quick validation against its manifest (read-only; a step plain Orbax wrote, which ckptd
    would adopt, is accepted on the commit rule and its structure alone; a step committed from host parts,
    only with every part's record: ``format/_parts.py``)."""
    storage.invalidate(job_path)
    for parsed, entry in step_entries(storage, job_path):
        if parsed.is_tmp or (at_most is not None and parsed.step > at_most):
            continue
        inspection = inspect_step(storage, entry)
        if inspection is None or inspection.state is not StepState.COMMITTED:
            continue
        if read_quarantine(storage, entry.path) is not None:
            continue
        if part_problems(storage, entry.path):  # committed from host parts: every part's record must be there
            continue
        result = validate_step(storage, entry.path, "quick")
        if result.ok or (result.problems == ["no manifest"] and not stored_contradictions(storage, entry.path)):
            return inspection  # a step ckptd would adopt: only if its metadata agrees with its data
    return None


__all__ = ["Level", "ValidationResult", "extent_problems", "latest_good_on_storage", "listing_problems",
           "parse_quarantine", "read_quarantine", "validate_step"]
