"""``python -m soak`` (``make soak``): the recovery soak. ``SOAK_TRIALS`` (default 100) trials, ``SOAK_SEED``
(default 0; ``random`` draws one) replays a soak, ``SOAK_PHASES`` (``--phases``; default every phase) names the
phases its trials draw from; prints the tables of docs/operations.md and writes
``soak-output/results.json`` in the current directory (untracked); ``SOAK_PUBLISH=1`` (``--publish``) writes the
tracked ``soak/results.json`` instead. Exit status 0 only when every trial recovered and the process's samples
stayed flat, both as the library left the process and after the harness cleared JAX's caches.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak.harness import Soak
from soak.report import flat, markdown, summarize, write
from soak.trials import PHASES, Trial, run_trial

PUBLISHED = Path(__file__).resolve().parent / "results.json"  # the tracked results (--publish)
OUTPUT = Path("soak-output") / "results.json"  # a run's results unless it publishes (relative to where it runs)
# What may grow from the first sample (after the reference run and one trial) to the last: no array, executable
# or thread of a trial may outlive it; RSS may move by what the allocator keeps (docs/operations.md).
RSS_TOLERANCE_MIB = 64.0


def phase_order(trials: int, rng: random.Random, phases: tuple[str, ...] = PHASES) -> list[str]:
    """Every phase of ``phases`` once per round of that many trials, in a random order each round."""
    order: list[str] = []
    while len(order) < trials:
        block = list(phases)
        rng.shuffle(block)
        order += block
    return order[:trials]


def run_soak(trials: int, seed: int, workdir: Path, *, sample_every: int = 10, phases: tuple[str, ...] = PHASES,
             progress: Callable[[Trial], None] | None = None) -> dict[str, Any]:
    """Run the soak in this process; the results (``soak.report.summarize``) with ``grew``: what was not flat."""
    rng = random.Random(seed)
    started = time.time()
    done: list[Trial] = []
    with Soak(workdir) as soak:
        soak.make_reference()
        for index, phase in enumerate(phase_order(trials, rng, phases), start=1):
            trial = run_trial(soak, index, phase, random.Random(rng.randrange(2**32)))
            done.append(trial)
            if progress is not None:
                progress(trial)
            if index == 1 or index % sample_every == 0:  # after the first: the baseline (first-time costs paid)
                soak.sample(index)
        results = summarize(done, soak.samples, seed=seed, started=started, finished=time.time(), pid=os.getpid())
    results["grew"] = flat(soak.samples, rss_mib=RSS_TOLERANCE_MIB)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default: {OUTPUT} (with --publish: the tracked soak/results.json)")
    parser.add_argument("--publish", action="store_true", default=os.environ.get("SOAK_PUBLISH") == "1",
                        help="write the tracked soak/results.json (SOAK_PUBLISH=1)")
    parser.add_argument("--sample-every", type=int, default=10, help="sample the process every N trials")
    parser.add_argument("--phases", default=os.environ.get("SOAK_PHASES", ""),
                        help=f"comma-separated phases the trials draw from (SOAK_PHASES; default: {','.join(PHASES)})")
    args = parser.parse_args(argv)
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip()) or PHASES
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"no such phase(s): {', '.join(unknown)} (the phases: {', '.join(PHASES)})")
    out: Path = args.out or (PUBLISHED if args.publish else OUTPUT)
    trials = int(os.environ.get("SOAK_TRIALS", "100"))
    seed_text = os.environ.get("SOAK_SEED", "0")
    seed = random.SystemRandom().randrange(2**32) if seed_text == "random" else int(seed_text)
    print(f"soak: {trials} trials, seed {seed} (replay with SOAK_SEED={seed}), pid {os.getpid()}"
          + ("" if phases == PHASES else f", phases {','.join(phases)}"), flush=True)

    def show(trial: Trial) -> None:
        status = "ok" if trial.ok else "FAILED: " + "; ".join(p.splitlines()[0] for p in trial.problems)
        print(f"  trial {trial.index:>4} {trial.phase:<15} {trial.variant:<15} {trial.seconds:6.1f}s {status}",
              flush=True)

    with tempfile.TemporaryDirectory(prefix="ckptd-soak-") as tmp:
        results = run_soak(trials, seed, Path(tmp), sample_every=args.sample_every, phases=phases,
                           progress=show)
    write(results, out)
    print()
    print(markdown(results))
    if results["grew"]:
        print(f"\nNOT FLAT: {results['grew']}")
    print(f"\nresults: {out}")
    return 0 if results["successes"] == trials and not results["grew"] else 1


if __name__ == "__main__":
    sys.exit(main())
