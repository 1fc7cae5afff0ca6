"""The trainer's request for its snapshot part back from a peer host's copy: ``POST /v1/jobs/{job}/peer-fetch``
(docs/multihost.md, "Peer copies").

Why a route: a trainer whose host memory was wiped, named by the multi-host resume agreement as fetching its
part from host ``source``, asks its own host's ckptd for it over the one control channel the trainer already
speaks (HTTP over TCP or a unix socket, with its token), typed by the wire contract (``PeerFetchRequest``,
``PeerFetchAnswer``); the bytes then move on the peer data channel between the sidecars (``ckptd/peers``), never
over HTTP. The fetch is the peer copier's (its deadline, its per-step lock, its numbers): this route hands the
request over and waits for the answer on the event loop, holding no handler thread while the bytes move.

A fetch that fails (the holder gone, a damaged copy, its deadline passed) is an answer, ``ok: false`` with why,
as is one whose hosts cannot be (the source the asker itself, an index past the hosts): the request was valid,
the part cannot come back. A sidecar whose peer channel is off answers ``409 PEER_CHANNEL_OFF``. Either way the
trainer restores from storage, as every host of the job does.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from ckptd.api._errors import ERROR_RESPONSES
from ckptd.api._json_body import JsonBodyRoute
from ckptd.api._openapi import route_doc
from ckptd.api._services import Services
from ckptd.errors import InvalidJobName, PeerChannelOff
from trainer_client.core import protocol as p


def router(svc: Services) -> APIRouter:
    api = APIRouter(tags=["peers"], responses=ERROR_RESPONSES, route_class=JsonBodyRoute)

    @api.post(p.ROUTE_PEER_FETCH, response_model=p.PeerFetchAnswer, response_model_exclude_none=True,
              **route_doc("POST", p.ROUTE_PEER_FETCH))
    async def peer_fetch(job: str, request: p.PeerFetchRequest) -> p.PeerFetchAnswer:
        if not p.is_valid_job_name(job):
            raise InvalidJobName(job)
        peers = svc.sidecar.peers
        if peers is None:
            raise PeerChannelOff()
        return await asyncio.wrap_future(peers.fetch(job, request))

    return api


__all__ = ["router"]
