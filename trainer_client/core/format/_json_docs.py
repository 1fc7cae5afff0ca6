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
  JSON object is not parsed again when the next step holds the same bytes;
* the per-array part itself is not parsed again either (``loads_sharing``): a document whose bytes hold,
  at that place, exactly the bytes an earlier document held there is parsed without them (a few hundred
  bytes instead of ~110 KB) and given the earlier value. Parsing the two documents that carry the arrays
  was most of what remained of a first sight (docs/benchmarks.md).

Nothing is checked less: a part that differs in any byte is parsed and validated in full, a part is only
taken over when it is proven to sit at that very place in the document (``_without``), and a document that
may hold an integer beyond 64 bits is read by ``json`` (orjson would make it a float). The memos hold the
last few layouts only (``_KEPT``). No jax here.
"""

from __future__ import annotations

import json
import operator
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import orjson
from pydantic import TypeAdapter

from trainer_client.core.protocol import ArraySpec, TrainingMetadata

_KEPT = 2  # distinct layouts remembered: a run's current one and the one before a reshard
_lock = threading.Lock()
_arrays: OrderedDict[bytes, dict[str, ArraySpec]] = OrderedDict()
_objects: OrderedDict[bytes, None] = OrderedDict()  # documents known to be JSON objects
# Parts shared between documents (``loads_sharing``): their exact bytes -> their parsed value, and the values
# by identity -> their validated arrays (``validated_arrays`` of a shared value is a dictionary look-up).
_parts: OrderedDict[bytes, Any] = OrderedDict()
_validated: dict[int, tuple[Any, dict[str, ArraySpec]]] = {}
_compact: dict[int, tuple[Any, bytes]] = {}  # shared values by identity -> their compact rendering
_rendered: OrderedDict[int, tuple[dict[str, ArraySpec], bytes]] = OrderedDict()  # validated layouts -> pydantic's
_TRIES = 3  # occurrences of a part (or of its key) tried in one document
_ENDS = 32  # closing braces, from the end of a document, tried as the end of its part
_COLON = re.compile(rb"\s*:\s*")
_MISSES_KEPT = 8  # after this many documents of a kind that shared nothing, only every 8th one is learned from
_misses: dict[tuple[str, ...], int] = {}
_MIN_PART = 4096  # smaller parts are parsed as they are: cheap, not worth remembering
# Larger ones too: a parsed part takes ~6x its bytes in memory, and four are kept (~35,000 arrays and more)
_MAX_PART = 4 << 20
# The stand-in for a shared part: an object whose one key no escape-free document holds by chance. It starts
# with a letter, so outside a string its bytes are never a JSON token of their own.
_NONCE = "zckptd" + secrets.token_hex(12)
_STAND_IN = b'{"' + _NONCE.encode() + b'":0}'
_STAND_IN_VALUE = {_NONCE: 0}
# Digits as "0", minus signs as "-", the rest as " ": runs of digits found at C speed (``_may_hold_huge_int``).
_DIGIT_SHAPES = bytes(ord("0") if chr(b).isdigit() and b < 128 else ord("-") if b == ord("-") else ord(" ")
                      for b in range(256))
_ARRAYS: TypeAdapter[dict[str, ArraySpec]] = TypeAdapter(dict[str, ArraySpec])  # TrainingMetadata.arrays


def loads(raw: bytes | str) -> Any:
    """Parse JSON (``ValueError`` when it is not JSON). What orjson refuses but Python's ``json`` reads
    (``NaN``, lone surrogates: Orbax writes its metadata with ``json``) is read by ``json``, so no document
    that parsed before is refused now; so is one that may hold an integer beyond 64 bits, which orjson reads
    as a float (silently): every number is read as it is written."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
    return json.loads(raw) if _may_hold_huge_int(raw) else value


