"""The peer data channel: each host's sidecar keeps copies of other hosts' snapshot parts in its shared memory,
so a host whose memory was wiped gets its part back from a peer instead of from storage (docs/multihost.md,
"Peer copies").

``PeerService`` is what the composition root (``ckptd/_sidecar.py``) builds from the ``PeerSettings`` group
(``_settings``) when ``CKPTD_PEER_PORT`` is set: the listener (``_server``), the copier and the fetcher
(``_copier``; the tasks they run, ``_tasks``; the requests they send, ``_requests``, and their typed headers,
``_headers``), over one ``PartStore`` of the host's shared-memory directory and one ``PeerDirectory`` of
addresses. The bytes travel on this channel, never on the JSON control API; what the trainer asks of it (its
part back from a peer's copy) comes over that API, ``POST /v1/jobs/{job}/peer-fetch``, and is handed to
``PeerService.fetch``.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptd.memory_tier._settings import MemoryTierSettings
from ckptd.peers._copier import PeerCopier, PeerOptions
from ckptd.peers._directory import PeerDirectory, parse_map, parse_peers
from ckptd.peers._protocol import RateLimit
from ckptd.peers._server import PeerListener
from ckptd.peers._settings import PeerSettings
from ckptd.peers._store import PartStore
from trainer_client.core import Storage
from trainer_client.core.protocol import PeerFetchAnswer, PeerFetchRequest

_log = logging.getLogger(__name__)


@dataclass
class PeerService:
    """The listener and the workers of one sidecar's peer channel, started and stopped together."""

    listener: PeerListener
    copier: PeerCopier

    @property
    def address(self) -> str:
        return self.copier.directory.address

    def start(self) -> None:
        dropped = self.listener.store.drop_staging()
        if dropped:
            _log.info("dropped %d part(s) a previous run was still receiving", dropped)
        self.listener.start()
        self.copier.start()
        _log.info("peer channel listening on %s", self.address)

    def stop(self) -> None:
        self.copier.stop()
        self.listener.stop()

    def fetch(self, job: str, request: PeerFetchRequest) -> Future[PeerFetchAnswer]:
        """The trainer's request for its part of ``job`` back from a peer's copy (ckptd's API hands it here): fetched
        on a task of the fetcher's own, within the fetch's deadline; the future's result is the answer (the part
        is back, or why not), never an exception."""
        return self.copier.asked(job, request)

    def snapshot(self) -> dict[str, Any]:
        """The channel's numbers (docs/operations.md, "Peer copies")."""
        c, s = self.copier.stats, self.listener.stats
        now = time.time()
        return {"address": self.address, "copies_sent": c.copies_sent, "bytes_sent": c.bytes_sent,
                "copy_failures": c.copy_failures, "fetched": c.fetched, "fetch_failures": c.fetch_failures,
                "refills": c.refills,
                "copy_age_s": {job: round(now - at, 3) for job, at in c.last_copy_at.items()},
                "last_copy_step": dict(c.last_copy_step),
                "copy_holders": {job: sorted(held.values()) for job, held in c.holders.items() if held},
                "copies_received": s.received,
                "bytes_received": s.received_bytes, "requests_refused": s.refused, "copies_served": s.served,
                "bytes_served": s.served_bytes, "copies_held_bytes": self.listener.store.copy_bytes(),
                "last_failure": c.last_failure, "listener_failures": list(s.failures)}


def build_peers(settings: PeerSettings, memory: MemoryTierSettings, root: str) -> PeerService | None:
    """The peer channel ``settings`` ask for (``CKPTD_PEER_PORT``) over the memory tier's shared-memory directory
    (``memory.shm_dir``) and the storage ``root``, not started; None when off."""
    if settings.peer_port is None:
        return None
    if not memory.shm_dir:
        _log.warning("CKPTD_PEER_PORT is set but CKPTD_SHM_DIR is not: the peer channel is off (it keeps and "
                     "serves copies of the hosts' parts in shared memory; set CKPTD_SHM_DIR to turn it on)")
        return None
    secret = settings.peer_secret
    assert secret is not None  # PeerSettings refuses a channel without one
    store = PartStore(memory.shm_dir, capacity_bytes=settings.peer_capacity_bytes)
    rate = RateLimit(settings.peer_bandwidth_bytes_s)
    listener = PeerListener(store, secret.encode(), host=settings.peer_host, port=settings.peer_port,
                            nice=memory.persist_nice)
    advertised = settings.peer_advertise or (
        f"{socket.getfqdn() if settings.peer_host in ('0.0.0.0', '::') else settings.peer_host}:{listener.port}")
    if settings.host_index is not None and settings.this_host() is None:
        _log.info("this host is host %d; without the host count (CKPTD_HOST_COUNT) it learns its jobs from their "
                  "parts", settings.global_host_index())
    static = parse_peers(settings.peers)
    directory = PeerDirectory(None if static else Storage(root), static, advertised)
    options = PeerOptions(k=settings.peer_copies, stride=settings.peer_stride,
                          explicit=parse_map(settings.peer_map) or None, nice=memory.persist_nice,
                          refill=settings.peer_refill, host=settings.this_host())
    return PeerService(listener, PeerCopier(store, directory, secret.encode(), rate, options,
                                            instance=listener.instance))


__all__ = ["PeerService", "PeerSettings", "build_peers"]
