"""The autopilot's host-memory and storage constraints (docs/planning.md, "Autopilot in a run"): the host's memory
limit read from the machine, whatever its files hold; a host-memory tier that does not fit beside the others
turned off (the shared-memory tier's saves going to Orbax, the replica tier for good); a storage bandwidth or request
rate that lengthens the persistent period; the constraints in force in each decision's event. On the scripted run of
``test_autopilot_runner``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.trainer.runtime.test_autopilot_runner import STEP, Replicas, Run
from trainer_client.core import protocol as p
from trainer_client.runtime.autopilot._autopilot_costs import Footprint, estimated_requests
from trainer_client.runtime.autopilot._host_memory import (
    RESERVE_FRACTION,
    HostMemory,
    host_memory_budget,
    host_memory_limit,
)
from trainer_client.runtime.autopilot._options import AutopilotOptions

GB = 10**9
GIB = 1 << 30


def _machine(tmp_path: Path, cgroup: str, files: dict[str, str], meminfo: str = "MemTotal:  16777216 kB\n",
             ) -> tuple[Path, Path]:
    """A fake ``/proc`` and ``/sys/fs/cgroup`` under ``tmp_path``: ``files`` by path under the cgroup root."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(meminfo)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def test_the_smallest_limit_set_on_the_cgroup_or_above_it_or_the_machines(tmp_path: Path) -> None:
    # cgroup v2: the process's own cgroup has no limit, its parent has 4 GiB; the machine has 16 GiB
    proc, root = _machine(tmp_path / "v2", "0::/pod/trainer\n", {"pod/trainer/memory.max": "max\n",
                                                                  "pod/memory.max": f"{4 * GIB}\n"})
    assert host_memory_limit(proc, root) == (4 * GIB, "cgroup v2 memory.max")
    # cgroup v1: unlimited (2^63 rounded down to a page) counts as no limit: the machine's memory
    proc, root = _machine(tmp_path / "v1", "4:memory:/job\n1:cpu:/\n",
                          {"memory/job/memory.limit_in_bytes": "9223372036854771712\n"})
    assert host_memory_limit(proc, root) == (16 * GIB, "/proc/meminfo MemTotal")
    proc, root = _machine(tmp_path / "v1b", "7:cpuacct,memory:/job\n",
                          {"memory/job/memory.limit_in_bytes": f"{2 * GIB}"})
    assert host_memory_limit(proc, root) == (2 * GIB, "cgroup v1 memory.limit_in_bytes")
    # a limit above the machine's memory: the machine's
    proc, root = _machine(tmp_path / "big", "0::/\n", {"memory.max": f"{64 * GIB}"})
    assert host_memory_limit(proc, root) == (16 * GIB, "/proc/meminfo MemTotal")
    budget = host_memory_budget(None, proc, root)
    assert budget is not None and budget.budget_bytes == pytest.approx(16 * GIB * (1 - RESERVE_FRACTION))
    assert budget.source.startswith("/proc/meminfo MemTotal")
    assert host_memory_budget(3 * GB, proc, root) == HostMemory(3 * GB, "option")  # the user's bound wins


@pytest.mark.parametrize("garbage", ["-1", "1e9", "0x100000000", "4294967296 4294967296", "", "\x00\x01\x02",
                                     "99999999999999999999999999", "12", "٤٢٩٤٩٦٧٢٩٦", "4294967296\n" + "9" * 70000])
def test_every_value_read_is_hostile(tmp_path: Path, garbage: str) -> None:
    """A limit that is not a plausible number of bytes is no limit; a meminfo line that is not one is no answer."""
    proc, root = _machine(tmp_path, "0::/a\n", {"a/memory.max": garbage},
                          meminfo=f"MemFree: 1 kB\nMemTotal: {garbage} kB\n")
    assert host_memory_limit(proc, root) is None
    assert host_memory_budget(None, proc, root) is None


