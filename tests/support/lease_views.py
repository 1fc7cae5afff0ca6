"""What a running ``ckptd serve`` says of a job's leadership lease: its ``/readyz`` details
(docs/operations.md, "Several sidecars on one root")."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.chaos_support import CkptdProcess


def lease_view(proc: CkptdProcess, job: str) -> dict[str, Any] | None:
    """The sidecar's view of ``job``'s lease (role, epoch, holder, ttl_s), with its own holder name as ``me``;
    None when it does not answer or has no lease for the job."""
    try:
        detail = httpx.get(f"{proc.url}/readyz", timeout=2).json().get("detail", {})
    except (httpx.HTTPError, ValueError):
        return None
    lease = detail.get("lease", {}).get("jobs", {}).get(job)
    return {**lease, "me": detail["lease"]["holder"]} if lease else None


__all__ = ["lease_view"]
