"""The exceptions trainer_client raises, one documented tree.

```
CkptdError
├── CkptdUnavailable        ckptd did not answer in time (connection refused, timeout, 5xx)
├── CkptdRequestError       ckptd answered with its error body (``code``, ``message``, ``status``)
├── NoCheckpointError       neither ckptd nor storage has a committed step to resume from
├── ElasticTimeoutError     lost slices did not come back within ``elastic_timeout_s``
└── ElasticRetriesExhausted more elastic events than ``elastic_max_retries``
```
Each also subclasses the closest built-in, so generic handlers keep working.
"""

from __future__ import annotations


class CkptdError(Exception):
    """Base of every trainer_client error."""


class CkptdUnavailable(CkptdError, ConnectionError):
    """The sidecar could not be reached or did not answer within the deadline."""


class CkptdRequestError(CkptdError):
    """The sidecar refused a request; ``code`` is a stable ``protocol.ErrorCode`` value."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class NoCheckpointError(CkptdError, LookupError):
    """There is no committed step to resume from."""


class ElasticTimeoutError(CkptdError, TimeoutError):
    """Slices needed by the policy did not come back in time."""


class ElasticRetriesExhausted(CkptdError, RuntimeError):
    """The job met more elastic events than it is allowed to survive."""


__all__ = [
    "CkptdError",
    "CkptdRequestError",
    "CkptdUnavailable",
    "ElasticRetriesExhausted",
    "ElasticTimeoutError",
    "NoCheckpointError",
]
