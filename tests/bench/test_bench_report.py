"""The report of docs/benchmarks.md (bench/report.py): each profile's table between its own markers, the prose
kept, and a quick run's figures judged against the full run's (its median within the quick run's spread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import BEGIN, END, QUICK_BEGIN, QUICK_END, agrees, write_report


def _payload(profile: str, value: float, low: float, high: float, started: str) -> dict[str, Any]:
    machine = {"cpu": "cpu", "cores": 2, "memory_gib": 8, "load_avg_at_end": [0.1], "python": "3.11",
               "jax": "0.10", "orbax-checkpoint": "0.12", "tensorstore": "0.1"}
    key = {"value": value, "min": low, "max": high, "n": 3, "unit": "ratio", "target": ">= 0.8",
           "pass": value >= 0.8}
    return {"profile": {"name": profile}, "machine": machine, "started_at": started, "duration_s": 60.0,
            "keys": {"persist_throughput_ratio_vs_disk_limit": key}}


def test_agrees_when_the_full_median_lies_within_the_quick_spread() -> None:
    quick = {"value": 0.8, "min": 0.7, "max": 0.9, "unit": "ratio"}
    assert agrees(quick, {"value": 0.85})
    assert agrees(quick, {"value": 0.7})
    assert agrees(quick, {"value": 0.905})  # within 1% of the range: the table's precision
    assert agrees({"value": 1.005, "min": 1.0047, "max": 1.006, "unit": "ratio"}, {"value": 1.0005})
    assert agrees(quick, {"value": 0.95}) is False
    assert agrees(quick, {"value": 0.6}) is False
    assert agrees({"value": 0.8, "min": None, "max": None, "unit": "x"}, {"value": 0.8}) is False


def test_absolute_figures_are_shown_but_not_judged() -> None:
    # a latency depends on the machine's pace and the quick job's size, not only on the code
    assert agrees({"value": 2.0, "min": 1.0, "max": 3.0, "unit": "ms"}, {"value": 50.0}) is None
    assert agrees({"value": 500.0, "min": 400.0, "max": 600.0, "unit": "req/s"}, {"value": 450.0}) is None


def test_quick_and_full_tables_live_side_by_side_and_keep_the_prose(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nprose before\n\n{BEGIN}\nold\n{END}\n\nprose after\n")
    full = _payload("full", 0.85, 0.8, 0.9, "full-run")
    write_report(full, docs)
    write_report(_payload("quick", 0.6, 0.5, 0.7, "quick-run"), docs, full)
    text = docs.read_text()
    assert "prose before" in text and "prose after" in text and "old" not in text
    full_part = text.split(BEGIN)[1].split(END)[0]
    quick_part = text.split(QUICK_BEGIN)[1].split(QUICK_END)[0]
    assert "`full` profile" in full_part and "agrees" not in full_part
    assert "`quick` profile" in quick_part and "the full run of full-run" in quick_part
    assert "**no**" in quick_part and "0 of 1 ratios agree" in quick_part
    row = next(line for line in quick_part.splitlines() if "persist_throughput_ratio_vs_disk_limit" in line)
    assert "| 0.850 | **no** |" in row, row  # 0.85 lies outside 0.5 .. 0.7
    # a second quick run replaces its own table, not the full one's
    write_report(_payload("quick", 0.8, 0.75, 0.9, "quick-run-2"), docs, full)
    text = docs.read_text()
    assert text.count(QUICK_BEGIN) == 1 and "full-run" in text.split(BEGIN)[1].split(END)[0]
    quick_part = text.split(QUICK_BEGIN)[1]
    row = next(line for line in quick_part.splitlines() if "persist_throughput_ratio_vs_disk_limit" in line)
    assert "| 0.850 | yes |" in row, row
