"""``make demo`` as a user runs it (``python -m examples.demo``, its own ckptd process), shortened: a slice lost
in resize and in pause, at a step boundary and inside JAX, is restored from the replica snapshots in the
hosts' memory with at most one step lost, in the same process; ``--no-replicas`` shows the path before that
tier (the newest shared-memory snapshot). Each report names where each recovery restored from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _demo(out: Path, *args: str, devices: int = 8) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "examples.demo", "--out", str(out), "--steps", "60", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # an expected slice loss is no warning: a successful run's console has no WARNING or ERROR line
    loud = [line for line in (run.stdout + run.stderr).splitlines() if re.match(r"(WARNING|ERROR|CRITICAL)\b", line)]
    assert loud == [], loud
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    assert report["pid_before"] == report["pid_after"]
    assert report["last_step_on_storage"] == 60
    return report


@pytest.mark.parametrize("args", [
    ("--fail-at", "30", "--down-for", "2"),  # resize at a step boundary: shrink, then grow back
    # a long form: pause and a loss inside JAX restored from the replicas are in the short suite as runner tests
    # (tests/trainer/runtime/test_elastic.py, test_in_jax_faults.py)
    pytest.param(("--policy", "pause", "--fail-at", "30", "--down-for", "2", "--fault", "in-jax"),
                 marks=pytest.mark.slow),
], ids=["resize-boundary", "pause-in-jax"])
def test_a_slice_loss_is_restored_from_the_replicas(tmp_path: Path, args: tuple[str, ...]) -> None:
    report = _demo(tmp_path / "out", *args)
    down = report["recoveries"][0]
    assert down["kind"] == "slice_down" and down["failed_at_step"] == 30
    assert down["restored_from"] == "replicas" and down["lost_steps"] <= 1
    assert all(r["restored_from"] == "replicas" for r in report["recoveries"])
    if "pause" in args:
        assert down["mesh_after"] == down["mesh_before"] == [4, 2]
    else:
        assert down["mesh_after"] == [3, 2]
    restored = [e for e in report["events"] if e["kind"] == "restored"]
    assert restored and "from replicas" in restored[0]["detail"]


def test_one_slice_on_one_device_waits_for_it_and_goes_on_over_a_unix_socket(tmp_path: Path) -> None:
    """The form the demo takes on one accelerator chip: ckptd on a unix socket, the only slice lost inside JAX,
    the run waits for it and restores onto it in the same PID. The replicas lived on that slice's hosts, so the
    newest shared-memory snapshot (every 5 steps) is what survives."""
    report = _demo(tmp_path / "out", "--slices", "1", "--policy", "pause", "--fault", "in-jax", "--uds",
                   "--fail-at", "32", "--down-for", "1", devices=1)
    assert report["ckptd_url"].startswith("unix:///") and report["slices"] == 1
    assert [f["slice_index"] for f in report["in_jax_faults"]] == [0]
    (down,) = report["recoveries"]
    assert down["kind"] == "slice_down" and down["mesh_before"] == down["mesh_after"] == [1, 1]
    assert down["restored_from"].startswith("memory: ") and down["restored_step"] == 30
    assert down["lost_steps"] == 2


@pytest.mark.slow
def test_without_replicas_the_newest_shared_memory_snapshot_is_restored(tmp_path: Path) -> None:
    report = _demo(tmp_path / "out", "--fail-at", "32", "--down-for", "2", "--no-replicas")
    down = report["recoveries"][0]
    assert report["replicas"] is False
    assert down["restored_from"].startswith("memory: ") and down["restored_step"] == 30  # every 5 steps
    assert down["lost_steps"] == 2


@pytest.mark.parametrize("module", ["examples.demo", "examples.multihost_demo"])
def test_every_option_of_the_demo_has_help_and_hosts_is_one(module: str) -> None:
    import argparse
    import importlib

    parser: argparse.ArgumentParser = importlib.import_module(module).build_parser()
    options = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings and a.dest != "help"}
    assert "--hosts" in options and "--hosts" in parser.format_help()
    assert [name for name, text in options.items() if not text] == []
