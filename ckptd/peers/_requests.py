"""The caller's end of the peer channel's requests: what this sidecar sends a peer's listener
(``ckptd/peers/_server.py``) for each operation, and what it checks in the answer before believing it.

One function per operation, each on a ``Channel`` already connected and authenticated (``_protocol.connect``):
``held`` (the steps whose copies a holder keeps), ``put`` (a part offered, then its bytes sent), ``jobs`` (which
jobs a holder keeps a host's part of), ``list`` (the newest copy a holder keeps) and ``get`` (a part asked back).
Each request is a typed header and each answer is parsed into its own (``ckptd/peers/_headers.py``): a field
missing or out of bounds ends the request with ``PeerError``. Its own module because these are the protocol's
steps, the same whatever asks for them; when to send what, to
whom, within which deadline and what a failure costs are the copier's (``ckptd/peers/_copier.py``).
"""

from __future__ import annotations

from typing import BinaryIO

from ckptd.peers._headers import (
    Done,
    GetAnswer,
    GetRequest,
    HeldAnswer,
    HeldRequest,
    JobsAnswer,
    JobsRequest,
    ListAnswer,
    ListRequest,
    PutAnswer,
    PutRequest,
    expect,
    send,
)
from ckptd.peers._protocol import Channel, PeerError, RateLimit
from trainer_client.core.format import SnapshotMeta

NEWEST_LISTED = 16  # of a holder's listing, the newest copy is looked for among its last entries only


def refuse_own(answer: PutAnswer | HeldAnswer, instance: str, job: str, holder: int) -> None:
    """``PeerError`` when the listener that answered is this sidecar's own (``instance``, reached by another
    address): a copy never lands on its origin."""
    if instance and answer.holder == instance:
        raise PeerError(f"host {holder}'s listener for {job} is this sidecar's own: a copy never lands on its "
                        "origin")


def tell_held(chan: Channel, job: str, meta: SnapshotMeta, held: tuple[int, ...], sender: str) -> HeldAnswer:
    """Tell a holder of ``job``'s copies of this host's part (``meta``'s host) that this host holds the steps
    ``held`` only (it drops the copies of the others); the answer."""
    send(chan, HeldRequest(job=job, origin=meta.process_index, count=meta.process_count, held=list(held),
                           sender=sender))
    return expect(chan, HeldAnswer)


def offer_part(chan: Channel, job: str, meta: SnapshotMeta, meta_bytes: int, held: tuple[int, ...],
               sender: str) -> PutAnswer:
    """Offer a holder this host's part of ``meta.step`` (its ``snapshot.json`` of ``meta_bytes``, its data of
    ``meta.nbytes``); the answer (``have``: the holder keeps that copy already, send nothing)."""
    send(chan, PutRequest(job=job, origin=meta.process_index, count=meta.process_count, step=meta.step,
                          held=list(held), meta=meta_bytes, data=meta.nbytes, sender=sender))
    return expect(chan, PutAnswer)


def send_part(chan: Channel, raw: bytes, data: BinaryIO, nbytes: int, rate: RateLimit) -> None:
    """The part offered (``offer_part``): its ``snapshot.json`` ``raw``, then ``nbytes`` of ``data`` at ``rate``;
    returns once the holder says the copy is kept."""
    chan.send_bytes(raw)
    chan.send_file(data, nbytes, rate)
    expect(chan, Done)


def jobs_kept(chan: Channel, index: int, count: int) -> list[str]:
    """The jobs of which the holder keeps copies of host ``index`` of ``count``'s part (at most
    ``MAX_JOBS_LISTED``, each a job's name)."""
    send(chan, JobsRequest(origin=index, count=count))
    return expect(chan, JobsAnswer).jobs


def newest_copy(chan: Channel, job: str, index: int, count: int) -> tuple[int, str | None] | None:
    """The newest copy the holder keeps of host ``index`` of ``count``'s part of ``job``: (step, save id); None
    when it keeps none. ``PeerError`` when the listing is not one."""
    send(chan, ListRequest(job=job, origin=index, count=count))
    listed = expect(chan, ListAnswer).copies[-NEWEST_LISTED:]
    return max(listed, key=lambda copy: (copy[0], copy[1] or "")) if listed else None


def ask_part(chan: Channel, job: str, step: int, *, origin: int, count: int, save_id: str | None) -> tuple[int, int]:
    """Ask the holder for its copy of host ``origin`` of ``count``'s part of ``step`` (that save, when
    ``save_id``); the sizes the part's ``snapshot.json`` and data come in, each checked against the format's
    bounds (the bytes follow on ``chan``: ``PartStore.receive``)."""
    send(chan, GetRequest(job=job, origin=origin, count=count, step=step, save_id=save_id))
    answer = expect(chan, GetAnswer)
    return answer.meta, answer.data


__all__ = ["ask_part", "jobs_kept", "newest_copy", "offer_part", "refuse_own", "send_part", "tell_held"]
