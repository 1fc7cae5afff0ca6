"""Which sockets the tests' ckptd servers and clients use: TCP on 127.0.0.1, or unix sockets.

Unix sockets are used in device mode (``CKPTD_TEST_DEVICE=1``, set by ``make test-device``) and, without it, on a
machine where no TCP socket can be made at all (a sandbox such as the lent TPU machine's: EAFNOSUPPORT or EPERM).
What needs TCP itself (the peer channel, ``jax.distributed``, the GCS emulator, the API's TCP listener) is marked
``needs_tcp`` and skipped then (tests/conftest.py).
"""

from __future__ import annotations

import errno
import functools
import os
import socket

DEVICE_MODE_ENV = "CKPTD_TEST_DEVICE"
_NO_TCP = {errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES, errno.EPROTONOSUPPORT}


def device_mode() -> bool:
    """Whether this run is ``make test-device``'s (``CKPTD_TEST_DEVICE=1``): as on the lent chip, no TCP."""
    return os.environ.get(DEVICE_MODE_ENV) == "1"


@functools.cache
def tcp_allowed() -> bool:
    """Whether this machine lets a process bind a TCP socket on 127.0.0.1 (tried once a process)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        if e.errno in _NO_TCP:
            return False
        raise
    return True


def unix_sockets_only() -> bool:
    """Whether the tests' servers listen, and their clients connect, on unix sockets instead of TCP."""
    return device_mode() or not tcp_allowed()


def no_tcp_reason() -> str | None:
    """Why a test that needs TCP cannot run here, or None where it can."""
    if device_mode():
        return f"needs TCP on 127.0.0.1: {DEVICE_MODE_ENV}=1 runs on unix sockets only, as on the lent TPU machine"
    if not tcp_allowed():
        return "needs TCP on 127.0.0.1, which this machine does not allow (unix sockets only)"
    return None


__all__ = ["DEVICE_MODE_ENV", "device_mode", "no_tcp_reason", "tcp_allowed", "unix_sockets_only"]
