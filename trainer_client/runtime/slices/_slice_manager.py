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

and adds one thing Manager has no notion of, hot spares (``take_slices``): an allocation of more slices than
the mesh uses (``mesh_slices``). Manager's wait sets ``active_slice_indices`` to every healthy slice; before
each attempt (``pre_callback``) the runner narrows it to the slices the mesh will use — the previous attempt's
that are still healthy, then healthy idle ones by index — so Manager's monitor health-checks the idle ones
(the spares) in the background, ``available_inactive_slices`` names the healthy spares, and
``default_device`` is on a slice in use. A lost slice that returns is just another idle slice: a spare.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import jax
from pathwaysutils.elastic.manager import Manager


class SliceManager(Manager):
    """Manager for the slices in ``slice_to_devices`` (a provider's), monitoring every ``monitor_interval_s``."""

    def __init__(self, slice_to_devices: Mapping[int, Sequence[jax.Device]], monitor_interval_s: float,
                 mesh_slices: int | None = None) -> None:
        # Not Manager.__init__ (see the module docstring); the same attributes, in the same order.
        self.slice_to_devices = slice_to_devices
        self.all_slice_indices = frozenset(self.slice_to_devices.keys())
        self._active_slice_indices: frozenset[int] = frozenset()
        self.available_inactive_slices: frozenset[int] = frozenset()
        self.active_slice_indices = frozenset[int]()  # elastic_retry sets it from its wait before each attempt
        self._stop_event = None
        self._monitor_thread = None
        self.monitor_interval_s = monitor_interval_s
        # slices a full mesh uses; the allocation's others are hot spares
        self.mesh_slices = len(self.all_slice_indices) if mesh_slices is None else mesh_slices
        if not 1 <= self.mesh_slices <= len(self.all_slice_indices):
            raise ValueError(f"a mesh of {self.mesh_slices} slices does not fit {len(self.all_slice_indices)} slices")
        self._in_use: frozenset[int] = frozenset()
        # Held by the monitor's health check (it makes arrays and runs a pmap on them) and by the deletion
        # of the failed attempt's arrays after an event (runtime/elastic/_recovery.py): deleting a buffer that a
        # running computation reads crashed the process ("Buffer has been deleted or donated", SIGSEGV).
        self.device_work = threading.Lock()

    def take_slices(self) -> tuple[frozenset[int], frozenset[int]]:
        """After Manager's wait (``active_slice_indices``: every healthy slice): the slices the next attempt's
        mesh uses — the previous attempt's still healthy first (a spare replaces only what was lost), then
        healthy idle ones by index, at most ``mesh_slices`` — and the healthy ones left idle (the spares).
        ``active_slice_indices`` becomes the slices in use, so the monitor checks the spares."""
        healthy = frozenset(self.active_slice_indices)
        order = sorted(healthy & self._in_use) + sorted(healthy - self._in_use)
        used = frozenset(order[: self.mesh_slices])
        self.active_slice_indices = used
        self.available_inactive_slices = healthy - used  # just health-checked by the wait
        self._in_use = used
        return used, healthy - used

    def slices_to_grow(self, active: frozenset[int]) -> frozenset[int]:
        """Healthy idle slices that a degraded mesh (fewer than ``mesh_slices`` slices: ``resize`` with no
        spare left) would grow back onto; none when the mesh is whole (idle slices are spares then)."""
        if len(active) >= self.mesh_slices:
            return frozenset()
        return frozenset(self.available_inactive_slices) - active

    def start_monitoring(self, poll_interval: float | int = 10) -> None:
        super().start_monitoring(self.monitor_interval_s)

    def _check_inactive_slices(self) -> None:
        with self.device_work:
            super()._check_inactive_slices()


class _HandledEventsAtDebug(logging.Filter):
    """Manager logs every slice loss it retries as ``Elastic event detected`` at ERROR with the traceback;
    the runner reports the same event itself (``failure_detected``, with the lost slices, and one ``recovered``
    summary), so that record goes on at DEBUG, without the traceback, and only where DEBUG is asked for (the
    logger's own level was checked at ERROR before this filter ran)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "Elastic event detected":
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger(Manager.__module__).addFilter(_HandledEventsAtDebug())


__all__ = ["SliceManager"]
