"""What ``elastic_max_retries`` counts in ckptd's runner: slice losses, never scale-ups (docs/maxtext.md, where
MaxText's flags are mapped: MaxText's counts every attempt, so the same number allows MaxText fewer events).

Against a real ckptd and real Orbax checkpoints, on 4 fake slices: a slice lost and back is two elastic events,
which pathwaysutils' ``ElasticRetryLimit(1)`` (MaxText's counting) would not allow past the first; ckptd's runner
with ``elastic_max_retries=1`` trains through both and ends only at the second slice loss (step 25).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import elastic_runner, run_to_end
from tests.support.helpers import wait_until
from trainer_client.errors import ElasticRetriesExhausted
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

pytestmark = pytest.mark.needs_devices(8)


def test_a_scale_up_uses_no_retry_and_the_loss_past_the_limit_ends_the_run(
        tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    faults = [SliceFault(0, at_step=12, down_for_s=None), SliceFault(1, at_step=25, down_for_s=None)]
    runner = elastic_runner(tmp_path, server.url, "resize", faults, elastic_max_retries=1)
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)

    def hook(step: int) -> None:
        if step == 17 and 0 not in runner.manager.active_slice_indices:  # slice 0 back: the run grows again
            slices.bring_back(0)
            wait_until(lambda: 0 in runner.manager.available_inactive_slices, what="the monitor to see slice 0")

    with pytest.raises(ElasticRetriesExhausted, match="2 slice failures exceed elastic_max_retries=1"):
        run_to_end(runner, make_train_fn(40, TrainLog(), step_hook=hook))
    # two events before the last loss (a loss, then the scale-up): MaxText's counting would have ended at the first
    assert [(r.kind, r.failed_at_step) for r in runner.recoveries] == [
        ("slice_down", 12), ("scale_up", 18), ("slice_down", 25)]
