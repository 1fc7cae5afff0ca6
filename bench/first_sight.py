"""First sight: what ckptd pays per step it has no records for (``first_sight_ms_per_step``).

Pointing ckptd at an existing bucket, or starting it after its records were lost, makes it verify every
step the full way (docs/operations.md, "First sight"): the commit rule and Orbax's structure, the manifest
against the step's files, the training metadata against the manifest, the seal, fsync, and the verified
record that every later start reads instead. This family times exactly that, ``Catalog.rebuild()`` over
steps of ``profile.state_arrays`` arrays (1,000 in the full and quick profiles) that carry no verified
record, and divides by the steps.

The steps are fabricated as the service family fabricates them (``bench.service.fabricate``: one real step
saved by trainer_client, the others hard-linked to its data with their own ``_CHECKPOINT_METADATA`` and
manifest). Beside each sample, in alternating order, the same number of fresh steps is *read raw*: every
step listed and its files read whole (no parsing, no writing), the least any first sight could do. Their
ratio is the robust figure on a shared machine; both are recorded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import Figure, Profile, Results, alternate, filesystem_of, rmtree
from bench.service import JOB, _template_step, fabricate

TARGET_MS = 5.0
# steps per sample and samples, by profile
_STEPS = {"full": 400, "quick": 200, "toy": 12}
_REPEATS = {"full": 5, "quick": 3, "toy": 1}


def _first_sight_ms(root: Path, state: Path, steps: int) -> float:
    """``Catalog.rebuild()`` of ``root`` (a fresh catalog: no records anywhere), per step; every step must
    come out verified."""
    from ckptd.catalog._catalog import Catalog
    from trainer_client.core._storage import Storage

    rmtree(state)
    state.mkdir(parents=True)
    catalog = Catalog(Storage(str(root)), state / "catalog.sqlite3")
    started = time.perf_counter()
    catalog.rebuild()
    seconds = time.perf_counter() - started
    verified = sum(1 for info in catalog.checkpoints(JOB) if info.state.value == "verified")
    catalog.close()
    if verified != steps:
        raise RuntimeError(f"first sight verified {verified} of {steps} steps")
    return seconds * 1000 / steps


def _raw_read_ms(job_dir: Path, steps: int) -> float:
    """List every step and read every file whole, per step: the floor of any first sight."""
    started = time.perf_counter()
    total = 0
    for step_dir in sorted(job_dir.iterdir()):
        for current, _dirs, names in os.walk(step_dir):
            for name in names:
                with open(os.path.join(current, name), "rb") as f:
                    total += len(f.read())
    seconds = time.perf_counter() - started
    if total == 0:
        raise RuntimeError("nothing read")
    return seconds * 1000 / steps


def run_first_sight(profile: Profile, results: Results, base: Path) -> None:
    steps = _STEPS[profile.name]
    base.mkdir(parents=True, exist_ok=True)
    template = _template_step(profile, base / "template")
    files = sum(len(names) for _, _, names in os.walk(template))
    print(f"first sight: {steps} steps of {profile.state_arrays} arrays ({files} files each) per sample", flush=True)
    sight: list[float] = []
    raw: list[float] = []
    for i in range(_REPEATS[profile.name]):
        sight_root, raw_root = base / f"sight{i}", base / f"raw{i}"
        fabricate(template, sight_root / JOB, steps)
        fabricate(template, raw_root / JOB, steps)

        def measure_sight(root: Path = sight_root, k: int = i) -> None:
            sight.append(_first_sight_ms(root, base / f"state{k}", steps))

        def measure_raw(root: Path = raw_root) -> None:
            raw.append(_raw_read_ms(root / JOB, steps))

        alternate(i, measure_sight, measure_raw)
        print(f"    sample {i + 1}: first sight {sight[-1]:.2f} ms/step, raw read {raw[-1]:.2f} ms/step", flush=True)
        rmtree(sight_root)
        rmtree(raw_root)
        rmtree(base / f"state{i}")
    ratios = [s / r for s, r in zip(sight, raw, strict=True)]
    results.measure("first_sight.raw_read_ms_per_step", raw, "ms",
                    "every file of a step read whole (listed, opened, read; no parsing, no writing), per step")
    results.measure("first_sight.ratio_vs_raw_read", ratios, "x",
                    "first sight / raw read of the same number of fresh steps, side by side in each sample")
    results.figure(Figure(
        "first_sight_ms_per_step", sight, "<=", TARGET_MS, "ms",
        f"Catalog.rebuild() over {steps} committed steps of {profile.state_arrays} arrays with no verified record "
        "(quick validation, seal, fsync, verified record written), per step; local disk, warm page cache",
        {"steps": steps, "arrays": profile.state_arrays, "files_per_step": files,
         "raw_read_ms_per_step_median": round(sorted(raw)[len(raw) // 2], 3),
         "ratio_vs_raw_read": [round(r, 2) for r in ratios], "filesystem": filesystem_of(base)}))
    rmtree(base / "template")


__all__ = ["run_first_sight"]
