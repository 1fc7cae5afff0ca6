"""MaxText's own elastic loop, kept: what its ``elastic_utils.elastic_retry`` is given, and its manager's stand-in.

MaxText wraps a run in pathwaysutils' ``Manager.elastic_retry`` (``elastic_utils.elastic_retry(config,
callback_fn, pre_callback_fn)``) and, on every elastic event, first runs ``clean_up_checkpoints``: it deletes the
newest step directory without ``commit_success``, also one a save of the failed attempt is still writing.
``MaxTextHooks`` gives that loop ckptd's rules instead, one instance per checkpoint directory
(``for_directory``), through the patch in ``integrations/maxtext/ckptd.patch`` (docs/maxtext.md, "The patch"):

- ``checkpoint_manager(...)`` stands in for the ``ocp.CheckpointManager(...)`` that MaxText's
  ``create_orbax_checkpoint_manager`` builds, with the same arguments: it returns a
  ``trainer_client.CheckpointManager`` (only good steps named, manifests written: docs/adopt.md) and keeps it
  so an elastic event can fence its saves.
- ``on_elastic_event`` (the event callback, in ``clean_up_checkpoints``' place) deletes nothing: it fences
  the failed attempt's managers — waits for their saves in flight to finish or fail, then closes them — so no
  save of the old attempt writes while the next one restores. A step left without its marker stays where
  it is: it is never named for a resume, and ckptd's retention removes what a crash abandoned.
- ``before_attempt`` (the pre-attempt callback) asks ckptd, or the same rule on storage when ckptd does not
  answer, for the newest good step: the step MaxText's ``load_state_if_possible`` will restore (it asks the
  manager's ``latest_step()``, which gives the same answer).

No replica snapshot tier is handed to MaxText: at the patch's commit MaxText has no ``RetryCache`` and no
``snapshotter`` slot for one (``elastic_backup_kind: snapshot`` is a setting nothing reads yet), so a patched
run recovers from its checkpoints (docs/maxtext.md, "MaxText's snapshot slot is not there yet").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import client_settings
from trainer_client.runtime.elastic._good_steps import GoodSteps
from trainer_client.runtime.orbax_compat._checkpoint_manager import CheckpointManager

_log = logging.getLogger(__name__)


def _key(directory: Any) -> str:
    """One name per directory: MaxText's ``config.checkpoint_dir`` ends with a slash, its manager's path not."""
    return str(directory).rstrip("/")


class MaxTextHooks:
    """ckptd's callbacks for MaxText's ``elastic_retry`` and the stand-in for its ``CheckpointManager``."""

    _by_directory: ClassVar[dict[str, MaxTextHooks]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, checkpoint_dir: str, ckptd: CkptdClient | None = None) -> None:
        """``checkpoint_dir``: MaxText's ``config.checkpoint_dir`` (``<base_output_directory>/<run_name>/
        checkpoints``); ``ckptd``: the client of the ckptd serving its parent, as ``CheckpointManager`` takes
        it (none: ``CKPTD_URL`` when set, else storage alone)."""
        self.checkpoint_dir = _key(checkpoint_dir)
        self.ckptd = ckptd
        self.resume_step: int | None = None  # the last answer of before_attempt
        self.fenced_steps: list[int] = []  # steps the fences waited for (their saves were in flight)
        self._managers: list[CheckpointManager] = []
        self._lock = threading.Lock()

    @classmethod
    def for_directory(cls, checkpoint_dir: str, ckptd: CkptdClient | None = None) -> MaxTextHooks:
        """The hooks of ``checkpoint_dir``, made on first use: ``elastic_retry`` and each attempt's
        ``create_orbax_checkpoint_manager`` name the directory, not an object they could share. Give
        ``ckptd`` before ``elastic_retry`` runs (or set ``CKPTD_URL``); the patched lines pass none."""
        with cls._registry_lock:
            hooks = cls._by_directory.get(_key(checkpoint_dir))
            if hooks is None:
                hooks = cls._by_directory[_key(checkpoint_dir)] = cls(checkpoint_dir, ckptd)
            elif ckptd is not None:  # the client given last is asked (a later manager is made with it too)
                hooks.ckptd = ckptd
            return hooks

    def checkpoint_manager(self, directory: Any, *args: Any, **kwargs: Any) -> CheckpointManager:
        """``ocp.CheckpointManager(directory, ...)``'s stand-in: a ``trainer_client.CheckpointManager`` with
        the same arguments (an option ckptd cannot honour is refused there, with ``ValueError``)."""
        if self.ckptd is not None:
            kwargs.setdefault("ckptd", self.ckptd)
        manager = CheckpointManager(directory, *args, **kwargs)
        with self._lock:
            self._managers.append(manager)
        return manager

    def on_elastic_event(self) -> None:
        """The event callback: fence the failed attempt's saves (wait for them, then close the managers);
        delete nothing. A save that fails because its slice is gone leaves an uncommitted step, never named."""
        with self._lock:
            managers, self._managers = self._managers, []
        for manager in managers:
            before = set(manager.all_steps())
            for fence in (manager.wait_until_finished, manager.close):
                try:
                    fence()
                except Exception:  # the failed attempt's save may fail with its slice: never fatal here
                    _log.warning("elastic event: a save of the failed attempt did not finish", exc_info=True)
            finished = sorted(set(self._good_steps().all()) - before)
            if finished:
                _log.info("elastic event: the save of step(s) %s finished before the next attempt", finished)
            self.fenced_steps += finished

    def before_attempt(self) -> None:
        """The pre-attempt callback: ask where the attempt resumes (``resume_step``; None: a new run)."""
        self.resume_step = self._good_steps().latest()
        _log.info("MaxText attempt resumes from %s in %s",
                  "nothing (a new run)" if self.resume_step is None else f"step {self.resume_step}",
                  self.checkpoint_dir)

    def _good_steps(self) -> GoodSteps:
        """The directory's good steps, asked of ckptd (the client given, else ``CKPTD_URL``'s) or storage."""
        if self.ckptd is None:
            settings = client_settings()
            if "url" in settings.model_fields_set:  # as CheckpointManager finds the sidecar
                self.ckptd = CkptdClient(settings)
        return GoodSteps(self.checkpoint_dir, self.ckptd)

    @staticmethod
    def chain(*callbacks: Callable[[], Any] | None) -> Callable[[], None]:
        """One callback calling each of ``callbacks`` given (MaxText's ``chain_callbacks``, skipping None)."""
        given = [c for c in callbacks if c is not None]

        def chained() -> None:
            for callback in given:
                callback()

        return chained


__all__ = ["MaxTextHooks"]
