"""The sidecar's exceptions, one documented tree under ckptd's root ``CkptdError``.

```
CkptdError                                root (trainer_client/core/_errors.py): also the core's errors
├── StorageError, StoredFormatError, PlanningError   raised by the core, mapped by the API as well
└── ServiceError                          a refusal of the sidecar's, with a stable ``ErrorCode``
    ├── InvalidRequest (ValueError)       the request's values do not make sense together
    ├── InvalidJobName (ValueError)       not one safe path segment
    ├── JobNotFound (LookupError)         no such job under the root
    ├── Refused                           a resume's or latest-good's refusal (no good step, no such step,
    │                                     not verified yet, not good, not laid out): code, words and
    │                                     Retry-After from the one refusal table (trainer_client/core/_refusals.py)
    ├── NotReady                          the catalog is being built
    ├── MissingInputs (ValueError)        the advisor lacks inputs the job's history does not give
    ├── Busy                              too much work now (the advisor's slots are taken, an answer timed out)
    ├── JobLimitReached                   a new job past the ``max_jobs`` setting
    └── PeerChannelOff                    a peer fetch asked of a sidecar whose peer channel is off
```
Domain code raises these; only the API (``ckptd/api/_errors.py``) turns them into HTTP: the status of
each code comes from the wire contract's ``ERROR_STATUS`` table, shared with the client.
"""

from __future__ import annotations

from trainer_client.core import (
    CkptdError,
    PlanningError,
    Refusal,
    StorageError,
    StoredFormatError,
    refusal_kind,
    refusal_message,
)
from trainer_client.core.protocol import ErrorCode


class ServiceError(CkptdError):
    """A failure reported to the caller with a stable ``code``, a human ``message`` and optional ``detail``."""

    code: ErrorCode = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, detail: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class InvalidRequest(ServiceError, ValueError):
    code = ErrorCode.INVALID_REQUEST


class InvalidJobName(ServiceError, ValueError):
    code = ErrorCode.INVALID_JOB_NAME

    def __init__(self, job: str) -> None:
        shown = job if len(job) <= 80 else job[:77] + "..."
        super().__init__(
            f"invalid job name {shown!r}: use one path segment of letters, digits, '.', '_' or '-' "
            "(not starting with '.', at most 128 characters)"
        )


class JobNotFound(ServiceError, LookupError):
    code = ErrorCode.JOB_NOT_FOUND

    def __init__(self, job: str, why: str | None = None) -> None:
        super().__init__(f"no job named {job!r} under the checkpoint root" + (f": {why}" if why else ""))


class Refused(ServiceError):
    """A refusal of the resume decision, or of latest-good, as the one refusal table says it
    (``trainer_client/core/_refusals.py``, which the client reads too): its code (answered with that code's
    status), its words, and ``Retry-After`` where the table gives one (steps committed, still being verified:
    "no checkpoint" must mean none, never "not checked yet")."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, why: Refusal, job: str) -> Refused:
        """The error ckptd answers ``why`` with, for ``job``."""
        return cls(why.code, refusal_message(job, why), refusal_kind(why.code).retry_after_s)


class NotReady(ServiceError):
    """Not answerable yet, but soon: the catalog is being built. 503 with ``Retry-After`` (steps committed and
    still being verified are the table's ``NOT_READY`` refusal: ``Refused``)."""

    code = ErrorCode.NOT_READY

    def __init__(self, message: str = "the catalog is still being built from storage; retry",
                 retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MissingInputs(ServiceError, ValueError):
    """Neither the request nor the job's history gives these inputs (``a|b``: either one will do)."""

    code = ErrorCode.MISSING_INPUT

    def __init__(self, names: list[str], message: str) -> None:
        super().__init__(message, {"missing": names})
        self.names = names


class Busy(ServiceError):
    """Not now: the work would starve other requests or ran out of time. ``retry_after_s`` goes out as the
    ``Retry-After`` header."""

    code = ErrorCode.BUSY

    def __init__(self, message: str, retry_after_s: int = 10) -> None:
        super().__init__(message, {"retry_after_s": retry_after_s})
        self.retry_after_s = retry_after_s


class JobLimitReached(ServiceError):
    """Creating this job would pass ``max_jobs`` (CKPTD_MAX_JOBS); the jobs there are served as before."""

    code = ErrorCode.JOB_LIMIT

    def __init__(self, job: str, limit: int) -> None:
        super().__init__(f"job {job!r} is not created: ckptd serves at most {limit} jobs (CKPTD_MAX_JOBS)",
                         {"max_jobs": limit})


class PeerChannelOff(ServiceError):
    """A trainer asked for its part back from a peer's copy, and this sidecar's peer channel is off (no
    ``CKPTD_PEER_PORT``, or no ``CKPTD_SHM_DIR`` for it): no copy can come from here; the trainer restores from
    storage."""

    code = ErrorCode.PEER_CHANNEL_OFF

    def __init__(self) -> None:
        super().__init__("this ckptd's peer channel is off (CKPTD_PEER_PORT unset, or no CKPTD_SHM_DIR): it brings "
                         "no part back from a peer; restore from storage")


__all__ = [
    "Busy",
    "CkptdError",
    "InvalidJobName",
    "InvalidRequest",
    "JobLimitReached",
    "JobNotFound",
    "MissingInputs",
    "NotReady",
    "PeerChannelOff",
    "PlanningError",
    "Refused",
    "ServiceError",
    "StorageError",
    "StoredFormatError",
]
