"""A pytree's structure as plain data: what a snapshot records instead of a pickled ``PyTreeDef``.

ckptd's persist worker must rebuild the trainer's state to hand it to Orbax, from a file others could have
written; unpickling that file would run whatever it says. So the trainer records, per leaf in flatten
order, its key path — each key a dict key (``"dict"``: a ``DictKey`` or an attribute) or a position
(``"seq"``) — and what the leaf is: an array, one of the empty values Orbax stores (``None``, ``{}``,
``[]``, ``()``), or a value that is not an array (``"value"``: a Python ``int``, ``float``, ``bool`` or
``str``, or a numpy scalar), recorded as data (``LeafValue``). That is exactly what Orbax writes into a
step's tree metadata (it records only those two key types), so the worker's tree of dicts and lists gives
the same checkpoint as the trainer's own classes: a target restores it as it would a direct save.

Values are kept exactly: a float as ``float.hex`` (NaN and infinities included), a numpy scalar with its
dtype. Orbax stores numbers as 0-d arrays (its ``ScalarHandler``) and strings in the item's
``_strings.json`` (``StringHandler``), so a value persisted from a snapshot reads back, through plain
Orbax too, as it would from a direct save.

``rebuild`` treats the description as untrusted: every inconsistency is a ``StoredFormatError``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer_client.core._errors import StoredFormatError

KeyKind = Literal["dict", "seq"]
EntryKind = Literal["array", "value", "none", "empty_dict", "empty_list", "empty_tuple"]
ValueType = Literal["int", "float", "bool", "str"]
MAX_DEPTH = 64  # deeper than any real training state; bounds the rebuild's recursion
MAX_STRING = 1 << 20  # characters of one string leaf
_EMPTY: dict[str, Any] = {"none": None, "empty_dict": {}, "empty_list": [], "empty_tuple": ()}
_SCALAR_KINDS = {"b": "bool", "i": "int", "u": "int", "f": "float"}  # numpy kinds a value may have


class LeafValue(BaseModel):
    """A leaf that is not an array, as data: a Python ``int``/``float``/``bool``/``str``, or with ``dtype`` a
    numpy scalar of that element type (bool, integer or floating). ``value``: the int, the bool, the string,
    or a float's ``float.hex()``."""

    model_config = ConfigDict(extra="forbid")

    type: ValueType
    value: int | bool | str
    dtype: str | None = Field(default=None, max_length=32, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _consistent(self) -> LeafValue:
        want = {"int": int, "bool": bool, "str": str, "float": str}[self.type]
        if type(self.value) is not want:
            raise ValueError(f"a {self.type} leaf holds {type(self.value).__name__}")
        if self.type == "str" and len(self.value) > MAX_STRING:  # type: ignore[arg-type]
            raise ValueError(f"a string leaf of {len(self.value)} characters")  # type: ignore[arg-type]
        if self.type == "float":
            float.fromhex(self.value)  # type: ignore[arg-type]  # ValueError: not a float
        if self.dtype is not None:
            try:
                dtype = np.dtype(self.dtype)
            except TypeError as exc:
                raise ValueError(f"not a dtype: {self.dtype!r}") from exc
            if _SCALAR_KINDS.get(dtype.kind) != self.type or dtype.fields is not None:
                raise ValueError(f"a {self.type} leaf of dtype {self.dtype}")
            if self.type == "int":
                info = np.iinfo(dtype)
                if not info.min <= self.value <= info.max:  # type: ignore[operator]
                    raise ValueError(f"{self.value} does not fit {self.dtype}")
        return self


class TreeEntry(BaseModel):
    """One leaf of the state: its key path from the root and what it holds."""

    model_config = ConfigDict(extra="forbid")

    path: list[tuple[KeyKind, str]] = Field(max_length=MAX_DEPTH)
    kind: EntryKind = "array"
    value: LeafValue | None = Field(default=None, exclude_if=lambda v: v is None,
                                    description="the leaf itself, when kind is 'value'")

    @model_validator(mode="after")
    def _value_iff_value_kind(self) -> TreeEntry:
        if (self.kind == "value") != (self.value is not None):
            raise ValueError("a 'value' entry, and only one, holds a value")
        return self


def encode_value(leaf: Any) -> LeafValue | None:
    """``leaf`` as data when it is a value that is not an array (None otherwise: an array, or anything else)."""
    if isinstance(leaf, np.generic) and not isinstance(leaf, np.ndarray):
        kind = _SCALAR_KINDS.get(leaf.dtype.kind)
        if kind is None:
            return None
        python = leaf.item()
        return LeafValue(type=kind, value=float(python).hex() if kind == "float" else python,  # type: ignore[arg-type]
                         dtype=leaf.dtype.name)
    if isinstance(leaf, bool):
        return LeafValue(type="bool", value=leaf)
    if isinstance(leaf, int):
        return LeafValue(type="int", value=int(leaf))
    if isinstance(leaf, float):
        return LeafValue(type="float", value=float(leaf).hex())
    if isinstance(leaf, str):
        return LeafValue(type="str", value=str(leaf))
    return None


def decode_value(value: LeafValue) -> Any:
    """The leaf ``value`` records: the Python value, or the numpy scalar of its dtype."""
    python: Any = float.fromhex(value.value) if value.type == "float" else value.value  # type: ignore[arg-type]
    if value.dtype is None:
        return python
    if value.type == "float" and math.isfinite(python) and abs(python) > float(np.finfo(value.dtype).max):
        raise StoredFormatError(f"{python} does not fit {value.dtype}")
    return np.dtype(value.dtype).type(python)


def rebuild(entries: list[TreeEntry], arrays: list[Any]) -> Any:
    """The tree the entries describe, made of dicts and lists, with ``arrays`` (in order) at its ``array``
    leaves, the recorded values at its ``value`` leaves and empty values at the others."""
    if sum(e.kind == "array" for e in entries) != len(arrays):
        raise StoredFormatError(f"the tree has {sum(e.kind == 'array' for e in entries)} arrays, "
                                f"the snapshot {len(arrays)}")
    if not entries:
        return {}
    values = iter(arrays)
    leaves = [(entry.path, next(values) if entry.kind == "array" else _leaf(entry)) for entry in entries]
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]  # the state is one leaf
    return _node(leaves, 0)


