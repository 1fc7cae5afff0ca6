"""The saved layouts the catalog keeps (what a plan of a step is made from), loaded once per step at a time.

Why it exists: reading a step's layout can take long — the zarr index of a step plain Orbax wrote is parsed
from its OCDBT database, up to the reader's deadline for a forged one (docs/operations.md, "What each limit
defends") — and several ask for it at once: the refresher and every resume of the step. Here one load per
step runs at a time; others asking meanwhile wait for it, an answer
at most ``wait_s`` (then ``Busy``: ``503`` with ``Retry-After``, the load goes on), so a slow step holds up
neither other steps nor the handler threads. The ``kept`` most recently used stay in memory (a layout holds
every array of a step: megabytes for a large model); a step re-inspected is forgotten. ``Recent`` keeps other
per-step values the same bounded way (the catalog's manifests).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from ckptd.errors import Busy
from trainer_client.core.format import StepLayout

LAYOUTS_KEPT = 8
ANSWER_WAIT_S = 1.5  # what an answer waits for another caller's read (a client's request times out at 2 s)
RETRY_AFTER_S = 5
_V = TypeVar("_V")


class Layouts:
    """Step path -> its saved layout, at most ``kept`` of them, each loaded by one caller at a time."""

    def __init__(self, kept: int = LAYOUTS_KEPT) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._layouts: OrderedDict[str, StepLayout] = OrderedDict()
        self._loading: dict[str, threading.Event] = {}

    def get(self, path: str, load: Callable[[], StepLayout], wait_s: float | None = None) -> StepLayout:
        """The layout of ``path``: kept, or ``load()`` now, or the load another caller runs (waited for at most
        ``wait_s`` seconds, None: until it is done; then ``Busy``)."""
        while True:
            with self._lock:
                if (kept := self._layouts.get(path)) is not None:
                    self._layouts.move_to_end(path)
                    return kept
                loading = self._loading.get(path)
                if loading is None:
                    loading = self._loading[path] = threading.Event()
                    break
            if not loading.wait(wait_s):
                raise Busy(f"the saved layout of {path} is still being read (more than {wait_s:g} s so far); "
                           f"retry later", retry_after_s=RETRY_AFTER_S)
            # done (or failed, or already evicted): look again, and load it here if it is not kept
        try:
            loaded = load()
            with self._lock:
                self._layouts[path] = loaded
                self._layouts.move_to_end(path)
                while len(self._layouts) > self.kept:
                    self._layouts.popitem(last=False)
            return loaded
        finally:
            with self._lock:
                del self._loading[path]
            loading.set()

    def forget(self, path: str) -> None:
        with self._lock:
            self._layouts.pop(path, None)


class Recent(Generic[_V]):
    """Step path -> a value, the ``kept`` most recently put (a manifest can be megabytes); safe across threads."""

    def __init__(self, kept: int = LAYOUTS_KEPT) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._values: OrderedDict[str, _V] = OrderedDict()

    def get(self, path: str) -> _V | None:
        with self._lock:
            return self._values.get(path)

    def put(self, path: str, value: _V) -> None:
        with self._lock:
            self._values[path] = value
            self._values.move_to_end(path)
            while len(self._values) > self.kept:
                self._values.popitem(last=False)

    def pop(self, path: str) -> None:
        with self._lock:
            self._values.pop(path, None)


__all__ = ["ANSWER_WAIT_S", "LAYOUTS_KEPT", "Layouts", "Recent"]