def _may_hold_huge_int(raw: bytes | str) -> bool:
    """Whether ``raw`` may hold an integer orjson reads as a float: beyond ``2**64 - 1`` (20 digits or more) or
    below ``-2**63`` (a minus and 19 digits or more). A run of digits anywhere counts (in a string too: then
    the document is only read the slower, exact way)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    shape = raw.translate(_DIGIT_SHAPES)
    return b"0" * 20 in shape or b"-" + b"0" * 19 in shape


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
    try:  # only its shape matters here: no need to read its numbers exactly
        found = isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        found = isinstance(json.loads(raw), dict)
    if found:
        _remember(_objects, raw, None)
    return found


def validated_arrays(value: Any) -> dict[str, ArraySpec]:
    """``value`` (the ``arrays`` part of training metadata, as parsed from JSON) validated; raises pydantic's
    ``ValidationError``. Validated once per distinct content (the same models are returned for the same
    bytes: they are never changed in place); a value ``loads_sharing`` handed out is looked up, not rendered."""
    with _lock:
        shared = _validated.get(id(value))
    if shared is not None and shared[0] is value:
        return dict(shared[1])
    try:
        key = dumps(value) if isinstance(value, dict) and value else b""
    except (TypeError, ValueError):
        key = b""
    with _lock:
        arrays = _arrays.get(key) if key else None
        if arrays is not None:
            _arrays.move_to_end(key)
    if arrays is None:
        arrays = _ARRAYS.validate_python(value)
        if key:
            _remember(_arrays, key, arrays)
    with _lock:
        if any(part is value for part in _parts.values()):
            _validated[id(value)] = (value, arrays)
    return dict(arrays)


def parse_training(value: Any) -> TrainingMetadata:
    """ckptd's training metadata from its JSON value (``ValidationError`` when it is not valid): everything
    but the arrays validated as usual, the arrays through ``validated_arrays``."""
    if not isinstance(value, dict) or not isinstance(value.get("arrays"), dict) or not value["arrays"]:
        return TrainingMetadata.model_validate(value)
    summary = TrainingMetadata.model_validate({**value, "arrays": {}})
    return summary.model_copy(update={"arrays": validated_arrays(value["arrays"])})


def _at(doc: Any, path: tuple[str, ...]) -> tuple[dict[str, Any] | None, Any]:
    """The object holding ``path``'s last key in ``doc`` and the value there (None, None: no such place)."""
    parent = doc
    for key in path[:-1]:
        parent = parent.get(key) if isinstance(parent, dict) else None
    if not isinstance(parent, dict):
        return None, None
    return parent, parent.get(path[-1])


def _value_starts(raw: bytes, path: tuple[str, ...]) -> Iterator[int]:
    """Where a value of ``path``'s last key may start in ``raw``: after each of its first ``_TRIES``
    occurrences as a key (quoted, then a colon), found as they are asked for. Cheaper than searching ``raw``
    for a 100 KB part."""
    key = b'"' + path[-1].encode("utf-8") + b'"'
    at = raw.find(key)
    for _ in range(_TRIES):
        if at < 0:
            return
        colon = _COLON.match(raw, at + len(key))
        if colon is not None:
            yield colon.end()
        at = raw.find(key, at + 1)


def _without(raw: bytes, part: bytes, path: tuple[str, ...], at: int) -> Any:
    """The document ``raw`` parsed with ``part``, which occurs at ``at``, replaced by the stand-in, when that
    proves ``part`` is the value at ``path``; else None.

    The proof: the bytes around ``part`` hold no backslash and not the stand-in's key, so the only string in
    the document equal to that key is the stand-in's own; found as the key of the object at ``path``, the
    stand-in was read as a whole JSON value there, outside any string (inside one, its first quote would end
    the string and the bare key after it would not parse). ``part`` is a whole JSON value too (it parsed on
    its own), so in ``raw`` it is read at the same place, as the same value, and the bytes after it as
    after the stand-in: ``raw`` parses to the returned document with that value in place of the stand-in."""
    key = _STAND_IN[2:-4]
    if not raw.startswith(part, at):
        return None
    head, tail = raw[:at], raw[at + len(part):]
    if b"\\" in head or b"\\" in tail or key in head or key in tail:
        return None
    try:
        doc = orjson.loads(head + _STAND_IN + tail)
    except orjson.JSONDecodeError:
        return None
    if _may_hold_huge_int(head) or _may_hold_huge_int(tail):
        return None  # ``loads`` reads it in full (exactly)
    _, value = _at(doc, path)
    if isinstance(value, dict) and list(value) == [_NONCE] and value[_NONCE] == 0:
        return doc  # the stand-in at ``path``: the caller puts the value there
    return None


