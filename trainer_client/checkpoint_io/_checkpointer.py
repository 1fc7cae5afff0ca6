"""Saving a training state as a step through Orbax, with what a resume plan needs recorded.

Every step is written by a plain ``orbax.checkpoint.CheckpointManager`` in Orbax's own layout (so plain
Orbax can restore it and ckptd can adopt it), asynchronously so the loop is blocked only for the
device-to-host copy. ckptd's training metadata (step, data position, global batch, mesh, slices, each
array's shape/dtype/partition spec, the run's identity) rides in Orbax's ``custom_metadata`` under the key
``ckptd``. The state is the item ``default`` (Orbax's ``StandardCheckpointHandler``); besides arrays it takes
the leaves that are not arrays, Python numbers and numpy scalars as Orbax's standard handler does, and strings
as the PyTree handler inside it does (``_strings.json``; ``trainer_client.checkpoint_io._state_tree``). A data
iterator's state, when the trainer has one, is the item ``iter`` in Grain's format
(``trainer_client.checkpoint_io._iterator_state``).

On a local disk every save asks Orbax for OCDBT data files of about 1/64 of the state (never smaller than the
largest shard, so no chunk is split; Orbax's default is one file of up to 2 GiB), so tensorstore writes and
fsyncs the files in parallel (docs/benchmarks.md). It is Orbax's own option
(``PyTreeSaveArgs.ocdbt_target_data_file_size``; ``trainer_client.checkpoint_io._handlers``); plain Orbax
restores the result as always. On ``gs://`` Orbax's default (400 MiB files) stays.

The trainer runtime saves through this class (restores are ``trainer_client.runtime.saving._checkpointing``'s), and
so does ckptd's persist worker when it writes a memory snapshot to storage. After an elastic event the
manager is replaced, never reused: Orbax's in-memory step cache can keep a failed async save (a known field
failure).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from trainer_client.checkpoint_io._handlers import data_file_bytes, route_data_file_size, standard_handler
from trainer_client.checkpoint_io._iterator_state import ITER_ITEM, IteratorStateHandler, IteratorStateSave
from trainer_client.checkpoint_io._state_tree import is_value, leaf_name
from trainer_client.config import client_settings
from trainer_client.core._durability import sync_tree
from trainer_client.core._errors import StoredFormatError
from trainer_client.core._storage import Storage, join_path
from trainer_client.core._written_crc import ClosedFileSums
from trainer_client.core.format._files import CKPTD_MANIFEST, COMMIT_MARKER, DEFAULT_ITEM, TMP_DIR_SUFFIX
from trainer_client.core.format._manifest import build_manifest, write_manifest
from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.core.format._steps import CUSTOM_METADATA_KEY
from trainer_client.core.protocol import ArraySpec, BatchPlan, MeshSpec, PartitionSpecJSON, TrainingMetadata

_log = logging.getLogger(__name__)
MAX_MARKER_BYTES = 64 * 1024  # Orbax's marker is a line naming the step; read whole in one request

PyTree = Any


def spec_to_json(spec: PartitionSpec) -> PartitionSpecJSON:
    out: PartitionSpecJSON = []
    for entry in spec:
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            out.append(entry)
        else:
            out.append([str(a) for a in entry])
    return out


def spec_from_json(spec: PartitionSpecJSON) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in spec])


def mesh_spec(mesh: Mesh) -> MeshSpec:
    return MeshSpec(axis_names=[str(a) for a in mesh.axis_names], shape=[int(s) for s in mesh.devices.shape])


def array_specs(state: PyTree) -> dict[str, ArraySpec]:
    """Shape, dtype and partition spec of every leaf Orbax stores as an array, keyed by dotted leaf path:
    arrays, and numbers (0-d arrays of Orbax's scalar types: ``int64``, ``float64``, ``bool``, or the numpy
    scalar's own); strings are not arrays (Orbax keeps them in ``_strings.json``)."""
    out: dict[str, ArraySpec] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, str):
            continue
        sharding = getattr(leaf, "sharding", None)
        spec = spec_to_json(sharding.spec) if isinstance(sharding, NamedSharding) else []
        out[leaf_name(path)] = ArraySpec(
            shape=[int(d) for d in getattr(leaf, "shape", ())],
            dtype=str(getattr(leaf, "dtype", "")) or (str(np.asarray(leaf).dtype) if is_value(leaf) else None),
            partition_spec=spec,
        )
    return out


def training_metadata(
    step: int,
    state: PyTree,
    *,
    data_position: int,
    global_batch: int,
    mesh: Mesh,
    slices: list[int],
    batch: BatchPlan | None = None,
    run_id: str | None = None,
) -> TrainingMetadata:
    """What a resume plan needs to know about ``state`` saved as ``step`` on ``mesh``, with the run's identity
    (``run_id``, by default ``CKPTD_RUN_ID``; the process count: docs/protocol.md, Identity)."""
    return TrainingMetadata(
        step=step, data_position=data_position, global_batch=global_batch, mesh=mesh_spec(mesh), slices=slices,
        wall_time=time.time(), arrays=array_specs(state), batch=batch,
        run_id=run_id if run_id is not None else client_settings().run_id, process_count=jax.process_count(),
    )


