"""Files and directories only their owner can touch: the host-memory tier's shared-memory directory.

Trainers and ckptd exchange snapshots through a directory in shared memory (``/dev/shm`` or a tmpfs the
pod's containers share). Whoever can write there decides what ckptd persists and what a recovery restores,
so the directory is private to the one user both run as (docs/operations.md, "Security"):

- the shm directory and every directory below it are owned by this process's user and writable by no one
  else (``check_private_dir``); a directory ckptd or the trainer creates is 0700, a file 0600;
- no path there is followed through a symbolic link (``O_NOFOLLOW`` on every open, ``lstat`` on every
  check), a file written there is created exclusively (``O_EXCL``) and renamed into place, and a file read
  from there must be a regular file owned by this user.

A directory that fails the rule is refused with ``UnsafePathError``: never used, never repaired.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from trainer_client.core._errors import UnsafePathError
from trainer_client.core._storage import read_fd

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def check_private_dir(path: str | os.PathLike[str]) -> None:
    """Raise ``UnsafePathError`` unless ``path`` is a real directory (not a link), owned by this process's
    user and writable by neither its group nor others. ``FileNotFoundError`` when it does not exist."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link; the memory tier's directories must be real ones")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{path} is not a directory")
    _check_owner_and_mode(path, info)


def _check_owner_and_mode(path: str | os.PathLike[str], info: os.stat_result) -> None:
    if info.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path} belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}: refusing it "
            "(trainer and ckptd must run as the same user, and nobody else may own their shared-memory directory)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"{path} is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):04o}): refusing it; "
            f"make it {DIR_MODE:04o} (`chmod {DIR_MODE:o} {path}`) or point the memory tier at a new directory"
        )


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a private directory: created 0700 (parents too, when missing) or checked as it is."""
    path = Path(path)
    try:
        check_private_dir(path)
        return path
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    with contextlib.suppress(FileExistsError):  # made meanwhile by another process: it must pass the check
        os.mkdir(path, DIR_MODE)
    check_private_dir(path)
    return path


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """A new directory ``path``, 0700 (``FileExistsError`` when something is already there)."""
    os.mkdir(path, DIR_MODE)
    check_private_dir(path)  # a umask cannot add bits, but an odd file system could ignore the mode
    return Path(path)


def open_private(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path``, opened without following a link, checked to belong to
    this user and to be writable by no one else. With ``os.O_CREAT`` the file is made 0600, and
    ``os.O_EXCL`` is added: a file is only ever created afresh, never reused through a planted name."""
    if flags & os.O_CREAT:
        flags |= os.O_EXCL
    fd = os.open(path, flags | _NOFOLLOW, FILE_MODE)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        _check_owner_and_mode(path, info)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The bytes of the private file ``path``; ``RecordTooLargeError`` past ``max_bytes``, by its size before
    a byte is read and by what the read finds (at most one byte more: ``storage.read_fd``)."""
    fd = open_private(path)
    try:
        return read_fd(fd, max_bytes, str(path))
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` as a new private file: created exclusively under a random name beside it,
    then renamed over ``path`` (a link planted at ``path`` is replaced, never written through)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory and not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "check_private_dir",
    "ensure_private_dir",
    "is_real_dir",
    "make_private_dir",
    "open_private",
    "read_private",
    "write_private",
]
