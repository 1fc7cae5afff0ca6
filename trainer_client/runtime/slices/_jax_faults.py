"""Slice failures raised from inside JAX operations, on CPU: the way a lost Pathways slice shows up.

On Pathways a dead slice is not noticed at a step boundary: the JAX call that touches it raises
``JaxRuntimeError(DATA_LOSS)`` — reading a result to the host, ``block_until_ready``, a transfer to the
devices (a restore), a compile. ``InJaxFaults`` makes JAX on CPU do the same for the slices of a
``SimulatedSlices``: while it is active, those operations raise ``DATA_LOSS`` when they involve a device of a
slice that is down, or an array that lived on it when it went down (its contents are gone for good, even
once the slice is back). ``fail_during(op, slice)`` arms a fault that takes the slice down *inside* the
n-th such operation, optionally only within a given function (``MemoryTier._write``: mid snapshot copy).

It is pathwaysutils' own idea (``pathwaysutils/test/mock_fault_injection.py``, ``DeviceLossSimulator``:
patch the array accessors, ``block_until_ready`` and ``jax.jit`` so a lost device's arrays raise), rebuilt
because that simulator cannot run a recovering process: it tracks arrays by ``id()`` with no cleanup, so once
the failed attempt's arrays are freed, new arrays that reuse their ids read as lost forever; and it wraps
only the ``jax.jit`` functions created after it starts. Here arrays lost at a failure are held by weak
reference, and health comes from ``SimulatedSlices`` (so pathwaysutils' default pmap health check sees
the same slices down). A ``jit`` call itself is not intercepted (XLA's C++ dispatch path): its outputs
live on the lost slice and the first read of or wait on them raises, as an asynchronously dispatched
step's failure surfaces on real hardware.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from unittest import mock

import jax
import jax.stages
import numpy as np
from jax._src import array as _array

from trainer_client.runtime.slices._slices import SimulatedSlices

Op = Literal["to_host", "to_device", "block", "compile"]


@dataclass
class _Armed:
    op: Op
    slice_index: int | None
    nth: int
    down_for_s: float | None
    inside: str | None
    seen: int = 0


@dataclass(frozen=True)
class Fired:
    """Where an armed fault went off: the operation, the slice it took down, the thread, the function."""

    op: Op
    slice_index: int
    thread: str
    inside: str | None


class InJaxFaults:
    """Patches JAX (and numpy's conversions of JAX arrays) so operations on a down slice raise DATA_LOSS."""

    def __init__(self, slices: SimulatedSlices) -> None:
        self.slices = slices
        self.fired: list[Fired] = []
        self.raised: list[tuple[Op, str]] = []  # every DATA_LOSS raised: (operation, thread)
        self._slice_of = {d.id: k for k, devices in slices.slice_to_devices.items() for d in devices}
        self._lost_arrays: dict[int, weakref.ref[Any]] = {}
        self._armed: list[_Armed] = []
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._patchers: list[Any] = []
        slices.add_loss_listener(self._on_loss)

    # ---- arming ---------------------------------------------------------------------------------

    def fail_during(self, op: Op, slice_index: int | None = None, *, nth: int = 1,
                    down_for_s: float | None = 5.0, inside: str | None = None) -> None:
        """The ``nth`` ``op`` from now that involves ``slice_index`` (``None``: any slice; the first it
        involves) takes that slice down for ``down_for_s`` seconds and raises DATA_LOSS. ``inside``: count
        only operations called (at any depth) from a function of that qualified name."""
        with self._lock:
            self._armed.append(_Armed(op, slice_index, nth, down_for_s, inside))

    def disarm(self) -> int:
        """Drop the faults armed that have not gone off (a soak's trial that ended first); how many."""
        with self._lock:
            n = len(self._armed)
            self._armed.clear()
            return n

    @property
    def armed(self) -> int:
        with self._lock:
            return len(self._armed)

    # ---- the check every patched operation makes --------------------------------------------------

    def _on_loss(self, slice_index: int) -> None:
        devices = {d.id for d in self.slices.slice_to_devices[slice_index]}
        with self._lock:
            for arr in jax.live_arrays():
                if {d.id for d in arr.sharding.device_set} & devices:
                    self._lost_arrays[id(arr)] = weakref.ref(arr, self._forget(id(arr)))

    def _forget(self, key: int) -> Callable[[weakref.ref[Any]], None]:
        def drop(_: weakref.ref[Any]) -> None:  # the array is gone: its id may be reused
            self._lost_arrays.pop(key, None)

        return drop

    def _is_lost(self, arr: Any) -> bool:
        ref = self._lost_arrays.get(id(arr))
        return ref is not None and ref() is arr

    def touch(self, op: Op, devices: Iterable[Any], arrays: Iterable[Any] = ()) -> None:
        """Fire an armed fault this operation matches; raise DATA_LOSS if it involves a down slice."""
        arrays = [a for a in arrays if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)]
        device_ids = {d.id for d in devices} | {d.id for a in arrays for d in _devices_of(a)}
        involved = sorted({self._slice_of[d] for d in device_ids if d in self._slice_of})
        with self._lock:
            for armed in list(self._armed):
                if armed.op != op or not involved or (armed.slice_index is not None
                                                       and armed.slice_index not in involved):
                    continue
                if armed.inside is not None and not _called_from(armed.inside):
                    continue
                armed.seen += 1
                if armed.seen < armed.nth:
                    continue
                self._armed.remove(armed)
                victim = armed.slice_index if armed.slice_index is not None else involved[0]
                self.fired.append(Fired(op, victim, threading.current_thread().name, armed.inside))
                self.slices.take_down(victim, armed.down_for_s)
            down = sorted(set(involved) - self.slices.healthy_now())
            lost = [a for a in arrays if self._is_lost(a)]
            if op == "to_host" and arrays and all(_on_host(a) for a in arrays):
                down, lost = [], []  # read back before the loss: its host copy needs no device
        if down or lost:
            self.raised.append((op, threading.current_thread().name))
            where = f"slice(s) {down}" if down else "an array of a lost slice"
            raise jax.errors.JaxRuntimeError(f"DATA_LOSS: {op} on {where} (simulated inside JAX by ckptd)")

    # ---- patching -------------------------------------------------------------------------------

    def _guard(self, op: Op, call: Callable[..., Any], involved: Callable[..., tuple[list[Any], list[Any]]],
               ) -> Callable[..., Any]:
        """``call`` preceded by ``touch`` (once per outermost patched call: an ``np.asarray`` that goes
        through ``__array__`` and ``_value`` is one transfer)."""
        faults = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(faults._depth, "n", 0)
            if depth == 0:
                devices, arrays = involved(*args, **kwargs)
                if devices or arrays:
                    faults.touch(op, devices, arrays)
            faults._depth.n = depth + 1
            try:
                return call(*args, **kwargs)
            finally:
                faults._depth.n = depth

        return wrapper

    def start(self) -> InJaxFaults:
        if self._patchers:
            return self
        self.slices.visible_in_jax = True
        one = _one_array
        value = _array.ArrayImpl._value
        patches: list[tuple[Any, str, Any]] = [
            (np, "asarray", self._guard("to_host", np.asarray, one)),
            (np, "array", self._guard("to_host", np.array, one)),
            (_array.ArrayImpl, "__array__", self._guard("to_host", _array.ArrayImpl.__array__, one)),
            (_array.ArrayImpl, "_value", property(self._guard("to_host", value.fget, one))),
            (_array.ArrayImpl, "block_until_ready",
             self._guard("block", _array.ArrayImpl.block_until_ready, one)),
            (jax, "block_until_ready", self._guard("block", jax.block_until_ready, _tree_arrays)),
            (jax, "device_put", self._guard("to_device", jax.device_put, _device_put_targets)),
            (jax, "make_array_from_callback",
             self._guard("to_device", jax.make_array_from_callback, _sharding_at(1))),
            (jax, "make_array_from_single_device_arrays",
             self._guard("to_device", jax.make_array_from_single_device_arrays, _sharding_at(1))),
            (jax.stages.Lowered, "compile", self._guard("compile", jax.stages.Lowered.compile, _lowered_devices)),
        ]
        for target, name, replacement in patches:
            patcher = mock.patch.object(target, name, replacement)
            patcher.start()
            self._patchers.append(patcher)
        return self

    def stop(self) -> None:
        while self._patchers:
            self._patchers.pop().stop()
        self.slices.visible_in_jax = False

    def __enter__(self) -> InJaxFaults:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _on_host(arr: Any) -> bool:
    """Whether JAX already holds ``arr``'s value on the host (a read needs no device)."""
    return getattr(arr, "_npy_value", None) is not None


