"""Orbax's on-storage layout and ckptd's commit rule (docs/architecture.md, invariant 2), in one place.

A step is *committed* only when its directory name is a plain integer (no ``.orbax-checkpoint-tmp``
suffix) **and** it holds ``commit_success.txt``. That rule is right in both of Orbax's atomicity modes:
rename-based (local disk) and commit-file (``gs://``, or forced), whereas Orbax's own reader in the
default mode accepts a commit-file step that was cut short. On top of the rule, a committed step must be
structurally sound: ``_CHECKPOINT_METADATA`` parses, and every item it names that Orbax's tree handlers
wrote has a parseable ``<item>/_METADATA`` (any item names: ``default``, MaxText's ``items``; an item of
another handler, like Grain's ``iter``, keeps its own files and is not checked here).

Step names are Orbax's (``orbax/checkpoint/_src/path/step.py``): ``120``, zero-padded ``00000120``, or
``<prefix>_120`` (``step_prefix``; a bare ``StandardCheckpointer`` user's ``checkpoint_120``), each possibly
with the tmp suffix. A prefixed name counts as a step only when it holds Orbax's files (metadata or the
commit marker) or carries the tmp suffix, so a ``data_1`` directory beside the steps is never a step (nor
deleted as an abandoned save). A step saved by a bare ``Checkpointer`` (no ``CheckpointManager``) has no
item directory: its one item is the step directory itself (``ROOT_ITEM``, ``""``).

Used by the sidecar's catalog and by the client's fallback scan, so both apply exactly the same rule.
Each document is read once and parsed with orjson (``json_docs.py``), the per-array part of the training
metadata only when its bytes differ from an earlier step's (``TRAINING_ARRAYS``): ckptd's first sight of a
step of a large model was mostly this parsing. No jax here.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from trainer_client.core._storage import Entry, Storage, join_path
from trainer_client.core.format._files import (
    CHECKPOINT_METADATA,
    COMMIT_MARKER,
    DEFAULT_ITEM,
    ITEM_METADATA,
    ROOT_ITEM,
    SHARDING_FILE,
)
from trainer_client.core.format._json_docs import is_json_object, loads, loads_sharing, parse_training
from trainer_client.core.protocol import MAX_STEP, ArraySpec, CheckpointInfo, MeshSpec, StepState, TrainingMetadata

CUSTOM_METADATA_KEY = "ckptd"
# Where ``_CHECKPOINT_METADATA`` holds the per-array part of ckptd's training metadata (``json_docs.loads_sharing``).
TRAINING_ARRAYS = ("custom_metadata", CUSTOM_METADATA_KEY, "arrays")
DEFAULT_SAVE_TIMEOUT_S = 3600.0

# Orbax's handlers that write a tree of arrays (the class name's end: subclasses keep it, e.g. MaxText's own).
_PYTREE_HANDLERS = ("PyTreeCheckpointHandler", "StandardCheckpointHandler")
# Orbax's names (step.py: ALLOWED_STEP_NAME_PATTERN, TMP_DIR_STEP_PATTERN): [<prefix>_]<digits>[.orbax-checkpoint-tmp*]
_STEP_NAME = re.compile(r"^(?:(?P<prefix>[^/]*?)_)?(?P<step>\d{1,19})(?P<tmp>\.orbax-checkpoint-tmp.*)?$")


@dataclass(frozen=True)
class StepName:
    step: int
    is_tmp: bool
    prefixed: bool = False  # <prefix>_<step>: a step only when it holds Orbax's files


def parse_step_name(name: str) -> StepName | None:
    """``"120"`` or ``"0120"`` -> step 120; ``"checkpoint_120"`` -> step 120 (prefixed);
    ``"[prefix_]120.orbax-checkpoint-tmp[-N]"`` -> tmp step 120; anything else None."""
    m = _STEP_NAME.fullmatch(name)
    if m is None or int(m.group("step")) > MAX_STEP:  # beyond int64: no catalog row or request can hold it
        return None
    prefix = m.group("prefix")
    if prefix is not None and (not prefix or prefix.startswith(".")):
        return None  # "_5", ".ckptd_5": not a name Orbax gives a step
    return StepName(int(m.group("step")), m.group("tmp") is not None, prefix is not None)


@dataclass(frozen=True)
class StepInspection:
    """What storage says about one step directory."""

    step: int
    path: str
    state: StepState
    reason: str | None
    committed_at: float | None
    training: TrainingMetadata | None
    item_names: tuple[str, ...] = ()

    def to_info(self, storage: Storage) -> CheckpointInfo:
        return CheckpointInfo(
            step=self.step,
            state=self.state,
            path=storage.url_of(self.path),
            reason=self.reason,
            committed_at=self.committed_at,
            training=self.training,
        )


def _unfinished(
    storage: Storage, entry: Entry, step: int, reason: str, save_timeout_s: float, now: float
) -> StepInspection:
    mtime = storage.newest_mtime(entry.path)
    old = mtime is not None and now - mtime > save_timeout_s
    state = StepState.ABANDONED if old else StepState.WRITING
    return StepInspection(step, entry.path, state, reason, None, None)


def inspect_step(
    storage: Storage,
    entry: Entry,
    *,
    save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
    now: float | None = None,
) -> StepInspection | None:
    """Apply the commit rule and the structural checks to one child of a job directory.

    Returns None for entries that are not step directories at all.
    """
    parsed = parse_step_name(entry.name)
    if parsed is None or not entry.is_dir:
        return None
    now = time.time() if now is None else now
    if parsed.is_tmp:
        return _unfinished(storage, entry, parsed.step, "tmp directory: save not finalized",
                           save_timeout_s, now)
    if parsed.prefixed and not ({e.name for e in storage.list_dir(entry.path)} & {COMMIT_MARKER, CHECKPOINT_METADATA}):
        return None  # a directory whose name ends in _<digits> but holds nothing of Orbax's: not a step
    if not storage.exists(join_path(entry.path, COMMIT_MARKER)):
        return _unfinished(storage, entry, parsed.step, f"no {COMMIT_MARKER}: save not finalized",
                           save_timeout_s, now)
    return _inspect_finalized(storage, entry.path, parsed.step)


def _read_json_object(storage: Storage, step_path: str, name: str) -> dict[str, Any] | str:
    """The JSON object in ``step_path/name``, or the reason it is not usable (``_CHECKPOINT_METADATA``: its
    per-array part possibly shared with an earlier step's, ``json_docs.loads_sharing``: not to be changed)."""
    try:
        raw = storage.read_bytes(join_path(step_path, name))
        value = loads_sharing(raw, TRAINING_ARRAYS) if name == CHECKPOINT_METADATA else loads(raw)
    except FileNotFoundError:
        return f"{name} missing"
    except ValueError as exc:  # UnicodeDecodeError is one
        return f"{name} is not JSON: {exc}"
    if not isinstance(value, dict):
        return f"{name} is not a JSON object"
    return value


def _json_object_problem(storage: Storage, step_path: str, name: str) -> str | None:
    """Why ``step_path/name`` is not a JSON object, or None when it is (the same bytes as an earlier step's
    are not parsed again: ``json_docs.is_json_object``)."""
    try:
        if is_json_object(storage.read_bytes(join_path(step_path, name))):
            return None
    except FileNotFoundError:
        return f"{name} missing"
    except ValueError as exc:
        return f"{name} is not JSON: {exc}"
    return f"{name} is not a JSON object"


def _inspect_finalized(storage: Storage, path: str, step: int) -> StepInspection:
    def corrupt(reason: str) -> StepInspection:
        return StepInspection(step, path, StepState.CORRUPT, reason, None, None)

    meta = _read_json_object(storage, path, CHECKPOINT_METADATA)
    if isinstance(meta, str):
        return corrupt(meta)
    handlers = step_items(storage, path, meta)
    items = tuple(sorted(handlers))
    for item, handler in sorted(handlers.items()):
        if not _is_pytree_handler(handler):
            continue  # another handler's item (Grain's iterator state, JSON): its own files, not Orbax's tree
        problem = _json_object_problem(storage, path, item_file(item, ITEM_METADATA))
        if problem is not None:
            return corrupt(problem)
    committed_ns = meta.get("commit_timestamp_nsecs")
    committed_at = committed_ns / 1e9 if isinstance(committed_ns, int | float) else None
    training = None
    custom = meta.get("custom_metadata")
    if isinstance(custom, dict) and CUSTOM_METADATA_KEY in custom:
        try:
            training = parse_training(custom[CUSTOM_METADATA_KEY])
        except ValidationError as exc:
            return corrupt(f"ckptd training metadata is invalid: {exc.error_count()} error(s)")
    return StepInspection(step, path, StepState.COMMITTED, None, committed_at, training, items)


def item_handlers(checkpoint_metadata: dict[str, Any]) -> dict[str, str | None]:
    """Each item of a step and the handler Orbax recorded for it, from its ``_CHECKPOINT_METADATA``: a
    manager with item names (MaxText's ``items`` and ``iter``) records a mapping, one without them (what
    trainer_client writes) a single handler for the item ``default``."""
    handlers = checkpoint_metadata.get("item_handlers")
    if isinstance(handlers, dict):
        return {str(k): v if isinstance(v, str) else None for k, v in handlers.items()}
    if isinstance(handlers, str):
        return {DEFAULT_ITEM: handlers}
    return {}


def step_items(storage: Storage, step_path: str, checkpoint_metadata: dict[str, Any]) -> dict[str, str | None]:
    """``item_handlers``, with the item of a step a bare ``Checkpointer`` saved (a single handler, and Orbax's
    ``_METADATA`` in the step directory itself rather than in ``default/``) named ``ROOT_ITEM``."""
    handlers = item_handlers(checkpoint_metadata)
    if set(handlers) == {DEFAULT_ITEM} and not isinstance(checkpoint_metadata.get("item_handlers"), dict) and (
        storage.exists(join_path(step_path, ITEM_METADATA))
        and not storage.exists(join_path(step_path, DEFAULT_ITEM, ITEM_METADATA))
    ):
        return {ROOT_ITEM: handlers[DEFAULT_ITEM]}
    return handlers


def item_file(item: str, name: str) -> str:
    """The path of an item's file ``name`` relative to the step (``name`` itself for ``ROOT_ITEM``)."""
    return f"{item}/{name}" if item != ROOT_ITEM else name


def _is_pytree_handler(handler: str | None) -> bool:
    """Whether an item's handler writes Orbax's tree of arrays (``_METADATA``, ``_sharding``, zarr arrays):
    Orbax's PyTree and Standard handlers and their subclasses by name; an unnamed handler is taken for one."""
    return handler is None or handler.rsplit(".", 1)[-1].endswith(_PYTREE_HANDLERS)


def array_items(storage: Storage, step_path: str) -> list[str]:
    """The items of a committed step that hold arrays (an Orbax tree: ``<item>/_METADATA`` with its
    ``tree_metadata``), sorted: ``["default"]`` for what trainer_client and a plain ``CheckpointManager``
    write, ``["items"]`` for MaxText's steps (whose ``iter`` item is Grain's iterator state, not arrays).
    ``["default"]`` when the step names no item that holds arrays (the layout readers then find none)."""
    meta = _read_json_object(storage, step_path, CHECKPOINT_METADATA)
    found = []
    for item, handler in sorted(step_items(storage, step_path, meta if isinstance(meta, dict) else {}).items()):
        if not _is_pytree_handler(handler):
            continue
        item_meta = _read_json_object(storage, step_path, item_file(item, ITEM_METADATA))
        if isinstance(item_meta, dict) and isinstance(item_meta.get("tree_metadata"), dict):
            found.append(item)
    return found or [DEFAULT_ITEM]


def read_training(storage: Storage, step_path: str) -> tuple[TrainingMetadata | None, str]:
    """ckptd's training metadata of a committed step, arrays included (None when the step has none or it
    does not parse: the step was then never verified with it), and the item trainer_client saved its arrays
    as: the one item with a tree handler (``default``, or ``items`` under ``SaveOptions.checkpoint_item``;
    an ``iter`` item beside it holds the data iterator's state), ``default`` when that is not one item."""
    meta = _read_json_object(storage, step_path, CHECKPOINT_METADATA)
    if not isinstance(meta, dict):
        return None, DEFAULT_ITEM
    trees = [item for item, handler in item_handlers(meta).items() if _is_pytree_handler(handler)]
    item = trees[0] if len(trees) == 1 else DEFAULT_ITEM
    custom = meta.get("custom_metadata")
    if not isinstance(custom, dict) or CUSTOM_METADATA_KEY not in custom:
        return None, item
    try:
        return parse_training(custom[CUSTOM_METADATA_KEY]), item
    except ValidationError:
        return None, item


def read_saved_sharding(
    storage: Storage, step_path: str, item: str = DEFAULT_ITEM
) -> tuple[MeshSpec | None, dict[str, ArraySpec]]:
    """Mesh and per-array partition specs from Orbax's ``<item>/_sharding`` (plain JSON, no jax).

    Keys there are base64 of the dotted leaf path. Arrays without a NamedSharding get no entry.
    """
    try:
        raw = loads(storage.read_bytes(join_path(step_path, item_file(item, SHARDING_FILE))))
    except (FileNotFoundError, ValueError):
        return None, {}
    if not isinstance(raw, dict):
        return None, {}
    mesh: MeshSpec | None = None
    arrays: dict[str, ArraySpec] = {}
    for key, value in raw.items():
        try:
            name = base64.b64decode(key).decode("utf-8")
            sharding = loads(value) if isinstance(value, str) else value
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(sharding, dict) or sharding.get("sharding_type") != "NamedSharding":
            continue
        try:
            this_mesh = MeshSpec(axis_names=list(sharding["axis_names"]), shape=list(sharding["shape"]))
            spec = ArraySpec(partition_spec=list(sharding.get("partition_spec", [])))
        except (KeyError, TypeError, ValidationError):
            continue
        mesh = mesh or this_mesh
        arrays[name] = spec
    return mesh, arrays


def step_entries(storage: Storage, job_path: str) -> list[tuple[StepName, Entry]]:
    """Children of a job directory that look like step directories, newest step first (a finalized name
    before a tmp one; of two names for one step, ``100`` and ``checkpoint_100``, the first by name)."""
    found = []
    for entry in storage.list_dir(job_path):
        parsed = parse_step_name(entry.name)
        if parsed is not None and entry.is_dir:
            found.append((parsed, entry))
    found.sort(key=lambda pe: (-pe[0].step, pe[0].is_tmp, pe[1].name))
    return found


def latest_committed(storage: Storage, job_path: str, *, at_most: int | None = None) -> StepInspection | None:
    """The newest committed, structurally sound step of a job (the client's fallback scan).

    Reads metadata only for the steps it has to look at, newest first.
    """
    storage.invalidate(job_path)
    for parsed, entry in step_entries(storage, job_path):
        if parsed.is_tmp or (at_most is not None and parsed.step > at_most):
            continue
        inspection = inspect_step(storage, entry)
        if inspection is not None and inspection.state is StepState.COMMITTED:
            return inspection
    return None


__all__ = [
    "CUSTOM_METADATA_KEY",
    "DEFAULT_SAVE_TIMEOUT_S",
    "TRAINING_ARRAYS",
    "StepInspection",
    "StepName",
    "array_items",
    "inspect_step",
    "item_file",
    "item_handlers",
    "latest_committed",
    "parse_step_name",
    "read_saved_sharding",
    "read_training",
    "step_entries",
    "step_items",
]