def loads_sharing(raw: bytes, path: tuple[str, ...]) -> Any:
    """``loads(raw)``; the object at ``path`` (a key of an object at each level: ``("training", "arrays")``)
    may be the very value an earlier document held there in the same bytes, so the caller must not change
    it. What makes a step's first sight cheap: a run's steps carry the same ~110 KB of per-array metadata
    twice each (``_CHECKPOINT_METADATA``, the manifest), byte for byte the previous step's."""
    with _lock:
        known = list(reversed(_parts.items()))
    for at in _value_starts(raw, path) if known else ():  # an older manifest holds its arrays twice: the 2nd
        for part, value in known:
            doc = _without(raw, part, path, at)
            if doc is not None:
                parent, _ = _at(doc, path)
                assert parent is not None
                parent[path[-1]] = value
                with _lock:
                    if part in _parts:
                        _parts.move_to_end(part)
                return doc
    doc = loads(raw)
    _learn(raw, doc, path)
    return doc


def _learn(raw: bytes, doc: Any, path: tuple[str, ...]) -> None:
    """Remember the bytes of the part of ``doc`` (``raw`` parsed) at ``path``, however the writer spaced
    them (orjson and pydantic compact, Python's ``json`` as Orbax calls it, pydantic's ``indent=1`` of older
    manifests): the part starts after its key; it ends at one of the last closing braces of the document (what
    follows the part is short); the one that ``_without`` proves, and that parses on its own, is it."""
    _, value = _at(doc, path)
    if not isinstance(value, dict) or len(raw) < _MIN_PART:
        return
    with _lock:
        misses = _misses.get(path, 0)
        _misses[path] = misses + 1
    if misses >= _MISSES_KEPT and misses % _MISSES_KEPT:
        return  # this kind of document rarely shares its part lately: try again only now and then
    starts = [at for at in _value_starts(raw, path) if raw[at:at + 1] == b"{"]
    ends: list[int] = []  # what follows the part is rarely more than a few closing braces
    at = raw.rfind(b"}")
    while at >= 0 and len(ends) < _ENDS:
        ends.append(at)
        at = raw.rfind(b"}", 0, at)
    for start in starts:
        for end in ends:
            if not _MIN_PART <= end + 1 - start <= _MAX_PART:
                continue
            part = raw[start:end + 1]
            if _without(raw, part, path, start) is None:
                continue
            try:
                own = loads(part)
            except ValueError:
                continue
            if own != value:
                continue
            with _lock:
                _parts.setdefault(part, value)  # learnt by another thread meanwhile: its value stays the one
                _parts.move_to_end(part)
                while len(_parts) > 2 * _KEPT:  # for the last two layouts, the part of each kind of document
                    _, dropped = _parts.popitem(last=False)
                    _validated.pop(id(dropped), None)
                    _compact.pop(id(dropped), None)
                _misses[path] = 0
            return


def dumps_sharing(doc: dict[str, Any], path: tuple[str, ...]) -> bytes:
    """``dumps(doc)``; a part at ``path`` that ``loads_sharing`` handed out is rendered once, not with each
    document (JSON is rendered part by part: the document's rendering with a stand-in there, the stand-in's
    bytes replaced by the part's, is the whole rendering)."""
    parent, value = _at(doc, path)
    if parent is None or not isinstance(value, dict) or not value:
        return dumps(doc)
    with _lock:
        known = _compact.get(id(value))
        shared = (known is not None and known[0] is value) or any(part is value for part in _parts.values())
    if not shared:
        return dumps(doc)
    if known is None or known[0] is not value:
        known = (value, dumps(value))
        with _lock:
            if any(part is value for part in _parts.values()):
                _compact[id(value)] = known
    parent[path[-1]] = _STAND_IN_VALUE
    try:
        body = dumps(doc)
    finally:
        parent[path[-1]] = value
    if body.count(_STAND_IN) != 1:
        return dumps(doc)
    return body.replace(_STAND_IN, known[1])


def rendered_arrays(arrays: dict[str, ArraySpec]) -> bytes | None:
    """pydantic's rendering of ``arrays`` when they are a layout ``validated_arrays`` handed out (the very
    models, in the same order), rendered once per layout; None for any other."""
    with _lock:
        layouts = list(_arrays.values())
    for layout in layouts:
        if len(layout) == len(arrays) and all(map(operator.is_, layout, arrays)) and all(
                map(operator.is_, layout.values(), arrays.values())):
            with _lock:
                kept = _rendered.get(id(layout))
            if kept is not None and kept[0] is layout:
                return kept[1]
            rendering = _ARRAYS.dump_json(layout)
            with _lock:
                _rendered[id(layout)] = (layout, rendering)
                while len(_rendered) > _KEPT:
                    _rendered.popitem(last=False)
            return rendering
    return None


__all__ = ["dumps", "dumps_sharing", "is_json_object", "loads", "loads_sharing", "parse_training", "rendered_arrays",
           "validated_arrays"]
