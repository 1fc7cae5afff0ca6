"""One racing taker of a dead save's claim, run in a process of its own (tests/server/multihost/test_claim_takeover.py):
a module with nothing else in it, so that each spawned taker imports only what taking a claim over needs."""

from __future__ import annotations

from typing import Any

from trainer_client.core._storage import Storage
from trainer_client.core.format._parts import Claim, take_over_claim


def race(root: str, job: str, step: int, stale_json: str, save_id: str, start: Any, won: Any) -> None:
    """Wait at ``start`` (a barrier of every taker), try to take the claim ``stale_json`` of ``step`` over as
    ``save_id`` (a save of 2 processes), and put ``(save_id, whether it replaced the claim)`` on ``won``."""
    stale = Claim.model_validate_json(stale_json)
    start.wait()
    won.put((save_id, take_over_claim(Storage(root), job, step, stale, save_id, 2)))


__all__ = ["race"]
