"""The autopilot harness (bench/autopilot.py) on short traces: it runs in seconds, its table and its verdicts on the
targets follow from its own numbers, and the run it replays traces through (bench/autopilot_sim.py) loses what a
hand count says it loses."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest

from bench.autopilot import STRATEGIES, Fixed, main, targets, worlds
from bench.autopilot_costs import load
from bench.autopilot_sim import World, simulate
from bench.autopilot_traces import DAY, HOUR, Trace, traces
from tests.support.helpers import REPO
from trainer_client.core.planning import TierCosts


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict, float]:
    out: list[str] = []
    path = tmp_path_factory.mktemp("autopilot") / "rows.json"
    started = time.perf_counter()
    assert main(["--days", "2", "--json", str(path)], out=out.append) == 0
    return out, json.loads(path.read_text()), time.perf_counter() - started


def test_the_harness_replays_four_short_traces_in_seconds(run: tuple[list[str], dict, float]) -> None:
    out, data, seconds = run
    assert seconds < 60  # ~1 s here; a loaded machine has room
    assert [r["trace"] for r in data["rows"]] == ["steady", "falling", "bursts", "slow storage"]
    for row in data["rows"]:
        assert set(row["goodput"]) == set(STRATEGIES)
        assert all(0.0 < g < 1.0 for g in row["goodput"].values())
        assert row["autopilot_decisions"] > row["days"] * 24 * 6  # asked every 10 minutes and after each recovery
    assert any(line.startswith(f"costs: step {load().step_s:.3g} s") for line in out)  # the newest chip run's


def test_the_table_and_the_verdicts_follow_from_its_own_numbers(run: tuple[list[str], dict, float]) -> None:
    out, data, _ = run
    rows = data["rows"]
    lines = "\n".join(out).splitlines()
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| trace |")]
    assert len(table) == len(rows)
    for line, row in zip(table, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        g = row["goodput"]
        assert cells[1] == str(row["failures"])
        shown = [float(c.strip("*%")) for c in cells[2:2 + len(STRATEGIES)]]
        assert shown == [pytest.approx(100 * g[s], abs=0.005) for s in STRATEGIES]
        best = max(STRATEGIES, key=lambda s: g[s])
        assert cells[2 + STRATEGIES.index(best)].startswith("**")
        assert float(cells[-1]) == pytest.approx(100 * (g["autopilot"] - g["oracle"]), abs=0.005)
        # the oracle's search starts from the advised periods: it is never worse than them
        assert g["oracle"] >= g["advise once"]
    verdicts = [line for line in lines if re.match(r"(holds|MISSED): ", line)]
    expected = targets(rows)
    assert verdicts == [f"{'holds' if ok else 'MISSED'}: {text}" for text, ok in expected]
    for text, ok in expected:  # each verdict is its comparison of two numbers of the table
        trace, _, rest = text.partition(": autopilot ")
        g = next(r["goodput"] for r in rows if r["trace"] == trace)
        other = "oracle" if "oracle" in rest else "MaxText" if "MaxText" in rest else "continuous"
        assert ok == (g["autopilot"] >= g[other] - 0.01 if other == "oracle" else g["autopilot"] > g[other])
    assert data["targets"] == [[text, ok] for text, ok in expected]


def test_a_failure_loses_the_steps_since_the_save_it_goes_back_to() -> None:
    # one tier, a save every 100 steps of 1 s, usable at once; a failure at 250.5 s goes back to step 200 and
    # recovers in 10 + 5 + 5 s: the run ends at step 200 + (1000 - 270.5)
    tier = TierCosts("storage", block_s=0.0, restore_s=5.0, first_step_s=5.0)
    trace = Trace("one", 1000.0, ((250.5, 2),), (), "")
    result = simulate(World(1.0, (tier,), (2,), 0.0, 10.0, trace), Fixed("x", (100,)))
    assert result.lost_steps == [pytest.approx(50.5)] and result.failures == 1
    assert result.goodput == pytest.approx((200 + 1000 - 270.5) / 1000)
    # a copy of 60 s: the save of step 200 is usable at 260 s, after the failure; the one of step 100 is left
    slow = simulate(World(1.0, (replace(tier, copy_s=60.0),), (2,), 0.0, 10.0, trace), Fixed("x", (100,)))
    assert slow.lost_steps == [pytest.approx(150.5)]


def test_losses_average_half_a_period_plus_the_copy() -> None:
    profile = load()
    steady = traces(14.0)[0]
    only_replicas = replace(steady, failures=tuple((t, 0) for t, _ in steady.failures))
    world = worlds(profile, only_replicas)[0]
    copy_steps = profile.tiers[0].copy_s / profile.step_s
    for period in (50, 400):
        lost = simulate(world, Fixed("x", (period, 10**6, 10**6))).mean_lost_steps
        # uniform over a period: the mean of ~85 failures within 4 standard errors (period / sqrt(12 x 85))
        assert lost == pytest.approx(period / 2 + copy_steps, abs=4 * period / (12 * 85) ** 0.5)


def test_the_traces_are_the_same_every_time_and_say_what_they_are() -> None:
    first, again = traces(4.0, seed=3), traces(4.0, seed=3)
    assert first == again and first != traces(4.0, seed=4)
    steady, falling, bursts, slow = first
    assert all(t.horizon_s == 4 * DAY for t in first)
    half = falling.horizon_s / 2
    early = sum(t < half for t, _ in falling.failures)
    assert len(falling.failures) - early > 3 * early  # 1 h against 8 h
    assert slow.slow and slow.factor(slow.slow[0][0]) == 10.0 and slow.factor(0.0) == 1.0
    assert {c for _, c in steady.failures} == {0, 1, 2}
    gaps = sorted(b - a for (a, _), (b, _) in zip(bursts.failures, bursts.failures[1:], strict=False))
    assert gaps[3] < HOUR / 2  # bursts: failures minutes apart


def test_the_costs_are_the_measured_ones() -> None:
    profile = load()
    results, device, tier_restore = (json.loads((REPO / name).read_text()) for name in profile.sources)
    replicas, memory, storage = profile.tiers
    choice = device["replica_runs"][0]["choice"]
    assert profile.step_s == device["step_s"] and profile.state_bytes == device["state_bytes"]
    assert replicas.block_s == pytest.approx(choice["replica_overhead"] * choice["replica_period"] * device["step_s"])
    assert replicas.copy_s == choice["replica_copy_seconds"] and replicas.restore_s == device["replica_restore_s"]
    assert memory.block_s == memory.copy_s == tier_restore["shm_save_s"]
    assert memory.restore_s == tier_restore["shm_restore_s"]
    persist = device["state_bytes"] / (results["measurements"]["io.persist_worker_child_gbps"]["median"] * 1e9)
    assert storage.nested and storage.block_s == 0 and storage.copy_s == pytest.approx(memory.copy_s + persist)
    assert profile.orbax.block_s > 0 and profile.orbax.copy_s > profile.orbax.block_s
