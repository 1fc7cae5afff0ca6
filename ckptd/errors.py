"""The sidecar's exceptions, one documented tree under ckptd's root ``CkptdError``.

```
CkptdError                                root (trainer_client/core/_errors.py): also the core's errors
├── StorageError, StoredFormatError, PlanningError   raised by the core, mapped by the API as well
└── ServiceError                          a refusal of the sidecar's, with a stable ``ErrorCode``
    ├── InvalidRequest (ValueError)       the request's values do not make sense together
    ├── InvalidJobName (ValueError)       not one safe path segment
    ├── JobNotFound (LookupError)         no such job under the root
    ├── StepNotFound (LookupError)        the job has no such step
    ├── NoGoodCheckpoint (LookupError)    the job has no verified step yet
    ├── StepNotGood                       the asked step is not verified (corrupt, quarantined, ...)
    ├── NotReady                          the catalog is being built, or committed steps are being verified
    ├── MissingInputs (ValueError)        the advisor lacks inputs the job's history does not give
    ├── Busy                              too much work now (the advisor's slots are taken, an answer timed out)
    └── JobLimitReached                   a new job past the ``max_jobs`` setting
```
Domain code raises these; only the API (``ckptd/api/_errors.py``) turns them into HTTP: the status of
each code comes from the wire contract's ``ERROR_STATUS`` table, shared with the client.
"""

from __future__ import annotations

from trainer_client.core._errors import CkptdError, PlanningError, StorageError, StoredFormatError
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


class StepNotFound(ServiceError, LookupError):
    code = ErrorCode.STEP_NOT_FOUND

    def __init__(self, job: str, step: int) -> None:
        super().__init__(f"job {job!r} has no step {step}")


class NoGoodCheckpoint(ServiceError, LookupError):
    code = ErrorCode.NO_GOOD_CHECKPOINT

    def __init__(self, job: str) -> None:
        super().__init__(
            f"job {job!r} has no verified checkpoint yet (partial, corrupt and quarantined steps are never served)"
        )


class StepNotGood(ServiceError):
    code = ErrorCode.STEP_NOT_GOOD


class NotReady(ServiceError):
    """Not answerable yet, but soon: the catalog is being built, or the steps that would answer are committed
    and still being verified. "No checkpoint" must mean none, so this is 503 with ``Retry-After``."""

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


__all__ = [
    "Busy",
    "CkptdError",
    "InvalidJobName",
    "InvalidRequest",
    "JobLimitReached",
    "JobNotFound",
    "MissingInputs",
    "NoGoodCheckpoint",
    "NotReady",
    "PlanningError",
    "ServiceError",
    "StepNotFound",
    "StepNotGood",
    "StorageError",
    "StoredFormatError",
]
