"""Orbax's retention options kept by ``trainer_client.CheckpointManager`` over good steps only (docs/adopt.md,
"Retention").

Orbax 0.12.8 turns ``max_to_keep``, ``keep_period``, ``keep_time_interval`` and ``best_fn`` into a preservation
policy (``LatestN``, ``EveryNSteps``, ``EveryNSeconds``, ``BestN``, any of them), or takes the user's
``preservation_policy`` (MaxText passes ``LatestN(max_num_checkpoints_to_keep)``). ``ManagerRetention`` asks
that same policy, Orbax's own objects, which steps to keep, but over the steps ckptd names good, and deletes
through Orbax's own deleter (``todelete_subdir`` and the primary host honoured) with ckptd's two rules on top
(docs/concepts.md, "Step states"):

- the newest good step is never deleted (``BestN`` would delete it when its metric is the worst);
- a step that is not good is never seen, so never deleted nor counted: a save in flight or cut short, a step
  ckptd quarantined or found corrupt, a step still in the host-memory tier.

Orbax's manager inside is handed the options without them, so it deletes nothing by its own judgement. A pass
runs when the next save starts, at ``wait_until_finished`` and at ``close`` (Orbax deletes after each save's
commit, in its background thread); a step a pass has not seen yet (not committed) is judged by the next one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_manager as orbax_manager
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as preservation_policy_lib

_log = logging.getLogger(__name__)

# The fields of CheckpointManagerOptions that make Orbax delete steps by its own judgement.
RETENTION_FIELDS = ("max_to_keep", "keep_time_interval", "keep_period", "preservation_policy")


def preserves_all(policy: Any) -> bool:
    """Orbax's policies that delete nothing: ``PreserveAll()``, ``LatestN(None)`` (MaxText's default without
    ``max_num_checkpoints_to_keep``)."""
    return isinstance(policy, preservation_policy_lib.PreserveAll) or (
        isinstance(policy, preservation_policy_lib.LatestN) and policy.n is None)


def conflicts(options: ocp.CheckpointManagerOptions) -> list[str]:
    """What Orbax's manager refuses of these retention options (a policy with the options it replaces)."""
    old = [name for name in ("max_to_keep", "keep_time_interval", "keep_period") if getattr(options, name)]
    if options.preservation_policy is not None and old:
        return [f"CheckpointManagerOptions(preservation_policy=...) with {', '.join(old)}: Orbax's "
                "`preservation_policy` and `delete options` are mutually exclusive"]
    return []


def orbax_policy(options: ocp.CheckpointManagerOptions) -> Any:
    """The policy Orbax's manager would apply for ``options`` (its own mapping), or None when it deletes
    nothing (no option set, a read-only manager, ``PreserveAll()``/``LatestN(None)``, ``max_to_keep=None``
    whatever else is set: Orbax then preserves every step)."""
    if options.read_only:
        return None
    if options.preservation_policy is not None:
        return None if preserves_all(options.preservation_policy) else options.preservation_policy
    if options.max_to_keep is None:
        return None
    return orbax_manager._get_default_preservation_policy(options)  # Orbax's own mapping


def describe(options: ocp.CheckpointManagerOptions) -> str:
    """The user's retention options as they wrote them, for log lines."""
    given = [f"{name}={getattr(options, name)!r}" for name in RETENTION_FIELDS if getattr(options, name) is not None]
    if options.best_fn is not None and options.max_to_keep is not None:
        given.append(f"best_fn (best_mode={options.best_mode!r})")
    return ", ".join(given)


def without_retention(options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManagerOptions:
    """``options`` for Orbax's manager inside: nothing it would delete by itself (``best_fn`` stays, for its
    metrics; without ``max_to_keep`` Orbax's ``BestN`` keeps every step)."""
    return dataclasses.replace(options, max_to_keep=None, keep_time_interval=None, keep_period=None,
                               preservation_policy=None)


class ManagerRetention:
    """The retention of one manager: ``policy`` (Orbax's; None: keep every step) applied to the good steps of
    ``manager`` (Orbax's manager inside, whose checkpoint infos carry each step's time and metrics)."""

    def __init__(self, manager: ocp.CheckpointManager, policy: Any, options: ocp.CheckpointManagerOptions,
                 good: Callable[[], Sequence[int]]) -> None:
        self.manager = manager
        self.policy = policy
        self.good = good
        self.named = describe(options)
        self.due = False  # a save was made since the last pass

    def infos(self, good: Sequence[int]) -> list[Any]:
        """Orbax's checkpoint infos of the ``good`` steps, oldest first (read again when one is missing: a step
        another writer or ckptd's persist worker committed)."""
        known = {info.step: info for info in self.manager._checkpoints}
        if not set(good) <= set(known):
            self.manager.reload()
            known = {info.step: info for info in self.manager._checkpoints}
        return [known[step] for step in good if step in known]

    def apply(self) -> list[int]:
        """One pass if a save was made since the last: deletes the good steps the policy does not keep, never
        the newest good one; returns the steps deleted (on every process; the primary host deletes)."""
        if self.policy is None or not self.due:
            return []
        self.due = False
        good = sorted(self.good())
        if len(good) < 2:
            return []
        infos = self.infos(good)
        keep = self.policy.should_preserve(infos, context=preservation_policy_lib.PreservationContext())
        doomed = [info.step for info, kept in zip(infos, keep, strict=True) if not kept and info.step != good[-1]]
        for step in doomed:
            _log.info("retention deleted step %s: not kept by %s (Orbax's policy over good steps; the newest good "
                      "step %s and steps that are not good are kept)", step, self.named, good[-1])
            self.manager._checkpoint_deleter.delete(step)  # Orbax's deleter: its primary host
            self.manager._checkpoints.delete_if(lambda info, s=step: info.step == s)
        return doomed

    def best(self, good: Sequence[int], best_fn: Callable[[Any], float], mode: str) -> int | None:
        """Orbax's ``best_step()`` over ``good``: the best step with metrics, else the newest good step."""
        ranked = sorted((info for info in self.infos(sorted(good)) if info.metrics is not None),
                        key=lambda info: best_fn(info.metrics), reverse=(mode == "min"))
        return ranked[-1].step if ranked else (max(good) if good else None)


__all__ = ["RETENTION_FIELDS", "ManagerRetention", "conflicts", "describe", "orbax_policy", "preserves_all",
           "without_retention"]
