"""The benchmark harness runs end to end on a toy size and writes valid results (bench/run.py).

The real figures come from ``make bench``; this only proves the harness executes: every io and service
figure (and the slowdown of training steps beside each background save) is measured, on a state of a few
KiB and a dozen steps, and lands in results.json and the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, clean_env

ROOT = REPO
IO_KEYS = {
    "save_stall_ratio_vs_memcpy",
    "persist_throughput_ratio_vs_raw_disk",
    "restore_time_ratio_vs_orbax",
    "reshard_restore_time_ratio_vs_orbax",
    "memory_tier_restore_speedup_vs_disk",
    "persist_throughput_ratio_vs_disk_limit",
    "restore_throughput_ratio_vs_disk_limit",
    "restore_peak_host_rss_ratio_vs_state",
    "gcs_requests_per_restore_ratio_vs_orbax",
    "gcs_requests_per_persist_ratio_vs_orbax",
}
SERVICE_KEYS = {"resume_p99_ms", "resume_burst64_makespan_ms", "catalog_rebuild_s_10k_steps", "load64_rps",
                "load64_p99_ms", "first_sight_ms_per_step"}
GCS_HOSTS_KEYS = {"gcs_commit_over_rate_bound", "gcs_lost_or_failed_parts", "gcs_objects_written_twice"}


def test_bench_harness_writes_valid_results(tmp_path: Path) -> None:
    out, docs = tmp_path / "results.json", tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--profile",
            "toy",
            "--only",
            "io,interference,first_sight,gcs_hosts,service",
            "--out",
            str(out),
            "--docs",
            str(docs),
            "--workdir",
            str(tmp_path),
            "--shm",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["schema"] == "ckptd-bench/1" and payload["profile"]["name"] == "toy"
    assert payload["errors"] == {}
    assert set(payload["keys"]) >= IO_KEYS | SERVICE_KEYS | GCS_HOSTS_KEYS  # and whatever newer families add
    # a step of 4 simulated hosts through the shaped bucket: committed, every part there, nothing written twice
    assert payload["keys"]["gcs_lost_or_failed_parts"]["value"] == 0
    assert payload["keys"]["gcs_objects_written_twice"]["value"] == 0
    assert payload["measurements"]["gcs_hosts.4.requests_per_host"]["median"] > 0
    for key, fig in payload["keys"].items():
        assert fig["n"] >= 1 and len(fig["samples"]) == fig["n"], key
        assert fig["min"] <= fig["median"] <= fig["max"], key
        assert isinstance(fig["pass"], bool) and fig["target"].split()[0] in ("<=", ">="), key
        assert "spread" in fig, key
    for kind in ("restore", "persist"):  # requests were counted at the emulator's proxy, on both sides
        details = payload["keys"][f"gcs_requests_per_{kind}_ratio_vs_orbax"]["details"]
        assert details["ckptd_requests_median"] > 0 and details["orbax_requests_median"] > 0
    assert payload["keys"]["restore_peak_host_rss_ratio_vs_state"]["value"] > 0
    assert payload["machine"]["cores"] and payload["context"]["io_state"]["bytes"] > 0
    report = docs.read_text()
    assert "<!-- bench:begin" in report and "`resume_p99_ms`" in report
    for key in payload["keys"]:
        assert f"* {key} = " in proc.stdout  # printed as measured
    for saver in ("checkpointer", "orbax_zstd", "persist_worker"):  # the steps beside each background save
        slowdown = payload["measurements"][f"interference.slowdown.{saver}"]
        assert slowdown["n"] >= 1 and slowdown["median"] > 0
