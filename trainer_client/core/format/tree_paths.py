"""A pytree's structure as plain data: what a snapshot records instead of a pickled ``PyTreeDef``.

ckptd's persist worker must rebuild the trainer's state to hand it to Orbax, from a file others could have
written; unpickling that file would run whatever it says. So the trainer records, per leaf in flatten
order, its key path — each key a dict key (``"dict"``: a ``DictKey`` or an attribute) or a position
(``"seq"``) — and what the leaf is: an array, or one of the empty values Orbax stores (``None``, ``{}``,
``[]``, ``()``). That is exactly what Orbax writes into a step's tree metadata (it records only those two
key types), so the worker's tree of dicts and lists gives the same checkpoint as the trainer's own
classes: a target restores it as it would a direct save.

``rebuild`` treats the description as untrusted: every inconsistency is a ``StoredFormatError``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer_client.core.errors import StoredFormatError

KeyKind = Literal["dict", "seq"]
EntryKind = Literal["array", "none", "empty_dict", "empty_list", "empty_tuple"]
MAX_DEPTH = 64  # deeper than any real training state; bounds the rebuild's recursion
_EMPTY: dict[str, Any] = {"none": None, "empty_dict": {}, "empty_list": [], "empty_tuple": ()}


class TreeEntry(BaseModel):
    """One leaf of the state: its key path from the root and what it holds."""

    model_config = ConfigDict(extra="forbid")

    path: list[tuple[KeyKind, str]] = Field(max_length=MAX_DEPTH)
    kind: EntryKind = "array"


def rebuild(entries: list[TreeEntry], arrays: list[Any]) -> Any:
    """The tree the entries describe, made of dicts and lists, with ``arrays`` (in order) at its ``array``
    leaves and empty values at the others."""
    if sum(e.kind == "array" for e in entries) != len(arrays):
        raise StoredFormatError(f"the tree has {sum(e.kind == 'array' for e in entries)} arrays, "
                                f"the snapshot {len(arrays)}")
    if not entries:
        return {}
    values = iter(arrays)
    leaves = [(entry.path, next(values) if entry.kind == "array" else _empty(entry.kind)) for entry in entries]
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]  # the state is one leaf
    return _node(leaves, 0)


def _empty(kind: str) -> Any:
    value = _EMPTY[kind]
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


__all__ = ["MAX_DEPTH", "EntryKind", "KeyKind", "TreeEntry", "rebuild"]
