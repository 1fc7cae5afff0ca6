"""Where a stretch of wall time went, by sampling every thread's Python stack.

Why it exists: a phase measured on the lent chip (the first step after an in-process restore) took seconds where
its twin in a new process took one, with no compile to explain it; a sampler started and stopped around the
phase names the lines the threads sat on, with no profiler to install on a machine that has no package index.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType


def _where(frame: FrameType | None, depth: int) -> str:
    """The innermost ``depth`` frames of a stack as ``file:line function``, innermost first."""
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


class StackSampler:
    """Samples every other thread's stack every ``interval_s`` between ``start`` and ``stop`` (the main thread's
    always, another's unless it sits in a ``threading`` wait); ``stop`` returns the most seen stacks as
    ``[samples, thread name, stack]``, most first."""

    def __init__(self, interval_s: float = 0.05, depth: int = 6) -> None:
        self.interval_s, self.depth = interval_s, depth
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name, stack = names.get(ident, str(ident)), _where(frame, self.depth)
                if name != "MainThread" and stack.startswith("threading.py"):
                    continue  # another thread idle in a wait: not where the time went
                self._counts[(name, stack)] += 1
            time.sleep(self.interval_s)

    def stop(self, top: int = 8) -> list[list[object]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return [[n, name, stack] for (name, stack), n in self._counts.most_common(top)]


__all__ = ["StackSampler"]
