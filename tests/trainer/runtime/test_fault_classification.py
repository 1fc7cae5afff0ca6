"""Only slice losses are retried: pathwaysutils' classification *and* a slice health check must agree.

pathwaysutils calls any ``JaxRuntimeError`` naming INTERNAL (or DATA_LOSS, ...) a slice loss; an XLA
compiler bug, an allocation failure or a corrupt read would then be replayed until the retries ran out.
The runner re-raises those at once: same exception object, original traceback, no elastic event.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import elastic_runner, run_to_end
from trainer_client.runtime.slices._slices import SimulatedSlices

pytestmark = pytest.mark.needs_devices(8)

COMPILER_BUG = ("INTERNAL: RET_CHECK failure (external/xla/xla/service/hlo_verifier.cc:1520) "
                "ShapeUtil::Compatible(...) Expected instruction to have shape equal to f32[48,128]")
ALLOCATION = "INTERNAL: Failed to allocate 17179869184 bytes for new constant: out of memory"


def _raise(message: str) -> None:
    raise jax.errors.JaxRuntimeError(message)


def _real_oom() -> None:
    """XLA's own out-of-memory error (256 TiB: never allocated, refused at once)."""
    jax.jit(lambda: jnp.ones((2**46,), jnp.float32))().block_until_ready()


def _real_callback_failure() -> None:
    """XLA's own INTERNAL error: a host callback inside a jitted computation raised."""
    def broken(x: Any) -> Any:
        raise ValueError("a bug in the training code's host callback")

    jax.jit(lambda x: jax.pure_callback(broken, jax.ShapeDtypeStruct((2,), jnp.float32), x))(
        jnp.ones(2)).block_until_ready()


NOT_SLICE_LOSSES = {
    "compiler bug (INTERNAL)": lambda: _raise(COMPILER_BUG),
    "allocation failure (INTERNAL)": lambda: _raise(ALLOCATION),
    "host callback failure (INTERNAL, raised by XLA)": _real_callback_failure,
    "out of memory (RESOURCE_EXHAUSTED, raised by XLA)": _real_oom,
    "corrupt read (DATA_LOSS, every slice healthy)": lambda: _raise("DATA_LOSS: checksum mismatch reading chunk"),
}


@pytest.mark.parametrize("case", sorted(NOT_SLICE_LOSSES))
def test_an_error_that_is_not_a_slice_loss_is_raised_at_once_unchanged(
    tmp_path: Path, ckptd_server: Any, case: str
) -> None:
    server = ckptd_server(tmp_path)
    raised: list[BaseException] = []
    calls: list[int] = []

    def hook(step: int) -> None:
        if step == 13:  # deterministic, as such bugs are: every retry would fail here again
            calls.append(step)
            try:
                NOT_SLICE_LOSSES[case]()
            except BaseException as exc:
                raised.append(exc)
                raise

    runner = elastic_runner(tmp_path, server.url, "pause", elastic_max_retries=3)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        run_to_end(runner, make_train_fn(20, TrainLog(), step_hook=hook))
    assert info.value is raised[0], "the error was wrapped or replaced"
    assert any(entry.name == "hook" for entry in info.traceback), "the original traceback was lost"
    assert calls == [13], "retried as a slice loss"
    kinds = [e.kind for e in runner.events]
    assert "failure_detected" not in kinds and kinds[-1] == "aborted"


def test_a_data_loss_with_a_slice_down_is_recovered(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    runner = elastic_runner(tmp_path, server.url, "pause")
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)
    calls: list[int] = []

    def hook(step: int) -> None:
        if step == 13 and not calls:
            calls.append(step)
            slices.take_down(2, 0.5)
            _raise("DATA_LOSS: slice 2 stopped responding")

    result = run_to_end(runner, make_train_fn(20, TrainLog(), step_hook=hook))
    assert result.pid == os.getpid() and result.final_step == 19
    (rec,) = result.recoveries
    assert (rec.kind, rec.failed_at_step, rec.restored_from) == ("slice_down", 13, "replicas")
    assert rec.restored_step in (12, 13)  # step 13's copy was done when the loss came, or was dropped whole
    detected = next(e for e in result.events if e.kind == "failure_detected")
    assert detected.detail.startswith("slice(s) [2] down: DATA_LOSS")


def test_classification_needs_pathwaysutils_and_the_health_check_to_agree() -> None:
    from trainer_client.runtime.elastic._fault_classification import SliceLoss, classify_failure

    slices = SimulatedSlices(num_slices=4)
    active = frozenset({0, 1, 2, 3})
    data_loss = jax.errors.JaxRuntimeError("DATA_LOSS: slice stopped responding")
    internal = jax.errors.JaxRuntimeError(COMPILER_BUG)
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.")
    assert classify_failure(data_loss, slices, active) is None  # every slice healthy
    assert classify_failure(internal, slices, active) is None
    slices.take_down(2, None)
    assert classify_failure(data_loss, slices, active) == SliceLoss(lost=frozenset({2}),
                                                                    healthy=frozenset({0, 1, 3}))
    assert classify_failure(internal, slices, active) == SliceLoss(lost=frozenset({2}),
                                                                   healthy=frozenset({0, 1, 3}))
    assert classify_failure(oom, slices, active) is None  # pathwaysutils: never a slice loss
    assert classify_failure(data_loss, slices, frozenset({0, 1})) is None  # the lost slice was not in use
    assert classify_failure(ValueError("DATA_LOSS"), slices, active) is None
