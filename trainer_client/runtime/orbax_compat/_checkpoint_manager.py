"""``trainer_client.CheckpointManager``: Orbax's ``CheckpointManager``, backed by ckptd (docs/adopt.md, "Plain Orbax").

A training loop written against ``orbax.checkpoint.CheckpointManager`` runs unchanged with the import swapped.
The writing is Orbax's own: every call is handed to a real ``orbax.checkpoint.CheckpointManager`` over the same
directory, so the steps are Orbax's layout and plain Orbax restores them. What ckptd adds:

- ``latest_step()`` and ``all_steps()`` name only good steps (``trainer_client.runtime.elastic._good_steps``): never a
  step without its commit marker, never one whose files no longer match its manifest; ckptd's answer when a
  client is given and ckptd answers, the same rule from storage when not. ``restore(None)`` restores the
  newest good step, and Orbax's manager is handed the same listing, so its save decisions never count a bad
  step;
- every save writes ckptd's manifest (every file's size and CRC32C) in Orbax's post-finalization callback,
  before the commit marker, as ``trainer_client.checkpoint_io._checkpointer`` does for the elastic runner
  (docs/architecture.md, "Data flow of a save"), through the same writer (``core.format._manifest``);
- Orbax's retention options (``max_to_keep``, ``keep_period``, ``keep_time_interval``, ``best_fn``,
  ``preservation_policy``) are Orbax's own policy applied over good steps only, never to the newest good step
  (``trainer_client.runtime.orbax_compat._manager_retention``); options that would name steps outside ckptd's commit
  rule
  are refused with the reason (``unsupported_options``). Every other field of Orbax's options is honoured by
  Orbax (``HONOURED``; a test checks that each field is in one table).

ckptd's training metadata (data position, global batch, mesh, arrays, run id) needs what an Orbax loop never
tells its manager: told ``global_batch=`` (and optionally ``data_position=``), every save records it where the
elastic runner does (the step's custom metadata and manifest: ``trainer_client.runtime.orbax_compat._manager_saves``),
and a
save the host-memory tier can hold goes there when one is configured (``ClientSettings.shm_dir``): the loop
pays the device-to-host copy and ckptd persists the step in Orbax's layout, routed as the runner routes
(``trainer_client.runtime.saving._saver``); ``wait_until_finished`` waits until ckptd has. Without ``global_batch=``
saves go to storage through Orbax with no training metadata (a configured tier is named in a warning), as
they do when the tier is full or the save holds more than it can (docs/adopt.md, "Training metadata and the
memory tier").

The job is the directory's last name under the root ckptd serves: ``<root>/<job>`` (MaxText's
``<base>/<run>/checkpoints``: ``ckptd serve --root <base>/<run>``, job ``checkpoints``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, SupportsIndex

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import args as args_lib
from orbax.checkpoint._src.path import atomicity
from orbax.checkpoint._src.path import step as step_lib
from orbax.checkpoint.abstract_checkpoint_manager import AbstractCheckpointManager

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._event_reporter import EventReporter
from trainer_client.config import client_settings
from trainer_client.core._durability import sync_tree
from trainer_client.core._storage import join_path
from trainer_client.core.format._files import CKPTD_MANIFEST, TMP_DIR_SUFFIX
from trainer_client.core.format._manifest import build_manifest, write_manifest
from trainer_client.core.format._steps import CUSTOM_METADATA_KEY, DEFAULT_SAVE_TIMEOUT_S
from trainer_client.core.protocol import Tier, TrainingMetadata
from trainer_client.runtime.elastic._good_steps import GoodSteps, GoodStepsOnly
from trainer_client.runtime.orbax_compat._manager_retention import (
    ManagerRetention,
    conflicts,
    orbax_policy,
    without_retention,
)
from trainer_client.runtime.orbax_compat._manager_saves import (
    MemoryRoute,
    MemorySave,
    TrainingInfo,
    array_item,
    memory_save,
    training_for,
)
from trainer_client.runtime.saving._step_aside import clear_for_save

_log = logging.getLogger(__name__)

_NAMING = "ckptd's commit rule reads Orbax's default step names (a plain integer directory per step)"


_TMP_LAYOUT = "ckptd's manifest and commit rule know Orbax's two standard layouts of a step being written " \
    "(AtomicRenameTemporaryPath, CommitFileTemporaryPath: choose with atomicity_options)"
_PRIMARY = "ckptd's manifest is written by process 0, before the commit Orbax's primary host makes: the primary " \
    "host must be process 0"
_COMMIT_RULE = "which steps count is ckptd's commit rule (a step without commit_success.txt is never named)"

# Every field of Orbax's CheckpointManagerOptions (0.12.8) is in one of these two tables; a test fails on a field
# Orbax adds, so a new option is judged here before it can be ignored.
HONOURED: frozenset[str] = frozenset({
    # Orbax's own, unchanged: when to save, how to write, what to read
    "save_interval_steps", "save_on_steps", "should_save_fn", "save_decision_policy",
    "enable_should_save_is_saving_in_progress_check", "enable_async_checkpointing", "async_options",
    "file_options", "create", "read_only", "save_root_metadata", "prevent_write_metrics",
    "lightweight_initialize", "single_host_load_and_broadcast",
    # Orbax's deletions: an explicit delete(step), and its retention (Orbax's own policy, applied by
    # ``_manager_retention`` over good steps, never to the newest good step)
    "todelete_subdir", "todelete_full_path", "enable_background_delete", "num_deletion_threads",
    "max_to_keep", "keep_time_interval", "keep_period", "preservation_policy",
    "best_fn", "best_mode", "keep_checkpoints_without_metrics",
    # honoured but for the values ``unsupported_options`` names: a custom temporary path class, a primary host
    # other than process 0, Orbax's reading of legacy steps without their commit marker
    "temporary_path_class", "multiprocessing_options", "atomicity_options",
})
REFUSED: dict[str, tuple[Any, str]] = {  # option: (the only value taken, why another is refused)
    "should_keep_fn": (None, "not an option of Orbax 0.12.8, whose retention ckptd maps (docs/adopt.md, "
                             "\"Retention\"): pass preservation_policy=CustomSteps(...) or another of its policies"),
    "cleanup_tmp_directories": (False, "it deletes every unfinished step, also one another process is still "
                                       "writing; ckptd cleans abandoned saves after its save timeout"),
    "step_prefix": (None, _NAMING),
    "step_format_fixed_length": (None, _NAMING),
    "step_name_format": (None, _NAMING),
    "enable_per_process_directory_creation": (False, _PRIMARY + " (Orbax needs primary_host=None for it)"),
}


def unsupported_options(options: ocp.CheckpointManagerOptions) -> list[str]:
    """Why each option set in ``options`` cannot be honoured (empty: all can)."""
    out = []
    for name, (default, why) in REFUSED.items():
        value = getattr(options, name, default)
        if value != default:
            out.append(f"CheckpointManagerOptions({name}={value!r}) is not supported: {why}")
    standard_tmp = (None, atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath)
    if options.temporary_path_class not in standard_tmp:
        out.append(f"CheckpointManagerOptions(temporary_path_class={options.temporary_path_class!r}) is not "
                   f"supported: {_TMP_LAYOUT}")
    multiprocessing = options.multiprocessing_options
    if multiprocessing.primary_host != 0:
        out.append(f"CheckpointManagerOptions(multiprocessing_options=MultiprocessingOptions(primary_host="
                   f"{multiprocessing.primary_host!r})) is not supported: {_PRIMARY}")
    if multiprocessing.active_processes is not None and 0 not in multiprocessing.active_processes:
        out.append(f"CheckpointManagerOptions(multiprocessing_options=MultiprocessingOptions(active_processes="
                   f"{multiprocessing.active_processes!r})) is not supported: {_PRIMARY}")
    atomicity_options = options.atomicity_options
    if atomicity_options is not None and atomicity_options.allow_legacy_atomic_rename:
        out.append("CheckpointManagerOptions(atomicity_options=AtomicityOptions(allow_legacy_atomic_rename=True)) "
                   f"is not supported: {_COMMIT_RULE}")
    return out + conflicts(options)


class CheckpointManager(AbstractCheckpointManager):
    """Orbax's ``CheckpointManager`` whose steps ckptd keeps honest: same constructor, same calls."""

    def __init__(
        self,
        directory: epath.PathLike,
        checkpointers: Any = None,
        options: ocp.CheckpointManagerOptions | None = None,
        metadata: Mapping[str, Any] | None = None,
        item_names: Sequence[str] | None = None,
        item_handlers: Any = None,
        logger: Any = None,
        handler_registry: Any = None,
        *,
        ckptd: CkptdClient | None = None,
        global_batch: int | None = None,
        data_position: Callable[[int], SupportsIndex] | None = None,
        persist_timeout_s: float = 600.0,
        save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
    ) -> None:
        """As ``orbax.checkpoint.CheckpointManager`` (``item_names``, ``item_handlers``, ``options``,
        ``metadata``, ``logger``, ``handler_registry``). ``ckptd``: the client of the ckptd serving the root
        (the directory's parent); without one, a client of ``CKPTD_URL`` when that is set, and none otherwise:
        good steps are then judged from storage. With a client every save is reported to ckptd as a
        ``checkpoint_started`` event (in the background; ``CKPTD_REPORT_EVENTS=false``: not). Raises
        ``ValueError`` for an option ckptd cannot honour (``unsupported_options``) and for Orbax's legacy
        ``checkpointers``.

        ``global_batch``: the samples of one step; with it every save records ckptd's training metadata, at the
        data position ``data_position(step)`` (by default ``step * global_batch``), and goes to the host-memory
        tier when ``ClientSettings.shm_dir`` names one and the save fits it. ``persist_timeout_s``: how long
        ``wait_until_finished`` waits for ckptd to persist this manager's memory-tier saves. ``save_timeout_s``: an
        uncommitted step written more recently holds its number (another writer may still be saving it: a save of
        that step raises Orbax's ``StepAlreadyExistsError`` saying so); an older one, or a quarantined one, is
        moved aside before the save (``trainer_client.runtime.saving._step_aside``)."""
        if checkpointers is not None:
            raise ValueError("CheckpointManager(checkpointers=...) is Orbax's legacy API and is not supported: "
                             "pass item_names=/item_handlers= and save with args=")
        options = options or ocp.CheckpointManagerOptions()
        problems = unsupported_options(options)
        if problems:
            raise ValueError("; ".join(problems))
        self._own_client: CkptdClient | None = None
        settings = ckptd.settings if ckptd is not None else client_settings()
        if ckptd is None and "url" in settings.model_fields_set:  # CKPTD_URL: the sidecar beside this trainer
            ckptd = self._own_client = CkptdClient(settings)
        if data_position is not None and global_batch is None:
            raise ValueError("data_position= needs global_batch=: ckptd's training metadata records both")
        self._training = None if global_batch is None else TrainingInfo(global_batch, data_position, settings.run_id)
        if settings.shm_dir is not None and self._training is None:
            _log.warning("ckptd's host-memory tier (%s) is not used by trainer_client.CheckpointManager without "
                         "global_batch=: its saves go to storage through Orbax (docs/adopt.md, \"Training metadata "
                         "and the memory tier\")", settings.shm_dir)
        self._good = GoodSteps(str(directory), ckptd)
        self._reporter = (EventReporter(ckptd.settings, self._good.job)
                          if ckptd is not None and ckptd.settings.report_events else None)
        self._storage = self._good.storage
        self._async = options.enable_async_checkpointing
        self._pending: tuple[int, TrainingMetadata | None] | None = None  # the save in flight: its manifest is
        # written before its commit
        self._default_item = item_names is None and not isinstance(item_handlers, Mapping)  # unnamed args: "default"
        self._persist_timeout_s = persist_timeout_s
        self._save_timeout_s = save_timeout_s
        self._read_only = options.read_only
        async_options = options.async_options
        self._user_callback = async_options.post_finalization_callback if async_options else None
        if self._async:  # Orbax refuses the callback without its asynchronous checkpointer
            async_options = dataclasses.replace(async_options or ocp.options.AsyncOptions(),
                                                post_finalization_callback=self._before_commit)
        names = step_lib.standard_name_format(
            single_host_load_and_broadcast=options.single_host_load_and_broadcast,
            temporary_path_cls=options.temporary_path_class, atomicity_options=options.atomicity_options,
        )
        delegated = dataclasses.replace(
            without_retention(options),
            async_options=async_options,
            step_name_format=GoodStepsOnly(names, self._good.all),
        )
        self._manager = ocp.CheckpointManager(
            directory, options=delegated, metadata=metadata, item_names=item_names, item_handlers=item_handlers,
            logger=logger, handler_registry=handler_registry,
        )
        self._best = (options.best_fn, options.best_mode)
        self._retention = ManagerRetention(self._manager, orbax_policy(options), options, self._good.all)
        self._memory = (MemoryRoute(self._manager, settings.shm_dir, self._storage, self._good.job, ckptd, settings)
                        if settings.shm_dir is not None and self._training is not None else None)

    # ---- what ckptd changes ----------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest good step on storage (a save still in flight is named once it is committed)."""
        return self._good.latest()

    def best_step(self) -> int | None:
        """Orbax's answer over good steps: with ``best_fn``, the best good step with metrics; else the latest."""
        best_fn, mode = self._best
        if best_fn is None:
            return self.latest_step()
        return self._retention.best(self._good.all(), best_fn, mode)

    def all_steps(self, read: bool = False) -> Sequence[int]:
        """Every good step, oldest first (always read: ckptd or storage is asked each time)."""
        return self._good.all()

    def save(self, step: int, items: Any = None, save_kwargs: Any = None, metrics: Any = None,
             force: bool | None = False, args: args_lib.CheckpointArgs | None = None,
             custom_metadata: dict[str, Any] | None = None) -> bool:
        """Orbax's ``save`` (same arguments, same decision); the step gets ckptd's manifest before its commit, and
        with ``global_batch=`` ckptd's training metadata; to the memory tier when it can take the save."""
        if not force and not self._manager.should_save(step):
            return False
        self._retention.apply()  # what the saves before this one left (committed by now, or judged next time)
        if not self._read_only:
            in_the_way = clear_for_save(self._storage, self._good.job, step, good=self._good.all,
                                        save_timeout_s=self._save_timeout_s, mover=jax.process_index() == 0)
            if in_the_way:
                self._good.renew(step)
        started = time.perf_counter()
        found = array_item(args, self._default_item) if items is None else None
        meta = training_for(step, found[1], self._training) if found is not None else None
        store = functools.partial(self._to_storage, step, items, save_kwargs, metrics, force, args, custom_metadata)
        taken = memory_save(args, self._default_item) if self._memory is not None and meta is not None else None
        if isinstance(taken, MemorySave) and metrics is None and not custom_metadata:  # what the tier carries
            assert self._memory is not None and meta is not None
            tier, saved = self._memory.save(step, taken, meta, store)
        else:
            if self._memory is not None and meta is not None:
                _log.info("step %s goes to storage, not the memory tier: %s", step,
                          taken if isinstance(taken, str) else "Orbax's metrics or custom metadata are given")
            tier, saved = Tier.STORAGE, store(meta)
        self._retention.due |= saved
        if saved and self._reporter is not None:
            blocked = time.perf_counter() - started
            self._reporter.report("checkpoint_started", time=time.time(), step=step, tier=tier,
                                  blocked_seconds=blocked, detail=f"{tier}, {blocked:.3f}s blocked")
        return saved

    def _to_storage(self, step: int, items: Any, save_kwargs: Any, metrics: Any, force: bool | None,
                    args: args_lib.CheckpointArgs | None, custom_metadata: dict[str, Any] | None,
                    meta: TrainingMetadata | None) -> bool:
        """The save through Orbax, with ``meta`` in the step's custom metadata (key ``ckptd``) and manifest."""
        self._manager.wait_until_finished()  # one save in flight: the callback below knows its step
        self._pending = (step, meta)
        if meta is not None:
            custom_metadata = {**(custom_metadata or {}), CUSTOM_METADATA_KEY: meta.model_dump(mode="json")}
        saved = bool(self._manager.save(step, items, save_kwargs=save_kwargs, metrics=metrics, force=force,
                                        args=args, custom_metadata=custom_metadata))
        if saved and not self._async:  # no callback before a synchronous save's commit: manifest it now
            self._manifest(step, meta, committed=True)
        return saved

    def restore(self, step: int | None, items: Any = None, restore_kwargs: Any = None,
                directory: epath.PathLike | None = None, args: args_lib.CheckpointArgs | None = None) -> Any:
        """Orbax's ``restore``; ``step=None`` restores the newest good step."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no good step in {self.directory}")
        return self._manager.restore(step, items, restore_kwargs=restore_kwargs, directory=directory, args=args)

    def reload(self) -> None:
        self._manager.reload()

    # ---- the manifest ------------------------------------------------------------------------------

    def _before_commit(self) -> None:
        """Orbax's post-finalization callback: every file of the step is written, its commit marker is not."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._manifest(*pending, committed=False)
        if self._user_callback is not None:
            self._user_callback()

    def _manifest(self, step: int, meta: TrainingMetadata | None, *, committed: bool) -> None:
        """ckptd's manifest of ``step`` (process 0 only, as Orbax's commit), fsynced with the step on a local disk."""
        if jax.process_index() != 0:
            return
        step_path = self._storage.join(self._good.job, str(step))
        tmp = step_path + TMP_DIR_SUFFIX
        if not committed and self._storage.exists(tmp):
            step_path = tmp
        if committed and self._storage.exists(join_path(step_path, CKPTD_MANIFEST)):
            return
        manifest = build_manifest(self._storage, step_path, step=step, writer="trainer_client",
                                  arrays=meta.arrays if meta is not None else None, training=meta)
        write_manifest(self._storage, step_path, manifest)
        if not self._storage.is_remote:
            sync_tree(step_path)

    # ---- Orbax's, unchanged ------------------------------------------------------------------------

    @property
    def directory(self) -> epath.Path:
        return self._manager.directory

    def reached_preemption(self, step: int) -> bool:
        return bool(self._manager.reached_preemption(step))

    def should_save(self, step: int) -> bool:
        return bool(self._manager.should_save(step))

    def delete(self, step: int) -> None:
        self._manager.delete(step)

    def item_metadata(self, step: int) -> Any:
        return self._manager.item_metadata(step)

    def metadata(self, step: int | None = None) -> Any:
        return self._manager.metadata(step)

    def metrics(self, step: int) -> Any:
        return self._manager.metrics(step)

    def is_saving_in_progress(self) -> bool:
        return bool(self._manager.is_saving_in_progress())

    def wait_until_finished(self) -> None:
        """Orbax's saves finished, then this manager's memory-tier saves committed on storage by ckptd (at most
        ``persist_timeout_s``: ``TimeoutError`` naming the steps still in shared memory, which ckptd persists
        when it can)."""
        self._manager.wait_until_finished()
        if self._memory is not None:
            self._memory.wait_persisted(self._persist_timeout_s)
        self._retention.apply()

    def check_for_errors(self) -> None:
        self._manager.check_for_errors()

    def close(self) -> None:
        """Orbax's ``close`` (waits for a save in flight), then the events go to ckptd (at most
        ``events_flush_timeout_s``)."""
        try:
            self._manager.wait_until_finished()
            self._retention.apply()
            self._manager.close()
        finally:
            if self._memory is not None:
                self._memory.close()
            if self._reporter is not None:
                self._reporter.close(self._reporter.settings.events_flush_timeout_s)
            if self._own_client is not None:
                self._own_client.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["HONOURED", "REFUSED", "CheckpointManager", "unsupported_options"]