class Checkpointer:
    """One job directory's Orbax manager, async saves with ckptd metadata, restores by plan."""

    def __init__(
        self, directory: str, *, async_save: bool = True, atomicity: str | None = None, compression: bool = False,
        item: str = DEFAULT_ITEM, run_id: str | None = None,
    ) -> None:
        """``atomicity``: None (Orbax's default for the storage: rename on local disk, commit file on
        ``gs://``), ``"commit_file"`` or ``"atomic_rename"``; ckptd's commit rule is right for all.
        ``compression``: Orbax's zstd on the array chunks. Off by default: it makes saving CPU-bound and
        trained weights barely compress (docs/benchmarks.md).
        ``item``: the Orbax item the state is saved as (``default``; MaxText's steps call it ``items``).
        ``run_id``: the run's identity recorded with every ``save`` (docs/protocol.md, Identity); by default
        ``CKPTD_RUN_ID``, as this process read it (``client_settings()``)."""
        if item == ITER_ITEM or not item.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{item!r} cannot name the state's item")
        self.item = item
        self.run_id = run_id if run_id is not None else client_settings().run_id
        self.directory = directory
        self.async_save = async_save
        self.atomicity = atomicity
        self.compression = compression
        self._storage = Storage(directory)
        self._pending: TrainingMetadata | None = None
        self._verify: Callable[[], None] | None = None  # of the save in flight: checked before its commit
        # the save in flight's data files summed as they are closed (local disk, the process that manifests)
        self._sums: ClosedFileSums | None = None
        self._data_file_size: int | None = None  # of the save being started; None: Orbax's default
        self._manager = self._new_manager()
        self.saved_steps: list[int] = []
        self.last_save_blocked_s: float | None = None

    def _new_manager(self) -> ocp.CheckpointManager:
        remote = self._storage.is_remote
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self.async_save,
            # An object store has no directory to make (Orbax's root check and its barrier are skipped), and the
            # job's steps are listed without reading each one's metadata: ckptd uses no Orbax retention, metrics
            # or timestamps, and the persist worker opens a Checkpointer per snapshot (docs/gcs.md, Requests).
            create=not remote,
            lightweight_initialize=remote,
            # Orbax's check of the step before its tmp path's create, which checks (and clears) the same place
            file_options=ocp.options.FileOptions(skip_sync_file_validations=self._commits_in_place()),
            max_to_keep=None,  # retention is ckptd's job: it never deletes the newest good step
            atomicity_options=(
                ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode(self.atomicity))
                if self.atomicity else None
            ),
            async_options=ocp.options.AsyncOptions(post_finalization_callback=self._before_commit)
            if self.async_save else None,
        )
        handler = standard_handler(self.compression)
        if not self._storage.is_remote:
            route_data_file_size(handler, lambda: self._data_file_size)
        handlers = {self.item: handler, ITER_ITEM: IteratorStateHandler()}
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        data_position: int,
        global_batch: int,
        mesh: Mesh,
        slices: list[int],
        batch: BatchPlan | None = None,
        extra: Mapping[str, Any] | None = None,
        data_iterator: DataIteratorRecord | None = None,
    ) -> None:
        """Start saving ``state`` as ``step``; returns once the device-to-host copy is done."""
        meta = training_metadata(step, state, data_position=data_position, global_batch=global_batch, mesh=mesh,
                                 slices=slices, batch=batch, run_id=self.run_id)
        self.save_with_metadata(step, state, meta, extra=extra, data_iterator=data_iterator)

    def save_with_metadata(
        self, step: int, state: PyTree, meta: TrainingMetadata, *, extra: Mapping[str, Any] | None = None,
        data_iterator: DataIteratorRecord | None = None, verify: Callable[[], None] | None = None,
    ) -> None:
        """Save with training metadata given as is (ckptd's persister: the layout the trainer had, not the
        host arrays it is handed); with ``data_iterator`` (its state at this step) the item ``iter`` too.

        ``verify``: called once every file is written and before the manifest and the commit (in Orbax's
        background thread for an asynchronous save, before anything is written for a synchronous one); if it
        raises, the step is never committed and ``wait`` raises. The persist worker checks the snapshot's
        bytes there, beside the write instead of before it."""
        custom = {CUSTOM_METADATA_KEY: meta.model_dump(mode="json"), **dict(extra or {})}
        started = time.perf_counter()
        self._manager.wait_until_finished()  # one save in flight: the callback below knows its step
        if verify is not None and not self.async_save:  # no callback before a synchronous save's commit
            verify()
            verify = None
        self._pending = meta
        self._verify = verify
        self._data_file_size = None if self._storage.is_remote else data_file_bytes(state)
        items: dict[str, Any] = {self.item: ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items[ITER_ITEM] = IteratorStateSave(data_iterator)
        self._drop_sums()  # a watch a failed save never handed to its commit
        if not self._storage.is_remote and jax.process_index() == 0:  # the manifest's pass, beside the write
            self._sums = ClosedFileSums(self._storage.root, existing_dirs=False)  # the new step's dirs only
        try:
            if self._committed_on_storage(step):
                raise StepAlreadyExistsError(f"step {step} is committed on storage")
            self._manager.save(step, args=ocp.args.Composite(**items), custom_metadata=custom, force=True)
        except StepAlreadyExistsError:
            # A committed step of this number is already on storage (saved before an elastic event took the
            # job back to an older step). It is a consistent state of this run: keep it, never overwrite.
            _log.warning("step %s is already on storage; not saving it again", step)
            self._pending = self._verify = None
            self._drop_sums()
            return
        except BaseException:
            self._drop_sums()
            raise
        if not self.async_save:
            self._before_commit_fallback(step)
            self._drop_sums()  # a committed step that had its manifest already took none
        self.last_save_blocked_s = time.perf_counter() - started
        self.saved_steps.append(step)

    def _committed_on_storage(self, step: int) -> bool:
        """Whether ``<step>/commit_success.txt`` is on storage now (one read; on ``gs://`` one ranged GET). Orbax's
        manager knows only the steps it listed when it was opened and saved since; for any other step its save
        first removes whatever stands at the step's name (the commit-file path's create, or ``force``), so a step
        another process committed meanwhile (a dead incarnation's late save, another persist of the same
        snapshot) would be deleted and written again in place (docs/gcs.md, "Fencing on gs://")."""
        marker = join_path(self._storage.join(str(step)), COMMIT_MARKER)
        try:
            self._storage.read_bytes(marker, max_bytes=MAX_MARKER_BYTES)
        except FileNotFoundError:
            return False
        except (ValueError, StoredFormatError):  # something stands there, too large or not a file: not ours to clear
            pass
        return True

    def _commits_in_place(self) -> bool:
        """Orbax writes the step where it stays and commits it with ``commit_success.txt`` (its default on
        an object store): there is no ``<step>.orbax-checkpoint-tmp``."""
        return self._storage.is_remote and self.atomicity in (None, "commit_file")

    def _step_dir_before_commit(self, step: int) -> str:
        if self._commits_in_place():  # no tmp directory to look for (3 requests fewer per GCS save)
            return self._storage.join(str(step))
        tmp = self._storage.join(f"{step}{TMP_DIR_SUFFIX}")
        return tmp if self._storage.exists(tmp) else self._storage.join(str(step))

    def _before_commit(self) -> None:
        """Orbax's post-finalization callback: every file is written, the commit marker is not.

        Writes ckptd's manifest into the step and, on a local disk, fsyncs every file and directory of
        it, so the commit that follows covers the manifest and reaches stable storage. Orbax runs this
        callback in every process of a multi-process job, after its barrier; only the primary process (0,
        the one that commits) writes the manifest: several writers raced on one file, and each one's
        listing could miss files another had not finished. A save's ``verify`` runs first: if it raises, the
        step stays uncommitted. The data files already summed as they were closed (``written_crc``) are not
        read again for the manifest."""
        sums, self._sums = self._sums, None
        try:
            verify, self._verify = self._verify, None
            if verify is not None:
                verify()
            meta = self._pending
            if meta is None or jax.process_index() != 0:
                return
            step_path = self._step_dir_before_commit(meta.step)
            manifest = build_manifest(
                self._storage, step_path, step=meta.step, writer="trainer_client", arrays=meta.arrays, training=meta,
                known=sums.entries(step_path) if sums is not None else None,
            )
            write_manifest(self._storage, step_path, manifest)
            if not self._storage.is_remote:
                sync_tree(step_path)
        finally:
            if sums is not None:
                sums.shutdown()

    def _drop_sums(self) -> None:
        sums, self._sums = self._sums, None
        if sums is not None:
            sums.shutdown()

    def _before_commit_fallback(self, step: int) -> None:
        """Synchronous saves have no callback: manifest the committed step right after it."""
        step_path = self._storage.join(str(step))
        if not self._storage.exists(join_path(step_path, CKPTD_MANIFEST)) and self._pending is not None:
            self._before_commit()

    def is_saving(self) -> bool:
        """True while an asynchronous save is still being written (a new save would wait for it)."""
        return bool(self._manager.is_saving_in_progress())

    def wait(self) -> None:
        """Block until every started save is finalized on storage."""
        self._manager.wait_until_finished()

    def reset(self) -> None:
        """Drop the manager (after an elastic event) and start a fresh one.

        A pending save is given the chance to finish; if it fails, the step stays uncommitted on storage
        and ckptd will never name it — the fresh manager does not inherit the old one's step cache.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as exc:
            _log.warning("pending checkpoint save failed during an elastic event: %s", exc)
        try:
            self._manager.close()
        except Exception as exc:
            _log.warning("closing the checkpoint manager failed: %s", exc)
        self._drop_sums()
        self._manager = self._new_manager()

    def close(self) -> None:
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        finally:
            self._drop_sums()


__all__ = [
    "Checkpointer",
    "array_specs",
    "mesh_spec",
    "spec_from_json",
    "spec_to_json",
    "training_metadata",
]