def test_paths_that_climb_links_and_directories_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "memory.max").write_text(f"{GIB}")
    proc, root = _machine(tmp_path / "m", "0::/../../outside\n4:memory:/a/../..\n", {}, meminfo="garbage\n")
    assert host_memory_limit(proc, root) is None  # the cgroup path climbs: not followed
    proc, root = _machine(tmp_path / "l", "0::/a\n", {}, meminfo="")
    (root / "a").mkdir(parents=True)
    os.symlink(outside / "memory.max", root / "a" / "memory.max")
    (root / "memory.max").mkdir()  # a directory where a file should be
    assert host_memory_limit(proc, root) is None
    (proc / "self" / "cgroup").unlink()
    (proc / "self" / "cgroup").mkdir()
    (proc / "meminfo").write_text("MemTotal: 1048576 kB\n")
    assert host_memory_limit(proc, root) == (GIB, "/proc/meminfo MemTotal")


def _memory_on(run: Run) -> bool:
    return run.pilot.periods.memory_tier


def test_a_tier_that_does_not_fit_the_hosts_memory_is_turned_off() -> None:
    """Replica snapshots holding 2 GB, shared-memory snapshots 6 GB (its files and the spare): with a budget of
    10 GB both are on; with 5 GB the shared-memory tier does not fit beside the replicas, nor alone, and is turned
    off (its persistent saves go to Orbax from then on); with the replicas at 8 GB and 5 GB of budget, the replica
    tier is turned off instead and the shared-memory tier stays."""
    footprint = Footprint(memory_bytes=lambda: 6 * GB)
    turned: list[bool] = []
    roomy = Run(AutopilotOptions(mtbf_hours=4.0), replicas=Replicas(host_bytes=2 * GB), footprint=footprint,
                host_memory=HostMemory(10 * GB, "option"), use_memory_tier=turned.append)
    roomy.train(600.0)
    first = roomy.decided()[0]
    assert first["autopilot_memory_period"] is not None and first["autopilot_replicas_period"] is not None
    assert (first["autopilot_host_memory_bytes"], first["autopilot_host_memory_source"]) == (10 * GB, "option")
    assert (first["autopilot_memory_host_bytes"], first["autopilot_replicas_host_bytes"]) == (6 * GB, 2 * GB)
    assert _memory_on(roomy) and turned == []

    tight = Run(AutopilotOptions(mtbf_hours=4.0), replicas=Replicas(host_bytes=2 * GB), footprint=footprint,
                host_memory=HostMemory(5 * GB, "option"), use_memory_tier=turned.append)
    tight.train(600.0)
    decided = tight.decided()
    off = next(i for i, f in enumerate(decided) if f["autopilot_memory_period"] is None)
    assert decided[off]["autopilot_replicas_period"] is not None and tight.replicas is not None
    assert tight.replicas.off_reason is None
    assert not _memory_on(tight) and tight.pilot.periods.memory is None and turned == [False]
    p.ElasticEvent(kind="autopilot_decided", time=1.0, **decided[off])  # every field one the event carries
    # from the boundary it was turned off at, every persistent save went to Orbax
    at = next(step for step, _, _, on in tight.in_force if not on)
    saved = [fields["tier"] for kind, step, fields in tight.events if kind == "checkpoint_started" and step >= at]
    assert saved and set(saved) == {"storage"}

    replicas = Replicas(host_bytes=8 * GB)
    big = Run(AutopilotOptions(mtbf_hours=4.0), replicas=replicas, footprint=Footprint(memory_bytes=lambda: 2 * GB),
              host_memory=HostMemory(5 * GB, "option"))
    big.train(600.0)
    assert replicas.off_reason is not None and _memory_on(big)
    decided = big.decided()
    off = next(f for f in decided if "autopilot_replicas_period" in f and f["autopilot_replicas_period"] is None)
    assert off["autopilot_memory_period"] is not None
    assert "autopilot_replicas_period" not in decided[-1]  # later choices are made without the tier


