"""The device profile (bench/device.py) runs end to end at its toy size on CPU devices: the replica tier with the
runner's defaults (paced, its memory kind measured and chosen) beside the same loop without it, a restore of the
held snapshot checked against the state it was taken from, and the rates per host memory kind.

The real figures come from a run on a chip (docs/benchmarks.md, "Device profile"); this keeps the code working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, clean_env


def test_the_device_profile_runs_at_its_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "device.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.device", "--size", "toy", "--schedule", "4,60,1", "--out", str(out)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["platform"] == "cpu" and result["state_bytes"] > 0 and result["step_s"] > 0
    (run,) = result["replica_runs"]
    choice = run["choice"]
    assert choice is not None, run  # the pacer measured both kinds and chose
    assert choice["replica_memory_kind"] in ("pinned_host", "unpinned_host") and choice["replica_period"] >= 1
    assert run["staged"] is True and run["snapshots"] >= 2  # one to each kind, then at the chosen period
    assert result["replica_overhead_ratio_whole"] > 0
    assert result["replica_restore_exact"] is True and result["replica_first_step_s"] > 0
    dispatched = sum(took for _, took in result["replica_trace"])  # the last may still be in flight when counted
    assert len(result["replica_trace"]) == 60 and dispatched >= run["snapshots"]
    assert {"pinned_host", "unpinned_host", "numpy"} <= set(result["memory_kinds"])
