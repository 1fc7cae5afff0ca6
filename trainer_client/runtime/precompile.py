"""Compile the likely next meshes ahead of time, so an elastic event does not compile on the critical path.

Recovery after a slice failure is dominated by re-tracing and recompiling the training step for the new
mesh. While training runs on a mesh, a background thread asks the user's ``precompile(mesh, batch)``
hook to lower and compile the step for the meshes an elastic event would lead to next: the full mesh
again when running degraded (the regrow), then every mesh with one slice fewer (one per slice that could
be lost). Lowering and compiling a jitted function warms jax's own cache for that function, so the first
step after a recovery on one of those meshes starts at once; with ``compilation_cache_dir`` set, JAX's
persistent compilation cache also keeps them across processes.

The hook is the user's because only the training code knows its step function and input layouts (see
``examples/elastic_mlp.py``). A failing compile is logged and skipped: precompiling is an optimisation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from trainer_client.core.batching import plan_batch
from trainer_client.core.planner import plan_mesh
from trainer_client.core.protocol import BatchOptions, BatchPlan, MeshSpec
from trainer_client.errors import PlanningError

_log = logging.getLogger(__name__)

PrecompileHook = Callable[[Mesh, BatchPlan], object]


def enable_persistent_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in ``directory`` for every compiled program."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def build_mesh(
    spec: MeshSpec, slice_order: Sequence[int], slice_to_devices: Mapping[int, Sequence[jax.Device]]
) -> Mesh:
    """Devices of the given slices, slice by slice, reshaped to ``spec``."""
    devices = [d for k in slice_order for d in slice_to_devices[k]]
    if len(devices) < spec.size:
        raise ValueError(f"the mesh needs {spec.size} devices, {len(devices)} are in those slices")
    grid = np.array(devices[: spec.size], dtype=object).reshape(spec.shape)
    return Mesh(grid, tuple(spec.axis_names))


def likely_next(
    current: MeshSpec,
    active: frozenset[int],
    slice_to_devices: Mapping[int, Sequence[jax.Device]],
) -> list[tuple[MeshSpec, list[int]]]:
    """(mesh, slices) an elastic event most likely leads to: the regrow first, then one slice fewer."""
    everything = sorted(slice_to_devices)
    options: list[list[int]] = []
    if set(everything) != set(active):
        options.append(everything)
    options += [sorted(active - {lost}) for lost in sorted(active) if len(active) > 1]
    out = []
    for slices in options:
        alive = sum(len(slice_to_devices[k]) for k in slices)
        try:
            spec = plan_mesh(current, {}, alive, "resize").mesh
        except PlanningError:
            continue
        out.append((spec, slices))
    return out


class Precompiler:
    """Runs the precompile hook for the likely next meshes in a daemon thread (one pass per mesh)."""

    def __init__(self) -> None:
        self._done: set[tuple[int, ...]] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._clear = threading.Event()  # set: no save is in progress, compiling may go on
        self._clear.set()
        self.compiled: list[tuple[list[int], float]] = []  # (mesh shape, seconds)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While a save is in progress: start no new mesh (tracing one holds the GIL for long stretches, and
        a save's many short Python steps would each queue behind it; measured: a 70 ms save took 7-15 s)."""
        self._clear.clear()
        try:
            yield
        finally:
            self._clear.set()

    def start(
        self,
        hook: PrecompileHook,
        current: MeshSpec,
        active: frozenset[int],
        slice_to_devices: Mapping[int, Sequence[jax.Device]],
        batch: BatchPlan,
        options: BatchOptions,
    ) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        targets = likely_next(current, active, slice_to_devices)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(hook, targets, slice_to_devices, batch, options), name="ckptd-precompile",
            daemon=True,
        )
        self._thread.start()

    def _run(
        self,
        hook: PrecompileHook,
        targets: list[tuple[MeshSpec, list[int]]],
        slice_to_devices: Mapping[int, Sequence[jax.Device]],
        batch: BatchPlan,
        options: BatchOptions,
    ) -> None:
        for spec, slices in targets:
            while not self._clear.wait(0.05):  # a save is in progress
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            mesh = build_mesh(spec, slices, slice_to_devices)
            key = tuple(d.id for d in mesh.devices.flat)
            if key in self._done:
                continue
            started = time.perf_counter()
            try:
                hook(mesh, plan_batch(batch, spec, options))
            except Exception as exc:  # an optimisation only: never let it hurt training
                _log.warning("precompiling for mesh %s failed: %s", spec.shape, exc)
                continue
            self._done.add(key)
            self.compiled.append((list(spec.shape), time.perf_counter() - started))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the current pass is done (tests; benchmarks)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, wait: bool = False) -> None:
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join()


__all__ = ["PrecompileHook", "Precompiler", "build_mesh", "enable_persistent_cache", "likely_next"]
