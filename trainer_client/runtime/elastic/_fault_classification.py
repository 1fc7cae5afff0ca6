"""Which errors are slice losses: pathwaysutils' classification, confirmed by a slice health check.

pathwaysutils' ``elastic.is_error_due_to_slice_down`` (what ``Manager.elastic_retry`` retries on) calls
every ``JaxRuntimeError`` whose text names ``DATA_LOSS``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND`` or
``INTERNAL`` a slice loss. ``INTERNAL`` is also what an XLA compiler bug (a failed ``RET_CHECK``) or an
allocation failure says, and ``DATA_LOSS`` what a corrupt read says: retried as slice losses they would
replay the same failure until the retries run out, hiding the real error for minutes.

So the elastic runner treats an error as a slice loss only when both agree: pathwaysutils classifies it
so, *and* the slice health check finds a slice of the failed attempt down. Anything else is not the
runner's to handle and is re-raised at once, unchanged (same exception object, original traceback).
See docs/architecture.md ("The elastic loop").
"""

from __future__ import annotations

import logging
from collections.abc import Set
from dataclasses import dataclass
from typing import Protocol

import jax
from pathwaysutils.elastic import elastic

_log = logging.getLogger(__name__)


class _HealthChecked(Protocol):
    def healthy_slices(self) -> frozenset[int]: ...


def pathwaysutils_says_slice_down(error: BaseException) -> bool:
    """pathwaysutils' own classification of ``error`` (a ``JaxRuntimeError`` with one of its codes)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and bool(
        elastic.is_error_due_to_slice_down(error, log_traceback=False))


@dataclass(frozen=True)
class SliceLoss:
    """A confirmed slice loss: the attempt's slices the health check found down, and the healthy ones."""

    lost: frozenset[int]
    healthy: frozenset[int]


def classify_failure(error: BaseException, slices: _HealthChecked, active: Set[int]) -> SliceLoss | None:
    """A ``SliceLoss`` when ``error`` is one (pathwaysutils says so and a slice in ``active`` is down);
    ``None`` when the caller must re-raise it."""
    if not pathwaysutils_says_slice_down(error):
        return None
    healthy = slices.healthy_slices()
    lost = frozenset(active) - healthy
    if not lost:
        _log.error("%s looks like a slice loss to pathwaysutils, but every slice of the attempt (%s) is healthy:"
                   " not retried", type(error).__name__, sorted(active))
        return None
    return SliceLoss(lost=lost, healthy=frozenset(healthy))


__all__ = ["SliceLoss", "classify_failure", "pathwaysutils_says_slice_down"]
