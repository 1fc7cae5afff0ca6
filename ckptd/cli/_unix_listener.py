"""``ckptd serve --uds PATH``: ckptd's listening unix socket, where file permissions are the access rule.

Some places allow no TCP or UDP socket at all (a sandbox such as the lent TPU machine's), and a sidecar that only
its own pod talks to needs no port: there ckptd listens on a unix socket and trainers use
``CKPTD_URL=unix:///PATH``. Who may talk to ckptd is then who may connect to the socket file: its mode is 0600 (the
server's user) or 0660 (its group too, ``CKPTD_UDS_MODE``), set before the socket listens, so it is never open to
anyone else, even for a moment. That only holds in a directory no one else can change: the socket's directory must
be owned by this user (or root) and not writable by every user, else anyone could put a socket of their own where
trainers look for ckptd. A missing directory is created (0700; 0710 for a 0660 socket) when its parent exists.

What is at PATH already decides the rest: nothing, or a socket nothing answers on (left by a server that died),
and ckptd binds there (the stale socket replaced); a socket something answers on (another ckptd), or anything but
a socket (a regular file, a directory, a link), and ckptd refuses to start, deleting nothing. Every refusal is a
``ValueError`` whose text is the one line ``ckptd serve`` prints before the application starts. The bearer token
(``CKPTD_TOKEN``) applies over the socket as over TCP. At exit ``release`` removes the socket file if it is still
the one this server bound.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

PROBE_TIMEOUT_S = 2.0  # a connect to a live socket answers at once; one whose backlog is full counts as live


def _directory_problem(directory: Path, mode: int) -> str | None:
    """Why ``directory`` cannot hold ckptd's socket (``None``: it can), after creating it when it is missing."""
    if not directory.exists():
        try:
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o710 if mode & 0o060 else 0o700)  # the group may reach a 0660 socket in it
        except OSError as exc:
            return f"its directory {str(directory)!r} does not exist and cannot be created: {exc.strerror or exc}"
    try:
        info = directory.stat()
    except OSError as exc:
        return f"its directory {str(directory)!r} cannot be read: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{str(directory)!r} is not a directory"
    if info.st_mode & stat.S_IWOTH:
        return (f"its directory {str(directory)!r} is writable by every user (mode {stat.S_IMODE(info.st_mode):04o}): "
                "anyone could put their own socket there; use a directory only this user (or its group) may write")
    if info.st_uid not in (os.getuid(), 0):
        return (f"its directory {str(directory)!r} belongs to another user (uid {info.st_uid}), who could replace the "
                "socket; use a directory of this user's")
    return None


def _answers(path: str) -> bool:
    """Whether something accepts connections on the socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except TimeoutError:
            return True
        except OSError as exc:
            raise ValueError(f"cannot tell whether a server listens on it: {exc.strerror or exc}") from None
        return True


def _clear(path: str) -> None:
    """Nothing at ``path`` once this returns, or a ``ValueError`` saying why ckptd may not bind there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a link" if stat.S_ISLNK(info.st_mode) else "a file"
        raise ValueError(f"it exists and is not a socket but {kind}: remove it, or choose another path")
    if _answers(path):
        raise ValueError("a server already listens on it (another ckptd?): stop it, or choose another path")
    try:
        os.unlink(path)  # a stale socket, left by a server that died
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ValueError(f"a stale socket is there and cannot be removed: {exc.strerror or exc}") from None


def bind_unix(path: str, mode: int) -> socket.socket:
    """The unix socket at the absolute ``path``, bound with ``mode`` and listening (connections wait in its
    backlog until the server accepts them). ``ValueError``: why it cannot be, in one line naming ``path``."""
    try:
        problem = _directory_problem(Path(path).parent, mode)
        if problem is not None:
            raise ValueError(problem)
        _clear(path)
    except ValueError as exc:
        raise ValueError(f"cannot listen on the unix socket {path}: {exc}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = None
    try:
        sock.bind(path)
        bound = identity(path)
        os.chmod(path, mode)  # before listen(): until then every connect is refused, so none sees a wider mode
        sock.listen()
    except OSError as exc:
        sock.close()
        release(path, bound)
        raise ValueError(f"cannot listen on the unix socket {path}: {exc.strerror or exc}") from None
    return sock


def identity(path: str) -> tuple[int, int] | None:
    """The file at ``path`` as (device, inode), or ``None`` when there is none."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def release(path: str, bound: tuple[int, int] | None) -> None:
    """Remove the socket file at ``path`` if it is still the one bound (``identity`` after binding); a socket another
    server has put there since is left alone."""
    if bound is not None and identity(path) == bound:
        with contextlib.suppress(OSError):
            os.unlink(path)


__all__ = ["PROBE_TIMEOUT_S", "bind_unix", "identity", "release"]
