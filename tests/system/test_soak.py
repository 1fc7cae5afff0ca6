"""The recovery soak's short forms (``make soak`` runs 100 trials). ``make test`` runs one trial of each phase that
no in-process test covers (tests/trainer/runtime/test_in_jax_faults.py, test_replica_recovery.py and
test_elastic.py cover a loss mid-step, mid-snapshot, mid-restore, under a background compile and a slice that
returns), the replica tier's among them: a loss during the pinned copy, two slices lost at once, a loss right
after a scale-up; ``make test-all`` one trial of every phase.

The soak runs as ``make soak`` does, as its own trainer process (``python -m soak``): one process for every
trial, a real ``ckptd serve`` process, 4 fake slices with losses raised inside JAX. Every trial must recover
exactly (soak/trials.py says what that means), and between trials nothing of a trial may stay alive. (Not in
this pytest process: its plugins are no part of a trainer, and under them a one-off set of arrays was seen to
outlive a trial, held where the garbage collector cannot see, which no standalone soak has shown.)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from soak.harness import Sample
from soak.report import flat
from soak.trials import PHASES, TIERS, TIMINGS
from tests.support.helpers import REPO, clean_env

pytestmark = pytest.mark.integration


# the phases no in-process test covers, and the three the assertions below look into
SHORT = ("persist", "second_failure", "ckptd_restart", "replica_copy", "two_slices", "after_scale_up")


@pytest.mark.parametrize("phases", [SHORT, pytest.param(PHASES, marks=pytest.mark.slow)], ids=["short", "every-phase"])
def test_every_phase_recovers_and_nothing_of_a_trial_stays_alive(tmp_path: Path, phases: tuple[str, ...]) -> None:
    trials = len(phases)  # phase_order: one round holds every phase once
    published = REPO / "soak" / "results.json"
    before = hashlib.sha256(published.read_bytes()).hexdigest()
    env = clean_env(SOAK_TRIALS=str(trials), SOAK_SEED="20261201", TMPDIR=str(tmp_path), SOAK_PHASES=",".join(phases))
    env.pop("SOAK_PUBLISH", None)
    # as `make soak` runs it, with its default output: soak-output/ where it runs, the tracked results untouched
    proc = subprocess.run([sys.executable, "-m", "soak", "--sample-every", "1"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    out = tmp_path / "soak-output" / "results.json"
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert hashlib.sha256(published.read_bytes()).hexdigest() == before, "a soak that does not publish wrote it"
    results = json.loads(out.read_text())
    assert results["failures"] == [], results["failures"]
    assert (results["trials"], results["successes"]) == (trials, trials)
    assert {phase: p["successes"] for phase, p in results["phases"].items()} == {
        phase: int(phase in phases) for phase in PHASES}
    assert len({t["phase"] for t in results["trial_log"]}) == trials
    # each trial records the tier every slice-loss recovery restored from and the steps it lost; the results
    # report their distribution per phase, and every restore whose state could be read equals the run's there
    for phase, p in results["phases"].items():
        if phase not in phases:
            assert p["trials"] == 0, (phase, p)
            continue
        assert set(p["restored_from"]) <= {*TIERS, "interrupted"} and set(p["restored_from"]) & set(TIERS), (phase, p)
        assert sum(p["lost_steps"].values()) == sum(p["restored_from"].values()), (phase, p)
    log = {t["phase"]: t for t in results["trial_log"]}
    assert all(verdict != "DIFFERS" for t in log.values() for _, verdict in t["restores"])
    downs = {phase: [r for r in t["recoveries"] if r["kind"] == "slice_down"] for phase, t in log.items()}
    # a failed pinned copy is dropped: the step held before (or a newer one in memory) restores whole, its state
    # the run's at that step (the trial checks the tier against what the replicas held when the plan came)
    assert len(downs["replica_copy"]) == 1
    assert [v for _, v in log["replica_copy"]["restores"]] == ["equal"]
    # two replicas of two slices each: one of each lost leaves no whole replica (memory or storage)
    two = [r["restored_from"].split(":")[0] for r in downs["two_slices"]]
    assert len(two) == 1 and (log["two_slices"]["variant"] == "one_replica" or two[0] in ("memory", "storage"))
    assert [r["kind"] for r in log["after_scale_up"]["recoveries"]] == [
        "slice_down", "scale_up", "slice_down", "scale_up"]
    assert sum(results["restored_from"].values()) == sum(results["lost_steps"].values()) >= trials
    # A sample after every trial, the first (after trial 1: first-time costs paid) the baseline. No array,
    # executable, thread or open file of a trial may outlive it: tolerance 0 (JAX's caches are cleared before
    # counting, as the runner clears them after an event; what they hold is bounded by their LRU sizes). RSS is
    # taken after the allocator's free pages went back to the OS (malloc_trim, as after an event): measured
    # +1 to +2 MiB a trial over the first trials, levelling off (docs/operations.md, "Recovery soak"); 32 MiB
    # over these trials is ~3x that, while a trial that kept its state (arrays, Adam moments, a compiled
    # step per mesh) would also show in the counts, which allow nothing.
    # The RSS as the library left the process, before the harness collects, clears or trims anything, must be
    # flat too (its envelope: it swings by tens of MiB with what JAX's caches and the allocator hold); what
    # JAX's caches hold then is reported beside it (bounded by their LRU sizes, cleared after every event).
    samples = [Sample(**s) for s in results["samples"]]
    assert [s.after_trial for s in samples] == list(range(1, trials + 1))
    assert all(s.rss_raw_mib > 0 and s.live_executables_raw >= s.live_executables for s in samples)
    assert flat(samples, rss_mib=32.0, raw_rss_mib=64.0) == [], [
        (s.after_trial, s.rss_raw_mib, s.rss_mib, s.arrays_by_kind, s.held_by, s.files_open) for s in samples]
    assert "RSS as left" in proc.stdout
    for name in TIMINGS:
        assert results["timings_s"][name]["n"] >= trials - 1, (name, results["timings_s"][name])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "trials recovered" in proc.stdout
    assert "| phase | restored from | steps lost: failures |" in proc.stdout
