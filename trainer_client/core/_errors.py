"""The root of every exception ckptd raises, and the errors of the jax-free core.

```
CkptdError                              root: ``except CkptdError`` catches everything ckptd raises
├── StorageError (OSError)              storage could not be listed or read (after the backend's retries)
├── StoredFormatError (ValueError)      stored bytes are not the format they claim to be
│   ├── ArrayIndexError                 an item's zarr/OCDBT array metadata is missing or corrupt
│   ├── RecordTooLargeError             a record (manifest, claim, lease, ...) past its size bound: not read
│   └── OcdbtFormatError                an OCDBT index this reader does not understand (tensorstore reads it)
│       └── OcdbtRefusedError           one past a bound no real index reaches (shared nodes, aliased
│                                       files, node/key budget, deadline, decoded size): hostile, not read
├── UnsafePathError (PermissionError)   a memory-tier path others could write or that is a link, or a
│                                       path that a link leads out of the checkpoint root: refused
├── PlanningError (ValueError)          no resume plan exists for these inputs; ``code`` says why
├── NoWholeReplica (LookupError)        no whole replica of some arrays survives a slice loss in the
│                                       replica snapshot tier: resume from another tier
└── MissingExtra (ModuleNotFoundError)  a name or command needs a library of another install role:
                                        the message says which (``pip install 'ckptd[trainer]'``)
```
Each error also subclasses the closest built-in, so generic handlers keep working. The trainer library
adds its own branches (``trainer_client/errors.py``) and the sidecar its own (``ckptd/errors.py``), all
under ``CkptdError``.
"""

from __future__ import annotations

from trainer_client.core.protocol import ErrorCode


class CkptdError(Exception):
    """Base of every error ckptd's packages raise."""


class StorageError(CkptdError, OSError):
    """Storage could not be listed or read (after the file system's own retries)."""


class StoredFormatError(CkptdError, ValueError):
    """Stored bytes do not parse as the format they claim to be."""


class ArrayIndexError(StoredFormatError):
    """The item cannot be read as an Orbax item, or its array metadata is missing or corrupt."""


class RecordTooLargeError(StoredFormatError):
    """A file ckptd reads whole (one of its records, or Orbax's metadata) is larger than the bound for it: it
    was not read (docs/operations.md, "What each limit defends")."""


class OcdbtFormatError(StoredFormatError):
    """The database is not one this reader understands (or is damaged): read it with tensorstore instead."""


class OcdbtRefusedError(OcdbtFormatError):
    """The database passes a bound no real one reaches — a node reached twice or a data file named two ways,
    more nodes or keys than the budget, a node or manifest decoding past its cap, a read past its deadline —
    so it is hostile or broken: refused, and not handed to tensorstore either (docs/operations.md, "What each
    limit defends")."""


class UnsafePathError(CkptdError, PermissionError):
    """A shared-memory path is a link, or belongs to another user, or others may write it; or a path under the
    checkpoint root leads out of it through a link: it is refused."""


class PlanningError(CkptdError, ValueError):
    """No plan exists for these inputs; ``code`` says why in the wire contract's terms."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class NoWholeReplica(CkptdError, LookupError):
    """The replica snapshot tier holds no whole copy of some arrays on the slices that are left (the state was
    sharded across the lost slice, more slices were lost than there are replicas, or nothing is held yet):
    the caller resumes from the shared-memory tier or storage. ``arrays`` names the arrays that lack one."""

    def __init__(self, message: str, arrays: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.arrays = arrays


class MissingExtra(CkptdError, ModuleNotFoundError):
    """What was asked for needs a library that this install role does not bring (docs/architecture.md, the roles);
    the message names the extra that does (``trainer_client.core._extras.needs_extra``)."""


__all__ = [
    "ArrayIndexError",
    "CkptdError",
    "MissingExtra",
    "NoWholeReplica",
    "OcdbtFormatError",
    "OcdbtRefusedError",
    "PlanningError",
    "RecordTooLargeError",
    "StorageError",
    "StoredFormatError",
    "UnsafePathError",
]
