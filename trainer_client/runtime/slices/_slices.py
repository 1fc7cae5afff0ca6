"""Which slices exist and which are healthy: pathwaysutils on real Pathways, simulated slices on CPU.

Both providers expose the same three things to the elastic runner: the slice-to-devices map (which
pathwaysutils' ``Manager`` runs over: runtime/slices/_slice_manager.py), the set of healthy slices (pathwaysutils'
``get_active_slice_indices`` with a health checker: the confirmation that an error is a slice loss), and a
hook run at every step boundary. On Pathways the runtime itself raises ``JaxRuntimeError(DATA_LOSS)`` when
a slice dies; on CPU ``SimulatedSlices`` is the stand-in for slice *health*: a slice it takes down fails
health checks for a while, then comes back. Its scheduled ``SliceFault``s raise ``DATA_LOSS`` at a step
boundary; ``trainer_client.runtime.slices._jax_faults.InJaxFaults`` (which the runner turns on for a run on
simulated slices) makes JAX operations themselves raise it — mid-step, in a snapshot copy, a restore, a
compile, pathwaysutils' own pmap health check — as on Pathways. Listeners (``add_loss_listener``) hear of
each loss.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

import jax
import pathwaysutils
from pathwaysutils.elastic import elastic

_log = logging.getLogger(__name__)


def initialize_pathways() -> bool:
    """``pathwaysutils.initialize()`` (the Pathways proxy backend, its profiling and persistence handlers)
    when JAX runs on Pathways, detected as pathwaysutils detects it (``is_pathways_backend_used``: the
    ``proxy`` platform); never on CPU or a multi-controller TPU job. True when it was called."""
    if not pathwaysutils.is_pathways_backend_used():
        return False
    _log.info("Pathways backend configured: pathwaysutils.initialize()")
    pathwaysutils.initialize()  # a second call is a no-op in pathwaysutils
    return True


class SliceProvider(Protocol):
    """What the elastic runner needs to know about the slices of the allocation."""

    @property
    def slice_to_devices(self) -> Mapping[int, Sequence[jax.Device]]: ...

    def healthy_slices(self) -> frozenset[int]: ...

    def at_step_boundary(self, step: int, active: Set[int]) -> None: ...


class PathwaysSlices:
    """Real slices, from ``device.slice_index``, health-checked by pathwaysutils' tiny pmap per slice.

    Registers pathwaysutils' Pathways backend (``pathwaysutils.initialize()``) before it asks JAX for its
    devices, when JAX is configured for Pathways' proxy platform."""

    def __init__(self, devices: Sequence[jax.Device] | None = None) -> None:
        initialize_pathways()
        found = list(devices or jax.devices())
        plain = [d for d in found if not hasattr(d, "slice_index")]
        if plain:  # pathwaysutils would fail on them with a bare AttributeError
            kinds = ", ".join(sorted({d.platform for d in plain}))
            raise ValueError(f"PathwaysSlices needs Pathways devices (each with a slice_index); these {len(plain)} "
                             f"{kinds} device(s) have none: on CPU use SimulatedSlices(num_slices=...)")
        self.slice_to_devices = elastic.get_slice_to_devices(found)

    def healthy_slices(self) -> frozenset[int]:
        return frozenset(elastic.get_active_slice_indices(self.slice_to_devices))

    def at_step_boundary(self, step: int, active: Set[int]) -> None:
        """Nothing to do: the Pathways runtime raises on its own when a slice dies."""


@dataclass(frozen=True)
class SliceFault:
    """Take ``slice_index`` down at the boundary of ``at_step``; it returns after ``down_for_s``
    seconds (``None``: never)."""

    slice_index: int
    at_step: int
    down_for_s: float | None = 5.0


class _SimulatedHealthChecker(elastic.SliceHealthChecker):
    """A pathwaysutils health checker that consults the simulation instead of running a pmap."""

    def __init__(self, slices: SimulatedSlices) -> None:
        super().__init__(slices.slice_to_devices)
        self._slices = slices

    def dispatch(self) -> None:
        self._healthy = self._slices.healthy_now()

    def validate(self) -> Set[int]:
        return self._healthy


class SimulatedSlices:
    """N fake CPU devices grouped into ``num_slices`` equal slices, with scheduled slice failures."""

    def __init__(
        self,
        devices: Sequence[jax.Device] | None = None,
        *,
        num_slices: int,
        faults: Sequence[SliceFault] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        devices = list(devices or jax.devices())
        if num_slices < 1 or len(devices) % num_slices:
            raise ValueError(f"{len(devices)} devices do not split into {num_slices} equal slices")
        per = len(devices) // num_slices
        self.slice_to_devices: dict[int, list[jax.Device]] = {
            k: devices[k * per : (k + 1) * per] for k in range(num_slices)
        }
        self.faults = sorted(faults, key=lambda f: f.at_step)
        self._fired: set[int] = set()
        self._down_until: dict[int, float] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._loss_listeners: list[Callable[[int], None]] = []
        self.visible_in_jax = False  # an InJaxFaults is active for these slices

    def add_loss_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(slice_index)`` each time a slice is taken down (after it is marked down)."""
        self._loss_listeners.append(listener)

    def healthy_now(self) -> frozenset[int]:
        now = self._clock()
        with self._lock:
            down = {k for k, until in self._down_until.items() if until > now}
        return frozenset(self.slice_to_devices) - down

    def healthy_slices(self) -> frozenset[int]:
        """Through pathwaysutils' own health-check entry point, with the simulated checker."""
        return frozenset(
            elastic.get_active_slice_indices(self.slice_to_devices, checker=_SimulatedHealthChecker(self))
        )

    def take_down(self, slice_index: int, down_for_s: float | None) -> None:
        with self._lock:
            self._down_until[slice_index] = (
                float("inf") if down_for_s is None else self._clock() + down_for_s
            )
        for listener in list(self._loss_listeners):
            listener(slice_index)

    def bring_back(self, slice_index: int) -> None:
        with self._lock:
            self._down_until.pop(slice_index, None)

    def at_step_boundary(self, step: int, active: Set[int]) -> None:
        """Fire the faults scheduled for ``step``; raise like Pathways when an active slice is down."""
        fired = set()
        for i, fault in enumerate(self.faults):
            if fault.at_step == step and i not in self._fired and fault.slice_index in active:
                self._fired.add(i)
                fired.add(fault.slice_index)
                self.take_down(fault.slice_index, fault.down_for_s)
        lost = sorted(fired | (set(active) - self.healthy_now()))
        if lost:
            raise jax.errors.JaxRuntimeError(
                f"DATA_LOSS: slice(s) {lost} stopped responding at step {step} (simulated by ckptd)"
            )


__all__ = ["PathwaysSlices", "SimulatedSlices", "SliceFault", "SliceProvider", "initialize_pathways"]
