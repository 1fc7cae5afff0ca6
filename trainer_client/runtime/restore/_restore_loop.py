"""The one restore loop: restore the plan's step; when its tier cannot give it, the next plan without that tier.

A resume plan names one tier (``protocol.Tier``: replicas, memory, storage, fastest first). What it names can
still fail to come back: the replicas no longer hold a whole copy on the slices left (``NoWholeReplica``), a
memory snapshot's bytes no longer match their checksums or it was evicted after the plan named it
(``StoredFormatError``, ``FileNotFoundError``). Then the state comes from the next tier: the runner asks again
without the failed tier and every faster one, and restores that plan, each tier tried once. This loop was
written three times (the single-process runner's replica and memory fallbacks, and the multi-controller
agreement's); now ``ElasticContext.restore_or_init`` (``trainer_client/runtime/elastic/_elastic_context.py``) and
``ResumeAgreement.restore`` (``trainer_client/runtime/multihost/_multihost.py``, where a memory restore that fails in
any
process sends every process to storage) both call ``restore_by_plan``. ``FAILOVER`` says, per tier, what
failure moves on, whether the next plan must keep the mesh the attempt was built for, and whether no next plan
means a fresh start or the failure stands. ``restore_from_plan`` reads a memory or storage plan's step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from trainer_client.core._errors import NoWholeReplica, StoredFormatError
from trainer_client.core._resume_decision import TIERS_FASTEST_FIRST
from trainer_client.core.protocol import ResumePlan, Tier
from trainer_client.runtime.memory._memory_restore import restore_snapshot
from trainer_client.runtime.saving._checkpointing import restore

_log = logging.getLogger(__name__)
PyTree = Any
S = TypeVar("S")


@dataclass(frozen=True)
class Failover:
    """What failing to restore from one tier means (a row of ``FAILOVER``).

    ``errors``: what a restore from the tier raises when the tier cannot give the step (the restore moves on to
    the next plan; any other error stands). ``keeps_mesh``: the next plan must lay the state out on the failed
    plan's mesh (the attempt's mesh was built for it; otherwise the failure stands); when False the next
    plan's step is restored onto the attempt's mesh, with a warning where the meshes differ. ``fresh_when_none``:
    with no next plan the attempt starts afresh (nothing was read: the tier only held no whole copy); otherwise
    the failure stands. ``level``: how the move on is logged."""

    errors: tuple[type[Exception], ...]
    keeps_mesh: bool = True
    fresh_when_none: bool = False
    level: int = logging.ERROR


FAILOVER: Mapping[Tier, Failover] = MappingProxyType({
    Tier.REPLICAS: Failover((NoWholeReplica,), keeps_mesh=False, fresh_when_none=True, level=logging.INFO),
    Tier.MEMORY: Failover((StoredFormatError, FileNotFoundError)),
    Tier.STORAGE: Failover(()),  # the last tier: its failure stands
})


def tier_failed(plan: ResumePlan, error: Exception) -> Tier | None:
    """The tier ``error`` says could not give ``plan``'s step (``FAILOVER``), or None: the error stands."""
    tier = Tier(plan.tier)
    return tier if isinstance(error, FAILOVER[tier].errors) else None


def restore_by_plan(
    plan: ResumePlan,
    restore_step: Callable[[ResumePlan], S],
    next_plan: Callable[[frozenset[Tier]], ResumePlan | None],
    *,
    failed_tier: Callable[[ResumePlan, Exception], Tier | None] = tier_failed,
) -> tuple[S, ResumePlan] | None:
    """``(restore_step(p), p)`` for ``plan``, or for the next plan after a tier failed: ``next_plan(excluded)``
    is asked for a plan without the tiers in ``excluded`` (the failed one and every faster one) and tried the
    same way; a tier is never tried twice. None: no tier holds a step any more, and the failed tier's row says
    start afresh. ``failed_tier(p, error)``: which tier ``error`` means failed (None: it stands)."""
    excluded: frozenset[Tier] = frozenset()
    while True:
        try:
            return restore_step(plan), plan
        except Exception as exc:
            tier = failed_tier(plan, exc)
            if tier is None:
                raise
            rule = FAILOVER[tier]
            excluded |= frozenset(TIERS_FASTEST_FIRST[:TIERS_FASTEST_FIRST.index(tier) + 1])
            following = next_plan(excluded)
            if following is not None and Tier(following.tier) in excluded:
                following = None  # the failed tier again: each tier is tried once
            if following is None:
                if not rule.fresh_when_none:
                    raise
                _log.log(rule.level, "step %s from %s: %s; no other tier holds a step: starting afresh",
                         plan.step, tier, exc)
                return None
            if following.mesh != plan.mesh:
                if rule.keeps_mesh:
                    raise
                _log.warning("step %s of %s is laid out on mesh %s, the attempt's mesh is %s: restored onto the "
                             "attempt's", following.step, following.tier, following.mesh.shape, plan.mesh.shape)
            _log.log(rule.level, "step %s from %s: %s; restoring step %s from %s instead", plan.step, tier, exc,
                     following.step, following.tier)
            plan = following


def restore_from_plan(plan: ResumePlan, target: PyTree, host_bytes: int | None = None) -> PyTree:
    """The plan's step onto ``target``'s shardings, from host memory or from storage (holding at most
    ``host_bytes`` of host memory at once: ``ClientSettings.restore_host_bytes``)."""
    if plan.tier == Tier.MEMORY:
        return restore_snapshot(plan.path, target)
    return restore(plan.path, target, host_bytes=host_bytes)


__all__ = ["FAILOVER", "Failover", "restore_by_plan", "restore_from_plan", "tier_failed"]