def test_a_storage_bandwidth_lengthens_the_persistent_period() -> None:
    """A save of 20 GB under 10 MB/s: one every 2,000 s at most, where the model alone persists far more often."""
    size = Footprint(step_size=lambda: (20 * GB, 8))
    free = Run(AutopilotOptions(mtbf_hours=1.0), footprint=size)
    free.train(600.0)
    free_persist = free.pilot.periods.persist
    assert free_persist * STEP < 2000
    limited = Run(AutopilotOptions(mtbf_hours=1.0, storage_bytes_per_s=10e6), footprint=size)
    limited.train(600.0)
    persist, memory = limited.pilot.periods.persist, limited.pilot.periods.memory
    assert persist * STEP >= 20 * GB / 10e6 and persist > free_persist
    assert memory is not None and persist % memory == 0  # still persisted from a memory snapshot
    last = limited.decided()[-1]
    assert last["autopilot_storage_bound"] == "storage bandwidth" and last["autopilot_storage_period"] == persist
    assert (last["autopilot_storage_write_bytes"], last["autopilot_storage_bytes_per_s"]) == (20 * GB, 10e6)
    assert free.decided()[-1]["autopilot_storage_bytes_per_s"] is None  # no limit: none in force


def test_a_storage_request_rate_lengthens_the_persistent_period() -> None:
    """8 arrays: ~104 requests a save (estimated), at most 0.05 a second: one save every 2,080 s at most; told
    that a save makes 10, every 200 s."""
    size = Footprint(step_size=lambda: (GB, 8))
    estimated = estimated_requests(8)
    assert estimated == 104
    limited = Run(AutopilotOptions(mtbf_hours=1.0, storage_requests_per_s=0.05), footprint=size)
    limited.train(600.0)
    last = limited.decided()[-1]
    assert limited.pilot.periods.persist * STEP >= estimated / 0.05
    assert last["autopilot_storage_bound"] == "storage requests" and last["autopilot_storage_requests"] == estimated
    given = Run(AutopilotOptions(mtbf_hours=1.0, storage_requests_per_s=0.05, storage_requests_per_save=10),
                footprint=size)
    given.train(600.0)
    assert 10 / 0.05 <= given.pilot.periods.persist * STEP < estimated / 0.05
    assert given.decided()[-1]["autopilot_storage_requests"] == 10


def test_the_options_refuse_limits_that_are_not_positive() -> None:
    for name in ("host_memory_budget_bytes", "storage_bytes_per_s", "storage_requests_per_s",
                 "storage_requests_per_save"):
        for bad in (0, -1, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=name):
                AutopilotOptions(**{name: bad})


class _Tier:
    """A memory tier whose snapshots succeed; ``closed``: how often its spare's memory was given back."""

    last_blocked_s = 0.01
    process_count = 1

    def __init__(self) -> None:
        self.saved: list[int] = []
        self.closed = 0

    def save(self, step: int, state: object, meta: object, **_: object) -> None:
        self.saved.append(step)

    def close(self) -> None:
        self.closed += 1


def test_the_saver_goes_to_orbax_while_the_memory_tier_is_off_and_sizes_each_save() -> None:
    import numpy as np

    from tests.trainer.runtime.test_save_route import _Checkpointer
    from trainer_client.runtime.saving._saver import Saver, StepSize

    tier, checkpointer = _Tier(), _Checkpointer()
    saver = Saver(checkpointer, tier, None)  # type: ignore[arg-type]
    state = {"w": np.zeros((4, 4), np.float32), "b": np.zeros(3, np.float64), "step": 5, "name": "x"}
    assert saver.save(1, state, None, persist=True) == "memory+persist"  # type: ignore[arg-type]
    assert saver.last_size == StepSize(64 + 24, 2)
    saver.use_memory_tier(False)
    assert tier.closed == 1  # the spare file's memory given back at once
    assert saver.save(2, state, None, persist=True) == "storage"  # type: ignore[arg-type]
    assert saver.save(3, state, None, persist=False) == "storage"  # type: ignore[arg-type]
    saver.use_memory_tier(False)
    saver.use_memory_tier(True)
    assert saver.save(4, state, None, persist=True) == "memory+persist"  # type: ignore[arg-type]
    assert (tier.saved, checkpointer.saved, tier.closed) == ([1, 4], [2, 3], 1)
