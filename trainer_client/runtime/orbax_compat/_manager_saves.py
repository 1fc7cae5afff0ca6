"""What a save of ``trainer_client.CheckpointManager`` carries and where it may go (docs/adopt.md, "Training
metadata and the memory tier").

An Orbax loop tells its manager a step and Orbax's save arguments, never its data position or global batch,
which ckptd's training metadata (``TrainingMetadata``) requires. ``TrainingInfo`` is what the user tells the
manager instead (its ``global_batch=``/``data_position=`` keywords); from it and the state's shardings
``training_for`` makes the metadata the elastic runner records (``trainer_client.checkpoint_io._checkpointer``,
``training_metadata``), or nothing when a value is unknown (its one default, the data position
``step * global_batch``, is an assumption docs/adopt.md states). ``array_item`` finds the
state in Orbax's arguments; ``memory_save`` decides whether the save is one ckptd's host-memory tier can hold
(one array item, optionally Grain's iterator item ``iter``: what ckptd's persist worker writes back as the same
Orbax step) and takes it apart for ``MemoryTier.save``.

``MemoryRoute`` sends a save that fits into the tier through the runner's ``Saver`` (the same routing: a full
tier, or a multi-process job where one host's is, sends it to ``OrbaxWriter``: the user's own Orbax manager,
with the arguments the loop gave) and waits, when asked, until ckptd has committed it on storage.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, SupportsIndex, cast

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from trainer_client.checkpoint_io._checkpointer import training_metadata
from trainer_client.checkpoint_io._state_tree import is_value
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import COMMIT_MARKER, DEFAULT_ITEM, ITER_ITEM
from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.core.protocol import Tier, TrainingMetadata
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._data_iterator import DataIterator, state_record
from trainer_client.runtime.saving._saver import HealthWatch, Saver

_log = logging.getLogger(__name__)
PyTree = Any

ARRAY_ARGS = (ocp.args.StandardSave, ocp.args.PyTreeSave)  # the arguments of an item that holds the state


@dataclass(frozen=True)
class TrainingInfo:
    """What the loop tells the manager about its data: ``global_batch`` samples per step, and where the data
    stands at a step (``data_position(step)``: the global index of the next sample; by default
    ``step * global_batch``, the assumption that the state saved as step N has consumed N steps' samples)."""

    global_batch: int
    data_position: Callable[[int], SupportsIndex] | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch!r}: a step reads at least one sample")

    def position(self, step: int) -> int:
        position = self.data_position(step) if self.data_position is not None else step * self.global_batch
        try:
            index = operator.index(position)  # an int, a numpy integer; never a float rounded
        except TypeError:
            index = -1
        if isinstance(position, bool) or index < 0:
            raise ValueError(f"data_position({step}) gave {position!r}: the global index of the next sample")
        return index


def array_item(args: Any, default_item: bool) -> tuple[str, PyTree] | None:
    """``(item name, state)`` of the one item of ``args`` that holds arrays (``StandardSave``/``PyTreeSave``),
    or None when there is none or more than one. ``default_item``: the manager saves unnamed arguments as
    Orbax's item ``default``."""
    if isinstance(args, ocp.args.Composite):
        found = [(name, value.item) for name, value in args.items() if isinstance(value, ARRAY_ARGS)]
        return found[0] if len(found) == 1 else None
    if default_item and isinstance(args, ARRAY_ARGS):
        return DEFAULT_ITEM, args.item
    return None


def state_mesh(state: PyTree) -> jax.sharding.Mesh | None:
    """The mesh of the state's first array laid out by name (None: no array has a ``NamedSharding``)."""
    for leaf in jax.tree_util.tree_leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh  # type: ignore[return-value]
    return None


def training_for(step: int, state: PyTree, info: TrainingInfo | None) -> TrainingMetadata | None:
    """ckptd's training metadata of ``state`` saved as ``step``, or None without ``info`` or a mesh."""
    if info is None:
        return None
    mesh = state_mesh(state)
    if mesh is None:
        _log.info("step %s: no array of the state is laid out on a mesh (NamedSharding); saved without ckptd's "
                  "training metadata", step)
        return None
    return training_metadata(step, state, data_position=info.position(step), global_batch=info.global_batch,
                             mesh=mesh, slices=[], run_id=info.run_id)


@dataclass(frozen=True)
class MemorySave:
    """A save taken apart for the memory tier: the state, its Orbax item, and the data iterator's state."""

    item: str
    state: PyTree
    data_iterator: DataIteratorRecord | None


