"""How the peer channel's work is scheduled: each copy to a holder, each fetch, each refill and the discovery
run as a task on a thread of its own, at most one per key (a job and holder, or a job and step) and at most
``MAX_TASKS`` at once, so that a slow job or a slow peer holds up only itself (docs/multihost.md, "Peer
copies").

Its own module because it is the one concern of the peer workers that knows nothing of peers: what the tasks
do, and the deadline each has, is the copier's (``ckptd/peers/_copier.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

_log = logging.getLogger(__name__)
MAX_TASKS = 32  # copies, fetches and refills in flight at once (the channel's rate bounds their bytes together)


class Tasks:
    """Work on threads of its own, at most one per key and ``limit`` at once: one slow task holds up no other.

    A task's thread inherits the ``nice`` of the thread that starts it (the copier's lowered one, for copies)."""

    def __init__(self, name: str, limit: int = MAX_TASKS) -> None:
        self.name = name
        self.limit = limit
        self._running: dict[Hashable, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self, key: Hashable, work: Callable[[], object]) -> bool:
        """Run ``work`` unless a task of ``key`` runs or ``limit`` do; whether it was started."""
        with self._lock:
            if key in self._running or len(self._running) >= self.limit:
                return False
            thread = threading.Thread(target=self._run, args=(key, work), name=self.name, daemon=True)
            self._running[key] = thread
        thread.start()
        return True

    def _run(self, key: Hashable, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception:  # a task never takes the worker down
            _log.exception("peer channel task %s failed", key)
        finally:
            with self._lock:
                self._running.pop(key, None)

    def busy(self, key: Hashable) -> bool:
        """Whether a task of ``key`` is running."""
        with self._lock:
            return key in self._running

    def join(self, timeout_s: float) -> None:
        """Wait for the tasks running now, at most ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


__all__ = ["MAX_TASKS", "Tasks"]
