"""Which hosts hold copies of whose part (the failure-domain mapping), and where their sidecars listen
(docs/multihost.md, "Peer copies").

The mapping: host k's part goes to the K hosts ``k + stride, k + 2*stride, ...`` (modulo the host count,
never k itself), where ``stride`` is the number of hosts per failure domain (1: the next host; a TPU slice of 4
hosts: 4, the same position on the next slice), unless ``CKPTD_PEER_MAP`` names them (``0:2,1:3,...``).

Addresses: named in ``CKPTD_PEERS`` (``0=host-0.job:7480,1=...``: JobSet's stable pod names), else each sidecar
registers its own under the job on the storage root (``<root>/<job>/.ckptd/peers/process_<k>.json``) once it
sees that host's first part, and reads the others' there (cached for 30 s, read again at once when it does
not answer; each read goes to storage, never to a listing of the prefix the process's file system cached before
a host registered or moved). What it
reads there is checked like anything from the wire: a bounded JSON file holding one ``host:port``.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time

from ckptd._peer_lists import ADDRESS, parse_map, parse_peers
from trainer_client.core import Storage

_log = logging.getLogger(__name__)
MAX_RECORD_BYTES = 4096
CACHE_S = 30.0  # an address read from the root is kept this long; one that does not answer is read again at once


def holders_of(origin: int, count: int, k: int, stride: int, explicit: dict[int, list[int]] | None = None) -> list[int]:
    """The hosts that hold copies of ``origin``'s part: ``explicit[origin]`` when given, else K hosts
    ``stride`` apart after it (modulo ``count``; never ``origin``, none twice)."""
    if explicit and origin in explicit:
        return [h for h in dict.fromkeys(explicit[origin]) if h != origin and 0 <= h < count]
    out: list[int] = []
    for i in range(1, count):
        holder = (origin + i * stride) % count
        if holder != origin and holder not in out:
            out.append(holder)
        if len(out) == k:
            break
    return out


class PeerDirectory:
    """Where each host's sidecar of a job listens."""

    def __init__(self, storage: Storage | None, static: dict[int, str], address: str) -> None:
        self.storage = storage
        self.static = static
        self.address = address  # this sidecar's, as the others reach it
        self._registered: set[tuple[str, int]] = set()
        self._cache: dict[tuple[str, int], tuple[float, str | None]] = {}

    def _record(self, job: str, index: int) -> str:
        assert self.storage is not None
        return self.storage.join(job, ".ckptd", "peers", f"process_{index}.json")

    def register(self, job: str, index: int) -> None:
        """Publish this sidecar's address as host ``index``'s of ``job`` (once per process and job)."""
        if self.storage is None or self.static or (job, index) in self._registered:
            return
        path = self._record(job, index)
        body = json.dumps({"address": self.address, "registered_at": time.time()}).encode()
        if not self.storage.create_new(path, body):  # an earlier sidecar's (this host restarted): replace it
            self.storage.remove(path)
            if not self.storage.create_new(path, body):
                raise RuntimeError(f"cannot register the peer address at {path}")
        self._registered.add((job, index))
        _log.info("peer channel of %s host %d registered: %s", job, index, self.address)

    def address_of(self, job: str, index: int) -> str | None:
        """Host ``index``'s sidecar address for ``job``, or None when unknown."""
        if index in self.static:
            return self.static[index]
        if self.storage is None:
            return None
        cached = self._cache.get((job, index))
        if cached is not None and time.monotonic() - cached[0] < CACHE_S:
            return cached[1]
        address: str | None = None
        path = self._record(job, index)
        self.storage.invalidate(posixpath.dirname(path))  # gs://: not from a listing cached before it registered
        try:
            record = json.loads(self.storage.read_bytes(path, max_bytes=MAX_RECORD_BYTES))
            found = record.get("address") if isinstance(record, dict) else None
            address = found if isinstance(found, str) and ADDRESS.match(found) else None
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            _log.warning("peer address of %s host %d unreadable: %s", job, index, exc)
        self._cache[(job, index)] = (time.monotonic(), address)
        return address

    def forget(self, job: str, index: int) -> None:
        """Read host ``index``'s address again next time (its sidecar did not answer)."""
        self._cache.pop((job, index), None)


__all__ = ["PeerDirectory", "holders_of", "parse_map", "parse_peers"]
