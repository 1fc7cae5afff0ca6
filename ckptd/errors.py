"""The sidecar's exception tree and its mapping onto the one error body of the wire contract.

Every failure a handler can meet is an ``ApiError`` carrying a stable ``ErrorCode``; the status code comes
from ``trainer_client.protocol.ERROR_STATUS``, so the table lives in one place for both sides.
"""

from __future__ import annotations

from trainer_client.protocol import ERROR_STATUS, ErrorBody, ErrorCode


class ApiError(Exception):
    """A failure reported to the caller with a stable code and a human message."""

    def __init__(self, code: ErrorCode, message: str, detail: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def body(self) -> ErrorBody:
        return ErrorBody(code=self.code, message=self.message, detail=self.detail)


class JobNotFound(ApiError, LookupError):
    def __init__(self, job: str) -> None:
        super().__init__(ErrorCode.JOB_NOT_FOUND, f"no job named {job!r} under the checkpoint root")


class NoGoodCheckpoint(ApiError, LookupError):
    def __init__(self, job: str) -> None:
        super().__init__(
            ErrorCode.NO_GOOD_CHECKPOINT,
            f"job {job!r} has no verified checkpoint yet (partial, corrupt and quarantined steps are never served)",
        )


class InvalidJobName(ApiError, ValueError):
    def __init__(self, job: str) -> None:
        shown = job if len(job) <= 80 else job[:77] + "..."
        super().__init__(
            ErrorCode.INVALID_JOB_NAME,
            f"invalid job name {shown!r}: use one path segment of letters, digits, '.', '_' or '-' "
            "(not starting with '.', at most 128 characters)",
        )


__all__ = ["ApiError", "InvalidJobName", "JobNotFound", "NoGoodCheckpoint"]
