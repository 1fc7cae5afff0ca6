"""Two real ``ckptd serve`` processes on one root with ``CKPTD_LEASE_TTL_S`` and a forged epoch planted in the
job's lease directory before they start (docs/operations.md, "Several sidecars on one root"). Before,
``epoch-99999999999999999999.json`` made the first takeover create a 21-digit epoch no listing finds: the
job's leadership could never move again. Now the forged name is reported once by each sidecar and ignored,
never deleted; one sidecar leads a valid epoch within the lease time and verifies the steps; SIGKILLed, the
other leads within the lease time and verifies the next step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from ckptd.lease._lease import MAX_EPOCH, epoch_name
from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import wait_until
from tests.support.lease_views import lease_view
from tests.support.orbax_steps import write_orbax_steps

TTL_S = 2.0
JOB = "job"
FORGED = "epoch-99999999999999999999.json"
LEAD_LIMIT_S = TTL_S + TTL_S / 4 + 4.0  # the lease time, one tick, and a margin for a loaded 2-core machine


def _view(proc: CkptdProcess) -> dict[str, Any] | None:
    return lease_view(proc, JOB)


def _leader(procs: list[CkptdProcess]) -> CkptdProcess | None:
    """The one sidecar leading a valid epoch that storage lists, when exactly one does."""
    views = [(p, _view(p)) for p in procs]
    leaders = [(p, v) for p, v in views if v is not None and v["role"] == "leader"]
    if len(leaders) != 1:
        return None
    proc, view = leaders[0]
    assert 0 <= view["epoch"] <= MAX_EPOCH and view["holder"] == view["me"], view
    return proc


def _serves(proc: CkptdProcess, step: int) -> bool:
    got = httpx.get(f"{proc.url}/v1/jobs/{JOB}/checkpoints/latest-good", timeout=10).json()
    return bool(got.get("step") == step)


def test_a_forged_epoch_leaves_the_job_a_leader_and_takeovers(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_orbax_steps(str(root / JOB), [1])  # plain Orbax: the leader adopts it, the follower serves it after
    lease_dir = root / JOB / ".ckptd" / "leader"
    lease_dir.mkdir(parents=True)
    forged = json.dumps({"holder": "forger/1/x", "ttl_s": TTL_S, "created_at": time.time()})
    (lease_dir / FORGED).write_text(forged)
    procs = [CkptdProcess(str(root), tmp_path / f"state{i}", log_path=tmp_path / f"ckptd{i}.log",
                          env={"CKPTD_LEASE_TTL_S": str(TTL_S), "CKPTD_ADOPT_AFTER_S": "0"},
                          refresh_interval_s=TTL_S / 8) for i in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        ready_at = time.monotonic()
        leader = wait_until(lambda: _leader(procs), timeout=LEAD_LIMIT_S, what="one leader of a valid epoch")
        print(f"[lease] a forged epoch: led {time.monotonic() - ready_at:.2f}s after both were ready (ttl {TTL_S}s)")
        epoch = _view(leader)["epoch"]  # type: ignore[index]
        assert (lease_dir / epoch_name(epoch)).is_file()
        wait_until(lambda: all(_serves(p, 1) for p in procs), timeout=20, what="step 1 verified and served")

        leader.kill()
        killed_at = time.monotonic()
        survivor = next(p for p in procs if p is not leader)
        wait_until(lambda: _leader([survivor]), timeout=LEAD_LIMIT_S, what="a takeover")
        print(f"[lease] takeover {time.monotonic() - killed_at:.2f}s after the leader's SIGKILL")
        assert _view(survivor)["epoch"] > epoch  # type: ignore[index]
        write_orbax_steps(str(root / JOB), [2])
        wait_until(lambda: _serves(survivor, 2), timeout=20, what="step 2 verified by the new leader")
    finally:
        for p in procs:
            p.stop()
    assert (lease_dir / FORGED).read_text() == forged  # ignored, never deleted
    for p in procs:
        reports = [line for line in p.log_path.read_text().splitlines() if f"ignoring {FORGED}" in line]
        assert len(reports) == 1, (p.log_path, reports)
