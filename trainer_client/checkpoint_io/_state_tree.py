"""The leaves of a training state: arrays, and the values that are not arrays, on every path a step takes.

A state may hold, besides arrays, Python ``int``/``float``/``bool``/``str`` leaves and numpy scalars (a Flax
``TrainState``'s ``step`` before its first jitted update, an epoch counter, a run name). Orbax saves them with
its ``ScalarHandler`` (numbers: 0-d arrays) and ``StringHandler`` (``_strings.json``), and restores each as
the target asks: a value target (a Python or numpy scalar, a string) gets the saved value as that type (its
``restore_type``), an array target (``ShapeDtypeStruct`` with a sharding) an array of its dtype on its
sharding. Every path of a step here does the same — a direct save and restore, a memory snapshot (the
values recorded as data: ``trainer_client.core.format._tree_paths``), its persist by ckptd, a restore from
memory — so a step reads back the same whichever way it went, through plain Orbax too.

``describe_tree`` writes a state's structure as data for a snapshot; ``restored_leaf`` gives a saved leaf the
type its target asks for; ``orbax_restore`` restores a target of arrays and values through Orbax.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer_client.core.format._tree_paths import TreeEntry, encode_value

PyTree = Any


def leaf_name(path: tuple[Any, ...]) -> str:
    """The dotted leaf path Orbax uses in ``_sharding`` (``params.w``, ``opt.0.mu.b``)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def is_array_target(leaf: Any) -> bool:
    """A target leaf that asks for an array: it has a shape and a sharding (``ShapeDtypeStruct``, ``jax.Array``)."""
    return isinstance(getattr(leaf, "sharding", None), jax.sharding.Sharding) and hasattr(leaf, "shape")


def is_value(leaf: Any) -> bool:
    """A leaf that is a value, not an array: a Python int/float/bool/str or a numpy scalar."""
    return encode_value(leaf) is not None


def restored_leaf(saved: Any, want: Any, name: str) -> Any:
    """The saved leaf (a value, or a 0-d array of one) as the target leaf ``want`` asks for it: an array of
    ``want``'s dtype on its sharding, or a value of ``want``'s type (what Orbax's restore does)."""
    if is_array_target(want):
        if tuple(want.shape) != ():
            raise ValueError(f"{name}: a saved value does not fit a target of shape {tuple(want.shape)}")
        host = np.asarray(saved, dtype=want.dtype)
        return jax.make_array_from_callback((), want.sharding, lambda _: host, dtype=want.dtype)
    if isinstance(saved, jax.Array | np.ndarray):
        if saved.shape != ():
            raise ValueError(f"{name}: an array of shape {saved.shape} does not fit a {type(want).__name__} target")
        saved = np.asarray(saved).item()
    return type(want)(saved)


def orbax_restore(item_path: str, target: PyTree, arrays: PyTree | None = None) -> PyTree:
    """``target`` restored by Orbax's PyTree handler: its array leaves on their shardings (cast to their
    dtype), its value leaves as their types (``restore_type``). With ``arrays`` (the target's arrays, read
    already) only the values are read: the array leaves are Orbax's ``PLACEHOLDER`` (not read)."""
    def args(leaf: Any) -> Any:
        if is_value(leaf):  # a numpy scalar is read as the 0-d array Orbax wrote, then made that scalar
            return ocp.RestoreArgs(restore_type=np.ndarray if isinstance(leaf, np.generic) else type(leaf))
        if arrays is not None:
            return ocp.PLACEHOLDER
        if not is_array_target(leaf):
            raise ValueError(f"a target leaf of type {type(leaf).__name__} is neither an array nor a value")
        return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=leaf.sharding, global_shape=tuple(leaf.shape),
                                    dtype=leaf.dtype)

    restore_args = jax.tree_util.tree_map(args, target)
    item = jax.tree_util.tree_map(lambda leaf, a: ocp.PLACEHOLDER if a is ocp.PLACEHOLDER else leaf, target,
                                  restore_args)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        restored = checkpointer.restore(item_path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    finally:
        checkpointer.close()
    restored_leaves = jax.tree_util.tree_leaves(restored, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    if arrays is not None:  # fill the placeholders with the arrays read
        read = iter(jax.tree_util.tree_leaves(arrays))
        restored_leaves = [next(read) if leaf is ocp.PLACEHOLDER else leaf for leaf in restored_leaves]
    paths = [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]]
    wanted = jax.tree_util.tree_leaves(target)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), [
        restored_leaf(leaf, want, name) if is_value(want) else leaf
        for leaf, want, name in zip(restored_leaves, wanted, paths, strict=True)])


def describe_paths(state: PyTree) -> list[TreeEntry]:
    """``state``'s structure as data (``trainer_client.core.format._tree_paths``): every leaf's key path, with
    the empty values Orbax records (``None``, ``{}``, ``[]``, ``()``) as leaves of their own; every other leaf
    is an ``array`` entry here (``with_values`` says which are values, save by save)."""
    def empty(x: Any) -> bool:
        return x is None or (isinstance(x, (dict, list, tuple)) and not x)

    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=empty)[0]:
        keys = [("seq", str(k.idx)) if isinstance(k, jax.tree_util.SequenceKey)
                else ("seq", str(k.key)) if isinstance(k, jax.tree_util.FlattenedIndexKey)
                else ("dict", leaf_name((k,))) for k in path]
        if leaf is None:
            kind = "none"
        elif isinstance(leaf, dict):
            kind = "empty_dict"
        elif isinstance(leaf, list):
            kind = "empty_list"
        elif isinstance(leaf, tuple):
            kind = "empty_tuple" if type(leaf) is tuple else "none"  # an empty namedtuple: Orbax stores None
        else:
            kind = "array"
        entries.append(TreeEntry.model_validate({"path": keys, "kind": kind}))
    return entries


def with_values(paths: list[TreeEntry], leaves: list[Any]) -> list[TreeEntry]:
    """``paths`` (``describe_paths``) with the leaves that are values recorded as such: ``leaves`` are the
    state's leaves in flatten order (one per entry that is not an empty value)."""
    out = []
    values = iter(leaves)
    for entry in paths:
        if entry.kind != "array":
            out.append(entry)
            continue
        value = encode_value(next(values))
        out.append(entry if value is None else TreeEntry(path=entry.path, kind="value", value=value))
    return out


def describe_tree(state: PyTree) -> list[TreeEntry]:
    """``state``'s structure and its values as data (what a snapshot records)."""
    return with_values(describe_paths(state), jax.tree_util.tree_leaves(state))


__all__ = ["describe_paths", "describe_tree", "is_array_target", "is_value", "leaf_name", "orbax_restore",
           "restored_leaf", "with_values"]
