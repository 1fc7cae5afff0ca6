"""Resume plans already answered, kept as the bytes sent, so the same question is not planned twice.

A plan is a pure function of the step's saved layout and the request (every host's sidecar
answers the same). When a slice fails, every host of the job asks at once, and usually the same
question: the first request plans (a state of 1,000 arrays takes tens of milliseconds), the others wait
for it and get the same bytes. Entries are keyed by the step's path and the request, and are valid only
for the layout object they were planned from: the catalog hands out a new one when a step is inspected
again, so a step rewritten under the same name is planned afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

_Key = tuple[str, str]


@dataclass
class _Entry:
    source: object  # the layout the plan was made from (held, so its identity cannot be reused)
    ready: threading.Event = field(default_factory=threading.Event)
    body: bytes | None = None


class PlanCache:
    """At most ``size`` plans; ``answer`` plans each (step path, request) once, concurrent askers share it."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def answer(self, path: str, request: str, source: object, plan: Callable[[], bytes]) -> bytes:
        """The plan's bytes for ``(path, request)`` made from ``source``; ``plan()`` runs only when none is
        kept (or being made) for that source. An exception from ``plan()`` reaches every waiter's caller
        as a fresh attempt of its own: refusals are not kept."""
        key = (path, request)
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.source is source:
                    self._entries.move_to_end(key)
                    mine = False
                else:
                    entry = _Entry(source)
                    self._entries[key] = entry
                    while len(self._entries) > self.size:
                        self._entries.popitem(last=False)
                    mine = True
            if not mine:
                entry.ready.wait()
                if entry.body is not None:
                    with self._lock:
                        self.hits += 1
                    return entry.body
                continue  # the planner of that entry failed: try again (and fail the same way, for this caller)
            try:
                body = plan()
            except BaseException:
                with self._lock:
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                entry.ready.set()
                raise
            entry.body = body
            with self._lock:
                self.misses += 1
            entry.ready.set()
            return body


__all__ = ["PlanCache"]
