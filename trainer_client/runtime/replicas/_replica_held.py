"""What the replica tier holds and reports: a snapshot on its way to the host (``Copy``), a snapshot held
whole (``Snapshot``, its arrays as ``HeldArray``s and its other leaves as ``Value``s), and the answers the tier
gives about them (``Held``, ``ReplicaStats``, ``Restored``).

Why it exists: ``trainer_client.runtime.replicas._replica_tier`` moves these between the training thread, its copy
worker and a restore; the records themselves are plain data, kept here so that the tier's module is its
behaviour alone.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax

from trainer_client.runtime.replicas._replica_leaves import HeldArray

PyTree = Any


class Held(NamedTuple):
    """The step the tier holds whole, the slices its replicas live on, and each replica's slices (a replica
    of the whole state is whole when all of its slices are alive: ``ReplicasHeld.slices`` on the wire)."""

    step: int
    slices: frozenset[int]
    replicas: tuple[frozenset[int], ...] = ()


@dataclass(frozen=True)
class ReplicaStats:
    """The tier's counters: snapshots held, skipped (busy), failed (dropped mid-copy); the held one's bytes
    (this host's) and age (seconds since its dispatch); the last dispatch's blocking time."""

    held_step: int | None
    snapshots: int
    skips: int
    failures: int
    bytes_held: int
    age_s: float | None
    last_dispatch_s: float | None
    memory_kind: str | None = None  # the held snapshot's host memory kind
    staged: bool | None = None  # copies read an on-device copy of the state (None: no snapshot yet)
    last_copy_s: float | None = None  # the last copy's time to the host, from its dispatch


@dataclass(frozen=True)
class Restored:
    """A restore's result: the state on the new layout with what was kept with it, all of ``step``."""

    step: int
    state: PyTree
    data_position: int
    iterator_state: Any


@dataclass
class Snapshot:
    step: int
    treedef: Any
    leaves: list[HeldArray | Value]
    data_position: int
    iterator_state: Any
    taken_at: float
    nbytes: int

    @property
    def arrays(self) -> list[HeldArray]:
        return [leaf for leaf in self.leaves if isinstance(leaf, HeldArray)]


@dataclass(frozen=True)
class Value:
    value: Any  # a leaf that is not a jax.Array: kept as a copy


@dataclass
class Copy:
    """A snapshot on its way to the host: the staged device copies (or the host copies, dispatched directly),
    the leaves' names and key dtypes, and where each non-array leaf sits."""

    step: int
    treedef: Any
    names: list[str]
    key_dtypes: list[Any | None]
    sources: list[jax.Array]  # staged: on-device copies; direct: the host copies already dispatched
    shardings: list[Any]  # the state's arrays' shardings (the host copies go on them)
    staged: bool
    kind: str
    values: list[Value | None]  # per leaf: the kept value, or None for an array (in order of ``sources``)
    data_position: int
    iterator_state: Any
    taken_at: float


def kind_of(snap: Snapshot) -> str | None:
    arrays = snap.arrays
    return str(arrays[0].replicas[0].sharding.memory_kind) if arrays and arrays[0].replicas else None


def copy_value(leaf: HeldArray | Value) -> Any:
    assert isinstance(leaf, Value)
    return copy.deepcopy(leaf.value)


def let_go(snap: Snapshot | None) -> None:
    """Drop a snapshot no longer held, one array at a time: its host memory goes back as each is freed, and
    each free holds the interpreter's lock only for that array (all at once stalled a training step). Only
    when nothing else refers to it: a reader that took it before it was replaced (``held``, ``stats``) keeps it
    whole, and it is freed when that reader lets it go."""
    # the caller's name, the argument and getrefcount's own: nothing else (CPython's reference count)
    if snap is None or sys.getrefcount(snap) > 3:
        return
    while snap.leaves:
        snap.leaves.pop()


__all__ = ["Copy", "Held", "ReplicaStats", "Restored", "Snapshot", "Value", "copy_value", "kind_of", "let_go"]
