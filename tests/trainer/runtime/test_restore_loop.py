"""The one restore loop (``trainer_client/runtime/restore/_restore_loop.py``): a plan's step is restored; when its tier
cannot give it, the next plan without that tier (and every faster one) is asked for and tried, each tier once.
Replicas with no whole copy go on to memory or storage (or start afresh when no tier holds a step); a memory
snapshot whose bytes no longer match, or that is gone by the time it is read, goes on to storage (when the
storage step keeps the mesh; otherwise the memory error stands); a storage restore's errors stand."""

from __future__ import annotations

from typing import Any

import pytest

from trainer_client.core._errors import NoWholeReplica, StoredFormatError
from trainer_client.core.protocol import MeshSpec, ResumePlan, Tier
from trainer_client.runtime.restore import _restore_loop
from trainer_client.runtime.restore._restore_loop import restore_by_plan, restore_from_plan

REPLICAS, MEMORY, STORAGE = Tier.REPLICAS, Tier.MEMORY, Tier.STORAGE


def _plan(tier: Tier, step: int = 10, shape: tuple[int, int] = (4, 2)) -> ResumePlan:
    mesh = MeshSpec(axis_names=["replica", "data"], shape=list(shape))
    return ResumePlan(job="job", step=step, path=f"/{tier}/{step}", policy="resize", mesh=mesh, saved_mesh=mesh,
                      tier=tier)


class Tiers:
    """A restore that fails for the tiers in ``failing`` (with ``errors[tier]``), and the next plans on offer."""

    def __init__(self, failing: dict[Tier, Exception], offered: dict[Tier, ResumePlan | None]) -> None:
        self.failing, self.offered = failing, offered
        self.tried: list[Tier] = []
        self.asked: list[frozenset[Tier]] = []

    def restore(self, plan: ResumePlan) -> str:
        self.tried.append(Tier(plan.tier))
        if plan.tier in self.failing:
            raise self.failing[Tier(plan.tier)]
        return f"state from {plan.tier}"

    def next_plan(self, excluded: frozenset[Tier]) -> ResumePlan | None:
        self.asked.append(excluded)
        return next((p for tier, p in self.offered.items() if tier not in excluded), None)


@pytest.mark.parametrize("error", [StoredFormatError("checksum differs"), FileNotFoundError("snapshot.json is gone")])
def test_a_memory_snapshot_that_cannot_be_read_sends_the_restore_to_storage(error: Exception) -> None:
    storage = _plan(STORAGE, 8)
    tiers = Tiers({MEMORY: error}, {MEMORY: _plan(MEMORY), STORAGE: storage})
    assert restore_by_plan(_plan(MEMORY), tiers.restore, tiers.next_plan) == ("state from storage", storage)
    assert (tiers.tried, tiers.asked) == ([MEMORY, STORAGE], [{REPLICAS, MEMORY}])
    for offered in ({STORAGE: _plan(STORAGE, 8, (3, 2))}, {}):  # storage needs another mesh, or holds nothing
        tiers = Tiers({MEMORY: error}, offered)
        with pytest.raises(type(error)):  # the memory error stands
            restore_by_plan(_plan(MEMORY), tiers.restore, tiers.next_plan)


def test_a_storage_plans_error_stands_and_nothing_else_is_asked() -> None:
    tiers = Tiers({STORAGE: FileNotFoundError("step gone")}, {STORAGE: _plan(STORAGE)})
    with pytest.raises(FileNotFoundError):
        restore_by_plan(_plan(STORAGE), tiers.restore, tiers.next_plan)
    assert (tiers.tried, tiers.asked) == ([STORAGE], [])


def test_each_failing_tier_is_left_out_and_the_next_plan_tried_once() -> None:
    """Replicas without a whole copy, then a damaged memory snapshot: storage, each tier tried once, each next
    plan asked without the tiers that failed (and every faster one)."""
    tiers = Tiers({REPLICAS: NoWholeReplica("slices 0 and 1 lost"), MEMORY: StoredFormatError("checksum")},
                  {MEMORY: _plan(MEMORY, 9), STORAGE: _plan(STORAGE, 8)})
    state, plan = restore_by_plan(_plan(REPLICAS, 12), tiers.restore, tiers.next_plan) or (None, None)
    assert (state, plan) == ("state from storage", _plan(STORAGE, 8))
    assert tiers.tried == [REPLICAS, MEMORY, STORAGE]
    assert tiers.asked == [{REPLICAS}, {REPLICAS, MEMORY}]


def test_a_next_plan_of_a_tier_that_failed_is_not_tried_again() -> None:
    again = Tiers({MEMORY: StoredFormatError("checksum")}, {})
    again.next_plan = lambda excluded: _plan(MEMORY, 9)  # type: ignore[method-assign]
    with pytest.raises(StoredFormatError):
        restore_by_plan(_plan(MEMORY), again.restore, again.next_plan)
    assert again.tried == [MEMORY]


def test_replicas_with_no_other_tier_holding_a_step_start_afresh_on_any_mesh_otherwise() -> None:
    tiers = Tiers({REPLICAS: NoWholeReplica("nothing held yet")}, {})
    assert restore_by_plan(_plan(REPLICAS), tiers.restore, tiers.next_plan) is None
    other = _plan(STORAGE, 8, (3, 2))  # laid out on another mesh: restored onto the attempt's all the same
    tiers = Tiers({REPLICAS: NoWholeReplica("lost")}, {STORAGE: other})
    assert restore_by_plan(_plan(REPLICAS), tiers.restore, tiers.next_plan) == ("state from storage", other)


def test_any_error_is_a_tier_failure_where_the_caller_says_so() -> None:
    """The multi-controller agreement: a memory restore that failed in any process, whatever the error, sends
    every process to storage (``failed_tier``)."""
    storage = _plan(STORAGE, 8)
    tiers = Tiers({MEMORY: RuntimeError("restore of step 10 failed in process 1")}, {STORAGE: storage})
    with pytest.raises(RuntimeError):
        restore_by_plan(_plan(MEMORY), tiers.restore, tiers.next_plan)
    assert restore_by_plan(_plan(MEMORY), tiers.restore, tiers.next_plan,
                           failed_tier=lambda plan, error: MEMORY) == ("state from storage", storage)


def test_a_plan_is_read_from_the_tier_it_names_within_the_host_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[tuple[str, Any]] = []
    monkeypatch.setattr(_restore_loop, "restore_snapshot", lambda path, target: read.append(("shm", path)))
    monkeypatch.setattr(_restore_loop, "restore", lambda path, target, host_bytes=None: read.append(
        ("orbax", host_bytes)))
    restore_from_plan(_plan(MEMORY), None, 1 << 20)
    restore_from_plan(_plan(STORAGE), None, 1 << 20)
    assert read == [("shm", "/memory/10"), ("orbax", 1 << 20)]  # the runner's budget (restore_host_bytes)
