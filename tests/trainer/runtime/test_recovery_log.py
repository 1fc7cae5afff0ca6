"""What a recovered run says in its log: an expected slice loss is no warning, and each recovery ends with one
INFO line that sums it up (the steps lost, the tier restored from, the seconds to the first step) and says what
the training step must do on the new mesh (the batch, its microbatches, the learning-rate scale)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import elastic_runner, run_to_end
from trainer_client.runtime.slices._slices import SliceFault

pytestmark = pytest.mark.needs_devices(8)

SUMMARY = "elastic event recovered "


def test_a_slice_loss_logs_no_warning_and_one_summary_line_with_the_new_batch(
        tmp_path: Path, ckptd_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    server = ckptd_server(tmp_path)
    # resize with scale_batch: on 3 slices of 4 the global batch 48 becomes 36, the learning rate x 0.75
    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(1, at_step=13, down_for_s=None)],
                            batch_mode="scale_batch")
    with caplog.at_level(logging.INFO):
        result = run_to_end(runner, make_train_fn(20, TrainLog()))
    (recovery,) = result.recoveries
    assert recovery.restored_from == "replicas"
    warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    summaries = [r for r in caplog.records if r.getMessage().startswith(SUMMARY)]
    assert len(summaries) == 1 and summaries[0].levelno == logging.INFO
    line = summaries[0].getMessage()
    assert re.search(r"slice_down at step 13: \d+\.\d\ds to the first step, [01] step\(s\) lost, "
                     r"restored from replicas; batch 36 = 1 x 36 \(6 per device on 6\), lr x 0\.75, "
                     r"not the job's 48$", line), line
    # pathwaysutils' own record of the event is not shown at INFO: the runner's lines say it
    assert "Elastic event detected" not in caplog.text
