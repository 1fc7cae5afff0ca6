"""What every benchmark family shares: the profile (full, quick, toy), timing, statistics, the machine,
the page cache, and the record that becomes ``bench/results.json``.

No jax here: ``bench.run`` sets the device flags before anything imports jax.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

SCHEMA = "ckptd-bench/1"


MAX_KEPT_SAMPLES = 1000  # results.json keeps raw samples up to this many per measurement

@dataclass(frozen=True)
class Profile:
    """How big and how often. ``full`` is what ``make bench`` runs; ``quick`` (BENCH_QUICK=1) measures every
    figure on a smaller state with fewer repeats; ``toy`` only proves the harness runs (the smoke test)."""

    name: Literal["full", "quick", "toy", "device"]
    arrays: int  # the save/persist/restore state: ``arrays`` float32 arrays of rows x cols
    rows: int  # divisible by 8 and by 6 (sharded by rows over 8 devices, resharded onto 6)
    cols: int
    repeats: int  # repeats of every io measurement (each one side by side with its baseline)
    steps: int  # catalogued steps of the service benchmark
    state_arrays: int  # arrays in the training metadata of each catalogued step
    resume_requests: int  # sequential resume requests (p99)
    bursts: int  # bursts of 64 concurrent resume requests
    rebuilds: int  # catalog rebuilds timed (a ckptd restart each)
    recovery_repeats: int
    cold_reads: bool  # cold restores: the files they read evicted from the page cache before each
    persist_child: bool = True  # run the persist worker as ckptd does (a child process importing jax)
    rss_capped: bool = True  # also measure the peak RSS of a restore capped at a quarter of the state (a child)
    oneshot_repeats: int | None = None  # repeats that also time the one-shot persist CLI (None: every repeat)
    interference_repeats: int | None = None  # repeats of the interference family (None: ``repeats``)
    multihost_rows: int | None = None  # the multi-host families' state: ``arrays`` x multihost_rows x cols
    # the device profile (bench/device_profile.py): bench/decoder.py's size, and bench/device.py's replica schedule
    # (steps without the tier and with it per arm, repeats); ``repeats``: of the restores and the save stall
    decoder: str | None = None
    replica_schedule: tuple[int, int, int] | None = None

    @property
    def multihost_shape(self) -> tuple[int, int, int]:
        return (self.multihost_rows or self.rows, self.cols, self.arrays)

    @property
    def multihost_state_bytes(self) -> int:
        rows, cols, arrays = self.multihost_shape
        return rows * cols * arrays * 4

    @property
    def state_bytes(self) -> int:
        return self.arrays * self.rows * self.cols * 4


PROFILES: dict[str, Profile] = {
    # 8 x 12288 x 5632 float32 = 2.06 GiB (16384 x 4096 rows would not divide by 6).
    # The catalog work grows with steps x arrays: 10,000 steps of 1,000 arrays take minutes per rebuild here.
    "full": Profile("full", 8, 12288, 5632, 5, 10_000, 1000, 500, 5, 1, 5, True),
    # 8 x 6144 x 5632 float32 = 1.03 GiB: at 264 MiB the persist's fixed costs (~0.1-0.25 s) were half of a
    # write and the quick ratios a floor of the full ones; five repeats, so that a min .. max of the quick run
    # holds the full run's median when nothing differs (3 samples: 75% of the time; 5: 94%).
    # 1,000 catalogued steps (the key's name says 10k: see "steps").
    # Within its 10 minutes: the one-shot CLI (beside a key: a fresh process per persist, ~5 s each) is timed in
    # the first two repeats; the interference family (measurements, no key) repeats 3 times; the multi-host
    # families (ratios of two paths on the same state) run on half the rows (528 MiB).
    "quick": Profile("quick", 8, 6144, 5632, 5, 1_000, 1000, 300, 3, 1, 3, True, oneshot_repeats=2,
                     interference_repeats=3, multihost_rows=3072),
    # The smoke test: proves the harness runs (the persist worker runs in-process, not as a child).
    "toy": Profile("toy", 4, 48, 32, 1, 12, 10, 20, 1, 1, 1, False, persist_child=False, rss_capped=False),
}


# The device profile, by bench/decoder.py's size: "chip" fits the run in ~8 minutes on one TPU v5e chip (the replica
# tier's arms ~2 min of it); "toy" runs in seconds on CPU devices (tests/bench/test_bench_device.py)
DEVICE_PROFILES: dict[str, Profile] = {
    size: Profile("device", 0, 0, 0, repeats, 0, 0, 0, 0, 0, 1, False, persist_child=False, rss_capped=False,
                  decoder=size, replica_schedule=schedule)
    for size, repeats, schedule in (("chip", 2, (40, 180, 1)), ("chip-small", 2, (40, 160, 1)), ("toy", 1, (4, 60, 1)))
}


def profile_from_env(name: str | None = None) -> Profile:
    if name is None:
        name = "quick" if os.environ.get("BENCH_QUICK", "") not in ("", "0") else "full"
    return PROFILES[name]


# ---- statistics ---------------------------------------------------------------------------------


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median and spread of repeated runs, with the raw samples."""
    values = [float(v) for v in samples]
    if not values:
        return {"n": 0, "samples": [], "median": None, "min": None, "max": None, "spread": None}
    return {
        "n": len(values),
        "samples": [round(v, 6) for v in values],
        "median": round(statistics.median(values), 6),
        "min": round(min(values), 6),
        "max": round(max(values), 6),
        # half the range relative to the median: what a second run of the same profile may differ by
        "spread": round((max(values) - min(values)) / 2 / abs(statistics.median(values)), 4)
        if statistics.median(values) else None,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Timer:
    seconds: float = 0.0


@contextmanager
def timed() -> Iterator[Timer]:
    timer = Timer()
    started = time.perf_counter()
    try:
        yield timer
    finally:
        timer.seconds = time.perf_counter() - started


# ---- the record ---------------------------------------------------------------------------------

Op = Literal["<=", ">="]


@dataclass
class Figure:
    """One key of results.json: the median of its samples against the target."""

    key: str
    samples: list[float]
    op: Op
    target: float
    unit: str
    what: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        stats = summary(self.samples)
        value = stats["median"]
        passed = value is not None and (value <= self.target if self.op == "<=" else value >= self.target)
        return {"value": value, "unit": self.unit, "target": f"{self.op} {self.target:g}", "pass": passed,
                "what": self.what, **stats, "details": self.details}


@dataclass
class Results:
    profile: Profile
    figures: dict[str, Figure] = field(default_factory=dict)
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    on_progress: Callable[[], None] | None = field(default=None, repr=False)

    def progress(self) -> None:
        """Write what is measured so far (bench.run sets the writer)."""
        if self.on_progress is not None:
            self.on_progress()

    def measure(self, name: str, samples: Sequence[float], unit: str, what: str = "") -> dict[str, Any]:
        """Record a component measurement (raw samples and their spread) and print it; more than
        ``MAX_KEPT_SAMPLES`` samples (a loop's step times) are summarised, not kept."""
        entry = {"unit": unit, "what": what, **summary(samples)}
        if len(samples) > MAX_KEPT_SAMPLES:
            entry.pop("samples", None)
            entry["what"] = f"{what} (samples left out: {len(samples)})"
        self.measurements[name] = entry
        print(f"  {name:<52} median {_fmt(entry['median'])} {unit}  [{_fmt(entry['min'])} .. {_fmt(entry['max'])}]"
              f"  n={entry['n']}", flush=True)
        return entry

    def figure(self, fig: Figure) -> dict[str, Any]:
        self.figures[fig.key] = fig
        out = fig.to_json()
        mark = "PASS" if out["pass"] else "MISS"
        print(f"* {fig.key} = {_fmt(out['value'])} {fig.unit} (target {out['target']}) {mark}"
              f"  [{_fmt(out['min'])} .. {_fmt(out['max'])}] n={out['n']}", flush=True)
        return out

    def to_json(self, started: float, finished: float) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "profile": asdict(self.profile),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "duration_s": round(finished - started, 1),
            "machine": machine(),
            "context": self.context,
            "keys": {k: f.to_json() for k, f in self.figures.items()},
            "measurements": self.measurements,
            "notes": self.notes,
            "errors": self.errors,
        }


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.3f}"
    return f"{value:.4f}"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)


