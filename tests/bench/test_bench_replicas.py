"""The replica benchmarks run end to end on a toy state and write both keys (bench/replicas.py).

The real figures come from ``make bench``; this proves the family executes: a replica snapshot every step
against none, and a recovery from the replicas against one from the shared-memory tier, both restoring the
same state (the first step's loss after each restore is checked against a reference inside the family).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, clean_env

KEYS = ("replica_snapshot_step_overhead_ratio", "replica_recovery_speedup_vs_memory_tier")


def test_the_replica_family_writes_both_keys_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--profile", "toy", "--only", "replicas", "--out", str(out), "--docs",
         "none", "--workdir", str(tmp_path), "--shm", str(tmp_path)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["errors"] == {}
    for key in KEYS:
        fig = payload["keys"][key]
        assert fig["n"] == 1 and fig["value"] > 0 and fig["target"].split()[0] in ("<=", ">="), key
        assert f"* {key} = " in proc.stdout
    overhead = payload["keys"]["replica_snapshot_step_overhead_ratio"]["details"]
    assert overhead["snapshots"] >= 1 and overhead["host_bytes_per_snapshot"] > 0
    state = payload["context"]["replicas_state"]  # the state against the step's compute, recorded
    assert state["state_bytes"] > 0 and state["step_flops"] > 0 and state["host_bytes_per_step_flop"] > 0
    for name in ("recovery_s_from_replicas", "recovery_s_from_memory_tier", "restore_s_from_replicas",
                 "restore_s_from_memory_tier"):
        assert payload["measurements"][f"replicas.{name}"]["median"] > 0, name
