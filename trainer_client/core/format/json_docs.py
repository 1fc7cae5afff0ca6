"""The JSON documents of a step, parsed once and fast: what makes ckptd's first sight of a step cheap.

A step of a model with 1,000 arrays carries three JSON documents of 100-300 KB each: Orbax's
``_CHECKPOINT_METADATA`` (ckptd's training metadata inside, one entry per array), each item's ``_METADATA``
(one entry per leaf) and ckptd's manifest. Parsing them with the standard library and validating every
array's entry with pydantic cost ~40 ms a step: ten thousand steps seen for the first time took minutes
(docs/benchmarks.md, ``first_sight_ms_per_step``). Here:

* documents are parsed with orjson (a C parser, several times faster than ``json``);
* the per-array part of the training metadata is validated once per distinct content: the steps of one
  run share their array layout, so the arrays of step N+1 are byte for byte those of step N (the key is
  the exact compact JSON of that part, never a hash of it) and their validated models are reused;
* an item's ``_METADATA`` (the tree's structure, no step number in it) that was already found to be a
  JSON object is not parsed again when the next step holds the same bytes.

Nothing is checked less: a document that differs in any byte is parsed and validated in full. The memos
hold the last few layouts only (``_KEPT``). No jax here.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import orjson
from pydantic import TypeAdapter

from trainer_client.core.protocol import ArraySpec, TrainingMetadata

_KEPT = 2  # distinct layouts remembered: a run's current one and the one before a reshard
_lock = threading.Lock()
_arrays: OrderedDict[bytes, dict[str, ArraySpec]] = OrderedDict()
_objects: OrderedDict[bytes, None] = OrderedDict()  # documents known to be JSON objects
_ARRAYS: TypeAdapter[dict[str, ArraySpec]] = TypeAdapter(dict[str, ArraySpec])  # TrainingMetadata.arrays


def loads(raw: bytes | str) -> Any:
    """Parse JSON (``ValueError`` when it is not JSON). What orjson refuses but Python's ``json`` reads
    (``NaN``, integers beyond 64 bits, lone surrogates: Orbax writes its metadata with ``json``) is read by
    ``json``, so no document that parsed before is refused now."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Compact JSON, keys in their order: the rendering pydantic's ``model_dump_json`` gives the same values
    (``TypeError``/``ValueError`` for what orjson cannot render, e.g. an integer beyond 64 bits)."""
    return orjson.dumps(value)


def _remember(memo: OrderedDict[bytes, Any], key: bytes, value: Any) -> None:
    with _lock:
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > _KEPT:
            memo.popitem(last=False)


def _recall(memo: OrderedDict[bytes, Any], key: bytes) -> bool:
    with _lock:
        if key in memo:
            memo.move_to_end(key)
            return True
        return False


def is_json_object(raw: bytes) -> bool:
    """Whether ``raw`` is a JSON document whose top level is an object (``ValueError`` when it is not JSON at
    all). The same bytes seen again are not parsed again."""
    if _recall(_objects, raw):
        return True
    found = isinstance(loads(raw), dict)
    if found:
        _remember(_objects, raw, None)
    return found


def validated_arrays(value: Any) -> dict[str, ArraySpec]:
    """``value`` (the ``arrays`` part of training metadata, as parsed from JSON) validated; raises pydantic's
    ``ValidationError``. Validated once per distinct content (the same models are returned for the same
    bytes: they are never changed in place)."""
    try:
        key = dumps(value) if isinstance(value, dict) and value else b""
    except (TypeError, ValueError):
        key = b""
    if key:
        with _lock:
            kept = _arrays.get(key)
            if kept is not None:
                _arrays.move_to_end(key)
                return dict(kept)
    arrays = _ARRAYS.validate_python(value)
    if key:
        _remember(_arrays, key, arrays)
    return dict(arrays)


def parse_training(value: Any) -> TrainingMetadata:
    """ckptd's training metadata from its JSON value (``ValidationError`` when it is not valid): everything
    but the arrays validated as usual, the arrays through ``validated_arrays``."""
    if not isinstance(value, dict) or not isinstance(value.get("arrays"), dict) or not value["arrays"]:
        return TrainingMetadata.model_validate(value)
    summary = TrainingMetadata.model_validate({**value, "arrays": {}})
    return summary.model_copy(update={"arrays": validated_arrays(value["arrays"])})


__all__ = ["dumps", "is_json_object", "loads", "parse_training", "validated_arrays"]
