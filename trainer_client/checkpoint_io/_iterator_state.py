"""A data iterator's state in a step, as Grain checkpoints it: the Orbax item ``iter`` and its handler.

Grain's Orbax handler (``grain.checkpoint.CheckpointHandler``, ``grain.python.PyGrainCheckpointHandler``;
MaxText's ``GrainCheckpointHandler`` subclasses it) writes one process's iterator state into the step's item
``iter`` as ``process_<index>-of-<count>.json`` (``json.dumps(state, indent=4)``), so MaxText's steps are
``<step>/items`` + ``<step>/iter``. ckptd writes the same files through ``IteratorStateHandler``, from a state
recorded as data at the step boundary (``DataIteratorRecord``: nothing is ever pickled), both when the trainer
saves and when ckptd's persist worker writes a memory snapshot to storage; reading goes through
``read_step_state`` (untrusted input: bounded, JSON only). Taking the state from a live iterator and giving
it back is the trainer runtime's part (``trainer_client.runtime.saving._data_iterator``).

The step's ``_CHECKPOINT_METADATA`` names the handler of each item by the handler's Orbax type string; this
one's is the fixed ``ITER_HANDLER_TYPESTR`` (``ckptd.IteratorStateHandler``), which no module move changes.
Release 0.1.0 recorded the module path of its class instead (``LEGACY_ITER_HANDLER_TYPESTRS``): that name is
registered with Orbax too, so plain Orbax restoring such a step without arguments finds this handler.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import orbax.checkpoint as ocp
from etils import epath

from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import ITER_ITEM
from trainer_client.core.format._files import ITER_SHARED_FILE as SHARED_FILE
from trainer_client.core.format._snapshot import DataIteratorRecord

MAX_STATE_BYTES = 16 << 20  # one process's iterator state: a bigger file is refused, not read
ITER_HANDLER_TYPESTR = "ckptd.IteratorStateHandler"  # what a step records as the handler of ``iter``
LEGACY_ITER_HANDLER_TYPESTRS = ("trainer_client.runtime.data_iterator.IteratorStateHandler",)  # release 0.1.0


def process_file(process_index: int, process_count: int) -> str:
    """The file Grain's handler writes for one process: ``process_<index>-of-<count>.json``."""
    return f"process_{process_index}-of-{process_count}.json"


def state_text(state: object) -> str:
    """The file's text, as Grain's handler writes it (``json.dumps(state, indent=4)``)."""
    return json.dumps(state, indent=4)


@dataclasses.dataclass
class IteratorStateSave(ocp.args.CheckpointArgs):
    """Save ``record`` (one process's iterator state) as Grain's handler would."""

    record: DataIteratorRecord


@dataclasses.dataclass
class IteratorStateRestore(ocp.args.CheckpointArgs):
    """Read this process's iterator state back (a ``DataIteratorRecord``)."""


class IteratorStateHandler(ocp.CheckpointHandler):
    """Orbax's handler of the item ``iter``: Grain's file format, from a state recorded as data.

    Grain's own handler takes the live iterator and calls ``get_state()`` while Orbax saves; ckptd takes
    the state at the step boundary instead, because a memory snapshot is persisted later by another process
    (ckptd's persist worker) that has no iterator, and both paths must write the same item. The file is the
    one Grain writes, for the process the state belongs to; Grain's handler restores it."""

    @classmethod
    def typestr(cls) -> str:
        return ITER_HANDLER_TYPESTR

    def save(self, directory: epath.Path, args: IteratorStateSave) -> None:
        record = args.record
        (directory / process_file(record.process_index, record.process_count)).write_text(state_text(record.state))

    def restore(self, directory: epath.Path, args: IteratorStateRestore | None = None) -> DataIteratorRecord:
        del args
        record = read_step_state(str(directory), jax.process_index(), jax.process_count())
        if record is None:
            raise FileNotFoundError(f"{directory}: no iterator state for process {jax.process_index()}")
        return record

    def metadata(self, directory: epath.Path) -> None:
        del directory
        return None


ocp.args.register_with_handler(IteratorStateHandler, for_save=True)(IteratorStateSave)
ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)(IteratorStateRestore)


def _register_legacy(typestr: str) -> None:
    """Make Orbax's registry resolve ``typestr`` (an older name of the handler) to this handler: it keys handler
    classes by their type string and pairs each class with its own argument classes, so the old name gets a
    subclass that answers to it, with argument subclasses of its own."""
    legacy = type("LegacyIteratorStateHandler", (IteratorStateHandler,), {"typestr": classmethod(lambda cls: typestr)})
    save: type[IteratorStateSave] = dataclasses.dataclass(type("LegacyIteratorStateSave", (IteratorStateSave,), {}))
    restore: type[IteratorStateRestore] = dataclasses.dataclass(
        type("LegacyIteratorStateRestore", (IteratorStateRestore,), {}))
    ocp.args.register_with_handler(legacy, for_save=True)(save)
    ocp.args.register_with_handler(legacy, for_restore=True)(restore)


for _typestr in LEGACY_ITER_HANDLER_TYPESTRS:
    _register_legacy(_typestr)


def read_step_state(item_path: str, process_index: int, process_count: int) -> DataIteratorRecord | None:
    """This process's state in an ``iter`` item (``process_<index>-of-<count>.json``, else MaxText's shared
    ``process_0.json``); None when the item has neither. Read as untrusted: at most ``MAX_STATE_BYTES``,
    JSON only (``ValueError`` otherwise)."""
    storage = Storage(item_path)
    for name in (process_file(process_index, process_count), SHARED_FILE):
        path = join_path(storage.root, name)
        if not storage.exists(path):
            continue
        raw = storage.read_bytes(path)
        if len(raw) > MAX_STATE_BYTES:
            raise ValueError(f"{storage.url_of(path)}: {len(raw)} bytes of iterator state (at most {MAX_STATE_BYTES})")
        try:
            state = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{storage.url_of(path)} is not JSON: {exc}") from exc
        return DataIteratorRecord(process_index=process_index, process_count=process_count, state=state)
    return None


__all__ = [
    "ITER_HANDLER_TYPESTR",
    "ITER_ITEM",
    "LEGACY_ITER_HANDLER_TYPESTRS",
    "MAX_STATE_BYTES",
    "SHARED_FILE",
    "IteratorStateHandler",
    "IteratorStateRestore",
    "IteratorStateSave",
    "process_file",
    "read_step_state",
    "state_text",
]