# ---- the machine and the page cache ---------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "jax": _version("jax"),
        "orbax-checkpoint": _version("orbax-checkpoint"),
        "tensorstore": _version("tensorstore"),
        "numpy": _version("numpy"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def filesystem_of(path: str | os.PathLike[str]) -> str:
    try:
        out = subprocess.run(["df", "--output=source,fstype,target", str(path)], capture_output=True, text=True,
                             check=False, timeout=10).stdout.splitlines()
        return " ".join(out[-1].split()) if len(out) > 1 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def evict_from_page_cache(*roots: Path) -> bool:
    """Make every file under ``roots`` cold: written back (``sync``), then dropped from the page cache with
    ``posix_fadvise(DONTNEED)`` (no root needed, and nothing else is evicted). False where that call is
    missing (not Linux): reads stay warm.

    Not ``echo 3 > /proc/sys/vm/drop_caches``: dropping the whole page cache also flags every page of shared
    memory (tmpfs pages cannot be dropped; they are marked for reclaim instead, and that flag is the one the
    kernel's fault-around reads as "readahead": it stops mapping them ahead), until they are written again.
    A memory-tier restore after it took 16x the page faults, 0.33 s a GiB instead of 0.11 (measured,
    docs/benchmarks.md): a state no real host's snapshot is in. For the same reason never pass a directory
    in shared memory."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def free_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def rmtree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)


def alternate(i: int, first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run both, in alternating order by repeat, so neither always runs on a warmer or quieter machine."""
    if i % 2 == 0:
        first()
        second()
    else:
        second()
        first()


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """SIGTERM ``proc`` and wait up to ``timeout`` seconds; past that, SIGKILL it and reap it. True when it
    stopped on SIGTERM (or had already exited)."""
    if proc.poll() is not None:
        return True
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
        return False
