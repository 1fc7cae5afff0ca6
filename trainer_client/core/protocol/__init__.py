"""The wire contract between the ckptd sidecar and trainer_client, behind one import path.

Imported by both sides: the server builds its routes and its OpenAPI schema from these models; the
client parses answers with the same models, so the two cannot drift apart. Split by audience:

* ``_wire``: route templates, job names, error codes and their HTTP status, the error body, the requests
  and answers of the checkpoint routes (list, latest-good, resume);
* ``_stored``: what a step records (``TrainingMetadata``, mesh, arrays, batch plan) and its state;
* ``_advice``: the goodput advisor's query and answer;
* ``_events``: elastic events and the goodput report (``_autopilot_event``: an ``autopilot_decided`` event's
  fields).

Import from here (``from trainer_client.core import protocol as p``), never from the private modules.
Nothing here imports jax or the server framework.
"""

from __future__ import annotations

from trainer_client.core.protocol import _advice, _events, _stored, _wire
from trainer_client.core.protocol._advice import *  # noqa: F403
from trainer_client.core.protocol._events import *  # noqa: F403
from trainer_client.core.protocol._stored import *  # noqa: F403
from trainer_client.core.protocol._wire import *  # noqa: F403

__all__ = sorted([*_wire.__all__, *_stored.__all__, *_advice.__all__, *_events.__all__])
