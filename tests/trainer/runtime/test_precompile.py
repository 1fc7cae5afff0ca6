"""Compiling the likely next meshes ahead of time takes the compile off the recovery's critical path.

The runner clears JAX's in-memory caches after every elastic event (docs/architecture.md) but keeps the
executable the precompile hook returned for exactly the new mesh and hands it to the next attempt
(``ctx.precompiled``): after the recovery the step is neither lowered nor compiled. Without compile-ahead the
step is lowered again and compiled (tests/trainer/runtime/test_precompiled_handover.py: the handover itself)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

from examples.elastic_mlp import TrainLog, jitted_step, make_train_fn
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core.protocol import MeshSpec
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.compilation._precompile import likely_next
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner, Event
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

pytestmark = pytest.mark.needs_devices(8)

FULL = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])


def test_likely_next_meshes() -> None:
    slices = {k: jax.devices()[2 * k : 2 * k + 2] for k in range(4)}
    full = likely_next(FULL, frozenset(range(4)), slices)
    assert [(spec.shape, used) for spec, used in full] == [
        ([3, 2], [1, 2, 3]), ([3, 2], [0, 2, 3]), ([3, 2], [0, 1, 3]), ([3, 2], [0, 1, 2])
    ]
    degraded = likely_next(MeshSpec(axis_names=["replica", "data"], shape=[3, 2]), frozenset({0, 1, 3}), slices)
    assert (degraded[0][0].shape, degraded[0][1]) == ([4, 2], [0, 1, 2, 3])  # the regrow comes first
    assert [used for _, used in degraded[1:]] == [[1, 3], [0, 3], [0, 1]]


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("Compiling ", "Persistent compilation cache hit")):
            self.messages.append(message)


@pytest.fixture
def compiles() -> Iterator[_Compiles]:
    handler = _Compiles()
    logger = logging.getLogger("jax")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture
def fresh_compilation_cache() -> Iterator[None]:
    """JAX initialises its persistent cache once per process: let this test's runner choose the directory."""
    from jax._src import compilation_cache

    before = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def _is_step(message: str) -> bool:
    return "accumulated" in message or "train_step" in message


@pytest.mark.parametrize("precompile", [True, False])
def test_the_step_after_a_recovery_does_not_compile_when_precompiled(
    tmp_path: Path, ckptd_server: Any, compiles: _Compiles, fresh_compilation_cache: None, precompile: bool
) -> None:
    jitted_step.cache_clear()  # nothing compiled by an earlier test may help
    jax.clear_caches()
    server = ckptd_server(tmp_path)
    (tmp_path / "job").mkdir()
    config = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48,
                           checkpoint_period=10, elastic=ElasticOptions(policy="resize"),
                           health=HealthOptions(poll_interval_s=0.05, scale_up_check_interval_s=3600),
                           compilation=CompilationOptions(precompile=precompile,
                                                          compilation_cache_dir=str(tmp_path / "compilation-cache")))
    client = CkptdClient(ClientSettings(url=server.url), root=str(tmp_path))
    marks: list[tuple[str, int]] = []

    def on_event(event: Event) -> None:
        marks.append((event.kind, len(compiles.messages)))

    runner = ElasticRunner(config, slices=SimulatedSlices(num_slices=4, faults=[SliceFault(1, 15, None)]),
                           client=client, checkpoint_dir=str(tmp_path / "job"), on_event=on_event)

    def settle(step: int) -> None:
        if step == 14:
            runner.precompiler.wait(timeout=300)  # make the test independent of how busy the machine is

    try:
        result = runner.run(make_train_fn(20, TrainLog(), step_hook=settle))
    finally:
        runner.checkpointer.close()
        client.close()
    assert result.recoveries[0].mesh_after == [3, 2]
    kinds = [kind for kind, _ in marks]
    restored = kinds.index("restored", kinds.index("failure_detected"))
    first = kinds.index("first_step_done", restored)
    compiled_in_recovery = compiles.messages[marks[restored][1] : marks[first][1]]
    lowered = [m for m in compiled_in_recovery if m.startswith("Compiling ") and _is_step(m)]
    from_cache = [m for m in compiled_in_recovery if m.startswith("Persistent") and _is_step(m)]
    if precompile:
        assert not lowered, f"the precompiled executable was not used: the step was lowered again {lowered}"
        assert len(runner.precompiler.compiled) >= 4
    else:
        assert lowered, "the caches were cleared at the event: the step is lowered again"
        assert len(from_cache) < len(lowered), "without precompilation the recovery compiles the step"
