"""The one refusal table: what each refusal of a resume means to ckptd and to the client, in one place.

The decision (``trainer_client/core/_resume_decision.py``) refuses with a wire-contract code, and ckptd's
latest-good answer with the same codes. Both sides once mapped those codes to their errors apart, each its own
way: ckptd's answers to a ``ServiceError`` per code, the client to ``NoCheckpointError`` or
``CkptdRequestError`` (twice: for ckptd's answer and for its own fallback's). Now each reads ``REFUSALS``:

- the HTTP status is the wire contract's (``ERROR_STATUS``, ``refusal_status``);
- ``nothing_to_resume``: the job has no step to resume from. The client raises ``NoCheckpointError`` (a
  runner starts afresh) and its latest-good is None; every other refusal is raised as ``CkptdRequestError``
  with the code and status, whether ckptd answered it or the fallback found it;
- ``retry_after_s``: not yet (committed steps still being verified): ckptd answers 503 with ``Retry-After``;
- ``words``: the message of a refusal that carries none, worded by where it was looked for (ckptd's catalog,
  or the storage root the fallback scanned). A refusal with a message (the planner's, a tier's) keeps it.

ckptd raises ``ckptd.errors.Refused`` built from this table (``Refused.of``), the client
``trainer_client.client._ckptd_client.refusal_error``. No jax, no HTTP here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from trainer_client.core._resume_decision import Refusal
from trainer_client.core.protocol import ERROR_STATUS, ErrorCode


def _no_good_step(job: str, why: Refusal, where: str | None) -> str:
    if where is None:
        return f"job {job!r} has no verified checkpoint yet (partial, corrupt and quarantined steps are never served)"
    return f"job {job!r} has no good step in {where}"


def _no_such_step(job: str, why: Refusal, where: str | None) -> str:
    if where is None:
        return f"job {job!r} has no step {why.step}"
    return f"job {job!r} has no good step {why.step} in {where}"


def _being_verified(job: str, why: Refusal, where: str | None) -> str:
    return f"step {why.step} of job {job!r} is committed and still being verified; retry shortly"


@dataclass(frozen=True)
class RefusalKind:
    """What one refusal code means to both sides (the table's row)."""

    nothing_to_resume: bool = False
    retry_after_s: int | None = None
    words: Callable[[str, Refusal, str | None], str] | None = None


_ANSWERED = RefusalKind()  # raised with its code, status and message: an answer, never bypassed

REFUSALS: Mapping[ErrorCode, RefusalKind] = MappingProxyType({
    ErrorCode.NO_GOOD_CHECKPOINT: RefusalKind(nothing_to_resume=True, words=_no_good_step),
    ErrorCode.JOB_NOT_FOUND: RefusalKind(nothing_to_resume=True),
    ErrorCode.STEP_NOT_FOUND: RefusalKind(words=_no_such_step),
    ErrorCode.NOT_READY: RefusalKind(retry_after_s=1, words=_being_verified),
    ErrorCode.STEP_NOT_GOOD: _ANSWERED,
    ErrorCode.NOT_ENOUGH_DEVICES: _ANSWERED,
    ErrorCode.NO_VALID_MESH: _ANSWERED,
    ErrorCode.DOES_NOT_FIT: _ANSWERED,
    ErrorCode.FOREIGN_CHECKPOINT: _ANSWERED,
})


def refusal_kind(code: ErrorCode | str) -> RefusalKind:
    """The row of ``code`` (as the wire writes it, too); a code outside the table is an answer raised as is."""
    try:
        return REFUSALS.get(ErrorCode(code), _ANSWERED)
    except ValueError:  # not a code of this contract (a newer ckptd's, or "UNKNOWN"): as is
        return _ANSWERED


def refusal_status(code: ErrorCode) -> int:
    """The HTTP status ckptd answers ``code`` with, and the client's ``CkptdRequestError`` carries."""
    return ERROR_STATUS[code]


def refusal_message(job: str, why: Refusal, where: str | None = None) -> str:
    """What the refusal says: its own message, or the table's words for it (``where``: the storage root the
    fallback looked in; None: ckptd's catalog)."""
    words = refusal_kind(why.code).words
    if why.message or words is None:
        return why.message
    return words(job, why, where)


__all__ = ["REFUSALS", "RefusalKind", "refusal_kind", "refusal_message", "refusal_status"]
