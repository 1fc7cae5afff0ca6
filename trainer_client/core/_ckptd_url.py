"""Where a ckptd listens, from its URL: the one parser of ``CKPTD_URL`` and of every option that names a ckptd.

A ckptd answers over TCP (``http://HOST:PORT``, or ``https://`` behind a proxy) or over a unix domain socket
(``unix:///ABS/PATH/TO.sock``): the pod-local sidecar form, and the only one where no TCP is allowed at all (a
sandbox such as the lent TPU machine's). The trainer's client, its event reporter and the tests all read a URL
here, so a malformed one is refused the same way everywhere, once, when the settings are built (one
``ValueError`` line naming what is wrong: no scheme, a relative or missing socket path, a path too long for
``sun_path``), never at the first request. The server side checks ``ckptd serve --uds PATH`` with the same
``socket_path_problem``. A socket's path is taken as written (no percent-decoding).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

UNIX_SCHEME = "unix"
# sun_path, the terminating NUL included: 108 bytes on Linux, 104 on macOS. A path may use one byte less.
SUN_PATH_BYTES = 104 if sys.platform == "darwin" else 108
# The base URL of requests over a socket: only the Host header it gives matters (ckptd does not read it).
UDS_BASE_URL = "http://localhost"
_FORMS = "http://HOST:PORT or unix:///ABS/PATH/TO.sock"


@dataclass(frozen=True)
class CkptdAddress:
    """A ckptd URL, parsed: ``url`` as given (what messages show), ``base_url`` for the requests' URLs, and
    ``uds``, the socket's path when it is one (``None``: TCP)."""

    url: str
    base_url: str
    uds: str | None = None


def socket_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name ckptd's unix socket (``None``: it can): it must be absolute, without NUL, and fit
    in ``sun_path`` with its terminating NUL."""
    if not path:
        return "names no socket path"
    if "\x00" in path:
        return "has a NUL character in the socket path"
    if not path.startswith("/"):
        return f"the socket path {path!r} is relative: give an absolute one"
    if path.endswith("/"):
        return f"the socket path {path!r} names a directory, not a socket file"
    size = len(os.fsencode(path))
    if size >= SUN_PATH_BYTES:
        return (f"the socket path is {size} bytes, longer than a unix socket's path may be ({SUN_PATH_BYTES - 1} "
                "bytes, sun_path): choose a shorter directory")
    return None


def parse_ckptd_url(url: str) -> CkptdAddress:
    """``url`` parsed (``ValueError``, one line naming the URL and what is wrong with it, when it is malformed)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"ckptd URL {url!r} has no scheme: give {_FORMS}")
    kind = scheme.lower()
    if kind == UNIX_SCHEME:
        if rest and not rest.startswith("/"):
            raise ValueError(f"ckptd URL {url!r}: the socket path must be absolute, after three slashes "
                             f"(unix:///abs/path/to.sock; {rest.split('/', 1)[0]!r} would be a host)")
        if rest in ("", "/"):
            raise ValueError(f"ckptd URL {url!r} names no socket: give unix:///ABS/PATH/TO.sock")
        problem = socket_path_problem(rest)
        if problem is not None:
            raise ValueError(f"ckptd URL {url!r}: {problem}")
        return CkptdAddress(url, UDS_BASE_URL, rest)
    if kind in ("http", "https"):
        if not rest.split("/", 1)[0].rpartition("@")[2]:
            raise ValueError(f"ckptd URL {url!r} names no host: give {_FORMS}")
        return CkptdAddress(url, url)
    raise ValueError(f"ckptd URL {url!r}: {scheme!r} is not a scheme ckptd answers on: give {_FORMS}")


def unix_url(path: str | os.PathLike[str]) -> str:
    """The ``unix://`` URL of the socket at the absolute ``path`` (``unix:///run/ckptd/ckptd.sock``)."""
    return f"{UNIX_SCHEME}://{os.fspath(path)}"


__all__ = ["SUN_PATH_BYTES", "UDS_BASE_URL", "UNIX_SCHEME", "CkptdAddress", "parse_ckptd_url", "socket_path_problem",
           "unix_url"]
