"""The exceptions trainer_client raises, one documented tree.

```
CkptdError                          root (trainer_client/core/_errors.py): catches everything below
├── StorageError (OSError)          storage could not be listed or read
├── StoredFormatError (ValueError)  stored bytes are not the format they claim to be
│   ├── ArrayIndexError             an item's array metadata is missing or corrupt
│   ├── RecordTooLargeError         a record or metadata file past its size bound: not read
│   └── OcdbtFormatError            an OCDBT index the direct reader does not understand
│       └── OcdbtRefusedError       one past a bound no real index reaches: hostile, not read
├── UnsafePathError (PermissionError)  a memory-tier path others could write or that is a link, or a
│                                   path a link leads out of the checkpoint root: refused
├── PlanningError (ValueError)      no resume plan exists for the devices alive (``code`` says why)
├── MissingExtra (ModuleNotFoundError)  a name needs the ``trainer`` install (jax): the message says so
├── NoWholeReplica (LookupError)    no whole replica of some arrays survives a slice loss: another tier
├── CkptdUnavailable (ConnectionError)  ckptd did not answer in time (connection refused, timeout, 5xx)
├── CkptdRequestError               ckptd answered with its error body (``code``, ``message``, ``status``)
├── NoCheckpointError (LookupError) neither ckptd nor storage has a good step to resume from
├── ElasticTimeoutError (TimeoutError)      lost slices did not come back within ``elastic_timeout_s``
├── ElasticRetriesExhausted (RuntimeError)  more elastic events than ``elastic_max_retries``
├── MemoryTierFull (MemoryError)    no room in host memory for another snapshot
└── DirectRestoreUnsupported (NotImplementedError)  a step the direct reader does not handle (Orbax
                                    restores it instead; raised and caught inside the restore)
```
Each also subclasses the closest built-in, so generic handlers keep working. Every class of the tree is
importable from ``trainer_client`` too (docs/architecture.md, "Errors").
"""

from __future__ import annotations

from trainer_client.core._errors import (
    ArrayIndexError,
    CkptdError,
    MissingExtra,
    NoWholeReplica,
    OcdbtFormatError,
    OcdbtRefusedError,
    PlanningError,
    RecordTooLargeError,
    StorageError,
    StoredFormatError,
    UnsafePathError,
)


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


class MemoryTierFull(CkptdError, MemoryError):
    """No room in host memory for another snapshot (too many held, or not enough free memory)."""


class DirectRestoreUnsupported(CkptdError, NotImplementedError):
    """This checkpoint (or target) is not one the direct reader handles; restore through Orbax."""


__all__ = [
    "ArrayIndexError",
    "CkptdError",
    "CkptdRequestError",
    "CkptdUnavailable",
    "DirectRestoreUnsupported",
    "ElasticRetriesExhausted",
    "ElasticTimeoutError",
    "MemoryTierFull",
    "MissingExtra",
    "NoCheckpointError",
    "NoWholeReplica",
    "OcdbtFormatError",
    "OcdbtRefusedError",
    "PlanningError",
    "RecordTooLargeError",
    "StorageError",
    "StoredFormatError",
    "UnsafePathError",
]