def _leaf(entry: TreeEntry) -> Any:
    if entry.value is not None:
        return decode_value(entry.value)
    value = _EMPTY[entry.kind]
    return type(value)() if value is not None else None  # a fresh container per leaf


def _node(leaves: list[tuple[list[tuple[KeyKind, str]], Any]], depth: int) -> Any:
    """The container at ``depth`` of ``leaves``' paths (all of which share their first ``depth`` keys)."""
    kinds = {path[depth][0] for path, _ in leaves if len(path) > depth}
    if len(kinds) != 1 or any(len(path) <= depth for path, _ in leaves):
        raise StoredFormatError("the tree description is inconsistent: a node is both a leaf and a container, "
                                "or both a dict and a sequence")
    groups: dict[str, list[tuple[list[tuple[KeyKind, str]], Any]]] = {}
    for path, value in leaves:
        groups.setdefault(path[depth][1], []).append((path, value))
    children = {key: group[0][1] if len(group) == 1 and len(group[0][0]) == depth + 1 else _node(group, depth + 1)
                for key, group in groups.items()}
    if kinds == {"dict"}:
        return children
    positions = sorted(children, key=lambda key: int(key) if key.isdigit() else -1)
    if positions != [str(i) for i in range(len(positions))]:
        raise StoredFormatError(f"a sequence of the tree description has positions {positions[:8]}, not 0..n-1")
    return [children[key] for key in positions]


__all__ = ["MAX_DEPTH", "EntryKind", "KeyKind", "LeafValue", "TreeEntry", "decode_value", "encode_value", "rebuild"]
