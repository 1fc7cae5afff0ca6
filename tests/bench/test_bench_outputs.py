"""Where ``make bench`` writes: an untracked ``bench-output/`` unless asked to publish (bench/run.py).

A benchmark run on a developer's machine must not rewrite the tracked results (``bench/results*.json``) or the
published report (docs/benchmarks.md): it writes ``bench-output/results-<profile>.json`` and
``bench-output/benchmarks.md`` (the published prose with this run's table) in the directory it runs in. Only
``BENCH_PUBLISH=1`` (``--publish``) writes the tracked files.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from bench.report import BEGIN, END
from tests.support.helpers import REPO, clean_env

TRACKED = (REPO / "docs" / "benchmarks.md", REPO / "bench" / "results.json", REPO / "bench" / "results-quick.json")


def _digests() -> dict[Path, str | None]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
            for p in (*TRACKED, REPO / "bench" / "results-toy.json")}


def test_a_run_writes_bench_output_and_leaves_the_tracked_results_alone(tmp_path: Path) -> None:
    before = _digests()
    env = clean_env()
    env.pop("BENCH_PUBLISH", None)
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--profile", "toy", "--only", "", "--workdir",
                           str(tmp_path), "--shm", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _digests() == before, "a run that does not publish changed a tracked file"
    out = tmp_path / "bench-output"
    assert sorted(p.name for p in out.iterdir()) == ["benchmarks.md", "results-toy.json"]
    assert json.loads((out / "results-toy.json").read_text())["profile"]["name"] == "toy"
    report = (out / "benchmarks.md").read_text()
    published = (REPO / "docs" / "benchmarks.md").read_text()
    assert report.split(BEGIN)[0] == published.split(BEGIN)[0]  # the published prose, this run's table
    assert report.split(END, 1)[1] == published.split(END, 1)[1]
    assert "wrote bench-output/results-toy.json" in proc.stdout and "wrote bench-output/benchmarks.md" in proc.stdout