def memory_save(args: Any, default_item: bool) -> MemorySave | str:
    """``args`` as the memory tier holds it, or why it cannot: ckptd's persist worker writes back one array item
    with Orbax's standard handler (the values as given: no ``SaveArgs.dtype`` cast) and Grain's item ``iter``."""
    found = array_item(args, default_item)
    if found is None:
        return "no single StandardSave/PyTreeSave item"
    name, state = found
    if name == ITER_ITEM:
        return f"the state's item is named {ITER_ITEM!r}"
    extra = {k: v for k, v in args.items() if k != name} if isinstance(args, ocp.args.Composite) else {}
    if set(extra) - {ITER_ITEM}:
        return f"items other than the state and {ITER_ITEM!r}: {sorted(set(extra) - {ITER_ITEM})}"
    array_args = args[name] if isinstance(args, ocp.args.Composite) else args
    casts = [a for a in jax.tree_util.tree_leaves(getattr(array_args, "save_args", None),
                                                  is_leaf=lambda x: isinstance(x, ocp.SaveArgs))
             if isinstance(a, ocp.SaveArgs) and a.dtype is not None]
    if casts:
        return "SaveArgs(dtype=...) casts the values as they are written"
    for leaf in jax.tree_util.tree_leaves(state):
        if not is_value(leaf) and not isinstance(leaf, jax.Array):
            return f"a leaf of type {type(leaf).__name__} (the tier copies jax arrays from their devices)"
    record = None
    if ITER_ITEM in extra:
        iterator = getattr(extra[ITER_ITEM], "item", None)
        if not callable(getattr(iterator, "get_state", None)):
            return f"the item {ITER_ITEM!r} is not one Grain iterator's save arguments"
        record = state_record(cast(DataIterator, iterator))
    return MemorySave(name, state, record)


class OrbaxWriter:
    """The writer ``Saver`` sends a save to when the memory tier cannot take it: the user's Orbax manager,
    through ``store(step, meta)`` (set for each save by the manager: the loop's own arguments)."""

    def __init__(self, manager: ocp.CheckpointManager) -> None:
        self.manager = manager
        self.item = DEFAULT_ITEM
        self.store: Callable[[int, TrainingMetadata], None] | None = None
        self.last_save_blocked_s: float | None = None

    def is_saving(self) -> bool:
        return bool(self.manager.is_saving_in_progress())

    def save_with_metadata(self, step: int, state: PyTree, meta: TrainingMetadata, *,
                           data_iterator: DataIteratorRecord | None = None,
                           extra: Mapping[str, Any] | None = None) -> None:
        if self.store is None:
            raise RuntimeError("no save to hand to Orbax")
        self.store(step, meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def reset(self) -> None:
        self.manager.wait_until_finished()


class MemoryRoute:
    """A manager's saves into ckptd's host-memory tier of ``job`` (``shm_dir``), routed by the runner's ``Saver``
    (a full tier, or a multi-process job where one host's is: to the user's Orbax ``manager``), and the steps
    saved there until they are seen committed on ``storage``."""

    def __init__(self, manager: ocp.CheckpointManager, shm_dir: str, storage: Storage, job: str,
                 client: CkptdClient | None, settings: ClientSettings) -> None:
        self.manager = manager
        self.storage = storage
        self.job = job
        self.writer = OrbaxWriter(manager)
        self.saver = Saver(self.writer, MemoryTier(shm_dir, job),
                           HealthWatch(client) if client is not None else None, settings=settings)
        self.in_memory: set[int] = set()  # saved to the tier, not yet seen committed on storage

    def save(self, step: int, taken: MemorySave, meta: TrainingMetadata,
             store: Callable[[TrainingMetadata], bool]) -> tuple[str, bool]:
        """``(tier, saved)``: ``step`` into the tier, or through ``store`` when the tier cannot take it."""
        if step in self.manager.all_steps():  # as Orbax refuses a step it has saved
            raise StepAlreadyExistsError(f"Checkpoint for step {step} already exists.")
        stored: list[bool] = []
        self.writer.item = taken.item
        self.writer.store = lambda _, m: stored.append(store(m))
        try:
            tier = self.saver.save(step, taken.state, meta, persist=True, data_iterator=taken.data_iterator)
        finally:
            self.writer.store = None
        if tier == Tier.STORAGE:
            return tier, all(stored)
        self.in_memory.add(step)
        self.manager._add_checkpoint_info(step, None)  # Orbax's own decisions count the step as saved
        return tier, True

    def wait_persisted(self, timeout_s: float) -> None:
        """Until every step saved to the tier is committed on storage (``TimeoutError`` after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.storage.invalidate(self.storage.join(self.job))
            self.in_memory = {step for step in self.in_memory
                              if not self.storage.exists(self.storage.join(self.job, str(step), COMMIT_MARKER))}
            if not self.in_memory:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"steps {sorted(self.in_memory)} of {self.job!r} are still in ckptd's host-memory "
                                   f"tier, not on storage, after {timeout_s:.0f}s: is ckptd serving the directory's "
                                   "parent with the same shm_dir?")
            time.sleep(0.1)

    def close(self) -> None:
        """The tier's spare file goes back (the snapshots are ckptd's)."""
        self.saver.close()


__all__ = ["ARRAY_ARGS", "MemoryRoute", "MemorySave", "OrbaxWriter", "TrainingInfo", "array_item", "memory_save",
           "state_mesh", "training_for"]
