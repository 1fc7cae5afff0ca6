"""pathwaysutils' elasticity ``Manager`` over ckptd's slice providers: the retry loop the runner is built on.

``ElasticRunner`` runs its attempts through ``Manager.elastic_retry`` (pathwaysutils 0.1.13): the wait for
``minimum_slice_count`` healthy slices before each attempt (pathwaysutils' pmap health check), the attempt
under ``jax.default_device`` on an active slice, the retry after a slice-down ``JaxRuntimeError`` or a
``ScaleUpSignalError`` (with its ``retry_policy``), the profiler cleanup, and the background monitor thread
that health-checks only the *inactive* slices and publishes the healthy ones in
``available_inactive_slices`` — the step loop itself runs no health check. ckptd's part rides in its
callbacks (docs/architecture.md, "The elastic loop").

``SliceManager`` subclasses it for two reasons, and changes nothing of its loop:

- ``__init__``: Manager groups ``jax.devices()`` by ``device.slice_index`` and health-checks every slice
  at construction. CPU devices have no ``slice_index`` (``SimulatedSlices`` groups them into fake slices),
  and the first wait health-checks anyway: the slices come from the provider, the rest of the state is set
  as Manager sets it.
- ``start_monitoring``: ``elastic_retry`` starts the monitor with the wait loop's poll interval; the
  monitor polls at ``monitor_interval_s`` instead (pathwaysutils' pmap check compiles each time: ~55 ms a
  slice on CPU, a busy core if polled every 50 ms).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import jax
from pathwaysutils.elastic.manager import Manager


class SliceManager(Manager):
    """Manager for the slices in ``slice_to_devices`` (a provider's), monitoring every ``monitor_interval_s``."""

    def __init__(self, slice_to_devices: Mapping[int, Sequence[jax.Device]], monitor_interval_s: float) -> None:
        # Not Manager.__init__ (see the module docstring); the same attributes, in the same order.
        self.slice_to_devices = slice_to_devices
        self.all_slice_indices = frozenset(self.slice_to_devices.keys())
        self._active_slice_indices: frozenset[int] = frozenset()
        self.available_inactive_slices: frozenset[int] = frozenset()
        self.active_slice_indices = frozenset[int]()  # elastic_retry sets it from its wait before each attempt
        self._stop_event = None
        self._monitor_thread = None
        self.monitor_interval_s = monitor_interval_s
        # Held by the monitor's health check (it makes arrays and runs a pmap on them) and by the deletion
        # of the failed attempt's arrays after an event (runtime/recovery.py): deleting a buffer that a
        # running computation reads crashed the process ("Buffer has been deleted or donated", SIGSEGV).
        self.device_work = threading.Lock()

    def start_monitoring(self, poll_interval: float | int = 10) -> None:
        super().start_monitoring(self.monitor_interval_s)

    def _check_inactive_slices(self) -> None:
        with self.device_work:
            super()._check_inactive_slices()


class _HandledEventsAtInfo(logging.Filter):
    """Manager logs every slice loss it retries as ``Elastic event detected`` at ERROR with the traceback;
    the runner reports the same event itself (``failure_detected``, with the lost slices), so that record
    goes on at INFO, without the traceback that made a recovered run look like a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "Elastic event detected":
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger(Manager.__module__).addFilter(_HandledEventsAtInfo())


__all__ = ["SliceManager"]
