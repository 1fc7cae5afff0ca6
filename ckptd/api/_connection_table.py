"""Which open connection gives up its slot when every slot is taken.

A connection that has not sent a complete request head yet costs an attacker nothing to hold: 264 idle
sockets, reopened as the server closed them, once took every slot ckptd had, the probes' reserve included,
and ``/healthz`` answered ``503`` to 8 of 9 probes (the kubelet would have restarted the sidecar). Refusing
new connections while the table is full protects the wrong side: the idle sockets stay, the probe goes.

So the table is ordered by what a slot is worth. A connection with a request in progress (its head complete,
its body being read or its answer being written) is never given up. Every other connection is idle and can
give its slot to a newcomer, the oldest first, in two tiers:

* ``waiting``: no complete request head yet (nothing sent, or half a head), or idle between requests after
  one that did not carry the bearer token;
* ``trusted``: idle between requests after one that carried the token (or any request, when ckptd has no
  token): a client's keep-alive pool, given up only when no ``waiting`` connection is left.

A new connection that finds the table full takes the slot of the oldest idle one (``ckptd/api/_connections.py``
closes it), so a probe or an authenticated client always gets in; a flood only churns through its own
sockets. The table keeps its own count of the connections that hold a slot: one given up stops counting at
once, before its transport has finished closing. What the limits defend: docs/operations.md, "Security".
"""

from __future__ import annotations

from typing import Generic, TypeVar

C = TypeVar("C")


class ConnectionTable(Generic[C]):
    """The connections of one server that hold a slot, and the idle ones among them in the order they
    would give it up. One event loop calls every method: no lock."""

    def __init__(self) -> None:
        self._holding: set[C] = set()
        self._waiting: dict[C, None] = {}  # insertion order: the oldest first
        self._trusted: dict[C, None] = {}

    def __len__(self) -> int:
        """Connections that hold a slot."""
        return len(self._holding)

    def add(self, conn: C) -> None:
        """A new connection: it holds a slot and waits for its first request head."""
        self._holding.add(conn)
        self.waiting(conn)

    def waiting(self, conn: C) -> None:
        """``conn`` has no complete request head (a new one is arriving, or none came yet): the newest waiting."""
        if conn not in self._holding:
            return
        self._trusted.pop(conn, None)
        self._waiting.pop(conn, None)
        self._waiting[conn] = None

    def busy(self, conn: C) -> None:
        """A request of ``conn`` is in progress: it keeps its slot."""
        self._waiting.pop(conn, None)
        self._trusted.pop(conn, None)

    def idle(self, conn: C, *, trusted: bool) -> None:
        """``conn`` answered its last request and waits for the next: the newest of its tier."""
        if conn not in self._holding:
            return
        self.busy(conn)
        (self._trusted if trusted else self._waiting)[conn] = None

    def drop(self, conn: C) -> bool:
        """``conn`` closes or gives up its slot; whether it held one."""
        self.busy(conn)
        if conn not in self._holding:
            return False
        self._holding.discard(conn)
        return True

    def oldest_idle(self) -> C | None:
        """The connection that gives up its slot next: the oldest waiting one, else the oldest trusted one."""
        for tier in (self._waiting, self._trusted):
            for conn in tier:
                return conn
        return None


__all__ = ["ConnectionTable"]
