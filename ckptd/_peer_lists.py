"""The two peer-copy lists a sidecar's settings hold, parsed in one place: ``CKPTD_PEERS`` (where each host's
sidecar listens) and ``CKPTD_PEER_MAP`` (which hosts hold whose part). ``ckptd.config`` checks them at startup
and counts the hosts ``CKPTD_PEERS`` names (``ckptd/peers/_settings.py``); the peer channel (``ckptd.peers``)
reads them to find its holders. A leaf module of the shared layer, which the settings and the channel both
import (docs/multihost.md, "Peer copies")."""

from __future__ import annotations

import re

# host:port as a sidecar writes it in CKPTD_PEERS or in its record on the storage root: a DNS name or an address
ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")


def parse_peers(text: str) -> dict[int, str]:
    """``CKPTD_PEERS`` (``0=host:port,1=host:port``) as ``{index: address}``; ``ValueError`` when malformed."""
    out: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        index, sep, address = item.partition("=")
        if not sep or not index.strip().isdigit() or not ADDRESS.match(address.strip()):
            raise ValueError(f"CKPTD_PEERS: {item[:80]!r} is not INDEX=HOST:PORT")
        out[int(index)] = address.strip()
    return out


def parse_map(text: str) -> dict[int, list[int]]:
    """``CKPTD_PEER_MAP`` (``0:2,1:3`` or ``0:2+3``) as ``{origin: [holders]}``; ``ValueError`` when malformed."""
    out: dict[int, list[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        origin, sep, holders = item.partition(":")
        targets = holders.split("+")
        if not sep or not origin.strip().isdigit() or not all(t.strip().isdigit() for t in targets):
            raise ValueError(f"CKPTD_PEER_MAP: {item[:80]!r} is not ORIGIN:HOLDER[+HOLDER...]")
        out[int(origin)] = [int(t) for t in targets]
    return out


def hosts_named(text: str) -> int | None:
    """N when ``CKPTD_PEERS`` names hosts 0..N-1, else None."""
    named = parse_peers(text)
    return len(named) if named and set(named) == set(range(len(named))) else None


__all__ = ["ADDRESS", "hosts_named", "parse_map", "parse_peers"]