def _devices_of(arr: Any) -> Iterator[Any]:
    try:
        yield from arr.sharding.device_set
    except Exception:  # a deleted array: nothing to touch
        return


def _one_array(a: Any, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    return [], [a] if isinstance(a, jax.Array) else []


def _tree_arrays(x: Any, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    return [], [leaf for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, jax.Array)]


def _device_put_targets(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    device = kwargs.get("device", device)
    targets: list[Any] = []
    for leaf in jax.tree_util.tree_leaves(device, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding)):
        if isinstance(leaf, jax.sharding.Sharding):
            targets.extend(leaf.device_set)
        elif isinstance(leaf, jax.Device):
            targets.append(leaf)
    return targets, _tree_arrays(x)[1]


def _sharding_at(index: int) -> Callable[..., tuple[list[Any], list[Any]]]:
    def involved(*args: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
        sharding = kwargs.get("sharding", args[index] if len(args) > index else None)
        return (list(sharding.device_set) if isinstance(sharding, jax.sharding.Sharding) else []), []

    return involved


def _lowered_devices(lowered: Any, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    devices = getattr(getattr(lowered, "_lowering", None), "_device_list", None)
    return (list(devices) if devices is not None else []), []


def _called_from(qualname: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_qualname == qualname:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


__all__ = ["Fired", "InJaxFaults", "Op"]
